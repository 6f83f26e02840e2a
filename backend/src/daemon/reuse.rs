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
//!    [`detach_pages`] punches every page out of the file — a page a tenant
//!    pinned (io_uring fixed buffer, VFIO, RDMA, `vmsplice`) stays with it —
//!    and faults fresh ones in on the region's node's CPUs in parallel; the
//!    kernel zeroes each, so the region is clean without a user-space scrub.
//!    Holes a tenant punched need no check: everything is punched. Without
//!    detaching, [`check_released`] populates every page, so a hole the
//!    host cannot fill is found before a scrubber would `SIGBUS`, and the
//!    scrubbers clear the region.
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
    /// Proved unreachable and whole. `detached` pages were punched out and
    /// refaulted: every page is a fresh one the kernel zeroed. 0: detaching
    /// is off, every page is to be scrubbed.
    Free {
        /// Pages punched and refaulted; 0 when detaching is off.
        detached: u64,
    },
}

/// Runs the checks of the module docs on one quarantined region, given the
/// holder scan's finding for it. The region's entry is `Quarantined`, so
/// nothing else changes its page states meanwhile.
pub fn judge(
    region: &Region,
    holder: Option<Holder>,
    detach: bool,
    topology: &numa::Topology,
) -> Verdict {
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
    match detach_pages(region, topology) {
        Ok(detached) => Verdict::Free { detached },
        Err(reason) => Verdict::Broken(reason),
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
/// (the pool's quarantine verdict `Broken`), never scrubbed.
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

/// Detaches every page of a released region from any pin: punches the
/// whole file (`FALLOC_FL_PUNCH_HOLE`) and faults fresh kernel-zeroed pages
/// in through the daemon's own mapping (`MADV_POPULATE_WRITE`, so the
/// region's NUMA policy applies), in parallel on the region's node's CPUs
/// (pinned workers of `clearing::run_jobs`: the kernel zeroes each new page
/// in the faulting thread, so one thread zeroes at one core's speed). A
/// pinned page stays with its pinner; the file never sees it again. Every
/// page is zero afterwards. Returns the pages detached. Blocking.
///
/// # Errors
///
/// A message when the punch or the refault fails (the host has no page to
/// give: a pinner still holds the old ones); the region must be discarded.
pub fn detach_pages(region: &Region, topology: &numa::Topology) -> Result<u64, String> {
    crate::sys::punch_hole(region.fd(), 0, region.len()).map_err(|e| format!("punch: {e}"))?;
    let len = usize::try_from(region.len()).map_err(|_| "region too large".to_string())?;
    let page = usize::try_from(region.page_size().bytes()).unwrap_or(usize::MAX);
    let job = clearing::Job {
        start: 0,
        len,
        align: page,
        min_chunk: page,
        max_threads: usize::MAX,
        node: region.node(),
    };
    clearing::run_jobs(
        topology,
        &[job],
        &clearing::RunOptions::default(),
        |c: &clearing::Chunk| {
            // In bounds: chunks lie inside the job, which is the region.
            crate::sys::populate_write(region.as_ptr().wrapping_add(c.start), c.len)
        },
    )
    .map_err(|e| format!("refault after punch: {e}"))?;
    Ok(region.len() / region.page_size().bytes())
}
