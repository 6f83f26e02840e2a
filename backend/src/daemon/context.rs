//! The daemon's shared parts, built once by the start and handed to the
//! control plane, the blocking jobs and the handle.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use numa::Topology;
use tokio::sync::Notify;

use super::config::Config;
use super::lifecycle::Lifecycle;
use super::metrics::{Metrics, ScrubCounters};
use super::pool::Pool;
use super::scrub::Scrubbers;
use super::{fdstore, handover, rebalance, refill, server};

/// State shared by the control plane, the blocking jobs and the handle.
#[derive(Debug)]
pub struct Shared {
    pub(super) cfg: Config,
    pub(super) topology: Arc<Topology>,
    pub(super) pool: Arc<Pool>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) fault_totals: Arc<crate::fault::FaultTotals>,
    pub(super) scrub: Vec<Arc<ScrubCounters>>,
    pub(super) allowed_uids: Vec<u32>,
    pub(super) hugetlbfs: Vec<(guest_mem::PageSize, PathBuf)>,
    pub(super) max_alloc: u64,
    pub(super) started: Instant,
    pub(super) socket: PathBuf,
    pub(super) lifecycle: Arc<Lifecycle>,
    pub(super) quarantine_kick: Arc<Notify>,
    pub(super) rebalance: rebalance::Rebalancer,
    pub(super) refill: refill::Refill,
    pub(super) handover: handover::Handover,
    pub(super) fdstore: fdstore::FdStore,
    pub(super) slots: Arc<server::Slots>,
    pub(super) scrubbers: std::sync::Mutex<Scrubbers>,
    pub(super) next_session: std::sync::atomic::AtomicU64,
}

impl Shared {
    /// Stops the scrubbers and joins them (a handover freezing the daemon).
    pub(super) fn stop_scrubbers(&self) {
        self.scrubbers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .stop_and_join(&self.pool);
    }

    /// Starts them again (a handover given up).
    pub(super) fn restart_scrubbers(&self) -> io::Result<()> {
        self.scrubbers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .restart(&self.topology, &self.pool, self.cfg.scrub.batch.0)
    }

    /// The next session id.
    pub(super) fn next_session_hint(&self) -> u64 {
        self.next_session.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The hugetlbfs directory for path-backed regions of `page_size`.
    pub fn hugetlbfs_dir(&self, page_size: guest_mem::PageSize) -> Option<&Path> {
        self.hugetlbfs
            .iter()
            .find(|(p, _)| *p == page_size)
            .map(|(_, d)| d.as_path())
    }
}
