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
//!   [`crate::daemon::quarantine::holders`] scan found no process but the daemon holding it —
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
//! **The API.** The pool is the one owner of region state; nothing outside
//! it moves an entry from one state to another. Its verbs:
//!
//! * [`Pool::take`] (`take.rs`): the regions that serve an ALLOC, chosen
//!   here by the one rule (clean, grown, re-cleared, fresh, evicted for,
//!   waited for; lazy mode's own sources; per node, per page size, per
//!   backing), `Reserved`; [`Pool::commit`] hands them to a session (the
//!   clean-before-map check), [`Pool::put_back`] returns them when the ALLOC
//!   fails after the take. [`Pool::add_fresh`] is the refill's fresh region.
//! * [`Pool::release`], [`Pool::release_session`] (`release.rs`): a freed
//!   allocation's regions enter quarantine, or go back to the kernel over a
//!   limit.
//! * [`Pool::quarantined`] and [`Pool::apply_scan`]: what the quarantine
//!   loop checks and its verdicts (leave, stay held or withheld, discard).
//! * [`Pool::next_scrub`] and [`Pool::scrub_done`] (`scrubbing.rs`): the
//!   scrubbers' next dirty pages and how their batch ended (cleared, stopped,
//!   damaged: discarded).
//! * [`Pool::trim`]: idle regions given back above the target.
//! * Reads: [`Pool::stats`], [`Pool::pooled`], the allocations of a session
//!   ([`Pool::regions_of`] and its kin); for REBALANCE the in-use regions
//!   and their placement marks (`in_use.rs`).
//! * Owners (`owners.rs`): every allocation has a tenant uid and a secret
//!   re-attach token. [`Pool::orphan`] detaches an allocation from its
//!   session (a restarted daemon restores allocations that way);
//!   [`Pool::reattach`] gives an orphaned one to the session that shows its
//!   token; [`Pool::allocation_tokens`] is what the restore code saves.
//!
//! **Sizes.** Memfds are sealed against shrinking (`F_SEAL_SHRINK`, see
//! `guest_mem::region`) but not against growing. A request is served by an
//! exact-size clean or dirty region, or the largest smaller clean one grown
//! (see `take.rs`). A pooled region *larger* than the request is never used:
//! it cannot be truncated (the seal protects the daemon's own mapping from a
//! VMM), and handing out a larger file would give the VMM more memory than it
//! asked for.
//!
//! **Damaged files.** A tenant can change its file behind the daemon's
//! back: grow a memfd (the seals allow it), truncate a hugetlbfs file, punch
//! holes. Before a released region leaves quarantine, [`check_released`]
//! checks its size and populates every page (`MADV_POPULATE_WRITE`, which
//! errors where a store would `SIGBUS`); scrubbers populate each batch the
//! same way. A region that fails either is discarded (`Pool::discard`):
//! given back to the kernel, never scrubbed, never served.
//!
//! **Limits.** Per node, pooled bytes (clean + dirty + quarantined) never
//! exceed the limit, nor those of one page size its own limit
//! (`pool.limit_1g`, `limit_2m`, `limit_4k`; 4 KiB is 0 by default): a
//! released region that would is given back to the kernel at once (no scrub
//! needed: closing our fd and unmapping is enough, the kernel zeroes pages
//! before their next user). Above the target, clean regions idle for
//! `trim_after_secs` are given back, oldest first. The last regions given
//! back and why are kept for STATS (`given_back`).
//!
//! [`check_released`]: crate::daemon::quarantine::reuse::check_released

use std::collections::{BTreeMap, HashMap};

mod files;
mod given_back;
mod held;
mod in_use;
mod owners;
mod persist;
mod refault;
mod release;
mod scrubbing;
mod stats;
mod supply;
mod take;
pub use stats::PoolPart;

use files::reclaim_path;
pub use held::{Held, HeldRegion, Why};
pub use in_use::InUseRegion;
pub use owners::{AllocToken, TOKEN_SIZE};
pub use persist::{
    Adopted, AllocRecord, AllocSnapshot, Life, RegionRecord, RegionSnapshot, SavedLife, Snapshot,
};
pub use refault::FillWork;
pub use scrubbing::Scrubbed;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;
pub use supply::{free_pages, Sources};
pub use take::{shortage_note, Missing, Obtained, Part, Refusal, Source};

use guest_mem::{PageSize, Region};
use numa::NodeId;
use tracing::warn;

use super::config::PoolConfig;
use super::metrics::Metrics;
use super::quarantine::gate::ReserveGate;
use super::quarantine::holders::{Holder, Owned};

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
enum EntryState {
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
    /// exists (see `super::reuse`): why, and when it was first seen.
    withheld: Option<(String, Instant)>,
    /// The uid of the last client that held it (for a withheld region).
    tenant: Option<u32>,
    warned: bool,
    /// Pages may be on several nodes (a move is running, or a range was
    /// moved): released, such a region goes back to the kernel, never into
    /// a per-node pool (see `super::rebalance`).
    split: bool,
    /// Holes of a detached region still to be faulted in ahead of its
    /// guest (`refault.rs`), in any entry state.
    fill: Option<refault::Fill>,
}

#[derive(Debug)]
struct Allocation {
    /// The session that owns it; `None`: **orphaned**, restored after a
    /// restart and waiting for its VMM to re-attach ([`Pool::reattach`]).
    /// An orphaned allocation is no session's: FREE, LOCK, UNLOCK and UFFD
    /// refuse it, and no disconnect releases it.
    session: Option<SessionId>,
    regions: Vec<RegionId>,
    locked: bool,
    /// The uid it was handed to; only that uid may re-attach it.
    tenant: u32,
    /// The secret that re-attaches it (random, sent once in the ALLOC reply).
    token: AllocToken,
    /// Handed out in lazy mode (its regions may have uncleared pages).
    lazy: bool,
    /// Its lazy regions are served by the VMM's fallback, not by a fault
    /// service of this daemon (the uffd went with the old connection, or
    /// the old daemon): UFFD on it is refused.
    lazy_fallback: bool,
}

#[derive(Debug, Default)]
struct Inner {
    entries: BTreeMap<RegionId, Entry>,
    allocs: HashMap<AllocId, Allocation>,
    above_target_since: HashMap<NodeId, Instant>,
    stopping: bool,
    given_back: given_back::Recent,
}

/// How an allocation is handed out (see [`Pool::commit`]).
#[derive(Debug, Clone, Copy)]
struct Owner {
    locked: bool,
    lazy: bool,
    token: AllocToken,
}

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
struct Detached {
    /// Its id (kept: the region stays the same region).
    id: RegionId,
    /// The region, owned: nothing else references it.
    region: Region,
    key: PoolKey,
    since: Instant,
    old_len: u64,
}

/// What a scrubber does next (see [`Pool::next_scrub`]).
#[derive(Debug)]
pub enum Work {
    /// Clear dirty pages.
    Scrub(ScrubWork),
    /// Fault a detached region's holes in ahead of its guest.
    Fill(FillWork),
}

/// Pages a scrubber claimed: `pages` of region `id`, all in `Clearing`.
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
    sources: Sources,
    next_region: AtomicU64,
    next_alloc: AtomicU64,
    metrics: Arc<Metrics>,
    gate: ReserveGate,
}

impl Pool {
    /// An empty pool that creates fresh regions from `sources`.
    pub fn new(cfg: PoolConfig, metrics: Arc<Metrics>, sources: Sources) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            changed: Condvar::new(),
            cfg,
            sources,
            next_region: AtomicU64::new(1),
            next_alloc: AtomicU64::new(1),
            metrics,
            gate: ReserveGate::default(),
        }
    }

    /// The gate every hugetlb reservation of fresh pages and every punch of
    /// a released region passes (see [`ReserveGate`]).
    pub fn reserve_gate(&self) -> &ReserveGate {
        &self.gate
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
    fn next_region_id(&self) -> RegionId {
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
    fn insert_fresh(&self, id: RegionId, region: Region) -> std::io::Result<Taken> {
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
                fill: None,
            },
        );
        Ok(Taken { id, region })
    }

    /// True when a `Clean` region of `key` and exactly `size` bytes is pooled.
    fn has_clean(&self, key: PoolKey, size: u64) -> bool {
        self.lock()
            .entries
            .values()
            .any(|e| e.key == key && e.state == EntryState::Clean && e.region.len() == size)
    }

    /// Takes a `Clean` region of `key` and exactly `size` bytes.
    fn take_clean(&self, key: PoolKey, size: u64) -> Option<Taken> {
        self.take_state(key, size, EntryState::Clean)
    }

    /// Takes the largest `Clean` region of `key` smaller than `size` out of
    /// the table, to grow it ([`Region::grow`] needs the region itself, not a
    /// shared `Arc`). `None` when there is none, or when something else still
    /// holds a reference to the largest one (it then stays pooled as it was).
    /// The caller gives it back with [`Pool::insert_grown`] or
    /// [`Pool::restore`]; meanwhile it counts in no pool statistic.
    fn detach_smaller_clean(&self, key: PoolKey, size: u64) -> Option<Detached> {
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
    fn insert_grown(&self, d: Detached) -> std::io::Result<Taken> {
        self.reinsert(d, EntryState::Reserved)
    }

    /// Puts a detached region back into the pool: `Clean` when every page is
    /// (a grow that failed leaves the region as it was), else every page is
    /// marked `Dirty` and the scrubbers take it (new pages a failed prepare
    /// left half done). If even that fails (`fstat`), the region goes back
    /// to the kernel.
    fn restore(&self, d: Detached) {
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
                fill: None,
            },
        );
        Ok(Taken { id, region })
    }

    /// Takes a `Dirty` region of `key` and exactly `size` bytes, to clear it on
    /// the ALLOC path; scrubbers finish the pages they already started.
    fn take_dirty(&self, key: PoolKey, size: u64) -> Option<Taken> {
        self.take_state(key, size, EntryState::Dirty)
    }

    fn take_state(&self, key: PoolKey, size: u64, state: EntryState) -> Option<Taken> {
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
    fn owned(&self, id: RegionId) -> Option<Owned> {
        self.lock().entries.get(&id).map(|e| e.owned.clone())
    }

    /// True while region `id` is the daemon's (in any state).
    pub fn contains(&self, id: RegionId) -> bool {
        self.lock().entries.contains_key(&id)
    }

    /// Puts the `Reserved` regions of an ALLOC that failed after
    /// [`Pool::take`] back: `Clean` when every page is, else `Dirty`
    /// (scrubbers are woken).
    pub fn put_back(&self, ids: &[RegionId]) {
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
    fn requarantine(&self, id: RegionId, holder: Holder) {
        let mut g = self.lock();
        if let Some(e) = g.entries.get_mut(&id) {
            warn!(region = id, pid = holder.pid, hold = ?holder.hold, "a pooled region is held by another process; back to quarantine");
            e.state = EntryState::Quarantined;
            e.holder = Some(holder);
            e.since = Instant::now();
        }
    }

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
    ) -> Result<AllocId, String> {
        // Before the lock: a syscall.
        let token = owners::new_token()?;
        let mut g = self.lock();
        for id in ids {
            let e = g
                .entries
                .get(id)
                .ok_or_else(|| format!("region {id} vanished from the pool"))?;
            if lazy {
                if e.state != EntryState::Reserved {
                    return Err(format!(
                        "region {id} cannot be handed out lazily (entry {:?})",
                        e.state
                    ));
                }
                continue;
            }
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
        // Eager: every page is Clean (checked above under the lock every
        // entry transition takes; scrubbers never touch Clean pages).
        Ok(self.hand_out(
            &mut g,
            session,
            tenant,
            ids,
            Owner {
                locked,
                lazy,
                token,
            },
        ))
    }

    /// The part of [`Pool::commit`] after its checks: regions whose pages are all `Clean` move to `Mapped`
    /// (lazy regions with dirty or unpopulated pages keep their states), every
    /// region becomes `InUse` of a new allocation of `session`.
    fn hand_out(
        &self,
        g: &mut Inner,
        session: SessionId,
        tenant: u32,
        ids: &[RegionId],
        owner: Owner,
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
            Allocation {
                session: Some(session),
                regions: ids.to_vec(),
                locked: owner.locked,
                tenant,
                token: owner.token,
                lazy: owner.lazy,
                lazy_fallback: false,
            },
        );
        alloc
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

    /// Records whether `alloc` is locked.
    pub fn set_locked(&self, alloc: AllocId, locked: bool) {
        if let Some(a) = self.lock().allocs.get_mut(&alloc) {
            a.locked = locked;
        }
    }

    /// Stops the scrubbers and waiters; the pool keeps its regions until dropped.
    pub fn stop(&self) {
        self.lock().stopping = true;
        self.changed.notify_all();
    }

    /// Region `id`, in any state.
    pub fn region(&self, id: RegionId) -> Option<Arc<Region>> {
        self.lock().entries.get(&id).map(|e| Arc::clone(&e.region))
    }

    /// The region ids of `session`'s live allocations.
    pub fn region_ids_of(&self, session: SessionId) -> Vec<RegionId> {
        self.lock()
            .allocs
            .values()
            .filter(|a| a.session == Some(session))
            .flat_map(|a| a.regions.iter().copied())
            .collect()
    }

    /// Number of live allocations of `session`.
    pub fn allocations_of(&self, session: SessionId) -> usize {
        self.lock()
            .allocs
            .values()
            .filter(|a| a.session == Some(session))
            .count()
    }
}

/// Pooled (not in use) bytes on `node`: clean, dirty and quarantined.
fn pooled_bytes(g: &Inner, node: NodeId) -> u64 {
    pooled_bytes_of(g, node, None)
}

/// [`pooled_bytes`] of one page size (`Some`), or of all.
fn pooled_bytes_of(g: &Inner, node: NodeId, page_size: Option<PageSize>) -> u64 {
    g.entries
        .values()
        .filter(|e| {
            e.key.node == node
                && page_size.is_none_or(|p| p == e.key.page_size)
                && matches!(
                    e.state,
                    EntryState::Clean | EntryState::Dirty | EntryState::Quarantined
                )
        })
        .map(|e| e.region.len())
        .sum()
}
