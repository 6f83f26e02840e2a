//! What the rooms of a session serve from ([`Rooms`]), and the settling
//! of released allocations that every room that releases shares
//! ([`settle_released`]). Below the session and the rooms, so that a room
//! (the park room, the orphan loop) uses them without importing the
//! session that dispatches to it.

use std::sync::Arc;

use guest_mem::Region;
use numa::Topology;
use tokio::sync::Notify;
use tracing::warn;

use super::alloc::{self, Alloc};
use super::lifecycle::Lifecycle;
use super::metrics::Metrics;
use super::pool::{Pool, Released};
use super::rebalance::Rebalancer;
use super::stats::StatsSource;

/// What a session serves its requests from: the rooms it dispatches to
/// and what the session itself uses (its fault services, its release).
#[derive(Debug)]
pub struct Rooms {
    /// Allocations and their regions.
    pub pool: Arc<Pool>,
    /// The counters.
    pub metrics: Arc<Metrics>,
    /// The host's nodes (fault services, unlocking).
    pub topology: Arc<Topology>,
    /// Every lazy fault service's counters.
    pub fault_totals: Arc<crate::fault::FaultTotals>,
    /// Shutdown and the task tracker.
    pub lifecycle: Arc<Lifecycle>,
    /// Wakes the quarantine (a release, a client's exit).
    pub quarantine_kick: Arc<Notify>,
    /// REBALANCE, and the policy's view of the clients.
    pub rebalance: Arc<Rebalancer>,
    /// ALLOC.
    pub alloc: Arc<Alloc>,
    /// STATS.
    pub stats: Arc<StatsSource>,
    /// Memory still to be filled from a tenant's files (VMs parked on demand).
    pub fills: Arc<super::fills::PendingFills>,
    /// Parked VMs held for the connection that saves them (EXPORT).
    pub saving: Arc<super::saving::Saving>,
}

/// What follows a release, off the executor: released allocations that
/// were locked are unlocked, regions given back to the kernel are dropped
/// (unmapped), and the quarantine is woken. FREE, a closing session and the
/// expiry of orphaned allocations all end this way.
pub fn settle_released(rooms: &Arc<Rooms>, released: Vec<Released>) {
    if released.is_empty() {
        return;
    }
    Metrics::add(&rooms.metrics.allocs_released, released.len() as u64);
    let s = Arc::clone(rooms);
    rooms.lifecycle.tracker().spawn_blocking(move || {
        for r in released {
            if r.locked {
                let refs: Vec<&Region> = r.quarantined.iter().map(|x| &**x).collect();
                if let Err((_, msg)) = alloc::lock_regions(&s.topology, &refs, false, 0, None) {
                    warn!(reason = %msg, "cannot unlock a released allocation");
                }
            }
            drop(r.dropped);
        }
        s.quarantine_kick.notify_one();
    });
}
