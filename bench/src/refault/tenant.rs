//! A CPU-bound tenant's rate alone and while a refault runs on the same
//! CPUs: by fault helpers (`SCHED_IDLE`), and by threads of normal
//! priority (the way the daemon refaulted before the helpers).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use guest_mem::Region;
use nix::sys::eventfd::EventFd;
use serde::Serialize;

use super::error::RefaultBenchError;
use super::load::{helpers, helpers_pass, punch, threads_pass};
use crate::harness::rounds;

/// The tenant's figures on one set of CPUs (medians over the repetitions).
#[derive(Debug, Clone, Serialize)]
pub struct TenantFigures {
    /// CPUs the tenant spins on (one pinned thread each).
    pub tenant_cpus: usize,
    /// CPUs the refault may use (the node's).
    pub refault_cpus: usize,
    /// The tenant's loop iterations per second alone, millions.
    pub alone_mips: f64,
    /// Its rate while fault helpers refault, over its rate alone.
    pub with_helpers: f64,
    /// Its rate while threads of normal priority refault, over alone.
    pub with_threads: f64,
    /// What the helpers refaulted meanwhile, GB/s.
    pub helpers_gbps: f64,
    /// What the threads refaulted meanwhile, GB/s.
    pub threads_gbps: f64,
}

/// What runs beside the tenant.
#[derive(Clone, Copy)]
enum Load {
    None,
    Helpers,
    Threads,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Spins one pinned thread per CPU of `tenant` for `window`, while `load`
/// refaults `region` over and over on `cpus`; (tenant iterations per
/// second, bytes refaulted per second).
fn one_window(
    region: &Region,
    cpus: &[usize],
    tenant: &[usize],
    load: Load,
    chunk: u64,
    window: Duration,
) -> Result<(f64, f64), RefaultBenchError> {
    let stop = AtomicBool::new(false);
    let stop_event = EventFd::new().map_err(|e| RefaultBenchError::Io(e.into()))?;
    let iterations = AtomicU64::new(0);
    let refaulted = AtomicU64::new(0);
    let len = region.len();
    // Helpers are started before the window opens (their spawn is not the tenant's loss).
    let h = match load {
        Load::Helpers => Some(helpers(region, cpus, cpus.len(), &stop_event)?),
        _ => None,
    };
    let started = Instant::now();
    let result = std::thread::scope(|s| -> Result<(), RefaultBenchError> {
        let loader = s.spawn(|| -> Result<(), RefaultBenchError> {
            while !stop.load(Ordering::Relaxed) {
                match load {
                    Load::None => return Ok(()),
                    Load::Helpers => {
                        punch(region)?;
                        let helpers = h.as_ref().ok_or(RefaultBenchError::Stopped)?;
                        let n = helpers_pass(helpers, len, chunk, &stop_event)?;
                        refaulted.fetch_add(n, Ordering::Relaxed);
                    }
                    Load::Threads => {
                        punch(region)?;
                        let n = threads_pass(region, cpus.len(), chunk, &|| {
                            stop.load(Ordering::Relaxed)
                        })?;
                        refaulted.fetch_add(n, Ordering::Relaxed);
                    }
                }
            }
            Ok(())
        });
        for &cpu in tenant {
            let (stop, iterations) = (&stop, &iterations);
            s.spawn(move || {
                let _ = numa::pin_current_thread(&[cpu]);
                let mut x = 1u64;
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for _ in 0..4096 {
                        x = std::hint::black_box(
                            x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1),
                        );
                    }
                    n += 4096;
                }
                iterations.fetch_add(n, Ordering::Relaxed);
            });
        }
        // The window is the measurement itself: a fixed span of the tenant's run.
        std::thread::sleep(window);
        stop.store(true, Ordering::Relaxed);
        stop_event
            .write(1)
            .map_err(|e| RefaultBenchError::Io(e.into()))?;
        loader.join().unwrap_or(Err(RefaultBenchError::Panicked))
    });
    let secs = started.elapsed().as_secs_f64();
    drop(h);
    result?;
    #[allow(clippy::cast_precision_loss)] // counts far below 2^52
    Ok((
        iterations.load(Ordering::Relaxed) as f64 / secs,
        refaulted.load(Ordering::Relaxed) as f64 / secs,
    ))
}

/// The tenant on `tenant` CPUs alone, beside helpers and beside threads,
/// `reps` times interleaved.
pub(super) fn measure(
    region: &Region,
    cpus: &[usize],
    tenant: &[usize],
    chunk: u64,
    window: Duration,
    reps: usize,
) -> Result<TenantFigures, RefaultBenchError> {
    let (mut alone, mut with_h, mut with_t, mut h_rate, mut t_rate) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    rounds::each(reps, |_| {
        let (a, _) = one_window(region, cpus, tenant, Load::None, chunk, window)?;
        let (h, hb) = one_window(region, cpus, tenant, Load::Helpers, chunk, window)?;
        let (t, tb) = one_window(region, cpus, tenant, Load::Threads, chunk, window)?;
        alone.push(a / 1e6);
        with_h.push(h / a);
        with_t.push(t / a);
        h_rate.push(hb / 1e9);
        t_rate.push(tb / 1e9);
        Ok::<_, RefaultBenchError>(())
    })?;
    Ok(TenantFigures {
        tenant_cpus: tenant.len(),
        refault_cpus: cpus.len(),
        alone_mips: median(alone),
        with_helpers: median(with_h),
        with_threads: median(with_t),
        helpers_gbps: median(h_rate),
        threads_gbps: median(t_rate),
    })
}
