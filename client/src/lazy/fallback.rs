//! The fallback fault service: what it holds (the uffd copy, the range
//! table, a second unregistered mapping of each region, the counters) and
//! what it does once the daemon connection closes: the watcher wakes every
//! registered range, then serves MINOR faults itself, clearing a page
//! through the scratch mapping unless `/proc/self/pagemap` says it is
//! already mapped (see the [`lazy`](super) module docs for why that is
//! safe).

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use clearing::ClearKernel;
use guest_mem::vm_memory::mmap::MmapRegion;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::EventFd;
use tracing::{debug, warn};

use crate::diag::RateLimit;
use crate::pagemap::Pagemap;
use crate::table::RangeTable;
use crate::uffd::{Fill, Uffd, UffdError, UffdEvent};

static FALLBACK_LOG: RateLimit = RateLimit::new(Duration::from_secs(1));

/// The fallback's view of one mapping: a second, unregistered mapping of the
/// same file range.
#[derive(Debug)]
pub(super) struct Scratch {
    pub(super) map: MmapRegion,
    pub(super) page_size: u64,
}

#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) active: AtomicBool,
    pub(super) faults: AtomicU64,
    pub(super) cleared: AtomicU64,
    pub(super) stale: AtomicU64,
    pub(super) unknown: AtomicU64,
}

#[derive(Debug)]
pub(super) struct Fallback {
    pub(super) uffd: Uffd,
    /// Range target: index into `scratch`; offset: bytes into that mapping.
    pub(super) table: Mutex<RangeTable<usize>>,
    pub(super) scratch: Vec<Scratch>,
    pub(super) pagemap: Pagemap,
    pub(super) kernel: ClearKernel,
    pub(super) counters: Counters,
}

/// The watcher: waits for the daemon connection to close (or a stop), then
/// serves faults until stopped.
pub(super) fn watch(fb: &Fallback, stop: &EventFd, daemon: &OwnedFd) {
    loop {
        // No POLLIN on the socket: replies are the client's; POLLHUP and
        // POLLERR are always reported.
        let mut fds = [
            PollFd::new(stop.as_fd(), PollFlags::POLLIN),
            PollFd::new(daemon.as_fd(), PollFlags::empty()),
        ];
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => {
                warn!(error = %e, "lazy-mode watcher cannot poll; taking over");
                break;
            }
        }
        if fds[0].revents().is_some_and(|r| !r.is_empty()) {
            return;
        }
        if fds[1].revents().is_some_and(|r| {
            r.intersects(PollFlags::POLLHUP | PollFlags::POLLERR | PollFlags::POLLNVAL)
        }) {
            break;
        }
    }
    takeover(fb, stop);
}

fn takeover(fb: &Fallback, stop: &EventFd) {
    fb.counters.active.store(true, Ordering::Release);
    warn!("daemon connection closed; the VMM serves lazy guest RAM faults itself");
    // Faults the daemon read but never answered: wake them so they fault again.
    let ranges: Vec<(u64, u64)> = lock_table(fb)
        .ranges()
        .iter()
        .map(|r| (r.vmm_start, r.len))
        .collect();
    for (start, len) in ranges {
        if let Err(e) = fb.uffd.wake(start, len) {
            warn!(error = %e, "cannot wake a lazy range");
        }
    }
    let mut events = Vec::with_capacity(64);
    loop {
        let mut fds = [
            PollFd::new(stop.as_fd(), PollFlags::POLLIN),
            PollFd::new(fb.uffd.as_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => {
                warn!(error = %e, "lazy-mode fallback cannot poll the uffd; faults stay pending");
                return;
            }
        }
        if fds[0].revents().is_some_and(|r| !r.is_empty()) {
            return;
        }
        events.clear();
        match fb.uffd.read_events(&mut events, 64) {
            Ok(_) => {}
            Err(e) => {
                warn!(error = %e, "lazy-mode fallback cannot read the uffd; faults stay pending");
                return;
            }
        }
        for ev in events.drain(..) {
            fallback_event(fb, ev);
        }
    }
}

fn lock_table(fb: &Fallback) -> std::sync::MutexGuard<'_, RangeTable<usize>> {
    fb.table.lock().unwrap_or_else(PoisonError::into_inner)
}

fn fallback_event(fb: &Fallback, ev: UffdEvent) {
    match ev {
        UffdEvent::PageFault(pf) => {
            fb.counters.faults.fetch_add(1, Ordering::Relaxed);
            let hit = lock_table(fb)
                .lookup(pf.address)
                .map(|h| (h.range.target, h.target_offset));
            let Some((i, offset)) = hit else {
                fb.counters.unknown.fetch_add(1, Ordering::Relaxed);
                if let Some(suppressed) = FALLBACK_LOG.check() {
                    warn!(
                        address = format_args!("{:#x}", pf.address),
                        suppressed, "fault outside lazy guest RAM; left pending"
                    );
                }
                return;
            };
            let s = &fb.scratch[i];
            let in_page = offset % s.page_size;
            let page_vmm = pf.address - in_page;
            let page_off = offset - in_page;
            if let Err(e) = serve_fallback(fb, s, page_vmm, page_off, in_page) {
                if let Some(suppressed) = FALLBACK_LOG.check() {
                    warn!(error = %e, suppressed, "lazy-mode fallback cannot serve a fault");
                }
            }
        }
        UffdEvent::Unmap { start, end } => {
            lock_table(fb).remove(start, end);
        }
        UffdEvent::Remap { from, to, len } => {
            lock_table(fb).remap(from, to, len);
        }
        UffdEvent::Remove { .. } | UffdEvent::Fork { .. } | UffdEvent::Unknown { .. } => {
            debug!(?ev, "lazy-mode fallback ignores an event");
        }
    }
}

/// Serves one fault: wake only if the page is already mapped, else clear it
/// through the scratch mapping and CONTINUE.
fn serve_fallback(
    fb: &Fallback,
    s: &Scratch,
    page_vmm: u64,
    page_off: u64,
    in_page: u64,
) -> Result<(), UffdError> {
    let mapped = fb.pagemap.present(page_vmm).unwrap_or(false);
    if mapped {
        fb.counters.stale.fetch_add(1, Ordering::Relaxed);
        return fb.uffd.wake(page_vmm, s.page_size);
    }
    // The scratch mapping covers the same range; offsets fit usize (it was mapped).
    let (off, len) = (page_off as usize, s.page_size as usize);
    if off + len > s.map.size() {
        return Ok(());
    }
    // SAFETY: `off` is below the scratch mapping's size (checked above), so
    // the pointer stays in the mapping.
    let ptr = unsafe { s.map.as_ptr().add(off) };
    // SAFETY: ptr..ptr+len is one huge page of the scratch mapping, which this
    // `Fallback` owns (MAP_SHARED read-write over the region's sealed memfd,
    // so every byte is backed). The page is not mapped in the registered guest
    // mapping (pagemap said so, and once the daemon is gone only this thread
    // installs pages), so no vCPU or VMM thread reads or writes it through
    // that mapping; the daemon stopped serving before its connection closed,
    // so it no longer writes it either; no Rust reference to these bytes
    // exists. Other mappings of the file are the VMM's business (trusted).
    unsafe { clearing::clear_huge_page_raw(fb.kernel, ptr, len, in_page as usize) };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match fb.uffd.continue_range(page_vmm, s.page_size, true)? {
            Fill::Done | Fill::AlreadyMapped => break,
            Fill::Retry { .. } if Instant::now() < deadline => std::thread::yield_now(),
            Fill::Retry { .. } => {
                return Err(UffdError::Continue {
                    start: page_vmm,
                    len: s.page_size,
                    source: io::Error::from_raw_os_error(libc::EAGAIN),
                })
            }
        }
    }
    fb.counters.cleared.fetch_add(1, Ordering::Relaxed);
    Ok(())
}
