//! Waiting on a bench's daemon's pool, shared by the demo and the alloc
//! bench: how long and how often the pool is looked at, and the wait until
//! the scrubbers have faulted a freed region's holes back in.

use std::time::{Duration, Instant};

use backend::daemon::DaemonHandle;
use hugemem_client::stats::Stats;

/// Longest wait for the pool to show a freed region clean.
pub(crate) const CLEAN_DEADLINE: Duration = Duration::from_secs(60);
/// How often the pool is looked at while waiting.
pub(crate) const CLEAN_POLL: Duration = Duration::from_millis(2);

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
