//! The demo's pages: the page size and the reservation, every fallback
//! said, and the ALLOC policy for the page size chosen.

use guest_mem::size::format_size;
use guest_mem::{PageSize, Reservation};

use super::error::DemoError;

/// Picks the page size and reserves pages, shrinking the size when only
/// fewer huge pages can be had; every decision goes into `notes`.
pub(super) fn reserve(
    size: u64,
    only: Option<PageSize>,
    notes: &mut Vec<String>,
) -> Result<(PageSize, u64, Option<Reservation>), DemoError> {
    if only == Some(PageSize::Base4K) {
        notes.push("4 KiB shmem pages, as asked".into());
        return Ok((PageSize::Base4K, size, None));
    }
    let candidates: Vec<PageSize> = match only {
        Some(p) => vec![p],
        None => vec![PageSize::Huge1G, PageSize::Huge2M],
    };
    for page in candidates {
        let want = size / page.bytes();
        if want == 0 || !size.is_multiple_of(page.bytes()) {
            notes.push(format!(
                "{} is not a multiple of {page} pages",
                format_size(size)
            ));
            continue;
        }
        match Reservation::for_run(page, want) {
            Ok(r) if r.report().met => {
                notes.push(format!(
                    "reserved {want} x {page} pages ({} free now)",
                    r.report().free
                ));
                return Ok((page, size, Some(r)));
            }
            Ok(r) if r.report().free > 0 => {
                let got = r.report().free.min(want);
                let smaller = got * page.bytes();
                notes.push(format!(
                    "asked for {want} x {page} pages, the kernel has {got} free: running with {} instead of {}",
                    format_size(smaller),
                    format_size(size)
                ));
                return Ok((page, smaller, Some(r)));
            }
            Ok(_) => notes.push(format!(
                "no {page} pages could be reserved (the kernel gave none)"
            )),
            Err(e) => notes.push(format!("cannot reserve {page} pages: {e}")),
        }
    }
    if let Some(p) = only {
        return Err(DemoError::NoPages(format!(
            "{p} pages were asked for: {}",
            notes.join("; ")
        )));
    }
    notes.push("falling back to 4 KiB shmem pages".into());
    Ok((PageSize::Base4K, size, None))
}
