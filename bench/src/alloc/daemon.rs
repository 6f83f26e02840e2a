//! The ways through a daemon: a fresh ALLOC on an empty pool, the FREE
//! until the scrubbers have it clean, and the ALLOC from the clean pool.

use std::time::{Duration, Instant};

use backend::client::Client;
use backend::daemon::config::PoolConfig;
use backend::daemon::{ByteSize, Config, Daemon, DaemonHandle};
use backend::proto::{AllocPart, AllocRequest, ClearMode, PagePolicy};
use guest_mem::PageSize;
use hugemem_client::stats::Stats;

use super::error::AllocBenchError;

/// Longest wait for a FREE to come back clean.
const CLEAN_DEADLINE: Duration = Duration::from_secs(120);

/// (clean bytes, dirty + quarantined bytes) over every pool in a STATS document.
pub(crate) fn pool_state(stats: &Stats) -> (u64, u64) {
    (
        stats.pool_sum(|p| p.clean_bytes),
        stats.pool_sum(|p| p.dirty_bytes + p.quarantined_bytes),
    )
}

fn wait_clean(daemon: &DaemonHandle, bytes: u64) -> Result<(), AllocBenchError> {
    let deadline = Instant::now() + CLEAN_DEADLINE;
    loop {
        let (clean, pending) = pool_state(&daemon.stats());
        if clean >= bytes && pending == 0 {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(AllocBenchError::CleanTimeout(CLEAN_DEADLINE));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Wall and CPU time of a FREE until the pool shows the memory clean.
#[derive(Debug, Clone, Copy)]
pub(super) struct DaemonTimes {
    pub(super) seconds: f64,
    /// CPU time of this whole process meanwhile: the in-process daemon's
    /// scrubbers, plus this thread's 1 ms polling (negligible).
    pub(super) cpu_seconds: f64,
}

/// CPU time this process has used, all threads, seconds.
fn process_cpu_seconds() -> Result<f64, AllocBenchError> {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_PROCESS_CPUTIME_ID)
        .map_err(|e| AllocBenchError::Clock(e.into()))?;
    #[allow(clippy::cast_precision_loss)] // seconds of CPU time fit an f64 exactly
    Ok(t.tv_sec() as f64 + t.tv_nsec() as f64 * 1e-9)
}

/// Through a fresh daemon: fresh ALLOC, FREE, wait for clean, pooled ALLOC.
/// Returns (fresh seconds, free→clean times, pooled seconds).
pub(super) fn through_daemon(
    size: u64,
    parts: &[AllocPart],
    page: PageSize,
) -> Result<(f64, DaemonTimes, f64), AllocBenchError> {
    let dir = std::env::temp_dir().join(format!("hugemem-bench-alloc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)
        .map_err(|e| AllocBenchError::NoPages(format!("socket dir: {e}")))?;
    let defaults = Config::default();
    // The pool must keep the freed VM, and look for other holders often.
    let config = Config {
        socket: dir.join("hugemem.sock"),
        pool: PoolConfig {
            target: defaults.pool.target.max(ByteSize(size)),
            limit: defaults.pool.limit.max(ByteSize(size)),
            recheck_ms: 10,
            ..defaults.pool.clone()
        },
        ..defaults
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
            parts: parts.to_vec(),
            want_paths: false,
        };
        // Both ALLOCs are timed to the point the daemon-less variants end
        // at: the memory mapped in this process and ready for a VMM (a
        // rust-vmm VMM's `GuestMemoryMmap`), not just the fds received.
        let t = Instant::now();
        let a = client.alloc(request.clone())?;
        let memory = a.guest_memory()?;
        let fresh = t.elapsed().as_secs_f64();
        let id = a.id;
        drop((memory, a));
        let (t, cpu) = (Instant::now(), process_cpu_seconds()?);
        client.free(id)?;
        wait_clean(&daemon, size)?;
        let clean = DaemonTimes {
            seconds: t.elapsed().as_secs_f64(),
            cpu_seconds: process_cpu_seconds()? - cpu,
        };
        let t = Instant::now();
        let a = client.alloc(request)?;
        let memory = a.guest_memory()?;
        let pooled = t.elapsed().as_secs_f64();
        let id = a.id;
        drop((memory, a));
        client.free(id)?;
        Ok((fresh, clean, pooled))
    })();
    if let Err(e) = daemon.shutdown() {
        tracing::warn!(error = %e, "daemon shutdown failed");
    }
    let _ = std::fs::remove_dir_all(&dir);
    result
}
