//! Waiting on a bench's daemon's pool: until a freed region shows clean,
//! and until the scrubbers have faulted its holes back in.

use std::time::{Duration, Instant};

use backend::daemon::DaemonHandle;
use hugemem_client::stats::Stats;

/// Longest wait for the pool to show a freed region clean.
pub(crate) const CLEAN_DEADLINE: Duration = Duration::from_secs(60);
/// How often the pool is looked at while waiting.
pub(crate) const CLEAN_POLL: Duration = Duration::from_millis(2);

/// (clean bytes, dirty + quarantined bytes) over every pool in a STATS
/// document.
pub(crate) fn pool_state(stats: &Stats) -> (u64, u64) {
    (
        stats.pool_sum(|p| p.clean_bytes),
        stats.pool_sum(|p| p.dirty_bytes + p.quarantined_bytes),
    )
}

/// Waits, looking every `poll`, until the pool holds at least `bytes`
/// clean and nothing dirty or quarantined; the last STATS as the error
/// after `deadline`.
pub(crate) fn wait_clean(
    daemon: &DaemonHandle,
    bytes: u64,
    deadline: Duration,
    poll: Duration,
) -> Result<Stats, Box<Stats>> {
    let end = Instant::now() + deadline;
    loop {
        let stats = daemon.stats();
        let (clean, pending) = pool_state(&stats);
        if clean >= bytes && pending == 0 {
            return Ok(stats);
        }
        if Instant::now() >= end {
            return Err(Box::new(stats));
        }
        std::thread::sleep(poll);
    }
}

/// Waits until the scrubbers have faulted `bytes` more of detached regions'
/// holes in than in `before`; `None` after the clean deadline.
pub(crate) fn wait_refaulted(daemon: &DaemonHandle, before: &Stats, bytes: u64) -> Option<Stats> {
    let refaulted = |s: &Stats| s.scrub.nodes.iter().map(|n| n.refault_bytes).sum::<u64>();
    let deadline = Instant::now() + CLEAN_DEADLINE;
    loop {
        let stats = daemon.stats();
        if refaulted(&stats).saturating_sub(refaulted(before)) >= bytes {
            return Some(stats);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(CLEAN_POLL);
    }
}
