//! Proof before reuse: what must hold before a released region's pages may
//! be scrubbed and handed to another tenant, checked in this order once the
//! `/proc` holder scan ([`crate::daemon::peers::holders`]) finds no process holding it:
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
//!    and reserves the holes again at once; every page the file gets from
//!    then on is one the kernel zeroes, so the region is clean without a
//!    user-space scrub, and may be handed out before its holes are faulted
//!    in (the node's scrubbers do that ahead of the guest). Holes a tenant
//!    punched need no check: everything is punched. Without
//!    detaching, [`check_released`] populates every page, so a hole the
//!    host cannot fill is found before a scrubber would `SIGBUS`, and the
//!    scrubbers clear the region.
//!
//! Everything here blocks (`/proc`, leases, populating whole regions when
//! not detaching): the quarantine loop calls [`judge`] on a blocking thread.

use std::os::fd::AsFd;
use std::sync::Arc;

use guest_mem::Region;

use crate::daemon::peers::holders::{self, FileId, Hold, Holder, Owned};
use crate::daemon::pool::{ReserveGate, Verdict};

/// The quarantine's check, one verdict per quarantined region: one `/proc`
/// holder scan ([`crate::daemon::peers::holders::scan`], which skips `predecessor`) for
/// all of them, then [`judge`]
/// on each with what the scan found. Each region comes with its id (kept
/// as given) and the daemon's own fd and mapping of it (exempt from the
/// scan). Blocking: the quarantine loop runs it on a blocking thread.
pub fn check_quarantined<Id>(
    quarantined: Vec<(Id, Owned, Arc<Region>)>,
    detach: bool,
    gate: &ReserveGate,
    predecessor: Option<i32>,
) -> Vec<(Id, Verdict)> {
    let owned: Vec<Owned> = quarantined.iter().map(|(_, o, _)| o.clone()).collect();
    let holders = holders::scan(&owned, predecessor).holders;
    quarantined
        .into_iter()
        .zip(holders)
        .map(|((id, _, region), holder)| (id, judge(&region, holder, detach, gate)))
        .collect()
}

/// Runs the checks of the module docs on one quarantined region, given the
/// holder scan's finding for it. The region's entry is `Quarantined`, so
/// nothing else changes its page states meanwhile.
pub fn judge(region: &Region, holder: Option<Holder>, detach: bool, gate: &ReserveGate) -> Verdict {
    if let Some(h) = holder {
        return Verdict::Held(h);
    }
    // A fault helper of the region that has not exited yet (stopped when
    // the region was released, or a helper of the same set as one the scan
    // found): while the kernel tears its address space down, its mapping
    // has left `/proc` but the pages it faulted are freed only at the end
    // of that teardown, and its reference to the file may outlive the
    // mapping. A punch then would find those pages kept, as if pinned, and
    // the lease would be refused, as if withheld. It holds the region; its
    // exit wakes the next round.
    let exiting = FileId::of(region.fd())
        .ok()
        .and_then(|f| crate::fault_helpers::helper_of_file(f.dev, f.ino));
    if let Some(pid) = exiting {
        return Verdict::Held(Holder {
            pid,
            hold: Hold::Unknown,
        });
    }
    if let Err(reason) = prove_unreachable(region) {
        return Verdict::Withheld(reason.to_string());
    }
    if !detach {
        return match check_released(region) {
            Ok(()) => Verdict::Free { detached: 0 },
            Err(reason) => Verdict::Broken(reason.to_string()),
        };
    }
    if let Err(reason) = check_size(region) {
        return Verdict::Broken(reason.to_string());
    }
    match detach_pages(region, gate) {
        Ok(detached) => Verdict::Free { detached },
        Err(verdict) => verdict,
    }
}

/// The file has exactly the region's size: a tenant can grow a memfd (its
/// seals allow growing) or truncate a hugetlbfs file.
fn check_size(region: &Region) -> Result<(), Damage> {
    let size = crate::sys::file_size(region.fd()).map_err(Damage::Stat)?;
    if size == region.len() {
        Ok(())
    } else {
        Err(Damage::Size {
            size,
            len: region.len(),
        })
    }
}

/// What is wrong with a released region's file: it is then discarded,
/// never scrubbed.
#[derive(Debug, thiserror::Error)]
pub enum Damage {
    /// The file cannot be looked at.
    #[error("fstat: {0}")]
    Stat(#[source] std::io::Error),
    /// The file's size is not the region's.
    #[error("file size is {size} bytes, the region has {len}")]
    Size {
        /// The file's.
        size: u64,
        /// The region's.
        len: u64,
    },
    /// The region does not fit the address space.
    #[error("region too large")]
    TooLarge,
    /// A page cannot be faulted in.
    #[error("pages cannot be populated (a hole the host cannot fill, or a truncation): {0}")]
    Populate(#[source] std::io::Error),
}

/// Why a released region cannot be proved unreachable: it is never reused
/// while that holds.
#[derive(Debug, thiserror::Error)]
pub enum Unproved {
    /// The write lease was refused: a description no process shows exists.
    #[error(
        "another open file description exists that no process shows (in flight in an \
         unreceived SCM_RIGHTS message, or behind a mapping): it can never be proved free"
    )]
    Unseen,
    /// Leases are not available.
    #[error("write lease unavailable ({0}): cannot prove it free")]
    NoLease(#[source] std::io::Error),
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
pub fn check_released(region: &Region) -> Result<(), Damage> {
    check_size(region)?;
    let len = usize::try_from(region.len()).map_err(|_| Damage::TooLarge)?;
    crate::sys::populate_write(region.as_ptr(), len).map_err(Damage::Populate)
}

/// A pooled region a predecessor daemon passed on, to check before it is
/// served as pooled (`crate::daemon::restart::takeover`).
#[derive(Debug, Clone, Copy)]
pub struct Inherited<'a> {
    /// The region, adopted.
    pub region: &'a Region,
    /// Pooled clean with no holes left to refault: every page must be
    /// present.
    pub whole: bool,
}

/// The checks at FREE, for pooled regions a predecessor passed on: no
/// other process holds them (one `/proc` scan, which skips `predecessor`
/// while it runs: it holds every region until it exits), no reference the
/// scan cannot see (the write lease), and a whole one has every page
/// present. Per region, in order: `None` when it passed, else why it goes
/// through quarantine first (where [`judge`] decides as for any release).
pub fn judge_inherited(regions: &[Inherited<'_>], predecessor: Option<i32>) -> Vec<Option<String>> {
    let owned: Vec<Option<Owned>> = regions
        .iter()
        .map(|i| {
            let r = i.region;
            Owned::region(
                r.fd(),
                r.as_ptr() as usize,
                usize::try_from(r.len()).unwrap_or(usize::MAX),
            )
            .ok()
        })
        .collect();
    let targets: Vec<Owned> = owned.iter().flatten().cloned().collect();
    let mut found = holders::scan(&targets, predecessor).holders.into_iter();
    regions
        .iter()
        .zip(&owned)
        .map(|(i, owned)| {
            if owned.is_none() {
                return Some("cannot identify its file".to_string());
            }
            if let Some(h) = found.next().flatten() {
                return Some(format!("held by pid {}", h.pid));
            }
            if let Err(w) = prove_unreachable(i.region) {
                return Some(w.to_string());
            }
            if !i.whole {
                return None;
            }
            match crate::sys::file_allocated_bytes(i.region.fd()) {
                Ok(b) if b >= i.region.len() => None,
                Ok(b) => Some(format!("{b} of {} bytes present", i.region.len())),
                Err(e) => Some(format!("fstat: {e}")),
            }
        })
        .collect()
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
pub fn prove_unreachable(region: &Region) -> Result<(), Unproved> {
    let granted = match region.path() {
        Some(_) => crate::sys::write_lease_free(region.fd()),
        None => crate::sys::reopen(region.fd())
            .and_then(|own| crate::sys::write_lease_free(own.as_fd())),
    };
    match granted {
        Ok(true) => Ok(()),
        Ok(false) => Err(Unproved::Unseen),
        Err(e) => Err(Unproved::NoLease(e)),
    }
}

/// The host's huge pages of `page_size` on `node` (host-wide for an
/// unbound region; reservations are only kept host-wide), read around the
/// punch of a released region to tell why its holes cannot be reserved
/// again.
fn host_pages(
    page_size: guest_mem::PageSize,
    node: Option<numa::NodeId>,
) -> Option<numa::PoolState> {
    numa::HugePages::host().pool(page_size.bytes(), node).ok()
}

/// Why the holes a punch just made could not be reserved again, from the
/// host's counts before and after the punch (`None`: unreadable) and the
/// pages the file held before it (`had`). Only those `had` offsets need a
/// new reservation: a hugetlbfs punch keeps the reservation of a hole that
/// never had a page (checked by hand on 6.18: 3 of 10 reserved pages
/// faulted, the whole file punched, `resv_hugepages` stays at 7), and holes
/// the tenant punched were reserved again before the punch.
fn why_short(
    had: u64,
    before: Option<numa::PoolState>,
    after: Option<numa::PoolState>,
    page_size: guest_mem::PageSize,
    error: &std::io::Error,
) -> Verdict {
    let (Some(before), Some(after)) = (before, after) else {
        return Verdict::Short(format!(
            "its holes could not be reserved again ({error}); the host's pool could not be read"
        ));
    };
    // Pages that left the file and reached the host: free again, or freed
    // to the buddy allocator as surplus.
    let returned = (after.free + before.surplus).saturating_sub(before.free + after.surplus);
    let pool = format!("{} free, {} reserved", after.free, after.reserved);
    if returned < had {
        Verdict::Pinned(format!(
            "{} of the {had} {page_size} pages in its file did not come back to the host at the punch \
             (held by a pin the daemon cannot see), and the host has none to spare for their holes \
             ({pool}; reserving them again: {error})",
            had - returned
        ))
    } else {
        Verdict::Short(format!(
            "all {had} {page_size} pages in its file came back to the host at the punch, but its \
             holes could not be reserved again ({pool}; {error}): another process took the pages, \
             or the pool was shrunk"
        ))
    }
}

/// Detaches every page of a released region from any pin, in three steps,
/// all under the pool's [`ReserveGate`] so no fresh region of the daemon
/// takes pages in between:
///
/// 1. **Reserve the holes a tenant punched** ([`crate::sys::reserve_holes`]):
///    every other offset is reserved already (its page, or a hole that never
///    had one, whose reservation survives a punch).
/// 2. **Punch** the whole file (`FALLOC_FL_PUNCH_HOLE`): every page leaves
///    it; a page a tenant pinned stays with its pinner, and the file never
///    sees it again. The punch gives up the reservation of each page it
///    removes.
/// 3. **Reserve those holes again** at once: from here on the host owes the
///    region a page for every hole, whoever else wants pages.
///
/// The region is then clean: every hole faults in a page the kernel zeroes
/// for it, and the reservation guarantees that page. The node's scrubbers
/// fault the holes in ahead of the guest (`crate::daemon::pool`'s refault), or the
/// guest's own first touch does. Returns the pages detached. Blocking, but
/// short: no page is faulted or cleared here.
///
/// # Errors
///
/// The verdict that sends the region back to the kernel: holes its tenant
/// punched that the host can no longer back (step 1, [`Verdict::Broken`]);
/// or, when the punched pages' holes cannot be reserved again, the host
/// pool's counts before and after the punch say why — pages that did not
/// come back ([`Verdict::Pinned`]: the file had them, the host did not get
/// them) or pages taken since ([`Verdict::Short`]). A failed punch is
/// [`Verdict::Broken`] too. (A 4 KiB shmem region has no reservations: its
/// re-reservation is a mapping that always succeeds.)
pub fn detach_pages(region: &Region, gate: &ReserveGate) -> Result<u64, Verdict> {
    let len =
        usize::try_from(region.len()).map_err(|_| Verdict::Broken("region too large".into()))?;
    let page_size = region.page_size();
    let page = page_size.bytes();
    let pages = region.len() / page;
    let gated = gate.hold();
    let had = crate::sys::file_allocated_bytes(region.fd()).map_or(pages, |b| b / page);
    // A region's every offset was reserved when it was made, and a punch
    // keeps the reservation of a hole that never had a page: the only
    // unreserved offsets now are holes a tenant punched (its page went to
    // the host). Reserve those first, while the file still has its pages,
    // so that a failure here is theirs alone.
    if let Err(e) = crate::sys::reserve_holes(region.fd(), len) {
        let pool = host_pages(page_size, region.node())
            .map(|p| format!("{} free, {} reserved", p.free, p.reserved))
            .unwrap_or_else(|| "the host's pool unreadable".into());
        return Err(Verdict::Broken(format!(
            "its tenant punched holes in it ({had} of its {pages} {page_size} pages in the file), \
             and the host no longer has pages for them ({pool}; reserving them again: {e})"
        )));
    }
    let before = host_pages(page_size, region.node());
    crate::sys::punch_hole(region.fd(), 0, region.len())
        .map_err(|e| Verdict::Broken(format!("punch: {e}")))?;
    let after = host_pages(page_size, region.node());
    let reserved = crate::sys::reserve_holes(region.fd(), len);
    drop(gated);
    if let Err(e) = reserved {
        return Err(why_short(had, before, after, page_size, &e));
    }
    Ok(pages)
}
