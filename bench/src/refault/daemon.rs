//! The daemon's responsiveness while it refaults: STATS round trips over
//! its socket, from the FREE of a region until its holes are faulted back
//! in, with fault helpers (the default) and with the scrubber thread
//! faulting through the daemon's own mapping (`scrub.refault_helpers =
//! false`, the way before issue 27), against the same daemon idle.

use std::time::{Duration, Instant};

use backend::client::Client;
use backend::daemon::config::{PoolConfig, ScrubConfig};
use backend::daemon::{ByteSize, Config, Daemon};
use backend::proto::{AllocRequest, ClearMode, PagePolicy};
use guest_mem::PageSize;
use serde::Serialize;

use super::error::RefaultBenchError;

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
    /// seconds (median).
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
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn refaulted(client: &mut Client) -> Result<u64, RefaultBenchError> {
    Ok(client.stats()?.scrub.nodes.iter().map(|n| n.refault_bytes).sum())
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
    let defaults = Config::default();
    let config = Config {
        socket: dir.join("hugemem.sock"),
        pool: PoolConfig {
            target: defaults.pool.target.max(ByteSize(size)),
            limit: defaults.pool.limit.max(ByteSize(size)),
            recheck_ms: 10,
            ..defaults.pool.clone()
        },
        scrub: ScrubConfig {
            refault_helpers: helpers,
            ..defaults.scrub.clone()
        },
        ..defaults
    };
    let threads = if helpers {
        numa::current_affinity().map_or(1, |c| c.len())
    } else {
        config.scrub.threads_per_node
    };
    let daemon = Daemon::start(config)?;
    let result = (|| {
        let mut client = Client::connect(daemon.socket_path())?;
        let request = AllocRequest {
            total_size: size,
            page_policy: match page {
                PageSize::Huge1G => PagePolicy::Huge1G,
                PageSize::Huge2M => PagePolicy::Huge2M,
                PageSize::Base4K => PagePolicy::Base4K,
            },
            clear_mode: ClearMode::Eager,
            lock: false,
            parts: Vec::new(),
            want_paths: false,
        };
        let (mut busy, mut idle, mut spans) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..reps {
            let a = client.alloc(request.clone())?;
            let id = a.id;
            drop(a);
            let before = refaulted(&mut client)?;
            let started = Instant::now();
            client.free(id)?;
            let mut round = 0;
            loop {
                let t = Instant::now();
                let done = refaulted(&mut client)?;
                busy.push(t.elapsed().as_secs_f64() * 1e3);
                round += 1;
                if done >= before + size {
                    break;
                }
                if started.elapsed() > REFAULT_DEADLINE {
                    return Err(RefaultBenchError::Timeout(size, REFAULT_DEADLINE));
                }
            }
            spans.push(started.elapsed().as_secs_f64());
            for _ in 0..round {
                let t = Instant::now();
                refaulted(&mut client)?;
                idle.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        busy.sort_by(f64::total_cmp);
        idle.sort_by(f64::total_cmp);
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
        })
    })();
    if let Err(e) = daemon.shutdown() {
        tracing::warn!(error = %e, "daemon shutdown failed");
    }
    let _ = std::fs::remove_dir_all(&dir);
    result
}
