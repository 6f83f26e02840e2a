//! NUMA rebalancing in the daemon: the REBALANCE request, per-region
//! placement for STATS and `hugemem status`, the vCPU-affinity policy loop,
//! and the `hugemem rebalance` client side.
//!
//! The moving itself is `migrate` ([`migrate::move_range`]); this module
//! decides who may move what, runs the move off the executor, and keeps the
//! pool's idea of where a region is in step with where its pages are.
//!
//! # Who may move what (operator model)
//!
//! A VMM client may REBALANCE only regions of allocations its own
//! connection was given, as with FREE/LOCK/UNLOCK: anything else is
//! `NOT_FOUND`. `hugemem rebalance` is a different connection from the
//! VMM's, so a second rule admits **operators**: a peer whose `SO_PEERCRED`
//! uid is in `[rebalance] operator_uids` (default: root and the daemon's
//! own uid) may REBALANCE any *in-use* region. A process with those uids
//! could move the VMM's pages itself (`move_pages` on its pid with
//! `CAP_SYS_NICE`), so this grants nothing new; a VMM running under another
//! allowed uid cannot touch other clients' memory. Regions in the pool (not
//! in use) belong to the daemon and are never moved on request: `NOT_FOUND`
//! for everyone. The alternative — a per-allocation token the VMM would have
//! to pass to the operator — needs a protocol change and a secret to leak.
//!
//! # Off the executor
//!
//! A move of GiBs takes seconds. It runs on a blocking thread of the
//! daemon's task tracker (`spawn_blocking`); the connection's task waits for
//! it, so that connection's next request waits too, and other connections
//! are served meanwhile. Daemon shutdown cancels the move between batches.
//! Moves of different regions may run at once; a second move of a region
//! that is moving is refused (`INVALID`, "being moved already"). The
//! requesting connection is not read while it waits, so a requester that
//! goes away does not stop its move (an owner's allocations are released,
//! and the move cancelled, once its connection is found closed).
//!
//! # FREE and disconnect during a move
//!
//! FREE (or the owner's disconnect) of an allocation whose region is being
//! moved is **accepted at once and cancels the move** (it stops before its
//! next batch: at most 64 MiB, or one 1 GiB page, is still copied). A region
//! is marked "on several nodes" in the pool for the whole of a move, and
//! such a region is given back to the kernel when released instead of being
//! quarantined for reuse; the move thread holds the last reference and the
//! memory goes when it stops. So the scrubbers never see a page that is
//! being moved, and no per-node pool ever holds a region with pages on
//! another node. Refusing FREE instead would leave a VMM that is shutting
//! down with an error it cannot act on; waiting would stall its connection
//! for up to a whole move.
//!
//! # Whole regions and ranges
//!
//! After every move the daemon asks where the region's pages are
//! ([`migrate::placement`], one address per page). When every present page
//! is on one node, that node is recorded: [`guest_mem::Region::set_node`]
//! and the region's pool key, so on release it returns to that node's pool
//! and that node's scrubbers clear it. A range move that leaves the region
//! split keeps the old node and marks the region as on several nodes; the
//! ranges asked for are kept per region (last target wins where ranges
//! overlap) and shown in STATS as `rebalanced`. Moving the rest, or moving
//! it all back, makes the region whole again. A split region is given back
//! to the kernel when released (see above).
//!
//! # The policy loop
//!
//! Off by default (`[rebalance] policy`). Every `interval_ms` one task takes
//! a snapshot of the clients that hold memory and, on a blocking thread,
//! samples the vCPU threads ([`migrate::policy::sample`], thread names of
//! QEMU, cloud-hypervisor, Firecracker, crosvm) of each client's process
//! (`SO_PEERCRED` pid) **and its descendants**: `hugemem launch` holds the
//! connection and runs the VMM as its child, so the launcher itself has no
//! vCPU threads. One [`migrate::Watcher`] per client applies the hysteresis;
//! on [`migrate::Decision::Move`] each of the client's regions is moved
//! through the same path as REBALANCE, all or nothing (`allow_partial:
//! false`: a target that cannot take every page refuses before anything
//! moves). A client whose regions are on different nodes (a guest NUMA
//! layout), split, or moving is left alone. A manual REBALANCE starts the
//! owner's cool-down as well.

mod moves;
mod policy;
mod rebalancer;
#[cfg(test)]
mod tests;

pub use moves::{add_placement, rebalance, serve};
pub use policy::{policy_loop, policy_step, RegionView, Step};
pub use rebalancer::{
    authorize, Access, Initiator, MoveOutcome, MoveRequest, RangeMap, RebalanceError, Rebalancer,
};
