//! Guest RAM regions for hugemem.
//!
//! Turns "8 GiB for a VM, 4 on node 0 and 4 on node 1" into memfd-backed,
//! NUMA-placed, clean memory that a VMM can map: page-size policy with a
//! fallback that is said out loud, placement with `mbind` verified by
//! `move_pages`, a per-huge-page state machine shared with the scrubber and the
//! fault handler, batched `mlock`, and a `vm-memory` adapter.
//!
//! `mmap`, `madvise`, `memfd_create` and `mlock` are called only from this
//! crate's private `sys` module.

#![deny(missing_docs)]

/// Filling a region from files (parking, restoring): parallel, NUMA-local, holes zeroed.
pub mod fill;
pub mod hugepages;
/// Batched `mlock`/`munlock` in chunks, per node in parallel, cancellable.
pub mod lock;
pub mod mapping;
/// Live huge-page pool counts and the page-size choice made from them.
pub mod pools;
/// Guest RAM regions: page-size policy, node binding, eager preparation, placement checks.
pub mod region;
pub mod size;
/// Per-page state (dirty, clearing, clean, mapped) shared by preparer, scrubber and fault handler.
pub mod state;
mod sys;
/// `vm-memory` adapter: regions as a rust-vmm `GuestMemoryMmap`.
pub mod vmm;

pub use fill::{
    fill_region, fill_region_planned, fill_unit, mark_for_fill, Checksums, FillCounts, FillError,
    FillOptions, FillPlan, FillProgress, FillReport, FillSource, Readahead, UnitFill,
};
pub use hugepages::{
    ensure_free, set_available, Ballast, Reservation, ReserveError, ReserveReport,
};
pub use lock::{
    lock_mapping, lock_ranges, unlock_mapping, unlock_ranges, LockError, LockOp, LockOptions,
    LockRange, LockReport, Lockable, DEFAULT_LOCK_CHUNK,
};
pub use mapping::{AnonMapping, MappingError, PageSize, SharedMapping};
pub use pools::{Availability, Choice, PoolCounts, PoolError, PoolSnapshot, Skipped};
pub use region::{
    AdoptError, AdoptSpec, Backing, PageFailure, PagePolicy, PlacementReport, PrepareError,
    PrepareReport, Region, RegionError, RegionSpec,
};
pub use state::{PageState, PageStates, StateCounts, StateError};
/// The `vm-memory` version the adapter builds on, for VMMs that must match it.
pub use vm_memory;
pub use vmm::{
    guest_memory, guest_region, shared_file_mapping, AdapterError, GuestMemoryHugememExt,
};
