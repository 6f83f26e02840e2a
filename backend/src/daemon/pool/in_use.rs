//! In-use regions as NUMA rebalancing (`crate::daemon::requests::rebalance`) sees them.

use std::sync::Arc;

use guest_mem::Region;
use numa::NodeId;

use super::table::{Entry, EntryState, Inner, Pool};
use crate::daemon::ids::{AllocId, RegionId, SessionId};

/// An in-use region, as REBALANCE, the placement report and the policy see it.
#[derive(Debug, Clone)]
pub struct InUseRegion {
    /// Its id.
    pub id: RegionId,
    /// The region.
    pub region: Arc<Region>,
    /// The allocation it belongs to.
    pub alloc: AllocId,
    /// The session that owns the allocation.
    pub session: SessionId,
    /// The node it is pooled by (where its pages are when not split).
    pub node: NodeId,
    /// Pages may be on several nodes.
    pub split: bool,
}

// Called by NUMA rebalancing (`crate::daemon::requests::rebalance`).
impl Pool {
    fn in_use_entry(g: &Inner, id: RegionId, e: &Entry) -> Option<InUseRegion> {
        let EntryState::InUse(alloc) = e.state else {
            return None;
        };
        // An orphaned allocation is no client's: not moved, not reported
        // as a client's, until its VMM re-attaches.
        let session = g.allocs.get(alloc)?.owner().session()?;
        Some(InUseRegion {
            id,
            region: Arc::clone(&e.region),
            alloc,
            session,
            node: e.key.node,
            split: e.split,
        })
    }
}

/// REBALANCE's view of the regions in use and their placement marks.
/// Borrowed from [`Pool::placement`]; each method takes the pool's one lock
/// for its step.
#[derive(Debug, Clone, Copy)]
pub struct Placement<'a> {
    pub(super) pool: &'a Pool,
}

impl Pool {
    /// REBALANCE's view of the regions in use.
    pub fn placement(&self) -> Placement<'_> {
        Placement { pool: self }
    }
}

impl Placement<'_> {
    /// True while region `id` is the daemon's (in any state).
    pub fn contains(&self, id: RegionId) -> bool {
        self.pool.lock().entries.contains_key(&id)
    }

    /// Region `id` if it is in use by a client.
    pub fn in_use(&self, id: RegionId) -> Option<InUseRegion> {
        let g = self.pool.lock();
        let e = g.entries.get(&id)?;
        Pool::in_use_entry(&g, id, e)
    }

    /// Every region in use by a client.
    pub fn in_use_regions(&self) -> Vec<InUseRegion> {
        let g = self.pool.lock();
        g.entries
            .iter()
            .filter_map(|(id, e)| Pool::in_use_entry(&g, *id, e))
            .collect()
    }

    /// Marks region `id`, still in use by `alloc`, as having pages on
    /// several nodes (from the start of a move). Returns false (nothing
    /// changed) when the region left that allocation. Under the same lock as
    /// release, so a released region was either marked first (and goes back
    /// to the kernel) or is refused here.
    pub fn mark_split(&self, id: RegionId, alloc: AllocId) -> bool {
        match self.pool.lock().entries.get_mut(&id) {
            Some(e) if e.state == EntryState::InUse(alloc) => {
                e.split = true;
                true
            }
            _ => false,
        }
    }

    /// Records that every page of region `id`, still in use by `alloc`, is
    /// on `node`: the pool key and the region's node follow, and it is no
    /// longer split. Returns false (nothing changed) when the region left
    /// that allocation.
    pub fn set_whole_node(&self, id: RegionId, alloc: AllocId, node: NodeId) -> bool {
        let mut g = self.pool.lock();
        match g.entries.get_mut(&id) {
            Some(e) if e.state == EntryState::InUse(alloc) => {
                e.key.node = node;
                e.split = false;
                e.region.set_node(Some(node));
                true
            }
            _ => false,
        }
    }
}
