//! The state one fault service's threads share, and the page operations
//! the policy drives through the daemon's own mapping.

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError, RwLock};
use std::time::{Duration, Instant};

use clearing::ClearKernel;
use guest_mem::{AnonMapping, PageSize, Region};
use nix::sys::eventfd::EventFd;
use numa::NodeId;
use tracing::{info, warn};

use super::super::metrics::FaultMetrics;
use super::super::policy::PageOps;
use crate::uffd::{FaultKind, Fill, Uffd, UffdError};
use hugemem_client::table::RangeTable;

use super::config::{StopReason, FAULT_ERROR_LOG, MAX_HINTS, RETRY_FOR};

/// Range target: which region (by index in guest-physical order).
#[derive(Debug, Clone)]
pub(super) struct Target(pub(super) usize);

/// One region the service serves, in guest-physical order.
#[derive(Debug)]
pub(super) struct Unit {
    pub(super) region: Arc<Region>,
    pub(super) node: Option<NodeId>,
}

/// A fault waiting for a handler.
#[derive(Debug, Clone, Copy)]
pub(super) struct Job {
    pub(super) unit: usize,
    pub(super) page: usize,
    pub(super) page_vmm: u64,
    pub(super) page_len: u64,
    pub(super) fault_offset: usize,
    pub(super) kind: FaultKind,
    pub(super) read_at: Instant,
    /// Re-checked before (the page was being cleared by another thread).
    pub(super) deferred: bool,
}

#[derive(Debug)]
pub(super) struct Shared {
    pub(super) label: String,
    pub(super) uffd: Uffd,
    pub(super) units: Vec<Unit>,
    pub(super) table: RwLock<RangeTable<Target>>,
    pub(super) metrics: Arc<FaultMetrics>,
    pub(super) kernel: ClearKernel,
    pub(super) readahead: usize,
    pub(super) stop: AtomicBool,
    pub(super) stop_fd: EventFd,
    pub(super) ended_fd: EventFd,
    pub(super) reason: Mutex<Option<StopReason>>,
    pub(super) reason_cv: Condvar,
    pub(super) queue: Mutex<VecDeque<Job>>,
    pub(super) queue_cv: Condvar,
    /// Faults on pages another thread was clearing, re-queued by the reader
    /// every [`RECHECK`] until the page is clean (the owner may be a pool
    /// scrubber, which does not install what it clears).
    pub(super) deferred: Mutex<Vec<Job>>,
    /// Wakes the reader when a fault is deferred.
    pub(super) kick_fd: EventFd,
    /// Read-ahead hints per scrubber group (index into `groups`).
    pub(super) hints: Vec<Mutex<VecDeque<(usize, usize)>>>,
    /// Node of each scrubber group.
    pub(super) groups: Vec<Option<NodeId>>,
    /// Zeroed source for MISSING fills, per page size (never written).
    pub(super) zeros_2m: OnceLock<AnonMapping>,
    pub(super) zeros_1g: OnceLock<AnonMapping>,
    pub(super) failure: Option<Arc<tokio::sync::Notify>>,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    /// Ends the service (first reason wins) and wakes every thread.
    pub(super) fn end(&self, reason: StopReason) {
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

    pub(super) fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    pub(super) fn group_of(&self, unit: usize) -> Option<usize> {
        let node = self.units.get(unit)?.node;
        self.groups.iter().position(|g| *g == node)
    }

    /// Queues read-ahead hints after a fault on `page` of `unit`.
    pub(super) fn hint_after(&self, unit: usize, page: usize) {
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
    pub(super) fn vmm_addrs(&self, unit: usize, page: usize) -> (Vec<u64>, u64) {
        let (offset, len) = self.units[unit].region.page_range(page);
        let table = self.table.read().unwrap_or_else(PoisonError::into_inner);
        (table.vmm_addrs_of(|t| t.0 == unit, offset, len), len)
    }

    pub(super) fn zeros(&self, len: u64) -> io::Result<&AnonMapping> {
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
    pub(super) fn install(
        &self,
        start: u64,
        len: u64,
        kind: FaultKind,
    ) -> std::result::Result<(), UffdError> {
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
    pub(super) fn settle_deferred(&self, unit: usize, page: usize) {
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
    pub(super) fn install_failed(&self, err: &UffdError) {
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
pub(super) struct DaemonOps<'a> {
    pub(super) shared: &'a Shared,
    pub(super) unit: usize,
    pub(super) page: usize,
    /// Where to install; `None`: every VMM address of the page (scrubbers).
    pub(super) at: Option<u64>,
    pub(super) scrub: bool,
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
