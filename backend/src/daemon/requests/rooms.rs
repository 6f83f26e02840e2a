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

use crate::daemon::counters::metrics::Metrics;
use crate::daemon::lifecycle::Lifecycle;
use crate::daemon::pool::{Pool, Released};
use crate::daemon::requests::alloc::{self, Alloc};
use crate::daemon::requests::rebalance::Rebalancer;
use crate::daemon::requests::stats::StatsSource;

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
    pub fills: Arc<crate::daemon::requests::parked::loads::PendingLoads>,
    /// Parked VMs held for the connection that saves them (EXPORT).
    pub saving: Arc<crate::daemon::requests::parked::saving::Saving>,
    /// Shared clones of parked VMs, and their budget (CLONE).
    pub clones: Arc<crate::daemon::requests::parked::clones::Clones>,
    /// Copy clones reading their template (RESTORE with COPY).
    pub copy_fills: Arc<crate::daemon::requests::parked::copy_fills::CopyFills>,
    /// Brings systemd's fd store up to date now (set at the start when
    /// the store is used; see [`Rooms::sync_now`]).
    pub store_sync: std::sync::OnceLock<StoreSync>,
    /// The note of parked VMs on disk, and those a start found lost.
    pub park_record: Arc<crate::daemon::requests::parked::note::ParkRecord>,
}

/// A blocking sync of systemd's fd store (`fdstore::sync_now`), set by
/// the start, which sits above both.
#[derive(Clone)]
pub struct StoreSync(pub Arc<dyn Fn() -> Result<(), SyncError> + Send + Sync>);

/// Why the fd store could not be brought up to date (its type lives above
/// the rooms, in `crate::daemon::restart::fdstore`).
pub type SyncError = Box<dyn std::error::Error + Send + Sync>;

impl std::fmt::Debug for StoreSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StoreSync")
    }
}

impl Rooms {
    /// Rewrites the note of parked VMs (after a PARK, RESTORE or UNPARK),
    /// off the executor: replaced before this returns (a daemon that ends
    /// from then on leaves it), `fsync`ed after, in a task of its own that
    /// the request's answer does not wait for (two `fsync`s on a busy disk
    /// take tens to hundreds of ms; the stop waits for it). The note says
    /// which parked VMs a restart lost; what keeps them across a restart
    /// is the fd store ([`Rooms::sync_now`]), done before the answer.
    pub async fn note_parked(&self) {
        let (record, pool) = (Arc::clone(&self.park_record), Arc::clone(&self.pool));
        let wrote = tokio::task::spawn_blocking(move || {
            record.replace_with(|| pool.parking().parked_list())
        })
        .await;
        match wrote {
            Ok(true) => {
                let record = Arc::clone(&self.park_record);
                self.lifecycle
                    .tracker()
                    .spawn_blocking(move || record.sync());
            }
            Ok(false) => {}
            Err(e) => warn!(error = %e, "the note of parked VMs panicked"),
        }
    }

    /// Brings systemd's fd store up to date, off the executor, when the
    /// daemon uses one: a parked VM's record is stored before its sender
    /// retires the VM, and gone before its memory may serve anyone else.
    /// A failure is logged: the periodic sync tries again.
    pub async fn sync_now(&self, why: &'static str) {
        let Some(sync) = self.store_sync.get().cloned() else {
            return;
        };
        match tokio::task::spawn_blocking(move || (sync.0)()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => warn!(error = %e, why, "cannot bring systemd's fd store up to date"),
            Err(e) => warn!(error = %e, why, "the fd store sync panicked"),
        }
    }
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
