//! The ALLOC path's moves of pooled entries, for the sources of
//! `supply.rs` (which [`crate::daemon::pool::Pool::take`], in `take.rs`,
//! chooses between): a region enters `Reserved` for the ALLOC (a fresh
//! one, a clean or dirty pooled one of the exact size, a smaller clean one
//! detached and grown), or goes back where it was when its source fails
//! (`restore`), or back to quarantine when a last holder check finds it
//! held. Nothing here is called from outside the pool.

use std::sync::Arc;
use std::time::Instant;

use guest_mem::Region;
use tracing::warn;

use super::table::{Entry, EntryState, Pool};
use crate::daemon::counters::metrics::Metrics;
use crate::daemon::ids::{PoolKey, RegionId};
use crate::daemon::peers::holders::{Holder, Owned};

/// A region an ALLOC holds in `Reserved` (see [`Pool::take`]).
#[derive(Debug, Clone)]
pub struct Taken {
    /// Its id.
    pub id: RegionId,
    /// The region.
    pub region: Arc<Region>,
}

/// A clean pooled region taken out of the table to be grown (see
/// [`Pool::detach_smaller_clean`]).
#[derive(Debug)]
pub(super) struct Detached {
    /// Its id (kept: the region stays the same region).
    pub(super) id: RegionId,
    /// The region, owned: nothing else references it.
    pub(super) region: Region,
    pub(super) key: PoolKey,
    pub(super) since: Instant,
    pub(super) old_len: u64,
}

// For the sources of `supply.rs`; private to the pool.
impl Pool {
    /// Inserts a freshly created, prepared region as `Reserved`.
    ///
    /// # Errors
    ///
    /// `fstat` of the region's fd.
    pub(super) fn insert_fresh(&self, id: RegionId, region: Region) -> std::io::Result<Taken> {
        let owned = Owned::region(
            region.fd(),
            region.as_ptr() as usize,
            usize::try_from(region.len()).unwrap_or(usize::MAX),
        )?;
        let node = region.node().unwrap_or(0);
        let key = PoolKey {
            node,
            page_size: region.page_size(),
            paths: region.path().is_some(),
        };
        let region = Arc::new(region);
        Metrics::add(&self.metrics.bytes_created, region.len());
        let mut g = self.lock();
        g.entries.insert(
            id,
            Entry::new(
                Arc::clone(&region),
                key,
                owned,
                EntryState::Reserved,
                Instant::now(),
            ),
        );
        Ok(Taken { id, region })
    }

    /// True when a `Clean` region of `key` and exactly `size` bytes is pooled.
    pub(super) fn has_clean(&self, key: PoolKey, size: u64) -> bool {
        self.lock()
            .entries
            .values()
            .any(|e| e.key == key && e.state == EntryState::Clean && e.region.len() == size)
    }

    /// Takes a `Clean` region of `key` and exactly `size` bytes.
    pub(super) fn take_clean(&self, key: PoolKey, size: u64) -> Option<Taken> {
        self.take_state(key, size, EntryState::Clean)
    }

    /// Takes the largest `Clean` region of `key` smaller than `size` out of
    /// the table, to grow it ([`Region::grow`] needs the region itself, not a
    /// shared `Arc`). `None` when there is none, or when something else still
    /// holds a reference to the largest one (it then stays pooled as it was).
    /// The caller gives it back with [`Pool::insert_grown`] or
    /// [`Pool::restore`]; meanwhile it counts in no pool statistic.
    pub(super) fn detach_smaller_clean(&self, key: PoolKey, size: u64) -> Option<Detached> {
        let mut g = self.lock();
        let id = g
            .entries
            .iter()
            .filter(|(_, e)| e.key == key && e.state == EntryState::Clean && e.region.len() < size)
            .max_by_key(|(_, e)| (e.region.len(), e.since))
            .map(|(id, _)| *id)?;
        let mut e = g.entries.remove(&id)?;
        match Arc::try_unwrap(e.region) {
            Ok(region) => Some(Detached {
                id,
                old_len: region.len(),
                region,
                key: e.key,
                since: e.since,
            }),
            Err(region) => {
                e.region = region;
                g.entries.insert(id, e);
                None
            }
        }
    }

    /// Puts a detached region back as `Reserved` for the ALLOC that grew it.
    ///
    /// # Errors
    ///
    /// `fstat` of the region's fd; the region then goes back to the kernel.
    pub(super) fn insert_grown(&self, d: Detached) -> std::io::Result<Taken> {
        self.reinsert(d, EntryState::Reserved)
    }

    /// Puts a detached region back into the pool: `Clean` when every page is
    /// (a grow that failed leaves the region as it was), else every page is
    /// marked `Dirty` and the scrubbers take it (new pages a failed prepare
    /// left half done). If even that fails (`fstat`), the region goes back
    /// to the kernel.
    pub(super) fn restore(&self, d: Detached) {
        let all_clean = d.region.states().counts().clean == d.region.states().len();
        if !all_clean {
            d.region.mark_all_dirty();
        }
        let state = if all_clean {
            EntryState::Clean
        } else {
            EntryState::Dirty
        };
        if let Err(e) = self.reinsert(d, state) {
            warn!(error = %e, "cannot put a pooled region back; it goes back to the kernel");
        }
        self.changed.notify_all();
    }

    pub(super) fn reinsert(&self, d: Detached, state: EntryState) -> std::io::Result<Taken> {
        let Detached {
            id,
            region,
            key,
            since,
            old_len,
        } = d;
        // Bytes the region grew by came from the kernel.
        Metrics::add(
            &self.metrics.bytes_created,
            region.len().saturating_sub(old_len),
        );
        let owned = match Owned::region(
            region.fd(),
            region.as_ptr() as usize,
            usize::try_from(region.len()).unwrap_or(usize::MAX),
        ) {
            Ok(owned) => owned,
            Err(e) => {
                Metrics::add(&self.metrics.bytes_released, region.len());
                // Dropped here, outside the lock: unmapped and closed.
                drop(region);
                return Err(e);
            }
        };
        let region = Arc::new(region);
        let mut g = self.lock();
        g.entries.insert(
            id,
            Entry::new(
                Arc::clone(&region),
                key,
                owned,
                state,
                if state == EntryState::Reserved {
                    Instant::now()
                } else {
                    since
                },
            ),
        );
        Ok(Taken { id, region })
    }

    /// Takes a `Dirty` region of `key` and exactly `size` bytes, to clear it on
    /// the ALLOC path; scrubbers finish the pages they already started.
    pub(super) fn take_dirty(&self, key: PoolKey, size: u64) -> Option<Taken> {
        self.take_state(key, size, EntryState::Dirty)
    }

    pub(super) fn take_state(&self, key: PoolKey, size: u64, state: EntryState) -> Option<Taken> {
        let mut g = self.lock();
        // The region with the fewest holes left first (a detached one has
        // holes until the scrubbers have faulted them in, each a page the
        // kernel zeroes at the guest's touch otherwise); then the most
        // recently cleaned: its pages are the likeliest to be warm in the
        // host's page tables.
        let (id, e) = g
            .entries
            .iter_mut()
            .filter(|(_, e)| e.key == key && e.state == state && e.region.len() == size)
            .max_by_key(|(_, e)| {
                let holes = e.fill.as_ref().map_or(0, |f| f.holes(e.region.len()));
                (std::cmp::Reverse(holes), e.since)
            })?;
        e.state = EntryState::Reserved;
        e.since = Instant::now();
        Some(Taken {
            id: *id,
            region: Arc::clone(&e.region),
        })
    }

    /// The daemon's own fd and mapping of a region, for a holder scan.
    pub(super) fn owned(&self, id: RegionId) -> Option<Owned> {
        self.lock().entries.get(&id).map(|e| e.owned.clone())
    }

    /// Puts a `Reserved` region back into quarantine (a holder turned up
    /// right before reuse).
    pub(super) fn requarantine(&self, id: RegionId, holder: Holder) {
        let mut g = self.lock();
        if let Some(e) = g.entries.get_mut(&id) {
            warn!(region = id, pid = holder.pid, hold = ?holder.hold, "a pooled region is held by another process; back to quarantine");
            e.state = EntryState::Quarantined;
            e.holder = Some(holder);
            e.since = Instant::now();
        }
    }
}
