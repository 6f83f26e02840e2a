//! The service's threads: the epoll reader, the fault handlers and the
//! node-local scrubbers, and the checks before they start.

use std::os::fd::AsFd;
use std::sync::{Arc, PoisonError};
use std::time::Instant;

use guest_mem::PageState;
use nix::sys::epoll::{Epoll, EpollEvent, EpollFlags, EpollTimeout};
use tracing::{debug, error, info, warn};

use super::super::error::{FaultError, Result};
use super::super::metrics::FaultMetrics;
use super::super::policy::{self, PolicyError, Served};
use crate::uffd::{FaultKind, Uffd, UffdError, UffdEvent};
use hugemem_client::table::Range;

use super::config::{
    FaultMapping, StopReason, EVENT_LOG, FAULT_ERROR_LOG, READ_BATCH, RECHECK, TOKEN_KICK,
    TOKEN_PEER, TOKEN_STOP, UNKNOWN_ADDR_LOG,
};
use super::shared::*;

pub(super) fn check_mappings(mappings: &[FaultMapping]) -> Result<(Vec<Unit>, Vec<Range<Target>>)> {
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

pub(super) fn check_resident(units: &[Unit]) -> Result<()> {
    for u in units {
        if let Err(page) = super::super::pagemap::dirty_pages_resident(&u.region) {
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
pub(super) fn set_nonblocking(uffd: &Uffd) -> Result<()> {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    let flags = fcntl(uffd.as_fd(), FcntlArg::F_GETFL).map_err(|e| FaultError::Setup(e.into()))?;
    let flags = OFlag::from_bits_truncate(flags) | OFlag::O_NONBLOCK;
    fcntl(uffd.as_fd(), FcntlArg::F_SETFL(flags)).map_err(|e| FaultError::Setup(e.into()))?;
    Ok(())
}

pub(super) fn reader(shared: &Shared, epoll: &Epoll) {
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
pub(super) fn drain(
    shared: &Shared,
    batch: &mut Vec<UffdEvent>,
) -> std::result::Result<(), UffdError> {
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

pub(super) fn dispatch(shared: &Shared, ev: UffdEvent) {
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

pub(super) fn handler(shared: &Shared) {
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

pub(super) fn serve(shared: &Shared, job: &Job) {
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
pub(super) fn scrubber(shared: &Shared, group: usize, index: usize, count: usize) {
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
pub(super) fn scrub_one(shared: &Shared, unit: usize, page: usize) -> bool {
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
