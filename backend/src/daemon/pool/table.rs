//! The pool's table and what it is built from: every region's entry
//! ([`Entry`], in one [`EntryState`]), every allocation, the lock that
//! guards them and the condition variable that announces changes. The
//! verbs that move entries live in the files of their callers' groups (see
//! the module docs of `crate::daemon::pool`); nothing here moves an entry.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use guest_mem::{PageSize, Region};
use numa::{NodeId, Topology};
use tokio::sync::Notify;

use super::allocation::{Allocation, Allocations};
use super::gate::ReserveGate;
use super::given_back::Recent;
use super::refault::Refault;
use crate::daemon::config::PoolConfig;
use crate::daemon::counters::metrics::Metrics;
use crate::daemon::ids::{AllocId, PoolKey, RegionId};
use crate::daemon::peers::holders::{Holder, Owned, Predecessor};

/// What the pool creates fresh regions with and whom it wakes, fixed for
/// the daemon's life.
#[derive(Debug)]
pub struct Sources {
    /// The host's topology (regions are bound and cleared per node).
    pub topology: Arc<Topology>,
    /// The hugetlbfs directory for path-backed regions of each page size.
    pub hugetlbfs: Vec<(PageSize, PathBuf)>,
    /// Woken when an ALLOC waits for quarantined pages (the holder scan
    /// then runs at once, see `crate::daemon::background::quarantine`).
    pub quarantine_kick: Arc<Notify>,
    /// The daemon this one took over from, while it runs: holder scans
    /// skip it.
    pub predecessor: Arc<Predecessor>,
}

impl Sources {
    /// The hugetlbfs directory for path-backed regions of `page_size`.
    pub(super) fn hugetlbfs_dir(&self, page_size: PageSize) -> Option<&Path> {
        self.hugetlbfs
            .iter()
            .find(|(p, _)| *p == page_size)
            .map(|(_, d)| d.as_path())
    }
}

/// Where a region is in its life (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum EntryState {
    /// Owned by an ALLOC in progress.
    Reserved,
    /// Handed to a client.
    InUse(AllocId),
    /// Released; waiting until no other process holds it.
    Quarantined,
    /// Waiting for (or being scrubbed by) a scrubber.
    Dirty,
    /// Every page clean; ready for ALLOC.
    Clean,
}

impl EntryState {
    pub(super) fn name(self) -> &'static str {
        match self {
            EntryState::Reserved | EntryState::InUse(_) => "in_use",
            EntryState::Quarantined => "quarantined",
            EntryState::Dirty => "dirty",
            EntryState::Clean => "clean",
        }
    }
}

#[derive(Debug)]
pub(super) struct Entry {
    pub(super) region: Arc<Region>,
    pub(super) key: PoolKey,
    pub(super) owned: Owned,
    pub(super) state: EntryState,
    pub(super) since: Instant,
    pub(super) holder: Option<Holder>,
    /// Quarantined, no process holds it, but a reference no process shows
    /// exists (see `crate::daemon::background::quarantine::reuse`): why, and when it was first seen.
    pub(super) withheld: Option<(String, Instant)>,
    /// The uid of the last client that held it (for a withheld region).
    pub(super) tenant: Option<u32>,
    pub(super) warned: bool,
    /// Pages may be on several nodes (a move is running, or a range was
    /// moved): released, such a region goes back to the kernel, never into
    /// a per-node pool (see `crate::daemon::requests::rebalance`).
    pub(super) split: bool,
    /// Holes of a detached region still to be faulted in ahead of its
    /// guest (`refault.rs`), in any entry state.
    pub(super) fill: Option<Refault>,
}

impl Entry {
    /// A new entry of `region` in `state` since `since`: no holder, not
    /// withheld, no tenant yet, on one node, no holes to fill.
    pub(super) fn new(
        region: Arc<Region>,
        key: PoolKey,
        owned: Owned,
        state: EntryState,
        since: Instant,
    ) -> Self {
        Self {
            region,
            key,
            owned,
            state,
            since,
            holder: None,
            withheld: None,
            tenant: None,
            warned: false,
            split: false,
            fill: None,
        }
    }
}

#[derive(Debug, Default)]
pub(super) struct Inner {
    pub(super) entries: BTreeMap<RegionId, Entry>,
    pub(super) allocs: Allocations,
    pub(super) above_target_since: HashMap<NodeId, Instant>,
    pub(super) stopping: bool,
    pub(super) given_back: Recent,
}

/// The pool (see the module docs).
#[derive(Debug)]
pub struct Pool {
    pub(super) inner: Mutex<Inner>,
    pub(super) changed: Condvar,
    pub(super) cfg: PoolConfig,
    pub(super) sources: Sources,
    pub(super) next_region: AtomicU64,
    pub(super) next_alloc: AtomicU64,
    pub(super) metrics: Arc<Metrics>,
    pub(super) gate: ReserveGate,
}

// The daemon's start builds the pool; the lock and ids are the pool's own.
impl Pool {
    /// An empty pool that creates fresh regions from `sources`.
    pub fn new(cfg: PoolConfig, metrics: Arc<Metrics>, sources: Sources) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            changed: Condvar::new(),
            cfg,
            sources,
            next_region: AtomicU64::new(1),
            next_alloc: AtomicU64::new(1),
            metrics,
            gate: ReserveGate::default(),
        }
    }

    /// The gate every hugetlb reservation of fresh pages and every punch of
    /// a released region passes (see [`ReserveGate`]).
    pub fn reserve_gate(&self) -> &ReserveGate {
        &self.gate
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves a table that is still
        // consistent entry by entry (every change is one assignment), so keep
        // serving rather than poisoning the whole daemon.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A fresh region id (for naming a region before it is inserted).
    pub(super) fn next_region_id(&self) -> RegionId {
        self.next_region.fetch_add(1, Ordering::Relaxed)
    }

    /// The configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.cfg
    }
}

impl Inner {
    /// Region `id`, in any state.
    pub(super) fn region(&self, id: RegionId) -> Option<Arc<Region>> {
        self.entries.get(&id).map(|e| Arc::clone(&e.region))
    }

    /// The first region (by id) that `is_it` picks, and its entry state.
    pub(super) fn find_region(
        &self,
        is_it: impl Fn(&Region) -> bool,
    ) -> Option<(RegionId, EntryState)> {
        self.entries
            .iter()
            .find(|(_, e)| is_it(&e.region))
            .map(|(id, e)| (*id, e.state))
    }

    /// The regions of allocation `a`, in its (guest-physical) order.
    pub(super) fn regions_of(&self, a: &Allocation) -> Vec<(RegionId, Arc<Region>)> {
        a.regions
            .iter()
            .filter_map(|id| self.entries.get(id).map(|e| (*id, Arc::clone(&e.region))))
            .collect()
    }

    /// The bytes of allocation `a`'s regions, and their pages not cleared
    /// yet (dirty, or being cleared: a lazy allocation's).
    pub(super) fn bytes_and_uncleared(&self, a: &Allocation) -> (u64, usize) {
        a.regions
            .iter()
            .filter_map(|id| self.entries.get(id))
            .fold((0, 0), |(bytes, pages), e| {
                let c = e.region.states().counts();
                (bytes + e.region.len(), pages + c.dirty + c.clearing)
            })
    }
}

/// Pooled (not in use) bytes on `node`: clean, dirty and quarantined.
pub(super) fn pooled_bytes(g: &Inner, node: NodeId) -> u64 {
    pooled_bytes_of(g, node, None)
}

/// [`pooled_bytes`] of one page size (`Some`), or of all.
pub(super) fn pooled_bytes_of(g: &Inner, node: NodeId, page_size: Option<PageSize>) -> u64 {
    g.entries
        .values()
        .filter(|e| {
            e.key.node == node
                && page_size.is_none_or(|p| p == e.key.page_size)
                && matches!(
                    e.state,
                    EntryState::Clean | EntryState::Dirty | EntryState::Quarantined
                )
        })
        .map(|e| e.region.len())
        .sum()
}
