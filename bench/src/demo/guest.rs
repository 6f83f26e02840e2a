//! The micro-guest on the allocation's memory, mapped as a rust-vmm VMM
//! maps it.

use std::time::{Duration, Instant};

use guest_mem::vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

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
