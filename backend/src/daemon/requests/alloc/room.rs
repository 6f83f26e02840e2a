//! What the ALLOC room uses: the pool, the host, the counters, the refill
//! it yields to, the hugetlbfs mounts and the limits.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use guest_mem::PageSize;
use numa::Topology;

use crate::daemon::background::refill::Refill;
use crate::daemon::config::PoolConfig;
use crate::daemon::counters::metrics::Metrics;
use crate::daemon::lifecycle::Lifecycle;
use crate::daemon::pool::Pool;

/// The ALLOC room (see [`crate::daemon::requests::alloc`]).
#[derive(Debug)]
pub struct Alloc {
    /// The pool that takes the regions.
    pub pool: Arc<Pool>,
    /// The host's nodes.
    pub topology: Arc<Topology>,
    /// The counters.
    pub metrics: Arc<Metrics>,
    /// The refill an ALLOC makes yield.
    pub refill: Arc<Refill>,
    /// Shutdown cancels an ALLOC in progress between chunks.
    pub lifecycle: Arc<Lifecycle>,
    /// The hugetlbfs directory per page size (path-backed regions).
    pub hugetlbfs: Vec<(PageSize, PathBuf)>,
    /// `limits.max_alloc`, resolved (0: the host's memory).
    pub max_alloc: u64,
    /// `[pool]`: how long an ALLOC waits, who may get dirty lazy memory.
    pub cfg: PoolConfig,
}

impl Alloc {
    /// The hugetlbfs directory for path-backed regions of `page_size`.
    pub fn hugetlbfs_dir(&self, page_size: PageSize) -> Option<&Path> {
        self.hugetlbfs
            .iter()
            .find(|(p, _)| *p == page_size)
            .map(|(_, d)| d.as_path())
    }
}
