//! What a pooled ALLOC handed out, read from the hand-out itself, and the
//! time until a VMM has touched every page of it.

use std::os::fd::AsFd;
use std::time::Instant;

use backend::client::Allocation;
use guest_mem::vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use serde::Serialize;

use super::error::AllocBenchError;

/// One pooled hand-out: its ALLOC, its first touch, and what it was.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct HandOut {
    /// ALLOC sent to the memory mapped in this process, seconds.
    pub alloc_s: f64,
    /// ALLOC sent to every page written once through that mapping (one
    /// thread, one write per page), seconds; 0 where it was not touched.
    pub touched_s: f64,
    /// Bytes of the received fds backed by pages at the hand-out (`fstat`
    /// `st_blocks`).
    pub resident_bytes: u64,
    /// Bytes of the received fds that were holes at the hand-out: each
    /// faults in a page the kernel zeroes at the VMM's first touch.
    pub hole_bytes: u64,
}

/// (resident, hole) bytes of an allocation's fds, as `fstat` sees them now.
pub(crate) fn resident_and_holes(alloc: &Allocation) -> Result<(u64, u64), AllocBenchError> {
    let mut resident = 0u64;
    for fd in &alloc.fds {
        let st = nix::sys::stat::fstat(fd.as_fd()).map_err(|e| AllocBenchError::Fstat(e.into()))?;
        let blocks = u64::try_from(st.st_blocks).unwrap_or(0);
        resident = resident.saturating_add(blocks.saturating_mul(512));
    }
    let resident = resident.min(alloc.size());
    Ok((resident, alloc.size() - resident))
}

/// Writes one byte into every `page` bytes of `memory`, as a guest's first
/// touch does; returns how many pages were written.
pub(crate) fn touch_every_page(
    memory: &guest_mem::vm_memory::GuestMemoryMmap,
    page: u64,
) -> Result<u64, AllocBenchError> {
    let mut pages = 0;
    for region in memory.iter() {
        let start = region.start_addr().0;
        let mut gpa = start;
        while gpa < start + region.len() {
            memory
                .write_obj(1u8, GuestAddress(gpa))
                .map_err(|e| AllocBenchError::Touch(e.to_string()))?;
            gpa += page;
            pages += 1;
        }
    }
    Ok(pages)
}

/// Times one pooled hand-out on `client`: ALLOC, what it holds, the
/// mapping, and (when `touch`) every page written once; FREEs it after.
pub(super) fn hand_out(
    client: &mut backend::client::Client,
    request: &backend::proto::AllocRequest,
    page: u64,
    touch: bool,
) -> Result<HandOut, AllocBenchError> {
    let t = Instant::now();
    let a = client.alloc(request.clone())?;
    // Read before the mapping: a mapping does not fault, but a scrubber
    // refaulting ahead may fill holes from now on, so this is what the
    // hand-out itself held.
    let (resident_bytes, hole_bytes) = resident_and_holes(&a)?;
    let memory = a.guest_memory()?;
    let alloc_s = t.elapsed().as_secs_f64();
    let touched_s = if touch {
        touch_every_page(&memory, page)?;
        t.elapsed().as_secs_f64()
    } else {
        0.0
    };
    let id = a.id;
    drop((memory, a));
    client.free(id)?;
    Ok(HandOut {
        alloc_s,
        touched_s,
        resident_bytes,
        hole_bytes,
    })
}
