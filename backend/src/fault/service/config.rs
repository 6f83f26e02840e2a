//! What a fault service is given ([`FaultServiceConfig`], the
//! [`FaultMapping`]s) and what it ends with ([`StopReason`],
//! [`FaultReport`]), and the tunings its threads share.

use std::sync::Arc;
use std::time::Duration;

use clearing::ClearKernel;
use guest_mem::Region;
use numa::Topology;

use crate::diag::RateLimit;
use crate::fault::metrics::{FaultStats, FaultTotals};

/// How long a fill that keeps answering `EAGAIN` is retried before the fault
/// is given up (the reader thread reads the pending event within
/// microseconds; this only bounds a wedged address space).
pub(super) const RETRY_FOR: Duration = Duration::from_secs(10);
/// Most read-ahead hints kept per node; older ones are dropped.
pub(super) const MAX_HINTS: usize = 4096;
/// Events read per `read(2)`.
pub(super) const READ_BATCH: usize = 64;
/// How often faults on pages another thread is clearing are looked at again.
pub(super) const RECHECK: Duration = Duration::from_millis(1);

pub(super) const TOKEN_STOP: u64 = 0;
pub(super) const TOKEN_UFFD: u64 = 1;
pub(super) const TOKEN_PEER: u64 = 2;
pub(super) const TOKEN_KICK: u64 = 3;

pub(super) static FAULT_ERROR_LOG: RateLimit = RateLimit::new(Duration::from_secs(1));
pub(super) static UNKNOWN_ADDR_LOG: RateLimit = RateLimit::new(Duration::from_secs(1));
pub(super) static EVENT_LOG: RateLimit = RateLimit::new(Duration::from_secs(1));

/// Configuration of one fault service.
#[derive(Debug, Clone)]
pub struct FaultServiceConfig {
    /// Threads serving faults (each clears one page at a time). Default 2.
    pub handler_threads: usize,
    /// Background scrubber threads per NUMA node that has memory in the
    /// service; 0 turns background scrubbing off. Default 1.
    pub scrub_threads_per_node: usize,
    /// Bulk clearing kernel (the faulting neighbourhood always uses a
    /// temporal one). Default [`ClearKernel::default_kernel`].
    pub kernel: ClearKernel,
    /// Pages after a faulting page that the scrubbers take next. Default 4.
    pub readahead_pages: usize,
    /// Topology for pinning scrubbers to their node's CPUs; `None` leaves
    /// them unpinned.
    pub topology: Option<Arc<Topology>>,
    /// Label for logs (e.g. the allocation id).
    pub label: String,
    /// Notified when the service ends abnormally ([`StopReason::Panicked`],
    /// [`StopReason::UffdFailed`]): the daemon then closes the connection so
    /// the VMM's fallback takes over.
    pub failure: Option<Arc<tokio::sync::Notify>>,
    /// Daemon-wide sums this service's counters are added to (the metrics
    /// endpoint); `None` outside a daemon.
    pub totals: Option<Arc<FaultTotals>>,
}

impl Default for FaultServiceConfig {
    fn default() -> Self {
        Self {
            handler_threads: 2,
            scrub_threads_per_node: 1,
            kernel: ClearKernel::default_kernel(),
            readahead_pages: 4,
            topology: None,
            label: String::from("lazy"),
            failure: None,
            totals: None,
        }
    }
}

/// One VMM mapping the service serves: `len` bytes at `vmm_start` in the
/// VMM, backed by `region` from `region_offset`.
#[derive(Debug, Clone)]
pub struct FaultMapping {
    /// Start in the VMM's address space (registered MINOR on the uffd).
    pub vmm_start: u64,
    /// Bytes; a multiple of the region's page size.
    pub len: u64,
    /// The region: its own mapping is where pages are cleared, its page
    /// states gate every install.
    pub region: Arc<Region>,
    /// Offset of `vmm_start` in the region; page aligned.
    pub region_offset: u64,
}

/// Why a service ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// [`FaultServiceHandle::stop`](crate::fault::FaultServiceHandle::stop) (or drop).
    Requested,
    /// The VMM process exited (its pidfd became readable).
    PeerExited,
    /// The VMM's address space is gone (`ESRCH` from a fill).
    VmmGone,
    /// The VMM unmapped every range.
    AllUnmapped,
    /// Reading or polling the uffd failed.
    UffdFailed(String),
    /// A service thread panicked.
    Panicked(String),
}

/// What a stopped service did.
#[derive(Debug, Clone)]
pub struct FaultReport {
    /// Why it ended.
    pub reason: StopReason,
    /// Final counters.
    pub stats: FaultStats,
}
