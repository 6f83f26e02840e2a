//! The allocations of a connection, for the session (FREE, LOCK, UFFD,
//! REATTACH, disconnect) and the test hook standing for a restart: who owns
//! an allocation, its regions, whether it is locked, and who may hold it
//! across a daemon restart: tenant uids, re-attach tokens, orphaned
//! allocations.
//!
//! Every allocation gets a random 16-byte token when it is committed; a
//! client that negotiated `FEATURE_REATTACH` receives it in the ALLOC reply.
//! After a restart the restore code puts allocations back **orphaned**
//! ([`super::allocation::Owner::Orphaned`]): they belong to no connection until their
//! VMM shows the token on a new one ([`Owners::reattach`]).
//!
//! Every refusal of [`Owners::reattach`] is the same [`OwnershipError`] text
//! as an unknown id, so a tenant cannot learn whether another tenant's id
//! exists, is live, or what its token is; the session rate-limits refusals.

use std::sync::Arc;

use guest_mem::Region;

use super::allocation::{ChangeGate, OwnershipError};
use super::table::Pool;
use super::token::AllocToken;
use crate::daemon::ids::{AllocId, RegionId, SessionId};

/// What [`Owners::reattach`] hands back: the allocation's regions in order
/// and whether it is locked.
pub type Reattached = (Vec<(RegionId, Arc<Region>)>, bool);

/// Who owns which allocation, for the rooms: ownership checks, the lock
/// state, the lazy fallback, tokens, REATTACH, orphaning, HANDOFF's move
/// (`handoff.rs`) and the parked VMs (`parked.rs`). Borrowed from
/// [`Pool::owners`]; each method takes the pool's one lock for its step
/// and leaves the checks of a move to the allocation's [`super::allocation::Owner`]
/// (`allocation.rs`).
#[derive(Debug, Clone, Copy)]
pub struct Owners<'a> {
    pub(super) pool: &'a Pool,
}

impl Pool {
    /// Who owns which allocation, and the moves between owners (REATTACH,
    /// orphaning, HANDOFF).
    pub fn owners(&self) -> Owners<'_> {
        Owners { pool: self }
    }
}

// Called by the session (`crate::daemon::connections::session`), for its own allocations.
impl Owners<'_> {
    /// The regions of `alloc` if `session` owns it.
    ///
    /// # Errors
    ///
    /// [`OwnershipError`].
    pub fn regions_of(
        &self,
        alloc: AllocId,
        session: SessionId,
    ) -> Result<(Vec<Arc<Region>>, bool), OwnershipError> {
        let g = self.pool.lock();
        let a = g.allocs.owned(alloc, session)?;
        let regions = g.regions_of(a).into_iter().map(|(_, r)| r).collect();
        Ok((regions, a.locked))
    }

    /// The change gate of `alloc` if `session` owns it (see
    /// [`ChangeGate`]). The caller checks ownership again once it holds the
    /// gate: a HANDOFF may have moved the allocation while it waited.
    ///
    /// # Errors
    ///
    /// [`OwnershipError`].
    pub fn change_gate(
        &self,
        alloc: AllocId,
        session: SessionId,
    ) -> Result<ChangeGate, OwnershipError> {
        let g = self.pool.lock();
        let a = g.allocs.owned(alloc, session)?;
        Ok(Arc::clone(&a.gate))
    }

    /// Records whether `alloc` is locked, if `session` still owns it: the
    /// check and the change are one step under the pool's lock.
    ///
    /// # Errors
    ///
    /// [`OwnershipError`], with the lock state recorded for the allocation
    /// now (`None`: it is gone), which the caller restores its mapping to.
    pub fn set_locked(
        &self,
        alloc: AllocId,
        session: SessionId,
        locked: bool,
    ) -> Result<(), (OwnershipError, Option<bool>)> {
        let mut g = self.pool.lock();
        let Some(a) = g.allocs.get_mut(alloc) else {
            return Err((OwnershipError::Unknown(alloc), None));
        };
        if !a.owner().is(session) {
            return Err((OwnershipError::NotYours(alloc), Some(a.locked)));
        }
        a.locked = locked;
        Ok(())
    }

    /// Region `id`, in any state.
    pub fn region(&self, id: RegionId) -> Option<Arc<Region>> {
        self.pool.lock().region(id)
    }

    /// The region ids of `session`'s live allocations.
    pub fn region_ids_of(&self, session: SessionId) -> Vec<RegionId> {
        self.pool
            .lock()
            .allocs
            .owned_by(session)
            .flat_map(|(_, a)| a.regions.iter().copied())
            .collect()
    }

    /// Number of live allocations of `session`.
    pub fn allocations_of(&self, session: SessionId) -> usize {
        self.pool.lock().allocs.owned_by(session).count()
    }

    /// Gives orphaned allocation `alloc` to `session` when `uid` is its
    /// tenant and `token` its token (compared in constant time). Returns its
    /// regions, in order, and whether it is locked.
    ///
    /// # Errors
    ///
    /// [`OwnershipError::Unknown`] for every refusal — unknown id, an
    /// allocation that is not orphaned (live on a connection, this one
    /// included), another uid's, a wrong token — with one text for all.
    pub fn reattach(
        &self,
        alloc: AllocId,
        token: &AllocToken,
        session: SessionId,
        uid: u32,
    ) -> Result<Reattached, OwnershipError> {
        let mut g = self.pool.lock();
        let refused = OwnershipError::Unknown(alloc);
        let a = g.allocs.get_mut(alloc).ok_or(refused)?;
        // The token is compared whatever else fails, so a refusal takes
        // the same time for an existing id as for a live or foreign one.
        let shown = a.shown_by(uid, token);
        let next = a.owner().reattach(session).map_err(|_| refused)?;
        if !shown {
            return Err(refused);
        }
        a.enter(next);
        let a = g.allocs.get(alloc).ok_or(refused)?;
        Ok((g.regions_of(a), a.locked))
    }

    /// Orphans `alloc`: it belongs to no session until [`Owners::reattach`],
    /// and with `tenant` to that uid from now on. Its fault service, if it
    /// had one, is gone with its connection, so a lazy allocation is marked
    /// served by the VMM's fallback ([`Owners::lazy_fallback`]). Returns false
    /// (nothing changed) for an unknown id.
    ///
    /// Tests orphan a live allocation to stand for a restart (the restore
    /// code imports allocations orphaned, `takeover.rs`).
    pub fn orphan(&self, alloc: AllocId, tenant: Option<u32>) -> bool {
        match self.pool.lock().allocs.get_mut(alloc) {
            Some(a) => {
                a.orphan(tenant);
                true
            }
            None => false,
        }
    }

    /// Marks `alloc`'s lazy regions as served by the VMM's fallback (the
    /// restore code, which does not resume fault services). Returns false
    /// for an unknown id.
    pub fn set_lazy_fallback(&self, alloc: AllocId, on: bool) -> bool {
        match self.pool.lock().allocs.get_mut(alloc) {
            Some(a) => {
                a.lazy_fallback = on;
                true
            }
            None => false,
        }
    }

    /// True when `alloc` exists and its lazy regions are served by the VMM's
    /// fallback since the daemon restarted (UFFD on it is refused).
    pub fn lazy_fallback(&self, alloc: AllocId) -> bool {
        self.pool
            .lock()
            .allocs
            .get(alloc)
            .is_some_and(|a| a.lazy_fallback)
    }

    /// The token of `alloc` (for the restore code's saved state).
    pub fn token_of(&self, alloc: AllocId) -> Option<AllocToken> {
        self.pool.lock().allocs.get(alloc).map(|a| a.token)
    }
}
