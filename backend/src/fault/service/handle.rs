//! Starting a fault service ([`FaultService::start`]) and the handle that
//! watches and stops it.

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags};
use nix::sys::eventfd::{EfdFlags, EventFd};
use numa::NodeId;
use tracing::{error, info, warn};

use super::config::{
    FaultMapping, FaultReport, FaultServiceConfig, StopReason, MAX_HINTS, TOKEN_KICK, TOKEN_PEER,
    TOKEN_STOP, TOKEN_UFFD,
};
use super::shared::{lock, Shared, Target, Unit};
use super::threads::{check_mappings, check_resident, handler, reader, scrubber, set_nonblocking};
use crate::fault::error::{FaultError, Result};
use crate::fault::metrics::{FaultMetrics, FaultStats};
use crate::uffd::Uffd;
use hugemem_client::table::RangeTable;

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
        let shared = new_shared(&cfg, uffd, units, table)?;
        lock(&LIVE).push((cfg.label.clone(), Arc::downgrade(&shared.metrics)));
        if let Some(t) = &cfg.totals {
            t.register(Arc::clone(&shared.metrics));
        }
        let epoll = watch(&shared, peer_exit.as_ref())?;
        let mut handle = FaultServiceHandle {
            shared: Arc::clone(&shared),
            threads: Vec::new(),
            _peer: peer_exit,
        };
        {
            let sh = Arc::clone(&shared);
            handle.spawn(
                "hm-uffd-rd".to_string(),
                Box::new(move || reader(&sh, &epoll)),
            )?;
        }
        for i in 0..cfg.handler_threads.max(1) {
            let sh = Arc::clone(&shared);
            handle.spawn(format!("hm-uffd-h{i}"), Box::new(move || handler(&sh)))?;
        }
        if cfg.scrub_threads_per_node > 0 {
            handle.spawn_scrubbers(&cfg)?;
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

/// The state every thread of a new service shares: one scrubber group
/// (and read-ahead hint queue) per node the units are on.
fn new_shared(
    cfg: &FaultServiceConfig,
    uffd: Uffd,
    units: Vec<Unit>,
    table: RangeTable<Target>,
) -> Result<Arc<Shared>> {
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
    Ok(Arc::new(Shared {
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
    }))
}

/// The reader thread's epoll set: the stop and kick eventfds, the uffd,
/// and the VMM's pidfd when there is one.
fn watch(shared: &Shared, peer_exit: Option<&OwnedFd>) -> Result<Epoll> {
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
    if let Some(p) = peer_exit {
        add(p.as_fd(), TOKEN_PEER)?;
    }
    Ok(epoll)
}

impl FaultServiceHandle {
    /// Starts service thread `name` running `f` (guarded: a panic ends the
    /// service).
    fn spawn(&mut self, name: String, f: Box<dyn FnOnce() + Send>) -> Result<()> {
        let sh = Arc::clone(&self.shared);
        let thread_name = name.clone();
        let h = std::thread::Builder::new()
            .name(name)
            .spawn(move || guarded(&sh, &thread_name, f))
            .map_err(FaultError::Threads)?;
        self.threads.push(h);
        Ok(())
    }

    /// Starts `cfg.scrub_threads_per_node` scrubbers per node group, each
    /// pinned to its node's CPUs when the topology is known.
    fn spawn_scrubbers(&mut self, cfg: &FaultServiceConfig) -> Result<()> {
        let shared = Arc::clone(&self.shared);
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
                let label = cfg.label.clone();
                self.spawn(
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
                )?;
            }
        }
        Ok(())
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
