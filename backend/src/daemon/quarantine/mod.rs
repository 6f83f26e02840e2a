//! The quarantine: what a released region goes through before its pages may
//! be scrubbed and handed to another tenant.
//!
//! * `recheck.rs`: the loop that re-checks quarantined regions and watches
//!   their holders' pidfds.
//! * [`holders`]: the `/proc` scan for processes still holding a region.
//! * [`reuse`]: the proof before reuse and its verdicts.
//! * [`gate`]: the reservation gate between a detach's punch and the
//!   daemon's fresh reservations.

pub mod gate;
pub mod holders;
mod recheck;
pub mod reuse;

pub use recheck::{quarantine_loop, Recheck, MAX_HOLDER_WATCHES};
