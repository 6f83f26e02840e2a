//! What the demo reads of the daemon's pool: the scrub figures, the pools
//! for the report, and the wait until a freed region is clean (the wait
//! for its holes to be faulted back in is shared with the alloc bench, in
//! `crate::harness::pool`).

use backend::daemon::DaemonHandle;
use hugemem_client::stats::Stats;

use super::error::DemoError;
use super::report::PoolFigures;
use crate::harness;
use crate::harness::pool::{CLEAN_DEADLINE, CLEAN_POLL};

/// Bytes the pool's scrubbers cleared, over every node.
pub(super) fn scrubbed_bytes(stats: &Stats) -> u64 {
    stats.scrub.nodes.iter().map(|n| n.bytes).sum()
}

/// Seconds the pool's scrubbers spent clearing, over every node.
pub(super) fn scrub_seconds(stats: &Stats) -> f64 {
    stats.scrub.nodes.iter().map(|n| n.seconds).sum()
}

pub(super) fn pools(stats: &Stats) -> Vec<PoolFigures> {
    stats
        .pools
        .iter()
        .map(|p| PoolFigures {
            node: u64::from(p.node),
            page_size: p.page_size.clone(),
            clean_bytes: p.clean_bytes,
            dirty_bytes: p.dirty_bytes,
            quarantined_bytes: p.quarantined_bytes,
            in_use_bytes: p.in_use_bytes,
        })
        .collect()
}

/// Waits until the pool holds at least `bytes` clean and nothing dirty or
/// quarantined.
pub(super) fn wait_clean(daemon: &DaemonHandle, bytes: u64) -> Result<Stats, DemoError> {
    harness::pool::wait_clean(daemon, bytes, CLEAN_DEADLINE, CLEAN_POLL)
        .map_err(|last| DemoError::CleanTimeout(CLEAN_DEADLINE, last.to_string()))
}
