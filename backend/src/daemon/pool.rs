//! The recycled, pre-zeroed pool: every region the daemon owns, in which
//! state, and who it belongs to.
//!
//! # Design
//!
//! A region lives in exactly one entry state for its whole life in the daemon:
//!
//! ```text
//!  fresh ─► Reserved ─► InUse ─FREE/disconnect─► Quarantined ─no holder─► Dirty ─scrubbed─► Clean
//!              ▲  │                                   │ (over limit:                │             │
//!              │  └── failed ALLOC ───────► Clean/Dirty  back to kernel)            │             │
//!              └──────── ALLOC takes an exact-size (or a smaller, grown) region ◄───┴─────────────┘
//! ```
//!
//! * **Reserved**: an ALLOC in progress owns it (a pooled region about to be
//!   handed out, a dirty one being cleared on the ALLOC path, a fresh one being
//!   committed). Scrubbers do not start pages of it.
//! * **Quarantined**: released by its client but maybe still mapped by it or
//!   by anyone it passed the fd to. It leaves quarantine only after a
//!   [`super::holders`] scan found no process but the daemon holding it —
//!   this gate is what makes "never scrub memory a live guest maps" true, and
//!   since the daemon never hands out a fd of a region it does not own in
//!   `InUse`, no process can gain access afterwards.
//! * **Dirty** → **Clean**: scrubbers ([`super::scrub`]) claim pages through
//!   the region's [`guest_mem::PageStates`]; the entry turns Clean when every
//!   page is.
//!
//! The invariant "no VM receives a page that is not clean in eager mode" is
//! enforced at the last step before a reply: [`Pool::commit`] refuses a region
//! whose pages are not all `Clean` and moves them `Clean → Mapped`, the only
//! way into `Mapped` the page-state table allows.
//!
//! One `Mutex` guards the table. Critical sections are map lookups and a pass
//! over a few thousand atomics at most; no syscall and no clearing runs under
//! it. Scrubbers wait on a `Condvar` of the same mutex, which also wakes
//! ALLOC-path waiters when a scrubber finishes a page they need.
//!
//! **Sizes.** Memfds are sealed against shrinking (`F_SEAL_SHRINK`, see
//! `guest_mem::region`) but not against growing, so an ALLOC takes, in this
//! order (see [`super::alloc`]): a clean region of exactly the size; else the
//! largest clean region of the same node, page size and backing that is
//! *smaller*, grown in place to the size ([`Pool::detach_smaller_clean`],
//! `Region::grow`; only its new pages are populated); else a fresh one. A
//! pooled region *larger* than the request is never used: it cannot be
//! truncated (the seal protects the daemon's own mapping from a VMM), and
//! handing out a larger file would give the VMM more memory than it asked
//! for. Such regions wait for a request of their size, and the per-node
//! target and limit below give unneeded ones back to the kernel. When the
//! kernel is short of pages, idle pooled regions of the same node and page
//! size are given back first (only when that can cover the shortfall) and
//! the creation is retried once.
//!
//! **Damaged files.** A tenant can change its file behind the daemon's
//! back: grow a memfd (the seals allow it), truncate a hugetlbfs file, punch
//! holes. Before a released region leaves quarantine, [`super::reuse`] checks
//! that no reference it cannot see exists (a write lease; refused, the region
//! stays quarantined as *withheld* and is re-checked), its size, and
//! populates every page (`MADV_POPULATE_WRITE`, which errors where a store
//! would `SIGBUS`); scrubbers populate each batch the same way. A region
//! that fails a check of the file is discarded ([`Pool::discard`]): given
//! back to the kernel, never scrubbed, never served. A region whose pages
//! were detached (punched and refaulted) is clean at once.
//!
//! **Limits.** Per node, pooled bytes (clean + dirty + quarantined) never
//! exceed the limit: a released region that would is given back to the
//! kernel at once (no scrub needed: closing our fd and unmapping is enough,
//! the kernel zeroes pages before their next user). Above the target, clean
//! regions idle for `trim_after_secs` are given back, oldest first.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use guest_mem::{PageSize, PageState, Region};
use numa::NodeId;
use serde_json::{json, Value};
use tracing::{info, warn};

use super::config::PoolConfig;
use super::holders::{Holder, Owned};
use super::metrics::Metrics;
use super::reuse::Verdict;

/// A region's id (in ALLOC replies, for REBALANCE).
pub type RegionId = u64;
/// An allocation's id.
pub type AllocId = u64;
/// A connection's id.
pub type SessionId = u64;

/// What regions are pooled by: node and page size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolKey {
    /// NUMA node the region is bound to.
    pub node: NodeId,
    /// Page size.
    pub page_size: PageSize,
    /// A hugetlbfs file with a path (ALLOC with paths) rather than a memfd.
    pub paths: bool,
}

/// Where a region is in its life (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryState {
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
    fn name(self) -> &'static str {
        match self {
            EntryState::Reserved | EntryState::InUse(_) => "in_use",
            EntryState::Quarantined => "quarantined",
            EntryState::Dirty => "dirty",
            EntryState::Clean => "clean",
        }
    }
}

#[derive(Debug)]
struct Entry {
    region: Arc<Region>,
    key: PoolKey,
    owned: Owned,
    state: EntryState,
    since: Instant,
    holder: Option<Holder>,
    /// Quarantined, no process holds it, but a reference no process shows
    /// exists (see [`super::reuse`]): why, and when it was first seen.
    withheld: Option<(String, Instant)>,
    /// The uid of the last client that held it (for a withheld region).
    tenant: Option<u32>,
    warned: bool,
    /// Pages may be on several nodes (a move is running, or a range was
    /// moved): released, such a region goes back to the kernel, never into
    /// a per-node pool (see `super::rebalance`).
    split: bool,
}

#[derive(Debug)]
struct Allocation {
    session: SessionId,
    regions: Vec<RegionId>,
    locked: bool,
}

#[derive(Debug, Default)]
struct Inner {
    entries: BTreeMap<RegionId, Entry>,
    allocs: HashMap<AllocId, Allocation>,
    above_target_since: HashMap<NodeId, Instant>,
    stopping: bool,
}

/// A region an ALLOC holds in `Reserved`.
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
pub struct Detached {
    /// Its id (kept: the region stays the same region).
    pub id: RegionId,
    /// The region, owned: nothing else references it.
    pub region: Region,
    key: PoolKey,
    since: Instant,
    old_len: u64,
}

/// Pages a scrubber claimed: `count` pages of region `id` from `first`, all
/// in `Clearing`.
#[derive(Debug)]
pub struct ScrubWork {
    /// Region id.
    pub id: RegionId,
    /// The region (kept alive while the scrubber works).
    pub region: Arc<Region>,
    /// First page.
    pub first: usize,
    /// Number of contiguous pages.
    pub count: usize,
    /// The pages were detached (`Unpopulated`, holes in the file): faulting
    /// them in gives fresh pages the kernel zeroes; no clear on top.
    pub populate_only: bool,
}

/// An allocation being given back: its regions and whether they were locked.
#[derive(Debug)]
pub struct Released {
    /// Regions now in quarantine (to unlock, if `locked`).
    pub quarantined: Vec<Arc<Region>>,
    /// Regions given back to the kernel (to drop off the executor).
    pub dropped: Vec<Arc<Region>>,
    /// The allocation was locked.
    pub locked: bool,
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

/// The pool (see the module docs).
#[derive(Debug)]
pub struct Pool {
    inner: Mutex<Inner>,
    changed: Condvar,
    cfg: PoolConfig,
    next_region: AtomicU64,
    next_alloc: AtomicU64,
    metrics: Arc<Metrics>,
}

impl Pool {
    /// An empty pool.
    pub fn new(cfg: PoolConfig, metrics: Arc<Metrics>) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            changed: Condvar::new(),
            cfg,
            next_region: AtomicU64::new(1),
            next_alloc: AtomicU64::new(1),
            metrics,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves a table that is still
        // consistent entry by entry (every change is one assignment), so keep
        // serving rather than poisoning the whole daemon.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A fresh region id (for naming a region before it is inserted).
    pub fn next_region_id(&self) -> RegionId {
        self.next_region.fetch_add(1, Ordering::Relaxed)
    }

    /// The configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.cfg
    }

    /// Inserts a freshly created, prepared region as `Reserved`.
    ///
    /// # Errors
    ///
    /// `fstat` of the region's fd.
    pub fn insert_fresh(&self, id: RegionId, region: Region) -> std::io::Result<Taken> {
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
            Entry {
                region: Arc::clone(&region),
                key,
                owned,
                state: EntryState::Reserved,
                since: Instant::now(),
                holder: None,
                withheld: None,
                tenant: None,
                warned: false,
                split: false,
            },
        );
        Ok(Taken { id, region })
    }

    /// True when a `Clean` region of `key` and exactly `size` bytes is pooled.
    pub fn has_clean(&self, key: PoolKey, size: u64) -> bool {
        self.lock()
            .entries
            .values()
            .any(|e| e.key == key && e.state == EntryState::Clean && e.region.len() == size)
    }

    /// Takes a `Clean` region of `key` and exactly `size` bytes.
    pub fn take_clean(&self, key: PoolKey, size: u64) -> Option<Taken> {
        self.take(key, size, EntryState::Clean)
    }

    /// Takes the largest `Clean` region of `key` smaller than `size` out of
    /// the table, to grow it ([`Region::grow`] needs the region itself, not a
    /// shared `Arc`). `None` when there is none, or when something else still
    /// holds a reference to the largest one (it then stays pooled as it was).
    /// The caller gives it back with [`Pool::insert_grown`] or
    /// [`Pool::restore`]; meanwhile it counts in no pool statistic.
    pub fn detach_smaller_clean(&self, key: PoolKey, size: u64) -> Option<Detached> {
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
    pub fn insert_grown(&self, d: Detached) -> std::io::Result<Taken> {
        self.reinsert(d, EntryState::Reserved)
    }

    /// Puts a detached region back into the pool: `Clean` when every page is
    /// (a grow that failed leaves the region as it was), else every page is
    /// marked `Dirty` and the scrubbers take it (new pages a failed prepare
    /// left half done). If even that fails (`fstat`), the region goes back
    /// to the kernel.
    pub fn restore(&self, d: Detached) {
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

    fn reinsert(&self, d: Detached, state: EntryState) -> std::io::Result<Taken> {
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
            Entry {
                region: Arc::clone(&region),
                key,
                owned,
                state,
                since: if state == EntryState::Reserved {
                    Instant::now()
                } else {
                    since
                },
                holder: None,
                withheld: None,
                tenant: None,
                warned: false,
                split: false,
            },
        );
        Ok(Taken { id, region })
    }

    /// Takes a `Dirty` region of `key` and exactly `size` bytes, to clear it on
    /// the ALLOC path; scrubbers finish the pages they already started.
    pub fn take_dirty(&self, key: PoolKey, size: u64) -> Option<Taken> {
        self.take(key, size, EntryState::Dirty)
    }

    fn take(&self, key: PoolKey, size: u64, state: EntryState) -> Option<Taken> {
        let mut g = self.lock();
        // The most recently cleaned region first: its pages are the likeliest
        // to be warm in the host's page tables.
        let (id, e) = g
            .entries
            .iter_mut()
            .filter(|(_, e)| e.key == key && e.state == state && e.region.len() == size)
            .max_by_key(|(_, e)| e.since)?;
        e.state = EntryState::Reserved;
        e.since = Instant::now();
        Some(Taken {
            id: *id,
            region: Arc::clone(&e.region),
        })
    }

    /// The daemon's own fd and mapping of a region, for a holder scan.
    pub fn owned(&self, id: RegionId) -> Option<Owned> {
        self.lock().entries.get(&id).map(|e| e.owned.clone())
    }

    /// Gives `Reserved` regions back after a failed ALLOC: `Clean` when every
    /// page is, else `Dirty` (scrubbers are woken).
    pub fn unreserve(&self, ids: &[RegionId]) {
        let mut g = self.lock();
        for id in ids {
            if let Some(e) = g.entries.get_mut(id) {
                if e.state == EntryState::Reserved {
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

    /// Puts a `Reserved` region back into quarantine (a holder turned up
    /// right before reuse).
    pub fn requarantine(&self, id: RegionId, holder: Holder) {
        let mut g = self.lock();
        if let Some(e) = g.entries.get_mut(&id) {
            warn!(region = id, pid = holder.pid, hold = ?holder.hold, "a pooled region is held by another process; back to quarantine");
            e.state = EntryState::Quarantined;
            e.holder = Some(holder);
            e.since = Instant::now();
        }
    }

    /// Checks the invariant (every page `Clean`), moves every page to
    /// `Mapped`, and records the allocation. On error nothing changed.
    ///
    /// # Errors
    ///
    /// A message naming the first region with pages that are not clean.
    pub fn commit(
        &self,
        session: SessionId,
        tenant: u32,
        ids: &[RegionId],
        locked: bool,
    ) -> Result<AllocId, String> {
        let mut g = self.lock();
        for id in ids {
            let e = g
                .entries
                .get(id)
                .ok_or_else(|| format!("region {id} vanished from the pool"))?;
            let counts = e.region.states().counts();
            if e.state != EntryState::Reserved || counts.clean != e.region.states().len() {
                return Err(format!(
                    "region {id} is not clean ({} of {} pages clean, entry {:?}); refusing to hand it out",
                    counts.clean,
                    e.region.states().len(),
                    e.state
                ));
            }
        }
        let alloc = self.next_alloc.fetch_add(1, Ordering::Relaxed);
        for id in ids {
            if let Some(e) = g.entries.get_mut(id) {
                // All pages are Clean and we hold the lock that every entry
                // transition takes; scrubbers never touch Clean pages.
                if let Err(err) = e.region.mark_mapped() {
                    warn!(region = id, error = %err, "page changed state while committing");
                }
                e.state = EntryState::InUse(alloc);
                e.tenant = Some(tenant);
                e.since = Instant::now();
            }
        }
        g.allocs.insert(
            alloc,
            Allocation {
                session,
                regions: ids.to_vec(),
                locked,
            },
        );
        Ok(alloc)
    }

    /// [`Pool::commit`] for an ALLOC that asked for lazy mode: regions whose
    /// pages are all `Clean` are committed as in eager mode (moved to
    /// `Mapped`); the others (dirty pooled regions handed out uncleared, with
    /// maybe a scrubber batch still in `Clearing`; fresh unpopulated ones)
    /// keep their page states, which the fault service (`backend::fault`) or
    /// the kernel's own zeroing then gate. On error nothing changed.
    ///
    /// # Errors
    ///
    /// A message naming the first region that is not `Reserved`.
    pub fn commit_lazy(
        &self,
        session: SessionId,
        tenant: u32,
        ids: &[RegionId],
        locked: bool,
    ) -> Result<AllocId, String> {
        let mut g = self.lock();
        for id in ids {
            let e = g
                .entries
                .get(id)
                .ok_or_else(|| format!("region {id} vanished from the pool"))?;
            if e.state != EntryState::Reserved {
                return Err(format!(
                    "region {id} cannot be handed out lazily (entry {:?})",
                    e.state
                ));
            }
        }
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
            Allocation {
                session,
                regions: ids.to_vec(),
                locked,
            },
        );
        Ok(alloc)
    }

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
        let g = self.lock();
        let a = g.allocs.get(&alloc).ok_or(OwnershipError::Unknown(alloc))?;
        if a.session != session {
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

    /// Records whether `alloc` is locked.
    pub fn set_locked(&self, alloc: AllocId, locked: bool) {
        if let Some(a) = self.lock().allocs.get_mut(&alloc) {
            a.locked = locked;
        }
    }

    /// Releases `alloc` (FREE): its regions go to quarantine, or back to the
    /// kernel when the node's pool is at its limit.
    ///
    /// # Errors
    ///
    /// [`OwnershipError`]; nothing changes then.
    pub fn release(&self, alloc: AllocId, session: SessionId) -> Result<Released, OwnershipError> {
        let mut g = self.lock();
        let a = g.allocs.get(&alloc).ok_or(OwnershipError::Unknown(alloc))?;
        if a.session != session {
            return Err(OwnershipError::NotYours(alloc));
        }
        let a = g
            .allocs
            .remove(&alloc)
            .ok_or(OwnershipError::Unknown(alloc))?;
        Ok(self.release_locked(&mut g, alloc, a))
    }

    /// Releases every allocation of a session (disconnect, shutdown).
    pub fn release_session(&self, session: SessionId) -> Vec<Released> {
        let mut g = self.lock();
        let ids: Vec<AllocId> = g
            .allocs
            .iter()
            .filter(|(_, a)| a.session == session)
            .map(|(id, _)| *id)
            .collect();
        ids.into_iter()
            .filter_map(|id| {
                g.allocs
                    .remove(&id)
                    .map(|a| self.release_locked(&mut g, id, a))
            })
            .collect()
    }

    fn release_locked(&self, g: &mut Inner, alloc: AllocId, a: Allocation) -> Released {
        let mut out = Released {
            quarantined: Vec::new(),
            dropped: Vec::new(),
            locked: a.locked,
        };
        for id in &a.regions {
            let Some(e) = g.entries.get(id) else { continue };
            let node = e.key.node;
            let len = e.region.len();
            let region = Arc::clone(&e.region);
            let (_, limit) = self.cfg.limits(node);
            let pooled = pooled_bytes(g, node);
            if e.split {
                if let Some(e) = g.entries.remove(id) {
                    info!(
                        region = id,
                        alloc,
                        bytes = len,
                        "region has pages on several nodes (moving, or moved in part); it goes back to the kernel"
                    );
                    Metrics::add(&self.metrics.bytes_released, len);
                    out.dropped.push(e.region);
                }
                continue;
            }
            if pooled + len > limit {
                if let Some(e) = g.entries.remove(id) {
                    info!(
                        region = id,
                        alloc,
                        node,
                        bytes = len,
                        limit,
                        "pool at its limit; region goes back to the kernel"
                    );
                    Metrics::add(&self.metrics.bytes_released, len);
                    out.dropped.push(e.region);
                }
                continue;
            }
            // A path-backed file was handed to the client's uid so it could
            // open it; take it back before quarantine starts, so the client
            // cannot open the file again once the scan has cleared it.
            if let Err(err) = reclaim_path(&region) {
                if let Some(e) = g.entries.remove(id) {
                    warn!(region = id, error = %err, "cannot take a hugetlbfs file back; region goes back to the kernel");
                    Metrics::add(&self.metrics.bytes_released, len);
                    out.dropped.push(e.region);
                }
                continue;
            }
            if let Some(e) = g.entries.get_mut(id) {
                e.state = EntryState::Quarantined;
                e.since = Instant::now();
                e.holder = None;
                e.withheld = None;
                e.warned = false;
                out.quarantined.push(Arc::clone(&e.region));
            }
        }
        info!(
            alloc,
            session = a.session,
            regions = a.regions.len(),
            "allocation released into quarantine"
        );
        out
    }

    /// The quarantined regions, for a holder scan and [`super::reuse::judge`].
    pub fn quarantined(&self) -> Vec<(RegionId, Owned, Arc<Region>)> {
        self.lock()
            .entries
            .iter()
            .filter(|(_, e)| e.state == EntryState::Quarantined)
            .map(|(id, e)| (*id, e.owned.clone(), Arc::clone(&e.region)))
            .collect()
    }

    /// Takes a region that a tenant damaged ([`super::reuse::check_released`] failed, or a
    /// scrub batch could not be populated) out of the pool if it is still in
    /// `state`, counts it as given back to the kernel, and returns it to be
    /// dropped off the lock (unmapped, closed, unlinked: its pages go back
    /// to the kernel, which zeroes them before their next user). It is never
    /// scrubbed or served again.
    pub fn discard(&self, id: RegionId, state: EntryState, reason: &str) -> Option<Arc<Region>> {
        let mut g = self.lock();
        if g.entries.get(&id).map(|e| e.state) != Some(state) {
            return None;
        }
        let e = g.entries.remove(&id)?;
        drop(g);
        Metrics::add(&self.metrics.bytes_released, e.region.len());
        Metrics::add(&self.metrics.regions_discarded, 1);
        warn!(
            region = id,
            node = e.key.node,
            bytes = e.region.len(),
            reason,
            "a released region was damaged by its tenant; it goes back to the kernel unscrubbed"
        );
        self.changed.notify_all();
        Some(e.region)
    }

    /// Applies the quarantine checks ([`super::reuse::judge`]): a region
    /// proved free becomes `Dirty` (scrubbers woken: they clear its dirty
    /// pages, or fault in fresh ones where its pages were detached); a held
    /// or withheld one stays, with the reason noted; a broken one is
    /// discarded. Returns how many left quarantine, and the discarded
    /// regions, to drop off the lock.
    pub fn apply_scan(&self, results: Vec<(RegionId, Verdict)>) -> (usize, Vec<Arc<Region>>) {
        Metrics::add(&self.metrics.quarantine_scans, 1);
        let mut left = 0;
        let mut dropped = Vec::new();
        let mut g = self.lock();
        for (id, verdict) in results {
            let Some(e) = g.entries.get_mut(&id) else {
                continue;
            };
            if e.state != EntryState::Quarantined {
                continue;
            }
            match verdict {
                Verdict::Free { detached } => {
                    if detached == 0 {
                        e.region.mark_all_dirty();
                    }
                    Metrics::add(&self.metrics.pages_detached, detached);
                    e.state = EntryState::Dirty;
                    e.holder = None;
                    e.withheld = None;
                    e.since = Instant::now();
                    left += 1;
                    info!(
                        region = id,
                        node = e.key.node,
                        bytes = e.region.len(),
                        detached,
                        "region left quarantine; scrubbing"
                    );
                }
                Verdict::Held(h) => {
                    if !e.warned && e.since.elapsed() > Duration::from_secs(60) {
                        e.warned = true;
                        warn!(region = id, pid = h.pid, hold = ?h.hold, "a released region is still held after 60 s");
                    }
                    e.holder = Some(h);
                }
                Verdict::Withheld(reason) => {
                    e.holder = None;
                    if e.withheld.is_none() {
                        Metrics::add(&self.metrics.regions_withheld, 1);
                        warn!(
                            region = id,
                            uid = ?e.tenant,
                            bytes = e.region.len(),
                            reason,
                            "a released region is withheld: a reference no process shows exists; re-checking"
                        );
                        e.withheld = Some((reason, Instant::now()));
                    }
                }
                Verdict::Broken(reason) => {
                    if let Some(e) = g.entries.remove(&id) {
                        Metrics::add(&self.metrics.bytes_released, e.region.len());
                        Metrics::add(&self.metrics.regions_discarded, 1);
                        warn!(
                            region = id,
                            node = e.key.node,
                            bytes = e.region.len(),
                            reason,
                            "a released region was damaged by its tenant; it goes back to the kernel unscrubbed"
                        );
                        dropped.push(e.region);
                    }
                }
            }
        }
        drop(g);
        if left > 0 || !dropped.is_empty() {
            self.changed.notify_all();
        }
        (left, dropped)
    }

    /// Blocks until a dirty page of a region on `node` can be claimed, or the
    /// pool stops (`None`). Claims up to `max_bytes` of contiguous dirty pages.
    pub fn next_scrub(&self, node: NodeId, max_bytes: u64, hint: usize) -> Option<ScrubWork> {
        let mut g = self.lock();
        loop {
            if g.stopping {
                return None;
            }
            let mut finished = Vec::new();
            let mut found = None;
            for (id, e) in &g.entries {
                if e.key.node != node || e.state != EntryState::Dirty {
                    continue;
                }
                let states = e.region.states();
                let Some((first, was)) = states.claim_pending(hint % states.len().max(1)) else {
                    if states.counts().clean == states.len() {
                        finished.push(*id);
                    }
                    continue;
                };
                let unit = e.region.state_unit();
                let mut count = 1;
                while (count as u64 + 1) * unit <= max_bytes
                    && first + count < states.len()
                    && states
                        .try_transition(first + count, was, PageState::Clearing)
                        .is_ok()
                {
                    count += 1;
                }
                found = Some(ScrubWork {
                    id: *id,
                    region: Arc::clone(&e.region),
                    first,
                    count,
                    populate_only: was == PageState::Unpopulated,
                });
                break;
            }
            for id in finished {
                if let Some(e) = g.entries.get_mut(&id) {
                    e.state = EntryState::Clean;
                    e.since = Instant::now();
                }
            }
            if found.is_some() {
                return found;
            }
            // The timeout is a safety net only; every change that creates
            // work notifies.
            g = self
                .changed
                .wait_timeout(g, Duration::from_secs(1))
                .map_or_else(|e| e.into_inner().0, |(g, _)| g);
        }
    }

    /// A scrubber finished (or gave up on) its pages.
    pub fn scrub_done(&self, work: &ScrubWork, cleared: bool) {
        let states = work.region.states();
        let to = match (cleared, work.populate_only) {
            (true, _) => PageState::Clean,
            // Still a hole (or a fresh zeroed page nobody wrote): populating
            // it later is enough, and nothing clears a hole with stores.
            (false, true) => PageState::Unpopulated,
            (false, false) => PageState::Dirty,
        };
        for page in work.first..work.first + work.count {
            if let Err(e) = states.try_transition(page, PageState::Clearing, to) {
                warn!(region = work.id, page, error = %e, "scrubbed page left Clearing under its owner");
            }
        }
        let mut g = self.lock();
        if let Some(e) = g.entries.get_mut(&work.id) {
            if e.state == EntryState::Dirty && states.counts().clean == states.len() {
                e.state = EntryState::Clean;
                e.since = Instant::now();
                info!(
                    region = work.id,
                    node = e.key.node,
                    bytes = e.region.len(),
                    "region scrubbed; clean in the pool"
                );
            }
        }
        drop(g);
        self.changed.notify_all();
    }

    /// Waits (blocking) until every page of `region` is `Clean`, or until
    /// `deadline`; returns whether it is.
    pub fn wait_clean(&self, region: &Region, deadline: Instant) -> bool {
        let mut g = self.lock();
        loop {
            let states = region.states();
            if states.counts().clean == states.len() {
                return true;
            }
            let now = Instant::now();
            if now >= deadline || g.stopping {
                return false;
            }
            g = self
                .changed
                .wait_timeout(g, deadline - now)
                .map_or_else(|e| e.into_inner().0, |(g, _)| g);
        }
    }

    /// Idle regions of `key`, oldest first, given back to the kernel until
    /// `bytes` are freed; only `Clean` regions and `Dirty` ones that no
    /// scrubber is working on. Returns the regions to drop.
    pub fn evict(&self, key: PoolKey, bytes: u64) -> Vec<Arc<Region>> {
        let mut g = self.lock();
        self.evict_locked(&mut g, key, bytes)
    }

    fn evict_locked(&self, g: &mut Inner, key: PoolKey, bytes: u64) -> Vec<Arc<Region>> {
        let mut victims: Vec<(Instant, RegionId)> = g
            .entries
            .iter()
            .filter(|(_, e)| {
                e.key == key
                    && (e.state == EntryState::Clean
                        || (e.state == EntryState::Dirty
                            && e.region.states().counts().clearing == 0))
            })
            .map(|(id, e)| (e.since, *id))
            .collect();
        victims.sort();
        let mut freed = 0;
        let mut out = Vec::new();
        for (_, id) in victims {
            if freed >= bytes {
                break;
            }
            if let Some(e) = g.entries.remove(&id) {
                freed += e.region.len();
                Metrics::add(&self.metrics.bytes_released, e.region.len());
                info!(region = id, node = key.node, page_size = %key.page_size, bytes = e.region.len(), "evicting an idle pooled region to make room");
                out.push(e.region);
            }
        }
        out
    }

    /// [`Pool::evict`] over `keys` (in order) for `bytes`, once the regions
    /// it could give back hold that much. While regions of `keys` are on
    /// their way there (quarantined after FREE, or dirty with a scrubber
    /// working on them) and could make up the difference, waits (blocking)
    /// for them, at most until `deadline`. Checking and evicting happen
    /// under one lock hold, so a scrubber cannot take a region in between.
    /// Returns the regions to drop: none when `bytes` cannot be reached.
    pub fn evict_when_settled(
        &self,
        keys: &[PoolKey],
        bytes: u64,
        deadline: Instant,
    ) -> Vec<Arc<Region>> {
        let mut g = self.lock();
        loop {
            let (mut evictable, mut settling) = (0, 0);
            for e in g.entries.values().filter(|e| keys.contains(&e.key)) {
                match e.state {
                    EntryState::Clean => evictable += e.region.len(),
                    EntryState::Dirty if e.region.states().counts().clearing == 0 => {
                        evictable += e.region.len();
                    }
                    // A withheld region waits for its tenant, not for time.
                    EntryState::Quarantined if e.withheld.is_some() => {}
                    EntryState::Dirty | EntryState::Quarantined => settling += e.region.len(),
                    EntryState::Reserved | EntryState::InUse(_) => {}
                }
            }
            if evictable >= bytes {
                let mut out = Vec::new();
                let mut freed = 0;
                for &key in keys {
                    if freed >= bytes {
                        break;
                    }
                    let victims = self.evict_locked(&mut g, key, bytes - freed);
                    freed += victims.iter().map(|r| r.len()).sum::<u64>();
                    out.extend(victims);
                }
                return out;
            }
            let now = Instant::now();
            if evictable + settling < bytes || now >= deadline || g.stopping {
                return Vec::new();
            }
            // Scrub progress is not always signalled page by page: poll too.
            let wait = (deadline - now).min(Duration::from_millis(10));
            g = self
                .changed
                .wait_timeout(g, wait)
                .map_or_else(|e| e.into_inner().0, |(g, _)| g);
        }
    }

    /// Bytes of idle (clean or dirty) pooled regions of `key`.
    pub fn idle_bytes(&self, key: PoolKey) -> u64 {
        self.lock()
            .entries
            .values()
            .filter(|e| e.key == key && matches!(e.state, EntryState::Clean | EntryState::Dirty))
            .map(|e| e.region.len())
            .sum()
    }

    /// Gives back clean regions on nodes that stayed above their target for
    /// `trim_after_secs` (and anything above the limit). Returns regions to drop.
    pub fn trim(&self, now: Instant) -> Vec<Arc<Region>> {
        let mut g = self.lock();
        let nodes: Vec<NodeId> = {
            let mut n: Vec<NodeId> = g.entries.values().map(|e| e.key.node).collect();
            n.sort_unstable();
            n.dedup();
            n
        };
        let mut out = Vec::new();
        for node in nodes {
            let (target, limit) = self.cfg.limits(node);
            let pooled = pooled_bytes(&g, node);
            let since = if pooled > target {
                *g.above_target_since.entry(node).or_insert(now)
            } else {
                g.above_target_since.remove(&node);
                continue;
            };
            let goal = if pooled > limit {
                limit
            } else if now.duration_since(since) >= Duration::from_secs(self.cfg.trim_after_secs) {
                target
            } else {
                continue;
            };
            let mut clean: Vec<(Instant, RegionId)> = g
                .entries
                .iter()
                .filter(|(_, e)| e.key.node == node && e.state == EntryState::Clean)
                .map(|(id, e)| (e.since, *id))
                .collect();
            clean.sort();
            let mut pooled = pooled;
            for (_, id) in clean {
                if pooled <= goal {
                    break;
                }
                if let Some(e) = g.entries.remove(&id) {
                    pooled -= e.region.len();
                    Metrics::add(&self.metrics.bytes_released, e.region.len());
                    info!(
                        region = id,
                        node,
                        bytes = e.region.len(),
                        target = goal,
                        "trimming the pool; region goes back to the kernel"
                    );
                    out.push(e.region);
                }
            }
            if pooled <= target {
                g.above_target_since.remove(&node);
            }
        }
        out
    }

    /// Stops the scrubbers and waiters; the pool keeps its regions until dropped.
    pub fn stop(&self) {
        self.lock().stopping = true;
        self.changed.notify_all();
    }

    /// The region ids of `session`'s live allocations.
    pub fn region_ids_of(&self, session: SessionId) -> Vec<RegionId> {
        self.lock()
            .allocs
            .values()
            .filter(|a| a.session == session)
            .flat_map(|a| a.regions.iter().copied())
            .collect()
    }

    /// Number of live allocations of `session`.
    pub fn allocations_of(&self, session: SessionId) -> usize {
        self.lock()
            .allocs
            .values()
            .filter(|a| a.session == session)
            .count()
    }

    /// Number of live allocations.
    pub fn allocations(&self) -> usize {
        self.lock().allocs.len()
    }

    /// The pool part of STATS: one object per (node, page size) with bytes and
    /// region counts per state, plus scrub backlog per node.
    pub fn stats(&self) -> (Value, HashMap<NodeId, u64>) {
        let g = self.lock();
        let mut by_key: BTreeMap<PoolKey, [(u64, u64); 4]> = BTreeMap::new();
        let mut pending: HashMap<NodeId, u64> = HashMap::new();
        let mut withheld: BTreeMap<PoolKey, u64> = BTreeMap::new();
        let mut allocs_bytes = 0;
        for e in g.entries.values() {
            if e.state == EntryState::Quarantined && e.withheld.is_some() {
                *withheld.entry(e.key).or_default() += e.region.len();
            }
            let slot = match e.state.name() {
                "clean" => 0,
                "dirty" => 1,
                "quarantined" => 2,
                _ => 3,
            };
            let v = by_key.entry(e.key).or_default();
            v[slot].0 += e.region.len();
            v[slot].1 += 1;
            if slot == 3 {
                allocs_bytes += e.region.len();
            }
            if e.state == EntryState::Dirty {
                let c = e.region.states().counts();
                let unit = e.region.state_unit();
                *pending.entry(e.key.node).or_default() +=
                    (c.dirty + c.clearing + c.unpopulated) as u64 * unit;
            }
        }
        let pools: Vec<Value> = by_key
            .iter()
            .map(|(k, v)| {
                let (target, limit) = self.cfg.limits(k.node);
                json!({
                    "node": k.node,
                    "page_size": k.page_size.to_string(),
                    "backing": if k.paths { "hugetlbfs" } else { "memfd" },
                    "clean_bytes": v[0].0,
                    "dirty_bytes": v[1].0,
                    "quarantined_bytes": v[2].0,
                    "withheld_bytes": withheld.get(k).copied().unwrap_or(0),
                    "in_use_bytes": v[3].0,
                    "regions": {"clean": v[0].1, "dirty": v[1].1, "quarantined": v[2].1, "in_use": v[3].1},
                    "target_bytes": target,
                    "limit_bytes": limit,
                })
            })
            .collect();
        let quarantine: Vec<Value> = g
            .entries
            .iter()
            .filter(|(_, e)| e.state == EntryState::Quarantined)
            .map(|(id, e)| {
                json!({
                    "region": id,
                    "bytes": e.region.len(),
                    "seconds": e.since.elapsed().as_secs_f64(),
                    "holder_pid": e.holder.as_ref().map(|h| h.pid),
                    "withheld": e.withheld.as_ref().map(|(reason, since)| json!({
                        "reason": reason,
                        "seconds": since.elapsed().as_secs_f64(),
                        "uid": e.tenant,
                    })),
                })
            })
            .collect();
        let regions: Vec<Value> = g
            .entries
            .iter()
            .map(|(id, e)| {
                json!({
                    "id": id,
                    "node": e.key.node,
                    "page_size": e.key.page_size.to_string(),
                    "bytes": e.region.len(),
                    "state": e.state.name(),
                    "inode": e.owned.id.ino,
                    "path": e.region.path().map(|p| p.display().to_string()),
                })
            })
            .collect();
        let v = json!({
            "pools": pools,
            "quarantine": quarantine,
            "regions": regions,
            "allocations": {"active": g.allocs.len(), "bytes": allocs_bytes},
        });
        (v, pending)
    }
}

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

// NUMA rebalancing (`super::rebalance`).
impl Pool {
    fn in_use_entry(g: &Inner, id: RegionId, e: &Entry) -> Option<InUseRegion> {
        let EntryState::InUse(alloc) = e.state else {
            return None;
        };
        let session = g.allocs.get(&alloc)?.session;
        Some(InUseRegion {
            id,
            region: Arc::clone(&e.region),
            alloc,
            session,
            node: e.key.node,
            split: e.split,
        })
    }

    /// Region `id` if it is in use by a client.
    pub fn in_use(&self, id: RegionId) -> Option<InUseRegion> {
        let g = self.lock();
        let e = g.entries.get(&id)?;
        Self::in_use_entry(&g, id, e)
    }

    /// Every region in use by a client.
    pub fn in_use_regions(&self) -> Vec<InUseRegion> {
        let g = self.lock();
        g.entries
            .iter()
            .filter_map(|(id, e)| Self::in_use_entry(&g, *id, e))
            .collect()
    }

    /// Marks region `id`, still in use by `alloc`, as having pages on
    /// several nodes (from the start of a move). Returns false (nothing
    /// changed) when the region left that allocation. Under the same lock as
    /// release, so a released region was either marked first (and goes back
    /// to the kernel) or is refused here.
    pub fn mark_split(&self, id: RegionId, alloc: AllocId) -> bool {
        match self.lock().entries.get_mut(&id) {
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
        let mut g = self.lock();
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

/// Gives a path-backed region's file back to the daemon's uid, mode 0600.
fn reclaim_path(region: &Region) -> std::io::Result<()> {
    if region.path().is_none() {
        return Ok(());
    }
    // SAFETY: geteuid/getegid have no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    // SAFETY: as above.
    let gid = unsafe { libc::getegid() };
    std::os::unix::fs::fchown(region.fd(), Some(uid), Some(gid))?;
    nix::sys::stat::fchmod(region.fd(), nix::sys::stat::Mode::from_bits_truncate(0o600))
        .map_err(std::io::Error::from)
}

/// Pooled (not in use) bytes on `node`: clean, dirty and quarantined.
fn pooled_bytes(g: &Inner, node: NodeId) -> u64 {
    g.entries
        .values()
        .filter(|e| {
            e.key.node == node
                && matches!(
                    e.state,
                    EntryState::Clean | EntryState::Dirty | EntryState::Quarantined
                )
        })
        .map(|e| e.region.len())
        .sum()
}
