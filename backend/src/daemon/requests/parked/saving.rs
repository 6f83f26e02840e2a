//! Parked VMs being saved: EXPORT sends a parked VM to a saver and holds
//! it for the saver's connection until that connection UNPARKs it or
//! ends. Meanwhile no other connection restores, exports or drops it, so
//! the VM the saver writes to disk is the VM that stays parked (or is
//! dropped once the save is in place).
//!
//! In memory only, by allocation: a takeover or a restart does not carry a
//! hold (the VM stays parked, free to anyone of its uid; the saver's
//! UNPARK by name still drops it).

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::daemon::ids::{AllocId, SessionId};

/// Every held parked VM: the allocation, and the connection holding it.
#[derive(Debug, Default)]
pub struct Saving {
    held: Mutex<HashMap<AllocId, SessionId>>,
}

impl Saving {
    fn lock(&self) -> MutexGuard<'_, HashMap<AllocId, SessionId>> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Holds `alloc` for `session` (EXPORT sent it).
    pub fn hold(&self, alloc: AllocId, session: SessionId) {
        self.lock().insert(alloc, session);
    }

    /// The connection other than `session` that holds `alloc`, if any: a
    /// RESTORE, EXPORT or UNPARK from `session` is refused then.
    pub fn held_by_other(&self, alloc: AllocId, session: SessionId) -> Option<SessionId> {
        self.lock().get(&alloc).copied().filter(|s| *s != session)
    }

    /// `alloc` is no longer held (dropped, or restored by its holder).
    pub fn release(&self, alloc: AllocId) {
        self.lock().remove(&alloc);
    }

    /// Every hold of `session` ends (the connection ended).
    pub fn release_session(&self, session: SessionId) {
        self.lock().retain(|_, s| *s != session);
    }
}
