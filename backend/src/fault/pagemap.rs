//! `/proc/self/pagemap` (in `hugemem_client::pagemap`), and the daemon's
//! check that every dirty page of a region is resident.

pub use hugemem_client::pagemap::*;

use guest_mem::{PageState, Region};

/// `Ok` when every `Dirty` page of the region is mapped in the daemon's own
/// mapping (so in the page cache); else the first page that is not (0 when
/// the check itself failed).
pub fn dirty_pages_resident(region: &Region) -> Result<(), usize> {
    let dirty = region.states().pages_in(PageState::Dirty);
    if dirty.is_empty() {
        return Ok(());
    }
    let (Ok(len), Ok(unit)) = (
        usize::try_from(region.len()),
        usize::try_from(region.state_unit()),
    ) else {
        return Err(0);
    };
    // SAFETY: the region's own mapping, `len` bytes from its 4 KiB-aligned
    // start, alive for the call (we hold the region); only inspected.
    let Ok(present) = (unsafe { resident_pages(region.as_ptr(), len, unit) }) else {
        return Err(0);
    };
    match dirty
        .into_iter()
        .find(|&p| !present.get(p).copied().unwrap_or(false))
    {
        Some(page) => Err(page),
        None => Ok(()),
    }
}
