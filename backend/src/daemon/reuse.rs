//! Proof before reuse: what must hold before a released region's pages may
//! be scrubbed and handed to another tenant, checked in this order once the
//! `/proc` holder scan ([`super::holders`]) finds no process holding it:
//!
//! 1. [`prove_unreachable`]: no open file description of the file exists but
//!    the daemon's own (a write lease is granted), which covers what no
//!    `/proc` scan shows: fds in flight in unreceived `SCM_RIGHTS` messages.
//!    Refused, the region is **withheld**: it stays quarantined, counted
//!    under the tenant's uid in STATS, and is re-checked every
//!    `pool.recheck_ms` until the reference is gone (the tenant received and
//!    closed the fd, or the socket holding the message was closed).
//! 2. [`check_released`]: the file has exactly the region's size and every
//!    page can be populated; else the region is discarded (back to the
//!    kernel, never scrubbed).
//! 3. With `pool.detach_pages` (the default), the size is checked and
//!    every page is punched out of the file ([`Region::detach_pages`]): a
//!    page a tenant pinned (io_uring fixed buffer, VFIO, RDMA, `vmsplice`)
//!    stays with it, and the file has no page left. The pages become
//!    `Unpopulated`; the node-pinned scrubbers (or an ALLOC that takes the
//!    region) fault fresh ones in, which the kernel zeroes — no user-space
//!    clear on top, and the refault runs on the node's own CPUs, in
//!    parallel. Holes a tenant punched need no check: everything is punched.
//!    Without detaching, [`check_released`] populates every page, so a hole
//!    the host cannot fill is found before a scrubber would `SIGBUS`.
//!
//! Everything here blocks (`/proc`, leases, faulting whole regions): the
//! quarantine loop calls [`judge`] on a blocking thread.

use std::os::fd::AsFd;

use guest_mem::Region;

use super::holders::Holder;

/// What a quarantine check decided for one region.
#[derive(Debug)]
pub enum Verdict {
    /// A process still holds or maps it: stays quarantined.
    Held(Holder),
    /// No process shows it, but another open description exists (in flight,
    /// or a mapping being torn down): stays quarantined, withheld, re-checked.
    Withheld(String),
    /// The tenant damaged the file (size, holes) or a detach failed: back to
    /// the kernel, never scrubbed or served.
    Broken(String),
    /// Proved unreachable and whole; `detached` pages were punched out (they
    /// are `Unpopulated` now), else every page is to be scrubbed.
    Free {
        /// Pages punched out of the file; 0 when detaching is off.
        detached: u64,
    },
}

/// Runs the checks of the module docs on one quarantined region, given the
/// holder scan's finding for it. The region's entry is `Quarantined`, so
/// nothing else changes its page states meanwhile.
pub fn judge(region: &Region, holder: Option<Holder>, detach: bool) -> Verdict {
    if let Some(h) = holder {
        return Verdict::Held(h);
    }
    if let Err(reason) = prove_unreachable(region) {
        return Verdict::Withheld(reason);
    }
    if !detach {
        return match check_released(region) {
            Ok(()) => Verdict::Free { detached: 0 },
            Err(reason) => Verdict::Broken(reason),
        };
    }
    if let Err(reason) = check_size(region) {
        return Verdict::Broken(reason);
    }
    region.mark_all_dirty();
    match region.detach_pages() {
        Ok(pages) => Verdict::Free {
            detached: pages as u64,
        },
        Err(e) => Verdict::Broken(e.to_string()),
    }
}

/// The file has exactly the region's size: a tenant can grow a memfd (its
/// seals allow growing) or truncate a hugetlbfs file.
fn check_size(region: &Region) -> Result<(), String> {
    let size = crate::sys::file_size(region.fd()).map_err(|e| format!("fstat: {e}"))?;
    if size == region.len() {
        Ok(())
    } else {
        Err(format!(
            "file size is {size} bytes, the region has {}",
            region.len()
        ))
    }
}

/// Proves a released region is whole before any page of it is touched: its
/// file has exactly the region's size (a tenant can grow a memfd, whose seals
/// allow growing, or truncate a hugetlbfs file), and every page is present or
/// can be allocated (`MADV_POPULATE_WRITE` fills holes a tenant punched with
/// fresh zeroed pages, and fails where a store would raise `SIGBUS`).
/// Blocking (it may fault in a whole region): call it off the executor.
///
/// # Errors
///
/// A message saying what is wrong; the region must then be discarded
/// ([`super::pool::Pool::discard`]), never scrubbed.
pub fn check_released(region: &Region) -> Result<(), String> {
    check_size(region)?;
    let len = usize::try_from(region.len()).map_err(|_| "region too large".to_string())?;
    crate::sys::populate_write(region.as_ptr(), len).map_err(|e| {
        format!("pages cannot be populated (a hole the host cannot fill, or a truncation): {e}")
    })
}

/// Proves that no open file description of a released region's file exists
/// but the daemon's own: a write lease (`F_SETLEASE`) on the daemon's
/// description is granted only then, and it counts what the `/proc` holder
/// scan cannot see: descriptions in flight in unreceived `SCM_RIGHTS`
/// messages, and those behind mappings. For a memfd the lease is taken on a
/// fresh reopen (the original `memfd_create` description, which the daemon
/// maps and keeps, is not counted by the kernel and is never handed out);
/// for a hugetlbfs file on the daemon's own description. Every tenant got
/// its own description ([`crate::sys::reopen`]), so a tenant's copy always
/// counts. Blocking; call it off the executor.
///
/// # Errors
///
/// A message when the proof fails (refused, or leases unavailable): the
/// region must then never be reused.
pub fn prove_unreachable(region: &Region) -> Result<(), String> {
    let granted = match region.path() {
        Some(_) => crate::sys::write_lease_free(region.fd()),
        None => crate::sys::reopen(region.fd())
            .and_then(|own| crate::sys::write_lease_free(own.as_fd())),
    };
    match granted {
        Ok(true) => Ok(()),
        Ok(false) => Err(
            "another open file description exists that no process shows (in flight in an \
             unreceived SCM_RIGHTS message, or behind a mapping): it can never be proved free"
                .into(),
        ),
        Err(e) => Err(format!(
            "write lease unavailable ({e}): cannot prove it free"
        )),
    }
}
