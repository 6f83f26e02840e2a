//! HANDOFF: a live allocation passes from the connection that
//! owns it to another connection of the same tenant, its VMM's successor,
//! in one step under the pool's lock, so there is no moment in which both
//! or neither own it. The successor shows the current token and gets a new
//! one: the token it showed stops working, so the predecessor can neither
//! take the allocation back nor hand it on.

use std::sync::Arc;

use guest_mem::Region;

use super::allocation::{Allocation, ChangeGate, Next, OwnershipError, Refused};
use super::owners::Owners;
use super::table::Inner;
use super::token::{new_token, AllocToken};
use crate::daemon::ids::{AllocId, RegionId, SessionId};

/// Why a HANDOFF was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandoffError {
    /// Unknown id, another tenant's, or a wrong token: one text for all, as
    /// for an id that does not exist (a tenant learns nothing of another's).
    #[error(transparent)]
    Refused(#[from] OwnershipError),
    /// The asking connection owns it already.
    #[error("allocation {0} already belongs to this connection")]
    AlreadyYours(AllocId),
    /// Some pages were never cleared: a lazy allocation whose clearing has
    /// not finished (its fault service belongs to the old connection).
    #[error(
        "allocation {alloc} still has {pages} page(s) to clear (a lazy allocation whose \
         clearing has not finished); a handoff needs every page cleared: retry when STATS \
         shows none left to clear"
    )]
    NotCleared {
        /// The allocation.
        alloc: AllocId,
        /// Pages dirty or being cleared.
        pages: usize,
    },
    /// PATHS was asked for and the regions are memfds, not hugetlbfs files.
    #[error(
        "allocation {0} is on memfds, not hugetlbfs files: it has no paths (ask without PATHS \
         and use the fds)"
    )]
    NoPaths(AllocId),
    /// No new token could be made, or the successor's fds could not be opened.
    #[error("{0}")]
    Internal(String),
}

/// What a successful [`Owners::hand_off`] gives the successor.
#[derive(Debug)]
pub struct HandedOff {
    /// The connection that owned it before (`None`: it was orphaned).
    pub previous: Option<SessionId>,
    /// Its regions, in reply (guest-physical) order.
    pub regions: Vec<(RegionId, Arc<Region>)>,
    /// Its new token.
    pub token: AllocToken,
}

/// The checks of a HANDOFF that need nothing but the record: the
/// allocation exists, `uid` is its tenant, `token` its current token
/// (compared in constant time, whatever else fails, so a refusal takes the
/// same time for an existing id as for a foreign one), and its owner may
/// hand it to `session` ([`super::allocation::Owner::hand_off`]: not parked, not
/// `session`'s already). Returns it and the state it would enter.
fn check<'a>(
    g: &'a Inner,
    alloc: AllocId,
    token: &AllocToken,
    session: SessionId,
    uid: u32,
) -> Result<(&'a Allocation, Next), HandoffError> {
    let refused = OwnershipError::Unknown(alloc);
    let a = g.allocs.get(alloc).ok_or(refused)?;
    if !a.shown_by(uid, token) {
        return Err(refused.into());
    }
    match a.owner().hand_off(session) {
        Ok(next) => Ok((a, next)),
        Err(Refused::AlreadyYours) => Err(HandoffError::AlreadyYours(alloc)),
        // A parked VM's allocation is taken only by RESTORE.
        Err(_) => Err(refused.into()),
    }
}

impl Owners<'_> {
    /// The change gate of `alloc` (see [`ChangeGate`]) and the connection
    /// that owns it now, for a HANDOFF that passed `check`. The successor
    /// waits on the gate for a change its predecessor began (a LOCK's
    /// mlock) and then calls [`Owners::hand_off`], which checks everything
    /// again. A refusal answers at once: only the holder of the right token
    /// ever waits.
    ///
    /// # Errors
    ///
    /// [`HandoffError`], as [`Owners::hand_off`] would refuse.
    pub fn hand_off_gate(
        &self,
        alloc: AllocId,
        token: &AllocToken,
        session: SessionId,
        uid: u32,
    ) -> Result<(ChangeGate, Option<SessionId>), HandoffError> {
        let g = self.pool.lock();
        let (a, _) = check(&g, alloc, token, session, uid)?;
        Ok((Arc::clone(&a.gate), a.owner().session()))
    }

    /// Gives allocation `alloc` to `session` when `uid` is its tenant and
    /// `token` its current token (compared in constant time), with a new
    /// token. The allocation may be live on another connection or orphaned.
    /// `prepare` runs on its regions (in guest-physical order) and whether
    /// it is locked, once every check passed and before anything changes
    /// (the daemon hands the allocation out there: the successor's fds are
    /// opened): when it fails, the allocation stays where it was. The caller holds the
    /// allocation's change gate ([`Owners::hand_off_gate`]).
    ///
    /// # Errors
    ///
    /// [`HandoffError`]; every refusal that a guesser could learn from is
    /// [`HandoffError::Refused`] with the text of an unknown id.
    pub fn hand_off<T>(
        &self,
        alloc: AllocId,
        token: &AllocToken,
        session: SessionId,
        uid: u32,
        prepare: impl FnOnce(&[(RegionId, Arc<Region>)], bool) -> Result<T, HandoffError>,
    ) -> Result<(HandedOff, T), HandoffError> {
        let fresh = new_token().map_err(|e| HandoffError::Internal(e.to_string()))?;
        let mut g = self.pool.lock();
        let (a, next) = check(&g, alloc, token, session, uid)?;
        let regions = g.regions_of(a);
        let (_, pages) = g.bytes_and_uncleared(a);
        if pages > 0 {
            return Err(HandoffError::NotCleared { alloc, pages });
        }
        let prepared = prepare(&regions, a.locked)?;
        let a = g
            .allocs
            .get_mut(alloc)
            .ok_or(OwnershipError::Unknown(alloc))?;
        let previous = a.owner().session();
        a.enter(next);
        a.token = fresh;
        let handed = HandedOff {
            previous,
            regions,
            token: fresh,
        };
        Ok((handed, prepared))
    }
}
