//! The parts of the soak beyond the first requests (`hostile_soak.rs`
//! holds the tenants, their allocations and the run): the parent's
//! daemon and its takeovers, and the tenants' HANDOFF, REATTACH, PARK,
//! RESTORE, UNPARK and saves.

pub mod daemon;
pub mod image;
pub mod migration;
pub mod owners;
pub mod parking;
pub mod saved;
