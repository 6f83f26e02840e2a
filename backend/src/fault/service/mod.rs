//! The fault service's runtime: an epoll reader thread, handler threads and
//! node-local scrubbers around one VMM's userfaultfd.
//!
//! ```text
//!   VMM uffd ──► hm-uffd-rd (epoll: uffd, stop EventFd, VMM pidfd)
//!                   │ page faults → queue      UNMAP/REMAP → range table
//!                   ▼
//!               hm-uffd-h0..N  policy::serve_fault → clear (daemon mapping) → UFFDIO_CONTINUE
//!                   │ read-ahead hints
//!                   ▼
//!               hm-uffd-sN-i   (pinned to node N) policy::scrub_page → UFFDIO_CONTINUE ahead
//! ```
//!
//! Mechanism only: what happens to a page is decided in [`super::policy`].

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use clearing::ClearKernel;
use guest_mem::Region;
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags};
use nix::sys::eventfd::{EfdFlags, EventFd};
use numa::{NodeId, Topology};
use tracing::{error, info, warn};

use super::metrics::{FaultMetrics, FaultStats};
use super::table::RangeTable;
use super::{FaultError, Result};
use crate::diag::RateLimit;
use crate::uffd::Uffd;

mod shared;
mod threads;

use shared::{lock, Shared};
use threads::*;

/// How long a fill that keeps answering `EAGAIN` is retried before the fault
/// is given up (the reader thread reads the pending event within
/// microseconds; this only bounds a wedged address space).
const RETRY_FOR: Duration = Duration::from_secs(10);
/// Most read-ahead hints kept per node; older ones are dropped.
const MAX_HINTS: usize = 4096;
/// Events read per `read(2)`.
const READ_BATCH: usize = 64;
/// How often faults on pages another thread is clearing are looked at again.
const RECHECK: Duration = Duration::from_millis(1);

const TOKEN_STOP: u64 = 0;
const TOKEN_UFFD: u64 = 1;
const TOKEN_PEER: u64 = 2;
const TOKEN_KICK: u64 = 3;

static FAULT_ERROR_LOG: RateLimit = RateLimit::new(Duration::from_secs(1));
static UNKNOWN_ADDR_LOG: RateLimit = RateLimit::new(Duration::from_secs(1));
static EVENT_LOG: RateLimit = RateLimit::new(Duration::from_secs(1));

/// Every fault service of this process (label, counters), for benchmarks and
/// diagnostics that cannot reach the handle (it lives in a daemon session).
static LIVE: Mutex<Vec<(String, std::sync::Weak<FaultMetrics>)>> = Mutex::new(Vec::new());

/// The counters of every fault service running in this process, by label.
pub fn live_services() -> Vec<(String, Arc<FaultMetrics>)> {
    let mut live = lock(&LIVE);
    live.retain(|(_, w)| w.strong_count() > 0);
    live.iter()
        .filter_map(|(l, w)| w.upgrade().map(|m| (l.clone(), m)))
        .collect()
}

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
    pub totals: Option<Arc<super::metrics::FaultTotals>>,
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
    /// [`FaultServiceHandle::stop`] (or drop).
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

/// A running fault service; stopping it (or dropping it) joins every thread.
#[derive(Debug)]
pub struct FaultServiceHandle {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    _peer: Option<OwnedFd>,
}

/// Starts fault services.
#[derive(Debug)]
pub struct FaultService;

impl FaultService {
    /// Checks the mappings, makes the uffd non-blocking, and starts the
    /// reader, the handlers and the scrubbers. `peer_exit` is an fd that
    /// becomes readable when the VMM is gone (its pidfd); the service then
    /// ends with [`StopReason::PeerExited`].
    ///
    /// Every `Dirty` page of the regions must be resident (the daemon's own
    /// mapping has it mapped, as every pooled page is after it was populated
    /// and cleared once): a dirty page that is not in the file's page cache
    /// would not raise a MINOR fault, the kernel would give the guest a fresh
    /// page, and a scrubber could later clear it under the guest. Such a
    /// region is refused ([`FaultError::NotResident`]): hand it out eagerly.
    ///
    /// # Errors
    ///
    /// [`FaultError`]: bad mappings, non-resident dirty pages, uffd or thread
    /// setup failures. Nothing keeps running after an error.
    pub fn start(
        cfg: FaultServiceConfig,
        uffd: Uffd,
        mappings: Vec<FaultMapping>,
        peer_exit: Option<OwnedFd>,
    ) -> Result<FaultServiceHandle> {
        let (units, ranges) = check_mappings(&mappings)?;
        check_resident(&units)?;
        let table = RangeTable::new(ranges).map_err(FaultError::Table)?;
        set_nonblocking(&uffd)?;
        let mut groups: Vec<Option<NodeId>> = Vec::new();
        for u in &units {
            if !groups.contains(&u.node) {
                groups.push(u.node);
            }
        }
        let efd = || {
            EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
                .map_err(|e| FaultError::Setup(e.into()))
        };
        let shared = Arc::new(Shared {
            label: cfg.label.clone(),
            uffd,
            hints: groups.iter().map(|_| Mutex::new(VecDeque::new())).collect(),
            groups,
            units,
            table: RwLock::new(table),
            metrics: Arc::new(FaultMetrics::default()),
            kernel: cfg.kernel,
            readahead: cfg.readahead_pages,
            stop: AtomicBool::new(false),
            stop_fd: efd()?,
            ended_fd: efd()?,
            reason: Mutex::new(None),
            reason_cv: Condvar::new(),
            queue: Mutex::new(VecDeque::new()),
            queue_cv: Condvar::new(),
            deferred: Mutex::new(Vec::new()),
            kick_fd: efd()?,
            zeros_2m: OnceLock::new(),
            zeros_1g: OnceLock::new(),
            failure: cfg.failure.clone(),
        });
        lock(&LIVE).push((cfg.label.clone(), Arc::downgrade(&shared.metrics)));
        if let Some(t) = &cfg.totals {
            t.register(Arc::clone(&shared.metrics));
        }
        let epoll =
            Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).map_err(|e| FaultError::Setup(e.into()))?;
        let add = |fd: BorrowedFd<'_>, token| {
            epoll
                .add(fd, EpollEvent::new(EpollFlags::EPOLLIN, token))
                .map_err(|e| FaultError::Setup(e.into()))
        };
        add(shared.stop_fd.as_fd(), TOKEN_STOP)?;
        add(shared.uffd.as_fd(), TOKEN_UFFD)?;
        add(shared.kick_fd.as_fd(), TOKEN_KICK)?;
        if let Some(p) = &peer_exit {
            add(p.as_fd(), TOKEN_PEER)?;
        }
        let mut handle = FaultServiceHandle {
            shared: Arc::clone(&shared),
            threads: Vec::new(),
            _peer: peer_exit,
        };
        let label = cfg.label.clone();
        let spawn = |name: String,
                     f: Box<dyn FnOnce() + Send>,
                     handle: &mut FaultServiceHandle|
         -> Result<()> {
            let sh = Arc::clone(&shared);
            let thread_name = name.clone();
            let h = std::thread::Builder::new()
                .name(name)
                .spawn(move || guarded(&sh, &thread_name, f))
                .map_err(FaultError::Threads)?;
            handle.threads.push(h);
            Ok(())
        };
        {
            let sh = Arc::clone(&shared);
            spawn(
                "hm-uffd-rd".to_string(),
                Box::new(move || reader(&sh, &epoll)),
                &mut handle,
            )?;
        }
        for i in 0..cfg.handler_threads.max(1) {
            let sh = Arc::clone(&shared);
            spawn(
                format!("hm-uffd-h{i}"),
                Box::new(move || handler(&sh)),
                &mut handle,
            )?;
        }
        if cfg.scrub_threads_per_node > 0 {
            for (g, node) in shared.groups.iter().enumerate() {
                let cpus = match (&cfg.topology, node) {
                    (Some(t), Some(n)) => t.node(*n).map(|n| n.cpus.clone()).unwrap_or_default(),
                    _ => Vec::new(),
                };
                for i in 0..cfg.scrub_threads_per_node {
                    let sh = Arc::clone(&shared);
                    let (count, cpus) = (cfg.scrub_threads_per_node, cpus.clone());
                    let name = format!(
                        "hm-uffd-s{}-{i}",
                        node.map_or_else(|| "x".to_string(), |n| n.to_string())
                    );
                    let label = label.clone();
                    spawn(
                        name,
                        Box::new(move || {
                            if !cpus.is_empty() {
                                if let Err(e) = numa::pin_current_thread(&cpus) {
                                    // Unpinned scrubbing is slower, not wrong.
                                    warn!(service = %label, error = %e, "cannot pin a lazy-mode scrubber");
                                }
                            }
                            scrubber(&sh, g, i, count);
                        }),
                        &mut handle,
                    )?;
                }
            }
        }
        info!(
            service = %cfg.label,
            regions = shared.units.len(),
            handlers = cfg.handler_threads.max(1),
            scrubbers_per_node = cfg.scrub_threads_per_node,
            "fault service started"
        );
        Ok(handle)
    }
}

/// Runs a service thread body; a panic ends the service instead of leaving
/// faults unserved in silence.
fn guarded(shared: &Shared, name: &str, f: Box<dyn FnOnce() + Send>) {
    if let Err(panic) = catch_unwind(AssertUnwindSafe(f)) {
        let msg = panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "non-string panic".into());
        error!(service = %shared.label, thread = name, panic = %msg, "fault service thread panicked");
        shared.end(StopReason::Panicked(format!("{name}: {msg}")));
    }
}

impl FaultServiceHandle {
    /// Counters so far.
    pub fn stats(&self) -> FaultStats {
        self.shared.metrics.snapshot()
    }

    /// The live counters (for a metrics endpoint).
    pub fn metrics(&self) -> Arc<FaultMetrics> {
        Arc::clone(&self.shared.metrics)
    }

    /// Asks the scrubbers to take the page holding VMM address `addr` (and
    /// the read-ahead after it) next. False when the address is not served.
    pub fn prioritize(&self, addr: u64) -> bool {
        let target = {
            let table = self
                .shared
                .table
                .read()
                .unwrap_or_else(PoisonError::into_inner);
            table.lookup(addr).map(|hit| {
                let unit = hit.range.target.0;
                (
                    unit,
                    usize::try_from(
                        hit.target_offset / self.shared.units[unit].region.state_unit(),
                    )
                    .unwrap_or(usize::MAX),
                )
            })
        };
        let Some((unit, page)) = target else {
            return false;
        };
        if let Some(g) = self.shared.group_of(unit) {
            let mut q = lock(&self.shared.hints[g]);
            if q.len() >= MAX_HINTS {
                q.pop_front();
            }
            q.push_back((unit, page));
        }
        self.shared.hint_after(unit, page);
        true
    }

    /// Dirty pages left in the service's regions.
    pub fn dirty_pages(&self) -> usize {
        self.shared
            .units
            .iter()
            .map(|u| u.region.states().counts().dirty)
            .sum()
    }

    /// Why the service ended by itself, if it did.
    pub fn ended(&self) -> Option<StopReason> {
        lock(&self.shared.reason).clone()
    }

    /// An fd that becomes readable when the service ends by itself (VMM gone,
    /// uffd failure, panic); not on [`FaultServiceHandle::stop`].
    pub fn ended_fd(&self) -> BorrowedFd<'_> {
        self.shared.ended_fd.as_fd()
    }

    /// Waits up to `timeout` for the service to end by itself.
    pub fn wait_ended(&self, timeout: Duration) -> Option<StopReason> {
        let deadline = Instant::now() + timeout;
        let mut r = lock(&self.shared.reason);
        while r.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            r = self
                .shared
                .reason_cv
                .wait_timeout(r, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        r.clone()
    }

    /// Stops the service: no new fault or scrub starts, pages being cleared
    /// are finished (at most one page per thread), every thread is joined,
    /// and the daemon's copy of the uffd is closed when the handle drops.
    /// Faults not yet served stay pending (the VMM keeps its own uffd copy).
    pub fn stop(mut self) -> FaultReport {
        self.stop_inner();
        FaultReport {
            reason: self.ended().unwrap_or(StopReason::Requested),
            stats: self.stats(),
        }
    }

    /// [`FaultServiceHandle::stop`], keeping a duplicate of the uffd (the
    /// same open description, so the VMM's registrations stay) for a
    /// successor daemon. Faults whose events this service read but did not
    /// answer stay pending; the successor wakes every range once its own
    /// service runs, so they fault again and reach it.
    ///
    /// # Errors
    ///
    /// Duplicating the fd (`EMFILE`); the service is stopped anyway.
    pub fn stop_keeping_uffd(self) -> (FaultReport, std::io::Result<OwnedFd>) {
        let fd = self.shared.uffd.as_fd().try_clone_to_owned();
        (self.stop(), fd)
    }

    fn stop_inner(&mut self) {
        self.shared.end(StopReason::Requested);
        for t in self.threads.drain(..) {
            let name = t.thread().name().unwrap_or("fault thread").to_string();
            if t.join().is_err() {
                error!(service = %self.shared.label, thread = %name, "fault service thread panicked outside its guard");
            }
        }
    }
}

impl Drop for FaultServiceHandle {
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            self.stop_inner();
        }
    }
}
