//! An allocation's life: who holds it ([`Owner`], one state at a time),
//! the moves between those states, the allocation's record
//! ([`Allocation`]) and the table of every allocation ([`Allocations`]),
//! which owns its map and its part of the pool's snapshot.
//!
//! | from | move | to | refused |
//! |---|---|---|---|
//! | — | ALLOC's commit | `Session(s)` | — |
//! | `Session(s)` | HANDOFF to `t` | `Session(t)` | `t` is `s` |
//! | `Session(s)` | its connection gone (a restart) | `Orphaned` | — |
//! | `Orphaned` | REATTACH or HANDOFF to `t` | `Session(t)` | — |
//! | `Session(s)`, `Orphaned` | PARK | `Parked(vm)` | another owner than the PARK saw |
//! | `Parked(vm)` | RESTORE to `t` | `Session(t)` | another name |
//! | `Parked(vm)` | REATTACH, HANDOFF, PARK | — | always |
//!
//! REATTACH, HANDOFF and RESTORE also ask for the tenant's uid, and the
//! first two for the allocation's token ([`Allocation::shown_by`]).
//!
//! Each move is a method of [`Owner`] that takes the state it starts from
//! and gives the next one ([`Next`]) or why it is refused ([`Refused`]);
//! only [`Allocation::enter`] applies a [`Next`], and only a move makes
//! one, so an owner never changes but through a move and its checks. A
//! life ends when the pool removes the allocation: FREE or a disconnect
//! (its connection's), the orphan loop (an orphan nobody re-attached in
//! time), UNPARK (a parked VM), a takeover that lost one of its regions.
//!
//! Properties that are not where the allocation is in its life stay plain
//! fields of [`Allocation`]: `locked` (LOCK and UNLOCK, kept across every
//! move), `lazy` (fixed when it is handed out) and `lazy_fallback` (who
//! serves a lazy allocation's faults: set when it loses its connection,
//! cleared when a UFFD of its new owner resumes the service).

use std::collections::HashMap;
use std::sync::Arc;

use super::parked_vm::ParkedVm;
use super::token::{same_token, AllocToken};
use crate::daemon::ids::{AllocId, RegionId, SessionId};

/// Who holds an allocation: where it is in its life.
///
/// A template (a parked VM that clones map) would be one more state beside
/// [`Owner::Parked`]: reached from it by a move of its own, no
/// connection's, and released only once no clone maps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Owner {
    /// Live: the connection that owns it. Only that connection's FREE,
    /// LOCK, UNLOCK, UFFD and REBALANCE act on it; its disconnect releases
    /// it.
    Session(SessionId),
    /// **Orphaned**: no connection's. Restored after a restart (or its
    /// connection stood for one in a test), it waits for its VMM to show
    /// its token: REATTACH or HANDOFF gives it to a connection. FREE,
    /// LOCK, UNLOCK and UFFD refuse it and no disconnect releases it; the
    /// orphan loop releases those nobody took back within
    /// `limits.reattach_timeout_secs` of the start.
    Orphaned,
    /// Parked: the VM whose memory it holds while no process runs it
    /// (`parked.rs`). No connection's and no orphan: it never times out,
    /// and only RESTORE (to a connection) or UNPARK (released) takes it.
    Parked(Arc<ParkedVm>),
}

/// The state a move of an [`Owner`] gives, applied with
/// [`Allocation::enter`]. Only the moves make one.
#[derive(Debug)]
#[must_use = "a move changes nothing until the allocation enters its next state"]
pub(super) struct Next(Owner);

/// Why a move of an [`Owner`] is refused. Callers word it for their
/// request (an [`OwnershipError`] with the text of an unknown id wherever a
/// tenant could learn something from it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Refused {
    /// Not orphaned: REATTACH takes only an orphan.
    NotOrphaned,
    /// Parked: only RESTORE or UNPARK takes it.
    Parked,
    /// The asking connection owns it already.
    AlreadyYours,
    /// Its owner is not the one the request saw (it changed hands).
    Moved,
    /// Not parked under the name asked for.
    NotParked,
}

impl Owner {
    /// The connection that owns it (`None`: orphaned or parked).
    pub fn session(&self) -> Option<SessionId> {
        match self {
            Owner::Session(s) => Some(*s),
            Owner::Orphaned | Owner::Parked(_) => None,
        }
    }

    /// The VM parked in it.
    pub fn parked(&self) -> Option<&Arc<ParkedVm>> {
        match self {
            Owner::Parked(vm) => Some(vm),
            Owner::Session(_) | Owner::Orphaned => None,
        }
    }

    /// True when connection `session` owns it.
    pub(super) fn is(&self, session: SessionId) -> bool {
        *self == Owner::Session(session)
    }

    /// The VM parked in it under `name`.
    pub(super) fn parked_as(&self, name: &str) -> Option<&Arc<ParkedVm>> {
        self.parked().filter(|vm| vm.name == name)
    }

    /// Its connection is gone (a restart, or a test standing for one): a
    /// live allocation becomes an orphan. An orphan stays one, and a
    /// parked VM, which has no connection to lose, stays parked.
    pub(super) fn orphan(&self) -> Next {
        Next(match self {
            Owner::Session(_) | Owner::Orphaned => Owner::Orphaned,
            Owner::Parked(vm) => Owner::Parked(Arc::clone(vm)),
        })
    }

    /// REATTACH: an orphan goes to connection `session`.
    pub(super) fn reattach(&self, session: SessionId) -> Result<Next, Refused> {
        match self {
            Owner::Orphaned => Ok(Next(Owner::Session(session))),
            Owner::Session(_) | Owner::Parked(_) => Err(Refused::NotOrphaned),
        }
    }

    /// HANDOFF: a live allocation of another connection, or an orphan,
    /// goes to connection `session`.
    pub(super) fn hand_off(&self, session: SessionId) -> Result<Next, Refused> {
        match self {
            Owner::Parked(_) => Err(Refused::Parked),
            Owner::Session(s) if *s == session => Err(Refused::AlreadyYours),
            Owner::Session(_) | Owner::Orphaned => Ok(Next(Owner::Session(session))),
        }
    }

    /// PARK: the allocation whose files a PARK brought, held by `seen` when
    /// the PARK looked (a connection, or `None`: an orphan), becomes the
    /// parked VM `vm`.
    pub(super) fn park(&self, seen: Option<SessionId>, vm: ParkedVm) -> Result<Next, Refused> {
        match self {
            Owner::Parked(_) => Err(Refused::Moved),
            Owner::Session(_) | Owner::Orphaned if self.session() != seen => Err(Refused::Moved),
            Owner::Session(_) | Owner::Orphaned => Ok(Next(Owner::Parked(Arc::new(vm)))),
        }
    }

    /// RESTORE: the VM parked under `name` goes to connection `session`.
    pub(super) fn restore(&self, name: &str, session: SessionId) -> Result<Next, Refused> {
        match self.parked_as(name) {
            Some(_) => Ok(Next(Owner::Session(session))),
            None => Err(Refused::NotParked),
        }
    }

    /// The owner as the state document says it: the session (`None`:
    /// orphaned or parked) and the parked VM.
    pub(super) fn record(&self) -> (Option<SessionId>, Option<ParkedVm>) {
        (self.session(), self.parked().map(|vm| ParkedVm::clone(vm)))
    }

    /// The owner a state document's `session` and `parked` say. A parked
    /// VM is no connection's: no daemon writes both, and a document that
    /// did is read as parked.
    pub(super) fn from_record(session: Option<SessionId>, parked: Option<ParkedVm>) -> Self {
        match (parked, session) {
            (Some(vm), _) => Owner::Parked(Arc::new(vm)),
            (None, Some(s)) => Owner::Session(s),
            (None, None) => Owner::Orphaned,
        }
    }
}

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

/// An allocation's change gate. LOCK, UNLOCK, UFFD, an owner's REBALANCE
/// and HANDOFF hold it from their ownership check until their change is
/// made and recorded, so a change the owner began (an mlock running on a
/// blocking thread, a move) is finished before the allocation can change
/// hands, and a request that waited for a HANDOFF finds the new owner when
/// it checks. An async mutex: holders wait across `.await`s, and a waiter
/// parks its task, not a runtime thread.
pub type ChangeGate = Arc<tokio::sync::Mutex<()>>;

/// One allocation: its owner and its properties.
#[derive(Debug)]
pub(super) struct Allocation {
    /// Who holds it: changed only by [`Allocation::enter`].
    owner: Owner,
    pub(super) regions: Vec<RegionId>,
    pub(super) locked: bool,
    /// The uid it was handed to; only that uid may re-attach it.
    pub(super) tenant: u32,
    /// The secret that re-attaches it (random, sent once in the ALLOC reply).
    pub(super) token: AllocToken,
    /// Handed out in lazy mode (its regions may have uncleared pages).
    pub(super) lazy: bool,
    /// Its lazy regions are served by the VMM's fallback, not by a fault
    /// service of this daemon (the uffd went with the old connection, or
    /// the old daemon): UFFD on it is refused.
    pub(super) lazy_fallback: bool,
    /// Held from an ownership check to the change it allows (see
    /// [`ChangeGate`]).
    pub(super) gate: ChangeGate,
}

impl Allocation {
    /// A new allocation of `regions`, owned by `session` (ALLOC's commit).
    pub(super) fn committed(
        session: SessionId,
        regions: Vec<RegionId>,
        tenant: u32,
        token: AllocToken,
        lazy: bool,
        locked: bool,
    ) -> Self {
        Self {
            owner: Owner::Session(session),
            regions,
            locked,
            tenant,
            token,
            lazy,
            lazy_fallback: false,
            gate: ChangeGate::default(),
        }
    }

    /// Who holds it.
    pub(super) fn owner(&self) -> &Owner {
        &self.owner
    }

    /// Enters the state a move of its owner gave.
    pub(super) fn enter(&mut self, next: Next) {
        self.owner = next.0;
    }

    /// Orphans it ([`Owner::orphan`]): its fault service, if it had one,
    /// is gone with its connection, so a lazy allocation is marked served
    /// by the VMM's fallback; with `tenant`, it is that uid's from now on.
    pub(super) fn orphan(&mut self, tenant: Option<u32>) {
        let next = self.owner.orphan();
        self.enter(next);
        self.lazy_fallback |= self.lazy;
        if let Some(uid) = tenant {
            self.tenant = uid;
        }
    }

    /// True when `uid` is its tenant and `token` its token. The token is
    /// compared (in constant time) whatever the uid, so a refusal takes
    /// the same time for an existing id as for a foreign one.
    pub(super) fn shown_by(&self, uid: u32, token: &AllocToken) -> bool {
        let token_ok = same_token(&self.token, token);
        self.tenant == uid && token_ok
    }

    /// Its snapshot as allocation `id`.
    fn snapshot(&self, id: AllocId) -> AllocSnapshot {
        AllocSnapshot {
            id,
            owner: self.owner.clone(),
            regions: self.regions.clone(),
            locked: self.locked,
            tenant: self.tenant,
            token: self.token,
            lazy: self.lazy,
            lazy_fallback: self.lazy_fallback,
        }
    }
}

/// One allocation of a snapshot (the pool's part of the state document).
#[derive(Debug, Clone)]
pub struct AllocSnapshot {
    /// Its id.
    pub id: AllocId,
    /// Who holds it.
    pub owner: Owner,
    /// Its regions, in reply order.
    pub regions: Vec<RegionId>,
    /// Locked.
    pub locked: bool,
    /// The uid it was handed to.
    pub tenant: u32,
    /// Its re-attach token.
    pub token: AllocToken,
    /// Handed out lazily.
    pub lazy: bool,
    /// Its lazy regions are served by the VMM's fallback.
    pub lazy_fallback: bool,
}

impl AllocSnapshot {
    /// As it is saved where no connection survives (systemd's fd store):
    /// orphaned ([`Allocation::orphan`]), its tenant kept.
    pub(super) fn orphaned(&self) -> Self {
        let mut out = self.clone();
        out.owner = self.owner.orphan().0;
        out.lazy_fallback |= self.lazy;
        out
    }
}

/// Every allocation, by id. The map is this file's: the rest of the pool
/// asks by owner ([`Allocations::owned`], [`Allocations::owned_by`],
/// [`Allocations::orphans`], [`Allocations::parked`]).
#[derive(Debug, Default)]
pub(super) struct Allocations {
    map: HashMap<AllocId, Allocation>,
}

impl Allocations {
    /// Allocation `id`.
    pub(super) fn get(&self, id: AllocId) -> Option<&Allocation> {
        self.map.get(&id)
    }

    /// Allocation `id`, to change.
    pub(super) fn get_mut(&mut self, id: AllocId) -> Option<&mut Allocation> {
        self.map.get_mut(&id)
    }

    /// Records allocation `id`.
    pub(super) fn insert(&mut self, id: AllocId, a: Allocation) {
        self.map.insert(id, a);
    }

    /// How many there are.
    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    /// Allocation `id` if connection `session` owns it.
    ///
    /// # Errors
    ///
    /// [`OwnershipError`].
    pub(super) fn owned(
        &self,
        id: AllocId,
        session: SessionId,
    ) -> Result<&Allocation, OwnershipError> {
        let a = self.map.get(&id).ok_or(OwnershipError::Unknown(id))?;
        if !a.owner.is(session) {
            return Err(OwnershipError::NotYours(id));
        }
        Ok(a)
    }

    /// The allocations connection `session` owns.
    pub(super) fn owned_by(
        &self,
        session: SessionId,
    ) -> impl Iterator<Item = (AllocId, &Allocation)> {
        self.map
            .iter()
            .filter(move |(_, a)| a.owner.is(session))
            .map(|(id, a)| (*id, a))
    }

    /// The orphans: waiting for their VMM to re-attach.
    pub(super) fn orphans(&self) -> impl Iterator<Item = (AllocId, &Allocation)> {
        self.map
            .iter()
            .filter(|(_, a)| a.owner == Owner::Orphaned)
            .map(|(id, a)| (*id, a))
    }

    /// Every parked VM and its allocation.
    pub(super) fn parked_all(
        &self,
    ) -> impl Iterator<Item = (AllocId, &Allocation, &Arc<ParkedVm>)> {
        self.map
            .iter()
            .filter_map(|(id, a)| a.owner.parked().map(|vm| (*id, a, vm)))
    }

    /// The VM tenant `uid` parked under `name`, and its allocation.
    pub(super) fn parked(
        &self,
        uid: u32,
        name: &str,
    ) -> Option<(AllocId, &Allocation, &Arc<ParkedVm>)> {
        self.parked_all()
            .find(|(_, a, vm)| a.tenant == uid && vm.name == name)
    }

    /// Removes allocation `id` if connection `session` owns it (FREE).
    ///
    /// # Errors
    ///
    /// [`OwnershipError`]; nothing changed.
    pub(super) fn remove_owned(
        &mut self,
        id: AllocId,
        session: SessionId,
    ) -> Result<Allocation, OwnershipError> {
        self.owned(id, session)?;
        self.map.remove(&id).ok_or(OwnershipError::Unknown(id))
    }

    /// Removes every allocation connection `session` owns (disconnect).
    pub(super) fn remove_owned_by(&mut self, session: SessionId) -> Vec<(AllocId, Allocation)> {
        let ids: Vec<AllocId> = self.owned_by(session).map(|(id, _)| id).collect();
        self.remove_all(ids)
    }

    /// Removes every orphan (the orphan loop's deadline passed).
    pub(super) fn remove_orphans(&mut self) -> Vec<(AllocId, Allocation)> {
        let ids: Vec<AllocId> = self.orphans().map(|(id, _)| id).collect();
        self.remove_all(ids)
    }

    /// Removes the VM tenant `uid` parked under `name` (UNPARK).
    pub(super) fn remove_parked(&mut self, uid: u32, name: &str) -> Option<(AllocId, Allocation)> {
        let (id, _, _) = self.parked(uid, name)?;
        self.map.remove(&id).map(|a| (id, a))
    }

    fn remove_all(&mut self, ids: Vec<AllocId>) -> Vec<(AllocId, Allocation)> {
        ids.into_iter()
            .filter_map(|id| self.map.remove(&id).map(|a| (id, a)))
            .collect()
    }

    /// Every allocation's snapshot.
    pub(super) fn snapshot(&self) -> Vec<AllocSnapshot> {
        self.map.iter().map(|(id, a)| a.snapshot(*id)).collect()
    }

    /// Enters the allocations a predecessor passed on, each with a new
    /// change gate. Returns the largest id entered (0: none).
    pub(super) fn import(&mut self, allocs: Vec<AllocSnapshot>) -> AllocId {
        let mut max = 0;
        for a in allocs {
            max = max.max(a.id);
            self.map.insert(
                a.id,
                Allocation {
                    owner: a.owner,
                    regions: a.regions,
                    locked: a.locked,
                    tenant: a.tenant,
                    token: a.token,
                    lazy: a.lazy,
                    lazy_fallback: a.lazy_fallback,
                    gate: ChangeGate::default(),
                },
            );
        }
        max
    }
}
