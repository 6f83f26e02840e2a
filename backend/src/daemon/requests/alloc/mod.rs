//! The ALLOC room: one request served whole by [`serve()`], the way
//! REBALANCE is served by [`crate::daemon::requests::rebalance::serve`]. The session
//! only dispatches and records a lazy allocation it hands out.
//!
//! * [`room`]: what the room uses ([`Alloc`]);
//! * [`plan`]: validate a request into per-node parts, have the pool take
//!   one region per part (**the one place that decides which region
//!   serves a request** is `crate::daemon::pool::take`), lock;
//! * [`serve`](mod@serve): the request served whole, from plan to reply.
//!
//! [`room`]: crate::daemon::requests::alloc::room
//! [`plan`]: crate::daemon::requests::alloc::plan

pub mod plan;
pub mod room;
pub mod serve;

pub use plan::{join_error, lock_regions};
pub use room::Alloc;
pub use serve::{serve, Requester};
