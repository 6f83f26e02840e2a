//! The allocations of a connection, for the session (FREE, LOCK, UFFD,
//! REATTACH, disconnect) and the test hook standing for a restart: who owns
//! an allocation, its regions, whether it is locked, and who may hold it
//! across a daemon restart: tenant uids, re-attach tokens, orphaned
//! allocations.
//!
//! Every allocation gets a random 16-byte token when it is committed; a
//! client that negotiated `FEATURE_REATTACH` receives it in the ALLOC reply.
//! After a restart the restore code puts allocations back **orphaned**
//! (`session: None`): they belong to no connection until their VMM shows
//! the token on a new one ([`Owners::reattach`]).
//!
//! Every refusal of [`Owners::reattach`] is the same [`OwnershipError`] text
//! as an unknown id, so a tenant cannot learn whether another tenant's id
//! exists, is live, or what its token is; the session rate-limits refusals.

use std::sync::Arc;

use guest_mem::Region;

use super::table::{ChangeGate, Pool};
use super::token::{same_token, AllocToken};
use crate::daemon::ids::{AllocId, RegionId, SessionId};

/// Why an allocation id was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum OwnershipError {
    /// Unknown id.
    // The same text as `NotYours`: a client must not learn whether another
    // tenant's id exists.
    #[error("allocation {0} does not exist or does not belong to this connection")]
    Unknown(AllocId),
    /// Another connection's id.
    #[error("allocation {0} does not exist or does not belong to this connection")]
    NotYours(AllocId),
}

/// What [`Owners::reattach`] hands back: the allocation's regions in order
/// and whether it is locked.
pub type Reattached = (Vec<(RegionId, Arc<Region>)>, bool);

/// Who owns which allocation: ownership checks, the lock state, the lazy
/// fallback, tokens, REATTACH, orphaning, and HANDOFF's move
/// (`handoff.rs`). Borrowed from [`Pool::owners`]; each method takes the
/// pool's one lock for its step.
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
        let a = g.allocs.get(&alloc).ok_or(OwnershipError::Unknown(alloc))?;
        if a.session != Some(session) {
            return Err(OwnershipError::NotYours(alloc));
        }
        let regions = a
            .regions
            .iter()
            .filter_map(|id| g.entries.get(id))
            .map(|e| Arc::clone(&e.region))
            .collect();
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
        let a = g.allocs.get(&alloc).ok_or(OwnershipError::Unknown(alloc))?;
        if a.session != Some(session) {
            return Err(OwnershipError::NotYours(alloc));
        }
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
        let Some(a) = g.allocs.get_mut(&alloc) else {
            return Err((OwnershipError::Unknown(alloc), None));
        };
        if a.session != Some(session) {
            return Err((OwnershipError::NotYours(alloc), Some(a.locked)));
        }
        a.locked = locked;
        Ok(())
    }

    /// Region `id`, in any state.
    pub fn region(&self, id: RegionId) -> Option<Arc<Region>> {
        self.pool
            .lock()
            .entries
            .get(&id)
            .map(|e| Arc::clone(&e.region))
    }

    /// The region ids of `session`'s live allocations.
    pub fn region_ids_of(&self, session: SessionId) -> Vec<RegionId> {
        self.pool
            .lock()
            .allocs
            .values()
            .filter(|a| a.session == Some(session))
            .flat_map(|a| a.regions.iter().copied())
            .collect()
    }

    /// Number of live allocations of `session`.
    pub fn allocations_of(&self, session: SessionId) -> usize {
        self.pool
            .lock()
            .allocs
            .values()
            .filter(|a| a.session == Some(session))
            .count()
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
        let a = g.allocs.get_mut(&alloc).ok_or(refused)?;
        // The token is compared whatever else fails, so a refusal takes
        // the same time for an existing id as for a live or foreign one.
        let token_ok = same_token(&a.token, token);
        if a.session.is_some() || a.parked.is_some() || a.tenant != uid || !token_ok {
            return Err(refused);
        }
        a.session = Some(session);
        let (ids, locked) = (a.regions.clone(), a.locked);
        let regions = ids
            .iter()
            .filter_map(|id| g.entries.get(id).map(|e| (*id, Arc::clone(&e.region))))
            .collect();
        Ok((regions, locked))
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
        match self.pool.lock().allocs.get_mut(&alloc) {
            Some(a) => {
                a.session = None;
                a.lazy_fallback |= a.lazy;
                if let Some(uid) = tenant {
                    a.tenant = uid;
                }
                true
            }
            None => false,
        }
    }

    /// Marks `alloc`'s lazy regions as served by the VMM's fallback (the
    /// restore code, which does not resume fault services). Returns false
    /// for an unknown id.
    pub fn set_lazy_fallback(&self, alloc: AllocId, on: bool) -> bool {
        match self.pool.lock().allocs.get_mut(&alloc) {
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
            .get(&alloc)
            .is_some_and(|a| a.lazy_fallback)
    }

    /// The token of `alloc` (for the restore code's saved state).
    pub fn token_of(&self, alloc: AllocId) -> Option<AllocToken> {
        self.pool.lock().allocs.get(&alloc).map(|a| a.token)
    }
}
