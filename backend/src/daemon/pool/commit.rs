//! The end of an ALLOC, for the ALLOC path (`crate::daemon::connections::session`,
//! `crate::daemon::requests::alloc`): [`Pool::commit`] hands the `Reserved` regions
//! that [`Pool::take`] chose to a session as one allocation (the
//! clean-before-map check), [`Pool::put_back`] returns them when the ALLOC
//! fails after the take.

use std::sync::atomic::Ordering;
use std::time::Instant;

use tracing::warn;

use super::allocation::Allocation;
use super::table::{EntryState, Inner, Pool};
use super::token::{new_token, AllocToken};
use crate::daemon::ids::{AllocId, RegionId, SessionId};

/// How an allocation is committed (see [`Pool::commit`]).
#[derive(Debug, Clone, Copy)]
struct Terms {
    locked: bool,
    lazy: bool,
    token: AllocToken,
}

// Called by the ALLOC path (`crate::daemon::connections::session`, `crate::daemon::requests::alloc`).
/// Why a commit refused the regions an ALLOC took (the invariant: no VM
/// receives a page that is not clean in eager mode).
#[derive(Debug, thiserror::Error)]
pub enum CommitError {
    /// No re-attach token could be made.
    #[error(transparent)]
    Token(#[from] super::token::TokenError),
    /// A region the ALLOC took is no longer in the table.
    #[error("region {0} vanished from the pool")]
    Vanished(RegionId),
    /// A lazy region not reserved by the ALLOC.
    #[error("region {region} cannot be handed out lazily (entry {entry})")]
    NotReserved {
        /// The region.
        region: RegionId,
        /// Its entry's state.
        entry: String,
    },
    /// An eager region with pages not clean.
    #[error("region {region} is not clean ({clean} of {pages} pages clean, entry {entry}); refusing to hand it out")]
    NotClean {
        /// The region.
        region: RegionId,
        /// Its clean pages.
        clean: usize,
        /// Its pages.
        pages: usize,
        /// Its entry's state.
        entry: String,
    },
}

impl Pool {
    /// Hands the `Reserved` regions `ids` of an ALLOC to `session`: records
    /// the allocation and returns its id. On error nothing changed.
    ///
    /// Eager (`lazy` false): checks the invariant (every page `Clean`) and
    /// moves every page to `Mapped`. Lazy: regions whose pages are all
    /// `Clean` are committed as in eager mode; the others (dirty pooled
    /// regions handed out uncleared, with maybe a scrubber batch still in
    /// `Clearing`; fresh unpopulated ones) keep their page states, which the
    /// fault service (`backend::fault`) or the kernel's own zeroing then gate.
    ///
    /// # Errors
    ///
    /// A message naming the first region that is not `Reserved`, or (eager)
    /// whose pages are not all clean.
    pub fn commit(
        &self,
        session: SessionId,
        tenant: u32,
        ids: &[RegionId],
        lazy: bool,
        locked: bool,
    ) -> Result<AllocId, CommitError> {
        // Before the lock: a syscall.
        let token = new_token()?;
        let mut g = self.lock();
        for id in ids {
            let e = g.entries.get(id).ok_or(CommitError::Vanished(*id))?;
            if lazy {
                if e.state != EntryState::Reserved {
                    return Err(CommitError::NotReserved {
                        region: *id,
                        entry: format!("{:?}", e.state),
                    });
                }
                continue;
            }
            let counts = e.region.states().counts();
            if e.state != EntryState::Reserved || counts.clean != e.region.states().len() {
                return Err(CommitError::NotClean {
                    region: *id,
                    clean: counts.clean,
                    pages: e.region.states().len(),
                    entry: format!("{:?}", e.state),
                });
            }
        }
        // Eager: every page is Clean (checked above under the lock every
        // entry transition takes; scrubbers never touch Clean pages).
        Ok(self.record_allocation(
            &mut g,
            session,
            tenant,
            ids,
            Terms {
                locked,
                lazy,
                token,
            },
        ))
    }

    /// The part of [`Pool::commit`] after its checks: regions whose pages are all `Clean` move to `Mapped`
    /// (lazy regions with dirty or unpopulated pages keep their states), every
    /// region becomes `InUse` of a new allocation of `session`.
    fn record_allocation(
        &self,
        g: &mut Inner,
        session: SessionId,
        tenant: u32,
        ids: &[RegionId],
        terms: Terms,
    ) -> AllocId {
        let alloc = self.next_alloc.fetch_add(1, Ordering::Relaxed);
        for id in ids {
            if let Some(e) = g.entries.get_mut(id) {
                let states = e.region.states();
                if states.counts().clean == states.len() {
                    if let Err(err) = e.region.mark_mapped() {
                        warn!(region = id, error = %err, "page changed state while committing");
                    }
                }
                e.state = EntryState::InUse(alloc);
                e.tenant = Some(tenant);
                e.since = Instant::now();
            }
        }
        g.allocs.insert(
            alloc,
            Allocation::committed(
                session,
                ids.to_vec(),
                tenant,
                terms.token,
                terms.lazy,
                terms.locked,
            ),
        );
        alloc
    }

    /// Puts the `Reserved` regions of an ALLOC that failed after
    /// [`Pool::take`] back: `Clean` when every page is, else `Dirty`
    /// (scrubbers are woken).
    pub fn put_back(&self, ids: &[RegionId]) {
        let mut g = self.lock();
        for id in ids {
            if let Some(e) = g.entries.get_mut(id) {
                if e.state == EntryState::Reserved {
                    // Handed to the tenant by the take's caller: the
                    // daemon's again (the tenant never got an fd of it).
                    if let Err(err) =
                        super::files::set_access(&e.region, super::files::Access::Daemon)
                    {
                        tracing::warn!(region = id, error = %err, "a region put back keeps its tenant's owner until its next release");
                    }
                    let all_clean = e.region.states().counts().clean == e.region.states().len();
                    if !all_clean {
                        e.region.mark_all_dirty();
                    }
                    e.state = if all_clean {
                        EntryState::Clean
                    } else {
                        EntryState::Dirty
                    };
                    e.since = Instant::now();
                }
            }
        }
        drop(g);
        self.changed.notify_all();
    }
}
