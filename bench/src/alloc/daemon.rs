//! The ways through a daemon: a fresh ALLOC on an empty pool, the FREE
//! until the scrubbers have it clean, and the ALLOC from the clean pool.

use std::path::Path;
use std::time::{Duration, Instant};

use backend::client::Client;
use backend::daemon::{Daemon, DaemonHandle};
use backend::proto::{AllocPart, AllocRequest};
use guest_mem::PageSize;
use hugemem_client::stats::Stats;

use super::error::AllocBenchError;
use super::handout::{hand_out, HandOut};
use crate::harness;
use crate::harness::pool::wait_refaulted;

/// Longest wait for a FREE to come back clean.
const CLEAN_DEADLINE: Duration = Duration::from_secs(120);

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

/// What one repetition measured through daemons.
#[derive(Debug, Clone, Copy)]
pub(super) struct DaemonFigures {
    /// Fresh ALLOC on an empty pool, mapped, seconds.
    pub(super) fresh_s: f64,
    /// FREE until the pool shows the memory clean.
    pub(super) clean: DaemonTimes,
    /// The ALLOC right after "clean" on a daemon with its defaults (the
    /// scrubbers may still be refaulting holes): `pooled_eager_s`.
    pub(super) pooled: HandOut,
    /// The ALLOC once the freed region is clean and refaulted: resident.
    pub(super) resident: HandOut,
    /// The ALLOC right after "clean" on a daemon that does not refault
    /// ahead (`pool.refault_ahead = false`): punched holes.
    pub(super) holes: HandOut,
}

/// A daemon on a private socket whose pool keeps `size` freed bytes and
/// looks for other holders often; `refault_ahead` as given.
fn start_daemon(
    dir: &Path,
    size: u64,
    refault_ahead: bool,
) -> Result<DaemonHandle, AllocBenchError> {
    let mut config = harness::daemon::holding(dir.join("hugemem.sock"), size, 10);
    config.pool.refault_ahead = refault_ahead;
    Ok(Daemon::start(config)?)
}

/// Waits (looking every 1 ms) until the pool shows `bytes` clean.
fn wait_clean(daemon: &DaemonHandle, bytes: u64) -> Result<Stats, AllocBenchError> {
    harness::pool::wait_clean(daemon, bytes, CLEAN_DEADLINE, Duration::from_millis(1))
        .map_err(|_| AllocBenchError::CleanTimeout(CLEAN_DEADLINE))
}

fn request(size: u64, parts: &[AllocPart], page: PageSize) -> AllocRequest {
    AllocRequest {
        parts: parts.to_vec(),
        ..harness::daemon::eager_request(size, page)
    }
}

/// Runs `body` against a fresh daemon in a fresh socket directory, and
/// shuts the daemon down (its pool goes back to the kernel) whatever happens.
fn with_daemon<T>(
    size: u64,
    refault_ahead: bool,
    body: impl FnOnce(&DaemonHandle, &mut Client) -> Result<T, AllocBenchError>,
) -> Result<T, AllocBenchError> {
    let dir = std::env::temp_dir().join(format!("hugemem-bench-alloc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)
        .map_err(|e| AllocBenchError::NoPages(format!("socket dir: {e}")))?;
    let daemon = start_daemon(&dir, size, refault_ahead)?;
    let result = Client::connect(daemon.socket_path())
        .map_err(AllocBenchError::from)
        .and_then(|mut client| body(&daemon, &mut client));
    if let Err(e) = daemon.shutdown() {
        tracing::warn!(error = %e, "daemon shutdown failed");
    }
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// FREEs `id` and waits until the pool shows `size` bytes clean.
fn free_until_clean(
    daemon: &DaemonHandle,
    client: &mut Client,
    id: u64,
    size: u64,
) -> Result<DaemonTimes, AllocBenchError> {
    let (t, cpu) = (Instant::now(), process_cpu_seconds()?);
    client.free(id)?;
    wait_clean(daemon, size)?;
    Ok(DaemonTimes {
        seconds: t.elapsed().as_secs_f64(),
        cpu_seconds: process_cpu_seconds()? - cpu,
    })
}

/// Waits until the pool shows `size` bytes clean and every page punched out
/// since `before` faulted back in: a resident, zeroed region.
fn wait_resident(
    daemon: &DaemonHandle,
    before: &Stats,
    size: u64,
    page: PageSize,
) -> Result<(), AllocBenchError> {
    let after = wait_clean(daemon, size)?;
    let detached = after
        .counters
        .pages_detached
        .saturating_sub(before.counters.pages_detached)
        .saturating_mul(page.bytes());
    wait_refaulted(daemon, before, detached)
        .map(drop)
        .ok_or(AllocBenchError::CleanTimeout(CLEAN_DEADLINE))
}

/// A fresh ALLOC, mapped as a VMM maps it: (seconds, id).
fn fresh_alloc(client: &mut Client, request: &AllocRequest) -> Result<(f64, u64), AllocBenchError> {
    // Timed to the point the daemon-less variants end at: the memory mapped
    // in this process and ready for a VMM (a rust-vmm VMM's
    // `GuestMemoryMmap`), not just the fds received.
    let t = Instant::now();
    let a = client.alloc(request.clone())?;
    let memory = a.guest_memory()?;
    let seconds = t.elapsed().as_secs_f64();
    let id = a.id;
    drop((memory, a));
    Ok((seconds, id))
}

/// Through daemons, each on a pool of its own so that no background work of
/// one hand-out runs into the next: on one with its defaults, a fresh ALLOC,
/// FREE until clean, and the pooled ALLOC at once; on a second, FREE until
/// clean and refaulted, then the resident ALLOC and its touch; on one that
/// does not refault ahead, the hand-out with holes and its touch.
pub(super) fn through_daemon(
    size: u64,
    parts: &[AllocPart],
    page: PageSize,
) -> Result<DaemonFigures, AllocBenchError> {
    let request = request(size, parts, page);
    let (fresh_s, clean, pooled) = with_daemon(size, true, |daemon, client| {
        let (fresh_s, id) = fresh_alloc(client, &request)?;
        let clean = free_until_clean(daemon, client, id, size)?;
        let pooled = hand_out(client, &request, page.bytes(), false)?;
        Ok((fresh_s, clean, pooled))
    })?;
    let resident = with_daemon(size, true, |daemon, client| {
        let (_, id) = fresh_alloc(client, &request)?;
        let before = daemon.stats();
        client.free(id)?;
        wait_resident(daemon, &before, size, page)?;
        hand_out(client, &request, page.bytes(), true)
    })?;
    let holes = with_daemon(size, false, |daemon, client| {
        let (_, id) = fresh_alloc(client, &request)?;
        free_until_clean(daemon, client, id, size)?;
        hand_out(client, &request, page.bytes(), true)
    })?;
    Ok(DaemonFigures {
        fresh_s,
        clean,
        pooled,
        resident,
        holes,
    })
}
