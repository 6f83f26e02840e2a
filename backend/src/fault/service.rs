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
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use clearing::ClearKernel;
use guest_mem::{AnonMapping, PageSize, PageState, Region};
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use numa::{NodeId, Topology};
use tracing::{debug, error, info, warn};

use super::metrics::{FaultMetrics, FaultStats};
use super::policy::{self, PageOps, PolicyError, Served};
use super::table::{Range, RangeTable};
use super::{FaultError, Result};
use crate::daemon::RateLimit;
use crate::uffd::{FaultKind, Fill, Uffd, UffdError, UffdEvent};

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

/// Range target: which region (by index in guest-physical order).
#[derive(Debug, Clone)]
struct Target(usize);

/// One region the service serves, in guest-physical order.
#[derive(Debug)]
struct Unit {
    region: Arc<Region>,
    node: Option<NodeId>,
}

/// A fault waiting for a handler.
#[derive(Debug, Clone, Copy)]
struct Job {
    unit: usize,
    page: usize,
    page_vmm: u64,
    page_len: u64,
    fault_offset: usize,
    kind: FaultKind,
    read_at: Instant,
    /// Re-checked before (the page was being cleared by another thread).
    deferred: bool,
}

#[derive(Debug)]
struct Shared {
    label: String,
    uffd: Uffd,
    units: Vec<Unit>,
    table: RwLock<RangeTable<Target>>,
    metrics: Arc<FaultMetrics>,
    kernel: ClearKernel,
    readahead: usize,
    stop: AtomicBool,
    stop_fd: EventFd,
    ended_fd: EventFd,
    reason: Mutex<Option<StopReason>>,
    reason_cv: Condvar,
    queue: Mutex<VecDeque<Job>>,
    queue_cv: Condvar,
    /// Faults on pages another thread was clearing, re-queued by the reader
    /// every [`RECHECK`] until the page is clean (the owner may be a pool
    /// scrubber, which does not install what it clears).
    deferred: Mutex<Vec<Job>>,
    /// Wakes the reader when a fault is deferred.
    kick_fd: EventFd,
    /// Read-ahead hints per scrubber group (index into `groups`).
    hints: Vec<Mutex<VecDeque<(usize, usize)>>>,
    /// Node of each scrubber group.
    groups: Vec<Option<NodeId>>,
    /// Zeroed source for MISSING fills, per page size (never written).
    zeros_2m: OnceLock<AnonMapping>,
    zeros_1g: OnceLock<AnonMapping>,
    failure: Option<Arc<tokio::sync::Notify>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    /// Ends the service (first reason wins) and wakes every thread.
    fn end(&self, reason: StopReason) {
        {
            let mut r = lock(&self.reason);
            if r.is_none() {
                if reason != StopReason::Requested {
                    info!(service = %self.label, ?reason, "fault service ending");
                }
                *r = Some(reason.clone());
                if reason != StopReason::Requested {
                    // Tell whoever watches ended_fd; a full counter is still readable.
                    let _ = self.ended_fd.write(1);
                }
                if matches!(reason, StopReason::Panicked(_) | StopReason::UffdFailed(_)) {
                    if let Some(n) = &self.failure {
                        n.notify_one();
                    }
                }
            }
        }
        self.reason_cv.notify_all();
        self.stop.store(true, Ordering::Release);
        let _ = self.stop_fd.write(1);
        // Take the lock so a handler between its check and its wait sees the flag.
        drop(lock(&self.queue));
        self.queue_cv.notify_all();
    }

    fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    fn group_of(&self, unit: usize) -> Option<usize> {
        let node = self.units.get(unit)?.node;
        self.groups.iter().position(|g| *g == node)
    }

    /// Queues read-ahead hints after a fault on `page` of `unit`.
    fn hint_after(&self, unit: usize, page: usize) {
        let Some(g) = self.group_of(unit) else { return };
        let pages = self.units[unit].region.states().len();
        let mut q = lock(&self.hints[g]);
        for p in (page + 1..pages).take(self.readahead) {
            if q.len() >= MAX_HINTS {
                q.pop_front();
            }
            q.push_back((unit, p));
        }
    }

    /// VMM start addresses of `page` of `unit` (usually one; none once unmapped).
    fn vmm_addrs(&self, unit: usize, page: usize) -> (Vec<u64>, u64) {
        let (offset, len) = self.units[unit].region.page_range(page);
        let table = self.table.read().unwrap_or_else(PoisonError::into_inner);
        (table.vmm_addrs_of(|t| t.0 == unit, offset, len), len)
    }

    fn zeros(&self, len: u64) -> io::Result<&AnonMapping> {
        let (cell, size) = if len == PageSize::Huge1G.bytes() {
            (&self.zeros_1g, PageSize::Huge1G)
        } else {
            (&self.zeros_2m, PageSize::Huge2M)
        };
        if let Some(m) = cell.get() {
            return Ok(m);
        }
        // Plain 4 KiB anonymous memory, never written: reads see the zero page.
        let len = usize::try_from(size.bytes())
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let m = AnonMapping::new(len, PageSize::Base4K).map_err(io::Error::other)?;
        Ok(cell.get_or_init(|| m))
    }

    /// Installs `[start, start + len)` in the VMM and wakes it: CONTINUE for
    /// MINOR, a copy of zeros for MISSING. `EAGAIN` is retried (the reader
    /// reads the pending non-cooperative event meanwhile); `EEXIST` is served.
    fn install(&self, start: u64, len: u64, kind: FaultKind) -> std::result::Result<(), UffdError> {
        let deadline = Instant::now() + RETRY_FOR;
        let mut at = start;
        let end = start + len;
        let mut spins = 0u32;
        while at < end {
            let fill = match kind {
                FaultKind::Missing => {
                    let zeros = self.zeros(end - at).map_err(|e| UffdError::Copy {
                        start: at,
                        len: end - at,
                        source: e,
                    })?;
                    let n = usize::try_from(end - at)
                        .unwrap_or(usize::MAX)
                        .min(zeros.len());
                    let fill = self.uffd.copy(at, &zeros.as_slice()[..n], true)?;
                    if fill == Fill::AlreadyMapped {
                        // COPY does not wake on EEXIST.
                        self.uffd.wake(at, end - at)?;
                    }
                    fill
                }
                _ => self.uffd.continue_range(at, end - at, true)?,
            };
            match fill {
                Fill::Done | Fill::AlreadyMapped => return Ok(()),
                Fill::Retry { done } => {
                    FaultMetrics::add(&self.metrics.retries, 1);
                    at += done;
                    if self.stopping() || Instant::now() > deadline {
                        return Err(UffdError::Continue {
                            start: at,
                            len: end - at,
                            source: io::Error::from_raw_os_error(libc::EAGAIN),
                        });
                    }
                    spins += 1;
                    if spins < 16 {
                        std::thread::yield_now();
                    } else {
                        std::thread::sleep(Duration::from_micros(50));
                    }
                }
            }
        }
        Ok(())
    }

    /// Page `page` of `unit` was just installed (the vCPUs waiting on it are
    /// woken): faults deferred on it are served, their latency recorded now.
    fn settle_deferred(&self, unit: usize, page: usize) {
        let mut settled = Vec::new();
        lock(&self.deferred).retain(|j| {
            let hit = j.unit == unit && j.page == page;
            if hit {
                settled.push(j.read_at);
            }
            !hit
        });
        for read_at in settled {
            self.metrics.latency.record(read_at.elapsed());
        }
    }

    /// Sorts an install error: the VMM gone ends the service; others are logged.
    fn install_failed(&self, err: &UffdError) {
        FaultMetrics::add(&self.metrics.errors, 1);
        let errno = std::error::Error::source(err)
            .and_then(|s| s.downcast_ref::<io::Error>())
            .and_then(io::Error::raw_os_error);
        if errno == Some(libc::ESRCH) {
            self.end(StopReason::VmmGone);
            return;
        }
        if self.stopping() {
            return;
        }
        if let Some(suppressed) = FAULT_ERROR_LOG.check() {
            warn!(service = %self.label, error = %err, ?errno, suppressed, "cannot install a page in the VMM");
        }
    }
}

/// [`PageOps`] of one page: clear through the daemon's mapping, install at
/// the VMM addresses.
struct DaemonOps<'a> {
    shared: &'a Shared,
    unit: usize,
    page: usize,
    /// Where to install; `None`: every VMM address of the page (scrubbers).
    at: Option<u64>,
    scrub: bool,
}

impl PageOps for DaemonOps<'_> {
    type Error = UffdError;

    fn clear(&self, fault_offset: Option<usize>) {
        let region = &self.shared.units[self.unit].region;
        let (offset, len) = region.page_range(self.page);
        // Region offsets and lengths fit usize (checked when it was created).
        let (offset, len) = (offset as usize, len as usize);
        // SAFETY: `offset` is inside the region (page_range clips), so the
        // pointer stays in the region's own mapping.
        let ptr = unsafe { region.as_ptr().add(offset) };
        // The page invariant: ptr..ptr+len is one page of the region's own
        // live mapping (the Arc in `units` keeps it mapped), MAP_SHARED
        // read-write over a sized memfd whose dirty pages are resident
        // (checked at start), so every byte is backed. This thread owns the
        // page through its `Clearing` state: no other clearer can claim it,
        // and it has not been installed in the VMM in this dirty epoch
        // (installs happen only from `Mapped`, reached only through `Clean`),
        // so no guest or VMM thread reads or writes it through the registered
        // mapping. No Rust reference to these bytes exists (only the region's
        // unsafe slice accessors make them, under the same exclusivity rule).
        match fault_offset {
            // SAFETY: the page invariant above (any offset is clamped).
            Some(off) => unsafe {
                clearing::clear_huge_page_raw(self.shared.kernel, ptr, len, off)
            },
            // SAFETY: the page invariant above.
            None => unsafe { clearing::clear_raw(self.shared.kernel, ptr, len) },
        }
        let m = &self.shared.metrics;
        if self.scrub {
            FaultMetrics::add(&m.scrub_pages, 1);
            FaultMetrics::add(&m.scrub_bytes, len as u64);
        } else {
            FaultMetrics::add(&m.fault_bytes_cleared, len as u64);
        }
    }

    fn install(&self, kind: FaultKind) -> std::result::Result<(), UffdError> {
        let len = self.shared.units[self.unit].region.page_range(self.page).1;
        match self.at {
            Some(at) => self.shared.install(at, len, kind)?,
            None => {
                let (addrs, len) = self.shared.vmm_addrs(self.unit, self.page);
                for a in addrs {
                    self.shared.install(a, len, kind)?;
                    FaultMetrics::add(&self.shared.metrics.precontinued, 1);
                }
            }
        }
        // The install woke every thread waiting on the page, deferred ones too.
        self.shared.settle_deferred(self.unit, self.page);
        Ok(())
    }
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

fn check_mappings(mappings: &[FaultMapping]) -> Result<(Vec<Unit>, Vec<Range<Target>>)> {
    if mappings.is_empty() {
        return Err(FaultError::NoMappings);
    }
    let mut units: Vec<Unit> = Vec::new();
    let mut ranges = Vec::with_capacity(mappings.len());
    for (i, m) in mappings.iter().enumerate() {
        let page = m.region.page_size();
        if !page.is_huge() {
            return Err(FaultError::NotHuge { mapping: i });
        }
        let p = page.bytes();
        let end = m.region_offset.checked_add(m.len);
        if m.len == 0
            || m.vmm_start % p != 0
            || m.len % p != 0
            || m.region_offset % p != 0
            || end.is_none_or(|e| e > m.region.len())
        {
            return Err(FaultError::BadMapping {
                mapping: i,
                vmm_start: m.vmm_start,
                len: m.len,
                region_offset: m.region_offset,
                region_len: m.region.len(),
                page_size: p,
            });
        }
        let unit = match units.iter().position(|u| Arc::ptr_eq(&u.region, &m.region)) {
            Some(u) => u,
            None => {
                units.push(Unit {
                    region: Arc::clone(&m.region),
                    node: m.region.node(),
                });
                units.len() - 1
            }
        };
        ranges.push(Range {
            vmm_start: m.vmm_start,
            len: m.len,
            offset: m.region_offset,
            target: Target(unit),
        });
    }
    Ok((units, ranges))
}

fn check_resident(units: &[Unit]) -> Result<()> {
    for u in units {
        if let Err(page) = super::daemon::dirty_pages_resident(&u.region) {
            return Err(FaultError::NotResident {
                region: u.region.name().to_string(),
                page,
            });
        }
    }
    Ok(())
}

/// Polling a blocking uffd always reports `EPOLLERR`; the flag is on the open
/// file, so the VMM's copy becomes non-blocking too (its reads then return
/// `EAGAIN` instead of waiting, which the fallback handles).
fn set_nonblocking(uffd: &Uffd) -> Result<()> {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    let flags = fcntl(uffd.as_fd(), FcntlArg::F_GETFL).map_err(|e| FaultError::Setup(e.into()))?;
    let flags = OFlag::from_bits_truncate(flags) | OFlag::O_NONBLOCK;
    fcntl(uffd.as_fd(), FcntlArg::F_SETFL(flags)).map_err(|e| FaultError::Setup(e.into()))?;
    Ok(())
}

fn reader(shared: &Shared, epoll: &Epoll) {
    let mut events = [EpollEvent::empty(); 4];
    let mut batch = Vec::with_capacity(READ_BATCH);
    let mut requeued = Instant::now();
    while !shared.stopping() {
        // Faults waiting for another thread's clear go back in the queue
        // every RECHECK; meanwhile the wait is short.
        let pending = !lock(&shared.deferred).is_empty();
        if pending && requeued.elapsed() >= RECHECK {
            let waiting = std::mem::take(&mut *lock(&shared.deferred));
            lock(&shared.queue).extend(waiting);
            shared.queue_cv.notify_all();
            requeued = Instant::now();
        }
        let timeout = if pending {
            u16::try_from(RECHECK.as_millis()).unwrap_or(1).max(1)
        } else {
            1000
        };
        let n = match epoll.wait(&mut events, EpollTimeout::from(timeout)) {
            Ok(n) => n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => {
                shared.end(StopReason::UffdFailed(format!("epoll_wait: {e}")));
                return;
            }
        };
        for ev in &events[..n] {
            match ev.data() {
                TOKEN_STOP => return,
                TOKEN_KICK => {
                    // A fault was deferred: loop to shorten the wait.
                    let _ = shared.kick_fd.read();
                }
                TOKEN_PEER => {
                    shared.end(StopReason::PeerExited);
                    return;
                }
                _ => {
                    if ev.events().contains(EpollFlags::EPOLLERR) {
                        shared.end(StopReason::UffdFailed(
                            "the uffd reports an error (no UFFDIO_API handshake?)".into(),
                        ));
                        return;
                    }
                    if let Err(e) = drain(shared, &mut batch) {
                        shared.end(StopReason::UffdFailed(e.to_string()));
                        return;
                    }
                }
            }
        }
    }
}

/// Reads every pending event and dispatches it.
fn drain(shared: &Shared, batch: &mut Vec<UffdEvent>) -> std::result::Result<(), UffdError> {
    loop {
        batch.clear();
        if shared.uffd.read_events(batch, READ_BATCH)? == 0 {
            return Ok(());
        }
        for ev in batch.drain(..) {
            dispatch(shared, ev);
        }
    }
}

fn dispatch(shared: &Shared, ev: UffdEvent) {
    let m = &shared.metrics;
    match ev {
        UffdEvent::PageFault(pf) => {
            let read_at = Instant::now();
            FaultMetrics::add(&m.faults, 1);
            let kind = pf.kind();
            match kind {
                FaultKind::Missing => FaultMetrics::add(&m.missing, 1),
                _ => FaultMetrics::add(&m.minor, 1),
            }
            let job = {
                let table = shared.table.read().unwrap_or_else(PoisonError::into_inner);
                table.lookup(pf.address).map(|hit| {
                    let unit = hit.range.target.0;
                    let region = &shared.units[unit].region;
                    let unit_len = region.state_unit();
                    let page = usize::try_from(hit.target_offset / unit_len).unwrap_or(usize::MAX);
                    let in_page = hit.target_offset % unit_len;
                    Job {
                        unit,
                        page,
                        page_vmm: pf.address - in_page,
                        page_len: region.page_range(page).1,
                        fault_offset: usize::try_from(in_page).unwrap_or(0),
                        kind,
                        read_at,
                        deferred: false,
                    }
                })
            };
            match job {
                Some(job) => {
                    lock(&shared.queue).push_back(job);
                    shared.queue_cv.notify_one();
                }
                None => {
                    // Not ours: never CONTINUE memory we cannot vouch for. The
                    // thread stays blocked until the VMM unregisters the range.
                    FaultMetrics::add(&m.unknown_address, 1);
                    if let Some(suppressed) = UNKNOWN_ADDR_LOG.check() {
                        warn!(service = %shared.label, address = format_args!("{:#x}", pf.address), suppressed, "fault outside every range this service serves; left unserved");
                    }
                }
            }
        }
        UffdEvent::Remove { start, end } => {
            // Pages stay in the page cache (MADV_DONTNEED) or leave it (MADV_REMOVE);
            // either way their state stays `Mapped` and a later fault re-installs
            // or refills them.
            FaultMetrics::add(&m.remove_events, 1);
            debug!(service = %shared.label, start, end, "VMM removed pages");
        }
        UffdEvent::Unmap { start, end } => {
            FaultMetrics::add(&m.unmap_events, 1);
            let mut t = shared.table.write().unwrap_or_else(PoisonError::into_inner);
            let bytes = t.remove(start, end);
            let empty = t.is_empty();
            drop(t);
            if let Some(suppressed) = EVENT_LOG.check() {
                info!(service = %shared.label, start = format_args!("{start:#x}"), bytes, suppressed, "VMM unmapped guest RAM; no longer served");
            }
            if empty {
                shared.end(StopReason::AllUnmapped);
            }
        }
        UffdEvent::Remap { from, to, len } => {
            FaultMetrics::add(&m.remap_events, 1);
            let bytes = shared
                .table
                .write()
                .unwrap_or_else(PoisonError::into_inner)
                .remap(from, to, len);
            if let Some(suppressed) = EVENT_LOG.check() {
                info!(service = %shared.label, from = format_args!("{from:#x}"), to = format_args!("{to:#x}"), bytes, suppressed, "VMM moved guest RAM");
            }
        }
        UffdEvent::Fork { uffd } => {
            FaultMetrics::add(&m.other_events, 1);
            // Closing the child's uffd unregisters the child's ranges. Lazy
            // mode does not follow forks: VMMs keep guest RAM MADV_DONTFORK.
            drop(uffd);
            if let Some(suppressed) = EVENT_LOG.check() {
                warn!(service = %shared.label, suppressed, "VMM forked with EVENT_FORK enabled; the child is not served");
            }
        }
        UffdEvent::Unknown { event } => {
            FaultMetrics::add(&m.other_events, 1);
            if let Some(suppressed) = EVENT_LOG.check() {
                warn!(service = %shared.label, event, suppressed, "unknown userfaultfd event");
            }
        }
    }
}

fn handler(shared: &Shared) {
    loop {
        let job = {
            let mut q = lock(&shared.queue);
            loop {
                if shared.stopping() {
                    // Queued faults are left waiting: the region is being
                    // taken back, or the VMM is gone (its fallback, if it
                    // is alive, wakes and serves them).
                    return;
                }
                if let Some(j) = q.pop_front() {
                    break j;
                }
                q = shared
                    .queue_cv
                    .wait(q)
                    .unwrap_or_else(PoisonError::into_inner);
            }
        };
        serve(shared, &job);
    }
}

fn serve(shared: &Shared, job: &Job) {
    let region = &shared.units[job.unit].region;
    let ops = DaemonOps {
        shared,
        unit: job.unit,
        page: job.page,
        at: Some(job.page_vmm),
        scrub: false,
    };
    let m = &shared.metrics;
    let fault_offset = job
        .fault_offset
        .min(usize::try_from(job.page_len).unwrap_or(usize::MAX));
    match policy::serve_fault(region.states(), job.page, job.kind, fault_offset, &ops) {
        Ok(Served::Coalesced) => {
            // Another thread is clearing the page. One of ours installs and
            // wakes it when done (and settles the deferred job then); a pool
            // scrubber does not, so the reader re-queues it every RECHECK.
            if !job.deferred {
                FaultMetrics::add(&m.coalesced, 1);
            }
            let mut again = *job;
            again.deferred = true;
            lock(&shared.deferred).push(again);
            let _ = shared.kick_fd.write(1);
            // Installed meanwhile: settle now rather than at the next re-check.
            if region.states().get(job.page) == Ok(PageState::Mapped) {
                shared.settle_deferred(job.unit, job.page);
            }
        }
        Ok(served) => {
            // A deferred fault was counted once already (as coalesced).
            let counter = match served {
                _ if job.deferred => None,
                Served::Cleared => Some(&m.served_cleared),
                Served::WasClean => Some(&m.served_clean),
                Served::WasMapped => Some(&m.served_mapped),
                Served::Adopted => Some(&m.served_adopted),
                Served::Coalesced => None,
                Served::Refused(state) => {
                    if let Some(suppressed) = FAULT_ERROR_LOG.check() {
                        warn!(service = %shared.label, page = job.page, %state, suppressed, "fault on a page being taken back; left unserved");
                    }
                    Some(&m.errors)
                }
            };
            if let Some(c) = counter {
                FaultMetrics::add(c, 1);
            }
            if !matches!(served, Served::Refused(_)) {
                m.latency.record(job.read_at.elapsed());
            }
            if matches!(served, Served::Cleared) {
                shared.hint_after(job.unit, job.page);
            }
        }
        Err(PolicyError::Install(e)) => shared.install_failed(&e),
        Err(PolicyError::State(e)) => {
            FaultMetrics::add(&m.errors, 1);
            if let Some(suppressed) = FAULT_ERROR_LOG.check() {
                error!(service = %shared.label, error = %e, suppressed, "fault maps to no page of its region");
            }
        }
    }
}

/// Background scrubber `index` of `count` in group `group` (one node): takes
/// read-ahead hints first, then walks its node's regions in guest-physical
/// order, clearing dirty pages and installing clean ones ahead of faults.
fn scrubber(shared: &Shared, group: usize, index: usize, count: usize) {
    let node = shared.groups[group];
    let mine: Vec<usize> = (0..shared.units.len())
        .filter(|u| shared.units[*u].node == node)
        .collect();
    // (unit, page) in guest-physical order.
    let order: Vec<(usize, usize)> = mine
        .iter()
        .flat_map(|&u| (0..shared.units[u].region.states().len()).map(move |p| (u, p)))
        .collect();
    if order.is_empty() {
        return;
    }
    // Scrubbers of one node start spread over its pages.
    let mut cursor = index * order.len() / count.max(1);
    let mut idle = 0;
    while !shared.stopping() {
        let hint = lock(&shared.hints[group]).pop_front();
        let (unit, page) = match hint {
            Some(h) => h,
            None => {
                if idle >= order.len() {
                    // A full pass found nothing to do: done.
                    debug!(service = %shared.label, ?node, "lazy-mode scrubber finished");
                    return;
                }
                let at = order[cursor % order.len()];
                cursor += 1;
                idle += 1;
                at
            }
        };
        if scrub_one(shared, unit, page) {
            idle = 0;
        }
    }
}

/// Clears (if dirty) and installs (if clean) one page still mapped in the
/// VMM. True when it did something.
fn scrub_one(shared: &Shared, unit: usize, page: usize) -> bool {
    let states = shared.units[unit].region.states();
    let state = states.get(page);
    if !matches!(state, Ok(PageState::Dirty | PageState::Clean)) {
        return false;
    }
    // Pages the VMM no longer maps are left to the pool's scrubbers after FREE.
    if shared.vmm_addrs(unit, page).0.is_empty() {
        return false;
    }
    let ops = DaemonOps {
        shared,
        unit,
        page,
        at: None,
        scrub: true,
    };
    let done = if state == Ok(PageState::Dirty) {
        policy::scrub_page(states, page, &ops)
    } else {
        policy::precontinue(states, page, &ops)
    };
    match done {
        Ok(did) => did,
        Err(PolicyError::Install(e)) => {
            shared.install_failed(&e);
            true
        }
        Err(PolicyError::State(e)) => {
            error!(service = %shared.label, error = %e, "scrubber page out of range");
            false
        }
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
