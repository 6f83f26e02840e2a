//! The rooms that serve requests, and what they serve from (`rooms`): ALLOC
//! (`alloc`), handing an allocation out (`delivery`) and what serving a
//! request produced (`outcome`), HANDOFF and REATTACH, LOCK and UNLOCK, lazy
//! allocations and their fault services, PARK, RESTORE, EXPORT and UNPARK
//! (`park`) and what the daemon keeps of parked VMs besides their memory
//! (`parked`), REBALANCE with its policy loop, and STATS.

pub mod alloc;
pub mod delivery;
pub mod handoff;
pub mod lazy_allocs;
pub(crate) mod locking;
pub mod outcome;
pub mod park;
pub mod parked;
pub mod reattach;
pub mod rebalance;
pub mod rooms;
pub mod stats;
