//! The daemon's responsiveness while it refaults: STATS round trips over
//! its socket, from the FREE of a region until its holes are faulted back
//! in, with fault helpers (the default) and with the scrubber thread
//! faulting through the daemon's own mapping (`scrub.refault_helpers =
//! false`, the way the daemon refaulted before the helpers), against the same daemon idle. Each
//! sample is a STATS round trip and an `mmap` + `munmap` of 4 KiB in this
//! process, which is the daemon's (in-process): the latter waits for the
//! daemon's `mmap_lock`, which a fault through the daemon's own mapping
//! holds while the kernel zeroes the page. The sampler pauses 1 ms between
//! samples, so that it does not itself keep a CPU busy (the helpers run at
//! idle priority and would yield to it).

use std::time::{Duration, Instant};

use backend::client::Client;
use backend::daemon::Daemon;
use guest_mem::{AnonMapping, PageSize};
use serde::Serialize;

use super::error::RefaultBenchError;
use crate::harness;
use crate::harness::rounds;

/// Longest wait for one refault.
const REFAULT_DEADLINE: Duration = Duration::from_secs(120);

/// One way of refaulting, through a private daemon.
#[derive(Debug, Clone, Serialize)]
pub struct Responsiveness {
    /// `helpers` or `scrub thread`.
    pub mode: String,
    /// Threads that refault (helpers per node, or scrubber threads).
    pub threads: usize,
    /// From the FREE's answer until STATS shows every byte refaulted,
    /// seconds (median; to the first sample that shows it, 1 ms apart).
    pub refault_s: f64,
    /// STATS round trips while refaulting: p50, p99, max, ms.
    pub stats_p50_ms: f64,
    /// p99.
    pub stats_p99_ms: f64,
    /// Max.
    pub stats_max_ms: f64,
    /// STATS round trips with the daemon idle (the same number), p50 ms.
    pub idle_p50_ms: f64,
    /// p99.
    pub idle_p99_ms: f64,
    /// Round trips measured while refaulting.
    pub samples: usize,
    /// `mmap` + `munmap` of 4 KiB in the daemon's process while
    /// refaulting: p50, p99, max, ms.
    pub mmap_p50_ms: f64,
    /// p99.
    pub mmap_p99_ms: f64,
    /// Max.
    pub mmap_max_ms: f64,
    /// The same with the daemon idle: p99, ms.
    pub idle_mmap_p99_ms: f64,
}

/// One sample: (STATS ms, mmap + munmap ms, refaulted bytes so far).
fn sample(client: &mut Client) -> Result<(f64, f64, u64), RefaultBenchError> {
    let t = Instant::now();
    let done = refaulted(client)?;
    let stats_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    drop(AnonMapping::new(4096, PageSize::Base4K)?);
    Ok((stats_ms, t.elapsed().as_secs_f64() * 1e3, done))
}

/// Pause between samples.
const PACE: Duration = Duration::from_millis(1);

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn refaulted(client: &mut Client) -> Result<u64, RefaultBenchError> {
    Ok(client
        .stats()?
        .scrub
        .nodes
        .iter()
        .map(|n| n.refault_bytes)
        .sum())
}

/// `reps` rounds of ALLOC, FREE and STATS until refaulted, through a
/// private daemon refaulting with helpers (`helpers`) or not.
pub(super) fn measure(
    size: u64,
    page: PageSize,
    helpers: bool,
    reps: usize,
) -> Result<Responsiveness, RefaultBenchError> {
    let dir = std::env::temp_dir().join(format!(
        "hugemem-bench-refault-{}-{}",
        std::process::id(),
        u8::from(helpers)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(RefaultBenchError::Io)?;
    let mut config = harness::daemon::holding(dir.join("hugemem.sock"), size, 10);
    config.scrub.refault_helpers = helpers;
    let threads = if helpers {
        numa::current_affinity().map_or(1, |c| c.len())
    } else {
        config.scrub.threads_per_node
    };
    let daemon = Daemon::start(config)?;
    let result = (|| {
        let mut client = Client::connect(daemon.socket_path())?;
        let request = harness::daemon::eager_request(size, page);
        let (mut busy, mut idle, mut spans) = (Vec::new(), Vec::new(), Vec::new());
        let (mut busy_mmap, mut idle_mmap) = (Vec::new(), Vec::new());
        rounds::each(reps, |_| {
            let a = client.alloc(request.clone())?;
            let id = a.id;
            drop(a);
            let before = refaulted(&mut client)?;
            let started = Instant::now();
            client.free(id)?;
            let mut round = 0;
            loop {
                let (stats_ms, mmap_ms, done) = sample(&mut client)?;
                if done >= before + size {
                    break;
                }
                busy.push(stats_ms);
                busy_mmap.push(mmap_ms);
                round += 1;
                if started.elapsed() > REFAULT_DEADLINE {
                    return Err(RefaultBenchError::Timeout(size, REFAULT_DEADLINE));
                }
                std::thread::sleep(PACE);
            }
            spans.push(started.elapsed().as_secs_f64());
            for _ in 0..round.max(1) {
                let (stats_ms, mmap_ms, _) = sample(&mut client)?;
                idle.push(stats_ms);
                idle_mmap.push(mmap_ms);
                std::thread::sleep(PACE);
            }
            Ok(())
        })?;
        for v in [&mut busy, &mut idle, &mut busy_mmap, &mut idle_mmap] {
            v.sort_by(f64::total_cmp);
        }
        spans.sort_by(f64::total_cmp);
        Ok(Responsiveness {
            mode: if helpers { "helpers" } else { "scrub thread" }.to_string(),
            threads,
            refault_s: percentile(&spans, 0.5),
            stats_p50_ms: percentile(&busy, 0.5),
            stats_p99_ms: percentile(&busy, 0.99),
            stats_max_ms: busy.last().copied().unwrap_or(0.0),
            idle_p50_ms: percentile(&idle, 0.5),
            idle_p99_ms: percentile(&idle, 0.99),
            samples: busy.len(),
            mmap_p50_ms: percentile(&busy_mmap, 0.5),
            mmap_p99_ms: percentile(&busy_mmap, 0.99),
            mmap_max_ms: busy_mmap.last().copied().unwrap_or(0.0),
            idle_mmap_p99_ms: percentile(&idle_mmap, 0.99),
        })
    })();
    if let Err(e) = daemon.shutdown() {
        tracing::warn!(error = %e, "daemon shutdown failed");
    }
    let _ = std::fs::remove_dir_all(&dir);
    result
}
