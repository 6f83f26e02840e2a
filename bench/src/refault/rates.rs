//! Refault rates: fault helpers, threads of this process, `fallocate`, with
//! 1..=all CPUs; and the memory's bandwidth limit (non-temporal clear).

use std::time::Instant;

use clearing::ClearKernel;
use guest_mem::Region;
use nix::sys::eventfd::EventFd;
use serde::Serialize;

use super::error::RefaultBenchError;
use super::load::{fallocate_pass, helpers, helpers_pass, punch, threads_pass};
use crate::harness::rounds;
use crate::stats::best;

/// One way at one thread count: the best of the repetitions.
#[derive(Debug, Clone, Serialize)]
pub struct RatePoint {
    /// Threads (helpers, or threads of this process).
    pub threads: usize,
    /// GB/s of the best repetition.
    pub gbps: f64,
}

/// Every rate of one run.
#[derive(Debug, Clone, Serialize)]
pub struct Rates {
    /// Fault helpers (processes, `SCHED_IDLE`, `MADV_POPULATE_WRITE`), the
    /// spawn outside the clock (it is `spawn_ms`).
    pub helpers: Vec<RatePoint>,
    /// Starting all CPUs' helpers until every one is ready, ms (best).
    pub spawn_ms: f64,
    /// Threads of this process through its own mapping (the old way).
    pub threads: Vec<RatePoint>,
    /// `fallocate` on the file from N threads.
    pub fallocate: Vec<RatePoint>,
    /// Non-temporal clear of the populated region, N threads pinned to the
    /// node: the memory's write bandwidth.
    pub nt_clear: Vec<RatePoint>,
}

fn gbps(bytes: u64, secs: f64) -> f64 {
    #[allow(clippy::cast_precision_loss)] // bytes of a bench region fit an f64's mantissa
    let b = bytes as f64;
    b / secs / 1e9
}

fn best_of(
    reps: usize,
    bytes: u64,
    mut pass: impl FnMut() -> Result<f64, RefaultBenchError>,
) -> Result<f64, RefaultBenchError> {
    let samples = rounds::collect(reps, |_| pass())?;
    Ok(gbps(bytes, best(&samples)))
}

/// Thread counts to measure on `cpus` CPUs: 1, 2, 4, … and all.
pub(super) fn counts(cpus: usize) -> Vec<usize> {
    let mut c: Vec<usize> = std::iter::successors(Some(1usize), |n| n.checked_mul(2))
        .take_while(|&n| n < cpus)
        .collect();
    c.push(cpus.max(1));
    c
}

/// Measures every rate on `region` (pages reserved for it), `reps` times.
pub(super) fn measure(
    region: &Region,
    cpus: &[usize],
    chunk: u64,
    reps: usize,
    progress: &mut dyn FnMut(&str),
) -> Result<Rates, RefaultBenchError> {
    let len = region.len();
    let never = EventFd::new().map_err(|e| RefaultBenchError::Io(e.into()))?;
    let mut rates = Rates {
        helpers: Vec::new(),
        spawn_ms: f64::MAX,
        threads: Vec::new(),
        fallocate: Vec::new(),
        nt_clear: Vec::new(),
    };
    for n in counts(cpus.len()) {
        progress(&format!("refault rates with {n} thread(s)"));
        let h = helpers(region, cpus, n, &never)?;
        let helpers_gbps = best_of(reps, len, || {
            punch(region)?;
            let t = Instant::now();
            helpers_pass(&h, len, chunk, &never)?;
            Ok(t.elapsed().as_secs_f64())
        })?;
        drop(h);
        rates.helpers.push(RatePoint {
            threads: n,
            gbps: helpers_gbps,
        });
        let threads_gbps = best_of(reps, len, || {
            punch(region)?;
            let t = Instant::now();
            threads_pass(region, n, chunk, &|| false)?;
            Ok(t.elapsed().as_secs_f64())
        })?;
        rates.threads.push(RatePoint {
            threads: n,
            gbps: threads_gbps,
        });
        let fallocate_gbps = best_of(reps, len, || {
            punch(region)?;
            let t = Instant::now();
            fallocate_pass(region, n, chunk)?;
            Ok(t.elapsed().as_secs_f64())
        })?;
        rates.fallocate.push(RatePoint {
            threads: n,
            gbps: fallocate_gbps,
        });
        // Populated by the pass above: the clear stores to resident pages.
        let nt_gbps = best_of(reps, len, || nt_clear(region, cpus, n))?;
        rates.nt_clear.push(RatePoint {
            threads: n,
            gbps: nt_gbps,
        });
    }
    let spawn_ms = rounds::collect(reps, |_| {
        let t = Instant::now();
        let h = helpers(region, cpus, cpus.len(), &never)?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        drop(h);
        Ok::<_, RefaultBenchError>(ms)
    })?;
    rates.spawn_ms = best(&spawn_ms);
    Ok(rates)
}

/// Seconds for `n` threads pinned to `cpus` to clear the whole populated
/// `region` with non-temporal stores, one slice each.
fn nt_clear(region: &Region, cpus: &[usize], n: usize) -> Result<f64, RefaultBenchError> {
    let kernel = if ClearKernel::NonTemporal.is_available() {
        ClearKernel::NonTemporal
    } else {
        ClearKernel::default_kernel()
    };
    // SAFETY: the region is this bench's own, populated, mapped by no other
    // process and touched by no other thread while the slice lives (the
    // passes above have joined).
    let buf = unsafe { region.as_mut_slice() };
    let per = buf.len().div_ceil(n.max(1));
    let t = Instant::now();
    std::thread::scope(|s| {
        for (i, part) in buf.chunks_mut(per).enumerate() {
            let cpu = cpus.get(i % cpus.len().max(1)).copied();
            s.spawn(move || {
                if let Some(cpu) = cpu {
                    let _ = numa::pin_current_thread(&[cpu]);
                }
                clearing::clear(kernel, part);
            });
        }
    });
    Ok(t.elapsed().as_secs_f64())
}
