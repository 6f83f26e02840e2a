//! Who may hold an allocation across a daemon restart: tenant uids,
//! re-attach tokens, orphaned allocations (issue 20).
//!
//! Every allocation gets a random 16-byte token when it is committed; a
//! client that negotiated `FEATURE_REATTACH` receives it in the ALLOC reply.
//! After a restart the restore code puts allocations back **orphaned**
//! (`session: None`): they belong to no connection until their VMM shows
//! the token on a new one ([`Pool::reattach`]).
//!
//! Every refusal of [`Pool::reattach`] is the same [`OwnershipError`] text
//! as an unknown id, so a tenant cannot learn whether another tenant's id
//! exists, is live, or what its token is; the session rate-limits refusals.

use std::sync::Arc;

use guest_mem::Region;

use super::{AllocId, OwnershipError, Pool, RegionId, SessionId};

/// Length of a re-attach token.
pub const TOKEN_SIZE: usize = hugemem_client::proto::TOKEN_SIZE;

/// A re-attach token.
pub type AllocToken = [u8; TOKEN_SIZE];

/// A fresh random token (the kernel's CSPRNG, `getrandom(2)`).
///
/// # Errors
///
/// The getrandom error, as text (the ALLOC then fails with INTERNAL).
pub(super) fn new_token() -> Result<AllocToken, String> {
    let mut t = [0u8; TOKEN_SIZE];
    getrandom::fill(&mut t).map_err(|e| format!("cannot make a re-attach token: {e}"))?;
    Ok(t)
}

/// `a == b` in time independent of where they differ (a token is a
/// secret: an early exit would tell a guesser how many bytes it has right).
fn same_token(a: &AllocToken, b: &AllocToken) -> bool {
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    // black_box: keep the compiler from turning the fold into an early exit.
    std::hint::black_box(diff) == 0
}

/// What [`Pool::reattach`] hands back: the allocation's regions in order
/// and whether it is locked.
pub type Reattached = (Vec<(RegionId, Arc<Region>)>, bool);

impl Pool {
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
        let mut g = self.lock();
        let refused = OwnershipError::Unknown(alloc);
        let a = g.allocs.get_mut(&alloc).ok_or(refused)?;
        // The token is compared whatever else fails, so a refusal takes
        // the same time for an existing id as for a live or foreign one.
        let token_ok = same_token(&a.token, token);
        if a.session.is_some() || a.tenant != uid || !token_ok {
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

    /// Orphans `alloc`: it belongs to no session until [`Pool::reattach`].
    /// Its fault service, if it had one, is gone with its connection, so a
    /// lazy allocation is marked served by the VMM's fallback
    /// ([`Pool::lazy_fallback`]). Returns false for an unknown id.
    ///
    /// The restore code orphans what it restores; tests orphan a live
    /// allocation to stand for a restart.
    pub fn orphan(&self, alloc: AllocId) -> bool {
        match self.lock().allocs.get_mut(&alloc) {
            Some(a) => {
                a.session = None;
                a.lazy_fallback |= a.lazy;
                true
            }
            None => false,
        }
    }

    /// Sets the tenant uid of `alloc` (the restore code's saved value).
    /// Returns false for an unknown id.
    pub fn set_tenant(&self, alloc: AllocId, uid: u32) -> bool {
        match self.lock().allocs.get_mut(&alloc) {
            Some(a) => {
                a.tenant = uid;
                true
            }
            None => false,
        }
    }

    /// Marks `alloc`'s lazy regions as served by the VMM's fallback (the
    /// restore code, which does not resume fault services). Returns false
    /// for an unknown id.
    pub fn set_lazy_fallback(&self, alloc: AllocId, on: bool) -> bool {
        match self.lock().allocs.get_mut(&alloc) {
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
        self.lock()
            .allocs
            .get(&alloc)
            .is_some_and(|a| a.lazy_fallback)
    }

    /// The token of `alloc` (for the restore code's saved state).
    pub fn token_of(&self, alloc: AllocId) -> Option<AllocToken> {
        self.lock().allocs.get(&alloc).map(|a| a.token)
    }

    /// Every allocation's id, token and tenant uid, by id: what the restore
    /// code saves so that a restarted daemon can honour the tokens.
    pub fn allocation_tokens(&self) -> Vec<(AllocId, AllocToken, u32)> {
        let g = self.lock();
        let mut out: Vec<_> = g
            .allocs
            .iter()
            .map(|(id, a)| (*id, a.token, a.tenant))
            .collect();
        out.sort_unstable_by_key(|(id, _, _)| *id);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_compare_whole_and_are_random() {
        let a = [7u8; TOKEN_SIZE];
        let mut b = a;
        assert!(same_token(&a, &b));
        for i in 0..TOKEN_SIZE {
            b = a;
            b[i] ^= 0x80;
            assert!(!same_token(&a, &b), "byte {i}");
        }
        let (x, y) = (new_token().expect("token"), new_token().expect("token"));
        assert_ne!(x, y, "two tokens from the CSPRNG");
    }
}
