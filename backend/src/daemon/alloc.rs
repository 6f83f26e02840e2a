//! The ALLOC path: validate a request into per-node parts, then obtain one
//! clean region per part. **This module is the one place that decides which
//! region serves a request**; [`super::supply`] only knows how to get one
//! from each source, and [`super::pool`] only keeps the table.
//!
//! # The rule, per part
//!
//! Page size first: for each page size the policy allows, largest first
//! (`best`: 1G, 2M, 4K; a strict policy: its own size only), the part is
//! served in that size if the pages exist anywhere — free in the kernel or
//! in the daemon's hands in any state — and only when they truly do not is
//! the next size tried. Within one page size, the cheapest source first:
//!
//! 1. A **clean pooled** region of exactly the size, node and backing: no
//!    memory is touched. Hugetlbfs files (which can be opened by path) and,
//!    with `pool.recheck_on_reuse`, memfds are scanned for holders once more.
//! 2. A **smaller clean pooled** region, grown in place (`Region::grow`, only
//!    the new pages populated; see `supply::grow_pooled`). A pooled region
//!    *larger* than the request is never taken: the seal forbids truncating
//!    it and a larger file would give the VMM memory it did not ask for. Not
//!    in lazy mode, where fresh demand-faulted memory is faster.
//! 3. A **dirty pooled** region of exactly the size: cleared right here with
//!    [`guest_mem::Region::prepare_eager`] on all of the node's CPUs.
//! 4. A **fresh** region, when the kernel has the pages free.
//! 5. **Pages the daemon holds under another pool key** (the other backing,
//!    memfd vs hugetlbfs path, or another region size), idle: given back to
//!    the kernel, and the ALLOC waits for them to be free, then creates a
//!    fresh region of the preferred size (4).
//! 6. **Pages on their way** (a region in quarantine, one a scrubber is
//!    clearing): the ALLOC kicks the holder scan and waits on the pool. The
//!    quarantine watches each holder's pidfd, so a holder's exit re-scans at
//!    once and the region's leaving quarantine wakes the ALLOC, which then
//!    starts over at 1.
//!
//! Every wait ends at the ALLOC's deadline (its `wait_ms`, else
//! `pool.alloc_wait_ms`, capped at `pool.max_alloc_wait_ms`): the ALLOC then
//! fails with `NoMemory` and a message naming what it waited for (which
//! region, quarantined by which pid, being scrubbed, pages not back in the
//! kernel); it never downgrades on a timeout, and loses nothing (every
//! region taken goes back to the pool).
//!
//! A page size is **missing** only when the kernel's free pages and every
//! page of that size the daemon holds outside allocations together fall
//! short. `best` then moves to the next size and the reply's message and the
//! log say which pages were missing (e.g. `2G on 2M pages: 2 x 1G pages
//! missing on node 0 (0 free, 0 in the pool)`), and STATS counts a
//! `downgrades`. A strict policy fails with that message instead.
//!
//! Lazy mode first tries a previous tenant's dirty pooled region (for uids
//! in `pool.lazy_dirty_uids`), a clean pooled one, and fresh unpopulated
//! memfd memory; then the rule above.
//!
//! Everything here blocks (clearing, populating, `/proc` scans, `mmap`): the
//! session calls it through `spawn_blocking`, whose thread only waits for the
//! pinned workers of [`clearing::run_jobs`]. A cancel token stops a long
//! prepare at daemon shutdown.

use std::io;
use std::time::{Duration, Instant};

use clearing::{CancelToken, RunOptions};
use guest_mem::{LockOptions, LockRange, PagePolicy as RegionPolicy, PageSize, PoolCounts, Region};
use numa::{NodeId, Topology};
use tracing::{info, warn};

use super::holders::{self, Owned};
use super::metrics::Metrics;
use super::pool::{Held, PoolKey, Taken, Why};
use super::supply;
use super::Shared;
use crate::proto::messages::{AllocRequest, ClearMode, PagePolicy};
use crate::proto::{Status, ANY_NODE};
use guest_mem::size::format_size;

pub use super::supply::Refusal;
use crate::diag::chain;

/// One validated part: where, how much, which page sizes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// The node (chosen by the daemon for `ANY_NODE`).
    pub node: NodeId,
    /// Bytes.
    pub size: u64,
    /// The policy for fresh creation.
    pub policy: RegionPolicy,
    /// Page sizes allowed, largest first, each dividing `size` (and, for
    /// path-backed parts, each with a hugetlbfs mount).
    pub candidates: Vec<PageSize>,
    /// Create hugetlbfs files with paths instead of memfds.
    pub paths: bool,
    /// Lazy mode asked for: a dirty pooled region is handed out uncleared
    /// (`backend::fault` clears on demand) when `dirty_ok`, else clean
    /// pooled or fresh unpopulated memory.
    pub lazy: bool,
    /// The client's uid is in `pool.lazy_dirty_uids`: it may be handed a
    /// previous tenant's uncleared pages in lazy mode (it could read them
    /// through any second mapping before the fault service clears them).
    pub dirty_ok: bool,
}

/// Where a region came from (for counters and logs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The clean pool.
    Pooled,
    /// A dirty pooled region, cleared on the ALLOC path.
    Recleared,
    /// A smaller clean pooled region, grown to the size.
    Grown,
    /// Fresh from the kernel.
    Fresh,
    /// Lazy mode: a dirty pooled region, uncleared (cleared on demand).
    Lazy,
    /// Lazy mode without dirty pooled memory: fresh and unpopulated, zeroed
    /// by the kernel at the VMM's first touch.
    Demand,
}

/// Checks a request against the host and the limits; nothing is allocated.
///
/// # Errors
///
/// `BadNode` for nodes that do not exist or have
/// no memory, `Invalid` for sizes that do not fit the page size, `NoMemory`
/// above the per-allocation limit.
pub fn plan(shared: &Shared, req: &AllocRequest) -> Result<Vec<Part>, Refusal> {
    if req.total_size > shared.max_alloc {
        return Err((
            Status::NoMemory,
            format!(
                "{} bytes asked, at most {} per allocation on this host",
                req.total_size, shared.max_alloc
            ),
        ));
    }
    let (policy, strict) = match req.page_policy {
        PagePolicy::Best => (RegionPolicy::Best, None),
        PagePolicy::Huge1G => (
            RegionPolicy::Strict(PageSize::Huge1G),
            Some(PageSize::Huge1G),
        ),
        PagePolicy::Huge2M => (
            RegionPolicy::Strict(PageSize::Huge2M),
            Some(PageSize::Huge2M),
        ),
        PagePolicy::Base4K => (
            RegionPolicy::Strict(PageSize::Base4K),
            Some(PageSize::Base4K),
        ),
    };
    let raw_parts: Vec<(u32, u64)> = if req.parts.is_empty() {
        vec![(ANY_NODE, req.total_size)]
    } else {
        req.parts.iter().map(|p| (p.node, p.size)).collect()
    };
    let available: Vec<NodeId> = shared
        .topology
        .nodes()
        .iter()
        .filter(|n| !n.is_memoryless())
        .map(|n| n.id)
        .collect();
    let mut parts = Vec::with_capacity(raw_parts.len());
    for (i, (node, size)) in raw_parts.into_iter().enumerate() {
        let candidates: Vec<PageSize> = match strict {
            Some(p) => vec![p],
            None => PageSize::FALLBACK_ORDER.to_vec(),
        }
        .into_iter()
        .filter(|p| size.is_multiple_of(p.bytes()))
        .collect();
        if candidates.is_empty() {
            let unit = strict.map_or_else(|| "4K".to_string(), |p| p.to_string());
            return Err((
                Status::Invalid,
                format!("part {i}: {size} bytes is not a multiple of the {unit} page size"),
            ));
        }
        if req.want_paths && strict == Some(PageSize::Base4K) {
            return Err((
                Status::Invalid,
                format!("part {i}: 4K pages cannot be served as hugetlbfs paths"),
            ));
        }
        let candidates = if req.want_paths {
            let mounted: Vec<PageSize> = candidates
                .iter()
                .copied()
                .filter(|p| shared.hugetlbfs_dir(*p).is_some())
                .collect();
            if mounted.is_empty() {
                let names: Vec<String> = candidates.iter().map(ToString::to_string).collect();
                return Err((
                    Status::Unsupported,
                    format!(
                        "part {i}: ALLOC with paths needs a hugetlbfs mount of {} pages; the daemon has none \
                         (mount one, or set hugetlbfs.dir_2m / dir_1g)",
                        names.join(" or ")
                    ),
                ));
            }
            mounted
        } else {
            candidates
        };
        let node = if node == ANY_NODE {
            choose_node(shared, size, &candidates, &available, req.want_paths)
        } else {
            match shared.topology.nodes().iter().find(|n| n.id == node) {
                None => {
                    return Err((Status::BadNode, format!("part {i}: NUMA node {node} does not exist (this host has nodes {available:?})")))
                }
                Some(n) if n.is_memoryless() => {
                    return Err((Status::BadNode, format!("part {i}: NUMA node {node} has no memory (nodes with memory: {available:?})")))
                }
                Some(_) => node,
            }
        };
        parts.push(Part {
            node,
            size,
            policy,
            candidates,
            paths: req.want_paths,
            lazy: req.clear_mode == ClearMode::Lazy,
            dirty_ok: false,
        });
    }
    Ok(parts)
}

/// For `ANY_NODE`: a node with a clean pooled region of the size, else the
/// node with the most free pages of the largest allowed size, else the first.
fn choose_node(
    shared: &Shared,
    size: u64,
    candidates: &[PageSize],
    available: &[NodeId],
    paths: bool,
) -> NodeId {
    let first = available.first().copied().unwrap_or(0);
    if available.len() <= 1 {
        return first;
    }
    for &p in candidates {
        let key = |node| PoolKey {
            node,
            page_size: p,
            paths,
        };
        if let Some(&n) = available
            .iter()
            .find(|&&n| shared.pool.has_clean(key(n), size))
        {
            return n;
        }
    }
    let Some(&p) = candidates.iter().find(|p| p.is_huge()) else {
        return first;
    };
    available
        .iter()
        .copied()
        .max_by_key(|&n| {
            PoolCounts::read(p, Some(n))
                .ok()
                .flatten()
                .map_or(0, |c| c.free)
        })
        .unwrap_or(first)
}

/// What one part got.
#[derive(Debug)]
pub struct Obtained {
    /// The region, `Reserved`.
    pub taken: Taken,
    /// Where it came from.
    pub source: Source,
    /// Set when `best` served a smaller page size than the largest allowed:
    /// which pages were missing (for the reply's message).
    pub downgrade: Option<String>,
}

/// Pages of one size that do not exist for a part: neither free in the
/// kernel nor in the daemon's hands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Missing {
    /// The page size.
    pub page_size: PageSize,
    /// The node.
    pub node: NodeId,
    /// Pages short.
    pub pages: u64,
    /// Free pages of that size on the node.
    pub free: u64,
    /// Pages of that size pooled on the node (idle, quarantined, being
    /// scrubbed).
    pub pooled: u64,
}

impl std::fmt::Display for Missing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} x {} pages missing on node {} ({} free, {} in the pool)",
            self.pages, self.page_size, self.node, self.free, self.pooled
        )
    }
}

/// `2G on 2M pages: 2 x 1G pages missing on node 0 (0 free, 0 in the pool)`.
pub fn shortage_note(size: u64, served: Option<PageSize>, missing: &[Missing]) -> String {
    let what: Vec<String> = missing.iter().map(ToString::to_string).collect();
    match served {
        Some(p) => format!("{} on {p} pages: {}", format_size(size), what.join("; ")),
        None => format!("cannot serve {}: {}", format_size(size), what.join("; ")),
    }
}

/// Obtains every part (blocking), each by the rule of the module docs,
/// waiting at most until `deadline`. On error every region taken so far
/// goes back to the pool; on success all are `Reserved` for the caller to
/// commit.
///
/// # Errors
///
/// The first part's refusal.
pub fn obtain_all(
    shared: &Shared,
    parts: &[Part],
    lock: bool,
    owner: (u32, u32),
    deadline: Instant,
    cancel: &CancelToken,
) -> Result<Vec<Obtained>, Refusal> {
    let mut taken: Vec<Obtained> = Vec::with_capacity(parts.len());
    let ids = |taken: &[Obtained]| taken.iter().map(|o| o.taken.id).collect::<Vec<_>>();
    for part in parts {
        match obtain(shared, part, deadline, cancel) {
            Ok(t) => taken.push(t),
            Err(e) => {
                shared.pool.unreserve(&ids(&taken));
                return Err(e);
            }
        }
    }
    // Path-backed files belong to the client while it uses them, so that a
    // VMM running as an allowed non-root uid can open them; the pool takes
    // them back on release, before quarantine.
    for o in &taken {
        let t = &o.taken;
        if t.region.path().is_some() {
            if let Err(e) = std::os::unix::fs::fchown(t.region.fd(), Some(owner.0), Some(owner.1)) {
                shared.pool.unreserve(&ids(&taken));
                return Err((
                    Status::Internal,
                    format!("cannot hand region {} to uid {}: {e}", t.id, owner.0),
                ));
            }
        }
    }
    if lock {
        let regions: Vec<&Region> = taken.iter().map(|o| &*o.taken.region).collect();
        if let Err(e) = lock_regions(&shared.topology, &regions, true, 0, Some(cancel)) {
            // Undo what was locked; unlocking memory that is not locked is fine.
            let _ = lock_regions(&shared.topology, &regions, false, 0, None);
            shared.pool.unreserve(&ids(&taken));
            return Err(e);
        }
    }
    Ok(taken)
}

fn obtain(
    shared: &Shared,
    part: &Part,
    deadline: Instant,
    cancel: &CancelToken,
) -> Result<Obtained, Refusal> {
    let got = |taken, source| Obtained {
        taken,
        source,
        downgrade: None,
    };
    if part.lazy {
        if let Some((t, s)) = obtain_lazy(shared, part) {
            return Ok(got(t, s));
        }
    }
    let mut missing = Vec::new();
    for &page_size in &part.candidates {
        match obtain_size(shared, part, page_size, deadline, cancel)? {
            Ok((taken, source)) => {
                let downgrade = (!missing.is_empty())
                    .then(|| shortage_note(part.size, Some(page_size), &missing));
                if let Some(note) = &downgrade {
                    Metrics::add(&shared.metrics.downgrades, 1);
                    warn!(region = taken.id, node = part.node, %note, "ALLOC served on a smaller page size");
                }
                return Ok(Obtained {
                    taken,
                    source,
                    downgrade,
                });
            }
            Err(m) => missing.push(m),
        }
    }
    let mut msg = shortage_note(part.size, None, &missing);
    if part.policy != RegionPolicy::Best {
        msg.push_str(" (a strict page policy never falls back to another size)");
    }
    Err((Status::NoMemory, msg))
}

/// Lazy mode's own sources (module docs), before the rule.
fn obtain_lazy(shared: &Shared, part: &Part) -> Option<(Taken, Source)> {
    let pool = &shared.pool;
    if part.dirty_ok {
        if let Some(t) = super::lazy_allocs::take_lazy_dirty(
            pool,
            part.node,
            part.size,
            &part.candidates,
            part.paths,
        ) {
            return Some((t, Source::Lazy));
        }
    }
    for &page_size in &part.candidates {
        let key = PoolKey {
            node: part.node,
            page_size,
            paths: part.paths,
        };
        if let Some(t) = supply::take_clean(shared, key, part.size) {
            return Some((t, Source::Pooled));
        }
    }
    if part.paths {
        return None;
    }
    let new_id = || pool.next_region_id();
    let t = super::lazy_allocs::fresh_demand(
        pool,
        &shared.topology,
        part.node,
        part.size,
        &part.candidates,
        new_id,
    )?;
    Metrics::add(&shared.metrics.regions_fresh, 1);
    Some((t, Source::Demand))
}

/// The rule (module docs) for one page size: `Ok(Ok(_))` served,
/// `Ok(Err(_))` the pages do not exist, `Err` a refusal (a deadline passed,
/// an error that is not a shortage).
fn obtain_size(
    shared: &Shared,
    part: &Part,
    page_size: PageSize,
    deadline: Instant,
    cancel: &CancelToken,
) -> Result<Result<(Taken, Source), Missing>, Refusal> {
    let pool = &shared.pool;
    let key = PoolKey {
        node: part.node,
        page_size,
        paths: part.paths,
    };
    let pages = part.size / page_size.bytes();
    let started = Instant::now();
    let mut kicked = false;
    let mut raced = 0;
    loop {
        if cancel.is_cancelled() {
            return Err((Status::Internal, "the daemon is shutting down".into()));
        }
        if let Some(t) = supply::take_clean(shared, key, part.size) {
            return Ok(Ok((t, Source::Pooled)));
        }
        if !part.lazy {
            if let Some(t) = supply::grow_pooled(shared, key, part.size, cancel) {
                return Ok(Ok((t, Source::Grown)));
            }
        }
        if let Some(t) = supply::reclear_dirty(shared, key, part.size, cancel)? {
            return Ok(Ok((t, Source::Recleared)));
        }
        let free = supply::free_pages(page_size, part.node);
        if free >= pages {
            let policy = RegionPolicy::Strict(page_size);
            match supply::create(shared, part.node, part.size, part.paths, policy, cancel) {
                Ok(t) => return Ok(Ok((t, Source::Fresh))),
                // Another ALLOC (or process) took the pages between the
                // count and the creation: look again, twice at most.
                Err(e) if supply::is_shortage(&e) && page_size.is_huge() && raced < 2 => {
                    raced += 1;
                    info!(node = part.node, page_size = %page_size, error = %chain(&e), "fresh region failed although the pages looked free; looking again");
                    continue;
                }
                Err(e) if supply::is_shortage(&e) && page_size.is_huge() => {
                    return Ok(Err(Missing {
                        page_size,
                        node: part.node,
                        pages,
                        free,
                        pooled: pool.held(part.node, page_size).total() / page_size.bytes(),
                    }));
                }
                Err(e) => return Err(supply::region_refusal(&e)),
            }
        }
        let held = pool.held(part.node, page_size);
        let short = (pages - free) * page_size.bytes();
        if held.total() < short {
            return Ok(Err(Missing {
                page_size,
                node: part.node,
                pages: (short - held.total()).div_ceil(page_size.bytes()),
                free,
                pooled: held.total() / page_size.bytes(),
            }));
        }
        if held.idle >= short {
            let victims = pool.evict_idle(part.node, page_size, short);
            drop(victims);
            // The pages go back to the kernel when the last reference to an
            // evicted region goes (a holder scan or a scrubber may hold one
            // for a moment): wait until they are free.
            while supply::free_pages(page_size, part.node) < pages {
                if Instant::now() >= deadline || cancel.is_cancelled() {
                    return Err((
                        Status::NoMemory,
                        format!(
                            "waited {:.1} s for {} x {page_size} pages on node {} that the pool gave back to reach the kernel; {} free",
                            started.elapsed().as_secs_f64(),
                            pages,
                            part.node,
                            supply::free_pages(page_size, part.node)
                        ),
                    ));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            continue;
        }
        // Pages on their way: wake the holder scan now, then wait for the
        // pool to change (a holder's exit re-scans at once: pidfd).
        if !kicked {
            kicked = true;
            shared.quarantine_kick.notify_one();
            info!(node = part.node, page_size = %page_size, size = part.size, "ALLOC waits for pooled pages to settle");
        }
        if Instant::now() >= deadline {
            return Err((
                Status::NoMemory,
                waited_message(part, page_size, started, &held),
            ));
        }
        pool.wait_change(deadline);
    }
}

/// The message of an ALLOC whose deadline passed while pages were settling.
/// The regions it waited for may be other tenants' (released, quarantined
/// because their VMM still maps them): the client is told how much it
/// waited for and why in general, the log names regions and holder pids for
/// the operator.
fn waited_message(part: &Part, page_size: PageSize, started: Instant, held: &Held) -> String {
    let what: Vec<String> = held
        .settling
        .iter()
        .map(|r| format!("region {} ({}) {}", r.id, format_size(r.bytes), r.why))
        .collect();
    warn!(
        node = part.node,
        page_size = %page_size,
        size = part.size,
        waited_s = started.elapsed().as_secs_f64(),
        regions = %what.join(", "),
        "ALLOC deadline passed while pooled pages were settling"
    );
    let quarantined = held
        .settling
        .iter()
        .filter(|r| matches!(r.why, Why::Quarantined(_)))
        .count();
    format!(
        "waited {:.1} s for {} on {page_size} pages on node {}, which the daemon holds but cannot hand out yet: \
         {} region(s), {} in all ({quarantined} still held by the process that had them, the others being scrubbed; \
         the daemon's log names them); nothing was allocated (give the ALLOC a longer wait, or end the holder)",
        started.elapsed().as_secs_f64(),
        format_size(part.size),
        part.node,
        held.settling.len(),
        format_size(held.settling_bytes()),
    )
}

/// Locks (`lock`) or unlocks regions through the daemon's own mappings, in
/// chunks of `chunk` bytes (0 = default), per node in parallel. Returns
/// (bytes, microseconds).
///
/// # Errors
///
/// `Invalid` for a bad chunk size, `NoMemory` for `ENOMEM`/`EAGAIN` (limits,
/// short pools), `Internal` otherwise.
pub fn lock_regions(
    topology: &Topology,
    regions: &[&Region],
    lock: bool,
    chunk: u64,
    cancel: Option<&CancelToken>,
) -> Result<(u64, u64), Refusal> {
    let mut opts = LockOptions::new();
    if chunk != 0 {
        let c = usize::try_from(chunk).map_err(|_| {
            (
                Status::Invalid,
                format!("chunk of {chunk} bytes is too large"),
            )
        })?;
        opts = opts
            .with_chunk(c)
            .map_err(|e| (Status::Invalid, chain(&e)))?;
    }
    let ranges: Vec<LockRange> = regions
        .iter()
        .map(|r| LockRange {
            start: r.as_ptr().expose_provenance(),
            // Region lengths fit usize (checked at creation).
            len: usize::try_from(r.len()).unwrap_or(usize::MAX),
            page_size: r.page_size(),
            node: r.node(),
        })
        .collect();
    let run = RunOptions {
        cancel,
        ..RunOptions::default()
    };
    let result = if lock {
        // SAFETY: every range is exactly the daemon's own mapping of a region
        // the caller holds an `Arc` of (through `regions`) for the whole call;
        // a region's mapping is only unmapped when its last `Arc` drops, so
        // nothing unmaps or remaps these addresses until this returns.
        unsafe { guest_mem::lock_ranges(topology, &ranges, &opts, &run) }
    } else {
        // SAFETY: as above.
        unsafe { guest_mem::unlock_ranges(topology, &ranges, &opts, &run) }
    };
    match result {
        // `as` saturates: a negative or huge time cannot wrap.
        Ok(r) => Ok((r.bytes, (r.seconds * 1e6) as u64)),
        Err(e @ (guest_mem::LockError::Limit { .. } | guest_mem::LockError::NoMemory { .. })) => {
            Err((Status::NoMemory, chain(&e)))
        }
        Err(e @ (guest_mem::LockError::BadChunk(_) | guest_mem::LockError::BadRange { .. })) => {
            Err((Status::Invalid, chain(&e)))
        }
        Err(e) => Err((Status::Internal, chain(&e))),
    }
}

/// Holder scan over `owned`, for the quarantine (blocking).
pub fn scan_holders(owned: &[Owned]) -> Vec<Option<holders::Holder>> {
    holders::scan(owned).holders
}

/// `io::Error` for a join failure of a blocking task.
pub fn join_error(e: &tokio::task::JoinError) -> io::Error {
    io::Error::other(format!("blocking task failed: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shortage_names_the_missing_pages_per_size_and_node() {
        let m = |page_size, pages, free, pooled| Missing {
            page_size,
            node: 0,
            pages,
            free,
            pooled,
        };
        assert_eq!(
            shortage_note(
                2 << 30,
                Some(PageSize::Huge2M),
                &[m(PageSize::Huge1G, 2, 0, 0)]
            ),
            "2G on 2M pages: 2 x 1G pages missing on node 0 (0 free, 0 in the pool)"
        );
        assert_eq!(
            shortage_note(
                3 << 30,
                Some(PageSize::Base4K),
                &[
                    m(PageSize::Huge1G, 1, 1, 1),
                    m(PageSize::Huge2M, 1472, 64, 0)
                ]
            ),
            "3G on 4K pages: 1 x 1G pages missing on node 0 (1 free, 1 in the pool); \
             1472 x 2M pages missing on node 0 (64 free, 0 in the pool)"
        );
        assert_eq!(
            shortage_note(8 << 30, None, &[m(PageSize::Huge1G, 5, 3, 0)]),
            "cannot serve 8G: 5 x 1G pages missing on node 0 (3 free, 0 in the pool)"
        );
    }
}
