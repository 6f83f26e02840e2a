//! The micro-guest on the allocation's memory, mapped as a rust-vmm VMM
//! maps it.

use std::time::{Duration, Instant};

use guest_mem::vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use guest_mem::PageSize;

use super::error::DemoError;
use super::report::GuestFigures;

/// Distance between the guest's reads and markers.
pub(super) const STRIDE: u64 = 2 << 20;

pub(super) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Maps the allocation and runs the micro-guest over it.
pub(super) fn run_guest(
    alloc: &backend::client::Allocation,
    marker: u64,
    alloc_started: Instant,
) -> Result<GuestFigures, DemoError> {
    let mem = alloc.guest_memory()?;
    run_guest_on(mem, marker, alloc_started)
}

/// The floor of [`run_guest`]: the same mapping and guest on a hugetlb
/// memfd of the same size and page size, populated before the clock, no
/// daemon (memory that needs no preparation); its "ALLOC sent" is the
/// start of the mapping.
pub(super) fn run_guest_on_resident_memfd(
    size: u64,
    page: PageSize,
    marker: u64,
) -> Result<GuestFigures, DemoError> {
    let (memory, _) = crate::floor::FloorMemory::populated(size, page)
        .map_err(|e| DemoError::Floor(backend::diag::chain(&e)))?;
    let started = Instant::now();
    let mem = backend::guest_memory::guest_memory_from_fds(&[memory.region()], &[memory.fd()])?;
    run_guest_on(mem, marker, started)
}

/// Runs the micro-guest over `mem`; `started` is when the caller began
/// asking for the memory.
fn run_guest_on(
    mem: GuestMemoryMmap,
    marker: u64,
    alloc_started: Instant,
) -> Result<GuestFigures, DemoError> {
    let mut ram = Vec::with_capacity(mem.num_regions());
    for r in mem.iter() {
        // A region's length fits usize: it was mapped.
        let len = usize::try_from(r.len()).map_err(|_| DemoError::Size(r.len()))?;
        // SAFETY: `r.as_ptr()..+len` is the live read-write shared mapping
        // vm-memory made for this region; `mem` outlives `ram` (both die at the
        // end of this function, `ram` first), and no Rust reference to the
        // memory exists while the guest runs.
        ram.push(unsafe {
            microguest::GuestRam::from_raw_parts(r.as_ptr(), len, r.start_addr().0)
        });
    }
    // `guest_memory()` leaves [3 GiB, 4 GiB) free, so the runner's default
    // control slot (4 GiB - 1 MiB) never overlaps guest RAM.
    let cfg = microguest::RunConfig {
        stride: STRIDE,
        marker,
        start_gpa: 0,
        ..Default::default()
    };
    let run_started = Instant::now();
    let report = microguest::run(&ram, &cfg)?;
    drop(ram);
    drop(mem);
    let before_run = run_started.duration_since(alloc_started);
    Ok(GuestFigures {
        vm_setup_ms: ms(report.setup),
        first_instruction_ms: ms(report.first_instruction),
        alloc_to_first_instruction_ms: ms(before_run + report.setup + report.first_instruction),
        all_touched_ms: ms(report.all_touched),
        pages_touched: report.pages_touched,
        saw_nonzero: report.saw_nonzero,
    })
}
