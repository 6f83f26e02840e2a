//! The host's huge-page pools for a test: making pages free (or skipping
//! the test, said out loud), holding them for the test's lifetime, and
//! reading the 2 MiB pool's sysfs counts.
//!
//! Every failure to get the pages (not root, the kernel gave fewer, no pool
//! of that size on this host) is a skip, never a panic: CI fails on any skip
//! outside its allow-list, so a host that should have the pages and does not
//! is still caught there.

use std::sync::{Mutex, PoisonError};

pub use guest_mem::PageSize;
use guest_mem::{Ballast, Reservation};

/// The pages [`free_pages`] holds back, per page size (2M, 1G).
static BALLAST: Mutex<[Option<Ballast>; 2]> = Mutex::new([None, None]);

/// `Ok` when `pages` free pages of `page_size` are there (on `node`, or
/// anywhere), raising the host pool if needed; otherwise why not. The pool
/// keeps its new size: for a reservation given back at the end, [`hold`].
///
/// Host-wide (`node` is `None`) **exactly** `pages` pages are left
/// available: pages beyond them, whatever earlier tests or runs left, are
/// held back by a [`guest_mem::Ballast`] until the next call for that page
/// size in this process (or its end). A test starts from the pages it asked
/// for, as on a fresh machine, so a leftover page can never make a test
/// pass that would fail on one (CI runs on such machines); the pool itself never shrinks
/// (a 1 GiB page given back may not be had again).
pub fn free_pages(page_size: PageSize, pages: u64, node: Option<u32>) -> Result<(), String> {
    let on = node.map_or_else(String::new, |n| format!(" on node {n}"));
    let report = match node {
        None => {
            let mut held = BALLAST.lock().unwrap_or_else(PoisonError::into_inner);
            let slot = usize::from(page_size == PageSize::Huge1G);
            held[slot] = None;
            guest_mem::set_available(page_size, pages).map(|(report, ballast)| {
                held[slot] = ballast;
                report
            })
        }
        Some(_) => guest_mem::ensure_free(page_size, pages, node),
    };
    match report {
        Ok(r) if r.met => Ok(()),
        Ok(r) => Err(format!(
            "only {} free {page_size} pages{on}, {pages} needed",
            r.free
        )),
        Err(e) => Err(format!("cannot reserve {pages} {page_size} pages{on}: {e}")),
    }
}

/// [`free_pages`], or a recorded skip of `test` and `false`.
pub fn reserve(page_size: PageSize, pages: u64, node: Option<u32>, test: &str) -> bool {
    match free_pages(page_size, pages, node) {
        Ok(()) => true,
        Err(why) => {
            crate::skip!("{test}: {why}");
            false
        }
    }
}

/// [`reserve`] of `n` 2 MiB pages anywhere.
pub fn reserve_2m(n: u64, test: &str) -> bool {
    reserve(PageSize::Huge2M, n, None, test)
}

/// `pages` free pages of `page_size` host-wide, held until the returned
/// guard drops (the pool then goes back to its earlier size); otherwise why
/// not, with the pool already given back.
pub fn hold(page_size: PageSize, pages: u64) -> Result<Reservation, String> {
    match Reservation::for_run(page_size, pages) {
        Ok(r) if r.report().met => Ok(r),
        Ok(r) => Err(format!(
            "only {} free {page_size} pages, {pages} needed",
            r.report().free
        )),
        Err(e) => Err(format!("cannot reserve {pages} {page_size} pages: {e}")),
    }
}

/// A host-wide count of the 2 MiB pool from sysfs (`free_hugepages`, ...).
pub fn hugepages_2m(what: &str) -> u64 {
    let path = format!("/sys/kernel/mm/hugepages/hugepages-2048kB/{what}");
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .trim()
        .parse()
        .expect("page count")
}

/// Holds all but `leave` of the host's free, unreserved 2 MiB pages
/// (reserved, never faulted) until dropped: a host on which the next
/// `leave` pages are the last.
///
/// # Panics
///
/// When the pages cannot be reserved.
pub fn hold_all_but_2m(leave: u64) -> Ballast {
    let spare = hugepages_2m("free_hugepages") - hugepages_2m("resv_hugepages");
    let pages = spare.saturating_sub(leave);
    Ballast::new(PageSize::Huge2M, pages)
        .unwrap_or_else(|e| panic!("reserve {pages} 2 MiB pages: {e}"))
}

/// A full host for `test`: exactly `pages` pages of `page_size` available
/// host-wide (free and unreserved), whatever earlier tests or runs left,
/// held until the guard drops (the pool then goes back to its earlier
/// size); `None`, with a recorded skip, when the kernel cannot give that.
pub fn exactly(page_size: PageSize, pages: u64, test: &str) -> Option<Reservation> {
    match Reservation::exactly(page_size, pages) {
        Ok(r) if r.report().met => Some(r),
        Ok(r) => {
            crate::skip!(
                "{test}: exactly {pages} available {page_size} pages needed, the host has {}",
                r.report().free
            );
            None
        }
        Err(e) => {
            crate::skip!("{test}: cannot set the {page_size} pool to {pages} available pages: {e}");
            None
        }
    }
}

/// 2 MiB pages any new mapping could take now, host-wide: free and not
/// reserved (the pages [`free_pages`] holds back are reserved).
pub fn available_2m() -> u64 {
    hugepages_2m("free_hugepages").saturating_sub(hugepages_2m("resv_hugepages"))
}
