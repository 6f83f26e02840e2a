//! The last regions the pool gave back to the kernel and why, for STATS
//! (`given_back`): a region leaves the table the moment it is given back,
//! so without this `status` could not say where it went.

use std::collections::VecDeque;
use std::time::Instant;

use hugemem_client::stats::GivenBack as StatsEntry;

use crate::daemon::ids::{PoolKey, RegionId};

/// How many are kept.
const KEEP: usize = 32;

/// One region given back.
#[derive(Debug, Clone)]
pub(super) struct GivenBack {
    id: RegionId,
    node: u32,
    page_size: guest_mem::PageSize,
    bytes: u64,
    why: String,
    at: Instant,
}

/// The most recent [`KEEP`] regions given back.
#[derive(Debug, Default)]
pub(super) struct Recent(VecDeque<GivenBack>);

impl Recent {
    /// Records that region `id` (pooled by `key`, `bytes` long) goes back
    /// to the kernel.
    pub(super) fn push(&mut self, id: RegionId, key: PoolKey, bytes: u64, why: impl Into<String>) {
        if self.0.len() == KEEP {
            self.0.pop_front();
        }
        self.0.push_back(GivenBack {
            id,
            node: key.node,
            page_size: key.page_size,
            bytes,
            why: why.into(),
            at: Instant::now(),
        });
    }

    /// The STATS list, newest first.
    pub(super) fn stats(&self) -> Vec<StatsEntry> {
        self.0
            .iter()
            .rev()
            .map(|g| StatsEntry {
                region: g.id,
                node: g.node,
                page_size: g.page_size.to_string(),
                bytes: g.bytes,
                why: format!("given back: {}", g.why),
                seconds_ago: g.at.elapsed().as_secs_f64(),
            })
            .collect()
    }
}
