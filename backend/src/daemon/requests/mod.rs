//! The rooms that serve requests: ALLOC (`alloc`), handing an allocation
//! out (`delivery`), HANDOFF and REATTACH, LOCK and UNLOCK, lazy
//! allocations and their fault services, parking (PARK, RESTORE, EXPORT,
//! UNPARK and the memory still to load from a tenant's files), and
//! REBALANCE with its policy loop.

pub mod alloc;
pub mod delivery;
pub mod handoff;
pub mod lazy_allocs;
pub(crate) mod locking;
pub mod park;
pub mod reattach;
pub mod rebalance;
