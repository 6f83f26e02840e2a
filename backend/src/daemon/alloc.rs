//! The ALLOC path: validate a request into per-node parts, then obtain one
//! clean region per part — pooled if possible, fresh otherwise.
//!
//! # Order of preference, per part
//!
//! 1. A **clean pooled** region of exactly the size, node and a page size the
//!    policy allows (largest first): no memory is touched at all. For
//!    hugetlbfs files (which can be opened by path) and with
//!    `pool.recheck_on_reuse`, the `/proc` holder scan runs once more first.
//! 2. A **smaller clean pooled** region, grown: the largest clean region of
//!    the same node, page size and backing that is smaller than the request
//!    is taken out of the pool, grown in place with `Region::grow` (new pages
//!    reserved and bound to the node, the file extended; memfds are sealed
//!    against shrinking only), then [`Region::prepare_eager`] populates just
//!    the new pages with node-pinned workers; the old ones are clean already.
//!    The same id and memfd are handed out. Any error puts the region back
//!    into the pool unchanged (or, if its new pages were half populated,
//!    dirty for the scrubbers) and the ALLOC goes on with the steps below.
//!    A pooled region *larger* than the request is never taken: the seal
//!    forbids truncating it and a larger file would give the VMM memory it
//!    did not ask for; the pool's per-node target and limit give such
//!    regions back to the kernel when they stay unused. Not in lazy mode,
//!    where fresh demand-faulted memory is faster than populating.
//! 3. A **dirty pooled** region of exactly the size: cleared right here with
//!    [`Region::prepare_eager`] (all CPUs of the node, in parallel), waiting
//!    for any page a scrubber already holds. Reusing it beats taking fresh
//!    pages from the kernel, which would grow the daemon's footprint while
//!    the dirty region sits idle.
//! 4. A **fresh** region: [`Region::allocate`] (create, `mbind`, populate with
//!    node-pinned workers; the kernel zeroes new pages), then a placement
//!    check. When the kernel is short of pages and idle pooled regions of the
//!    same node and page size (either backing) could cover the shortfall,
//!    they are given back and the creation is retried once. Regions freed a
//!    moment ago (still quarantined, or being scrubbed) count too: the ALLOC
//!    waits up to [`SETTLE_WAIT`] for them to become evictable, and then for
//!    their pages to be back in the kernel's free pool, instead of refusing a
//!    VM that starts right after another one's exit.
//!
//! With `page_policy = best`, pooled regions of any allowed size are
//! preferred to fresh pages of a larger size: a pooled 2 MiB region is ready
//! now, fresh 1 GiB pages must still be populated. Strict policies only ever
//! look at their own size.
//!
//! Everything here blocks (clearing, populating, `/proc` scans, `mmap`): the
//! session calls it through `spawn_blocking`, whose thread only waits for the
//! pinned workers of [`clearing::run_jobs`]. A cancel token stops a long
//! prepare at daemon shutdown.

use std::io;
use std::time::{Duration, Instant};

use clearing::{CancelToken, RunError, RunOptions};
use guest_mem::{
    Backing, LockOptions, LockRange, PagePolicy as RegionPolicy, PageSize, PoolCounts,
    PrepareError, Region, RegionError, RegionSpec,
};
use numa::{NodeId, Topology};
use tracing::{debug, info, warn};

use super::holders::{self, Owned};
use super::metrics::Metrics;
use super::pool::{PoolKey, Taken};
use super::Shared;
use crate::proto::messages::{AllocRequest, ClearMode, PagePolicy};
use crate::proto::{Status, ANY_NODE};

/// A refusal: status and the message for the client.
pub type Refusal = (Status, String);

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

/// Obtains every part (blocking). On error every region taken so far goes
/// back to the pool; on success all are `Reserved` for the caller to commit.
///
/// # Errors
///
/// The first part's refusal.
pub fn obtain_all(
    shared: &Shared,
    parts: &[Part],
    lock: bool,
    owner: (u32, u32),
    cancel: &CancelToken,
) -> Result<Vec<(Taken, Source)>, Refusal> {
    let mut taken: Vec<(Taken, Source)> = Vec::with_capacity(parts.len());
    for part in parts {
        match obtain(shared, part, cancel) {
            Ok(t) => taken.push(t),
            Err(e) => {
                shared
                    .pool
                    .unreserve(&taken.iter().map(|(t, _)| t.id).collect::<Vec<_>>());
                return Err(e);
            }
        }
    }
    // Path-backed files belong to the client while it uses them, so that a
    // VMM running as an allowed non-root uid can open them; the pool takes
    // them back on release, before quarantine.
    for (t, _) in &taken {
        if t.region.path().is_some() {
            if let Err(e) = std::os::unix::fs::fchown(t.region.fd(), Some(owner.0), Some(owner.1)) {
                shared
                    .pool
                    .unreserve(&taken.iter().map(|(t, _)| t.id).collect::<Vec<_>>());
                return Err((
                    Status::Internal,
                    format!("cannot hand region {} to uid {}: {e}", t.id, owner.0),
                ));
            }
        }
    }
    if lock {
        let regions: Vec<&Region> = taken.iter().map(|(t, _)| &*t.region).collect();
        if let Err(e) = lock_regions(&shared.topology, &regions, true, 0, Some(cancel)) {
            // Undo what was locked; unlocking memory that is not locked is fine.
            let _ = lock_regions(&shared.topology, &regions, false, 0, None);
            shared
                .pool
                .unreserve(&taken.iter().map(|(t, _)| t.id).collect::<Vec<_>>());
            return Err(e);
        }
    }
    Ok(taken)
}

fn obtain(shared: &Shared, part: &Part, cancel: &CancelToken) -> Result<(Taken, Source), Refusal> {
    let pool = &shared.pool;
    if part.lazy && part.dirty_ok {
        if let Some(t) = crate::fault::daemon::take_lazy_dirty(
            pool,
            part.node,
            part.size,
            &part.candidates,
            part.paths,
        ) {
            return Ok((t, Source::Lazy));
        }
    }
    for &page_size in &part.candidates {
        let key = PoolKey {
            node: part.node,
            page_size,
            paths: part.paths,
        };
        while let Some(t) = pool.take_clean(key, part.size) {
            if pool.config().recheck_on_reuse || part.paths {
                if let Some(owned) = pool.owned(t.id) {
                    if let Some(holder) = holders::scan(std::slice::from_ref(&owned))
                        .holders
                        .into_iter()
                        .next()
                        .flatten()
                    {
                        pool.requarantine(t.id, holder);
                        continue;
                    }
                }
            }
            debug!(
                region = t.id,
                node = part.node,
                size = part.size,
                "ALLOC served from the clean pool"
            );
            Metrics::add(&shared.metrics.regions_pooled, 1);
            return Ok((t, Source::Pooled));
        }
    }
    if !part.lazy {
        for &page_size in &part.candidates {
            let key = PoolKey {
                node: part.node,
                page_size,
                paths: part.paths,
            };
            if let Some(t) = grow_pooled(shared, part, key, cancel) {
                return Ok((t, Source::Grown));
            }
        }
    }
    if part.lazy && !part.paths {
        let new_id = || pool.next_region_id();
        if let Some(t) = crate::fault::daemon::fresh_demand(
            pool,
            &shared.topology,
            part.node,
            part.size,
            &part.candidates,
            new_id,
        ) {
            Metrics::add(&shared.metrics.regions_fresh, 1);
            return Ok((t, Source::Demand));
        }
    }
    for &page_size in &part.candidates {
        let key = PoolKey {
            node: part.node,
            page_size,
            paths: part.paths,
        };
        if let Some(t) = pool.take_dirty(key, part.size) {
            let opts = RunOptions {
                cancel: Some(cancel),
                ..RunOptions::default()
            };
            let cleared = t.region.prepare_eager(&shared.topology, &opts);
            let clean = cleared.is_ok()
                && pool.wait_clean(&t.region, Instant::now() + Duration::from_secs(60));
            if !clean {
                pool.unreserve(&[t.id]);
                return Err(match cleared {
                    Err(e) => prepare_refusal(&e),
                    Ok(_) => (
                        Status::Internal,
                        format!("region {} did not become clean within 60 s", t.id),
                    ),
                });
            }
            info!(
                region = t.id,
                node = part.node,
                size = part.size,
                "ALLOC cleared a dirty pooled region"
            );
            Metrics::add(&shared.metrics.regions_recleared, 1);
            return Ok((t, Source::Recleared));
        }
    }
    fresh(shared, part, cancel).map(|t| (t, Source::Fresh))
}

/// Step 2 of the module docs: the largest clean pooled region of `key`
/// smaller than the part, grown and prepared. `None` (the region, if any, is
/// back in the pool) when there is none or anything fails.
fn grow_pooled(shared: &Shared, part: &Part, key: PoolKey, cancel: &CancelToken) -> Option<Taken> {
    let pool = &shared.pool;
    let mut d = pool.detach_smaller_clean(key, part.size)?;
    let old_len = d.region.len();
    if pool.config().recheck_on_reuse || part.paths {
        if let Ok(owned) = Owned::region(
            d.region.fd(),
            d.region.as_ptr() as usize,
            usize::try_from(old_len).unwrap_or(usize::MAX),
        ) {
            if let Some(holder) = holders::scan(std::slice::from_ref(&owned))
                .holders
                .into_iter()
                .next()
                .flatten()
            {
                let id = d.id;
                pool.restore(d);
                pool.requarantine(id, holder);
                return None;
            }
        }
    }
    if let Err(e) = d.region.grow(&shared.topology, part.size) {
        info!(
            region = d.id,
            node = part.node,
            from = old_len,
            to = part.size,
            error = %chain(&e),
            "cannot grow a pooled region; it stays pooled"
        );
        pool.restore(d);
        return None;
    }
    let opts = RunOptions {
        cancel: Some(cancel),
        ..RunOptions::default()
    };
    let prepared = d.region.prepare_eager(&shared.topology, &opts);
    let clean = d.region.states().counts().clean == d.region.states().len();
    if let Err(e) = &prepared {
        warn!(region = d.id, error = %chain(e), "cannot populate the new pages of a grown pooled region");
    }
    if prepared.is_err() || !clean {
        // Half-populated new pages: dirty, for the scrubbers.
        pool.restore(d);
        return None;
    }
    match d.region.verify_placement() {
        Ok(p) if !p.misplaced.is_empty() => warn!(
            region = d.id,
            node = part.node,
            misplaced = p.misplaced.len(),
            pages = p.pages,
            "grown region has pages off its node"
        ),
        Ok(_) => {}
        Err(e) => warn!(region = d.id, error = %e, "cannot verify the placement of a grown region"),
    }
    let id = d.id;
    match pool.insert_grown(d) {
        Ok(t) => {
            info!(
                region = id,
                node = part.node,
                page_size = %key.page_size,
                "grown pooled region {} -> {}",
                human(old_len),
                human(part.size)
            );
            Metrics::add(&shared.metrics.regions_grown, 1);
            Some(t)
        }
        Err(e) => {
            warn!(region = id, error = %e, "cannot keep a grown region; it went back to the kernel");
            None
        }
    }
}

/// `2G`, `512M`, `4K` or bytes, for logs.
fn human(bytes: u64) -> String {
    const UNITS: [(u64, &str); 3] = [(1 << 30, "G"), (1 << 20, "M"), (1 << 10, "K")];
    UNITS
        .iter()
        .find(|(unit, _)| bytes >= *unit && bytes.is_multiple_of(*unit))
        .map_or_else(
            || bytes.to_string(),
            |(unit, s)| format!("{}{s}", bytes / unit),
        )
}

fn fresh(shared: &Shared, part: &Part, cancel: &CancelToken) -> Result<Taken, Refusal> {
    // Memfds: one try with the part's policy (guest_mem picks the size and
    // says why it fell back). Files: one try per mounted size, since a
    // mount fixes its page size.
    let attempts: Vec<RegionPolicy> = if part.paths {
        part.candidates
            .iter()
            .map(|p| RegionPolicy::Strict(*p))
            .collect()
    } else {
        vec![part.policy]
    };
    let mut first_err = None;
    for policy in attempts {
        match create(shared, part, policy, cancel) {
            Ok(t) => return Ok(t),
            Err(e) if is_shortage(&e) => {
                first_err.get_or_insert(e);
            }
            Err(e) => return Err(region_refusal(&e)),
        }
    }
    for &page_size in part.candidates.iter().filter(|p| p.is_huge()) {
        let key = PoolKey {
            node: part.node,
            page_size,
            paths: part.paths,
        };
        let free = free_bytes(page_size, part.node);
        // Idle regions of either backing hold pages of this size.
        let idle_keys = [
            key,
            PoolKey {
                paths: !part.paths,
                ..key
            },
        ];
        if free >= part.size {
            continue;
        }
        // A region freed a moment ago is still quarantined or being scrubbed
        // and cannot be given back yet; wait for it (bounded) rather than
        // refuse a VM that starts right after another one's exit.
        let victims = shared.pool.evict_when_settled(
            &idle_keys,
            part.size - free,
            Instant::now() + SETTLE_WAIT,
        );
        if victims.is_empty() {
            continue;
        }
        info!(node = part.node, page_size = %page_size, regions = victims.len(), "retrying a fresh region after giving idle pooled regions back");
        drop(victims);
        // The pages go back to the kernel when the last reference to an
        // evicted region goes, which may be a holder scan or a scrubber
        // finishing with it: wait (bounded) until they are free.
        let deadline = Instant::now() + SETTLE_WAIT;
        while free_bytes(page_size, part.node) < part.size
            && Instant::now() < deadline
            && !cancel.is_cancelled()
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        return create(shared, part, RegionPolicy::Strict(page_size), cancel)
            .map_err(|e| region_refusal(&e));
    }
    Err(first_err.map_or_else(
        || {
            (
                Status::NoMemory,
                "no page size could serve the request".into(),
            )
        },
        |e| region_refusal(&e),
    ))
}

/// How long a fresh ALLOC short of huge pages waits for just-freed pooled
/// regions (quarantined, being scrubbed) to become evictable.
pub const SETTLE_WAIT: Duration = Duration::from_secs(5);

fn create(
    shared: &Shared,
    part: &Part,
    policy: RegionPolicy,
    cancel: &CancelToken,
) -> Result<Taken, RegionError> {
    let id = shared.pool.next_region_id();
    let mut spec =
        RegionSpec::new(format!("hugemem-r{id}"), part.size, Some(part.node)).with_policy(policy);
    if part.paths {
        if let Some(dir) = match policy {
            RegionPolicy::Strict(p) => shared.hugetlbfs_dir(p),
            RegionPolicy::Best => None,
        } {
            spec = spec.with_backing(Backing::HugetlbfsDir(dir.to_path_buf()));
        }
    }
    let opts = RunOptions {
        cancel: Some(cancel),
        ..RunOptions::default()
    };
    let (region, report) = Region::allocate(&shared.topology, &spec, &opts)?;
    match region.verify_placement() {
        Ok(p) if !p.misplaced.is_empty() => {
            warn!(
                region = id,
                node = part.node,
                misplaced = p.misplaced.len(),
                pages = p.pages,
                "fresh region has pages off its node"
            );
        }
        Ok(_) => {}
        Err(e) => warn!(region = id, error = %e, "cannot verify the placement of a fresh region"),
    }
    debug!(
        region = id,
        gb_per_s = report.gb_per_s(),
        seconds = report.seconds,
        "fresh region populated"
    );
    let taken = shared
        .pool
        .insert_fresh(id, region)
        .map_err(|source| RegionError::Create {
            name: spec.name.clone(),
            source,
        })?;
    Metrics::add(&shared.metrics.regions_fresh, 1);
    Ok(taken)
}

/// Free bytes of `page_size` on `node` a new region could get now.
fn free_bytes(page_size: PageSize, node: NodeId) -> u64 {
    let node_free = PoolCounts::read(page_size, Some(node))
        .ok()
        .flatten()
        .map_or(0, |c| c.free);
    let host = PoolCounts::read(page_size, None)
        .ok()
        .flatten()
        .map_or(0, |c| c.available());
    node_free.min(host) * page_size.bytes()
}

fn is_shortage(e: &RegionError) -> bool {
    match e {
        RegionError::Unavailable { .. } => true,
        RegionError::Map { source, .. } => source.raw_os_error() == Some(libc::ENOMEM),
        RegionError::Prepare { source, .. } => {
            !matches!(source, PrepareError::Run(RunError::Cancelled { .. }))
        }
        _ => false,
    }
}

/// The error and its sources, `: `-joined.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

fn region_refusal(e: &RegionError) -> Refusal {
    let status = match e {
        RegionError::BadSize(_) => Status::Invalid,
        RegionError::UnknownNode { .. } | RegionError::MemorylessNode(_) => Status::BadNode,
        RegionError::Unavailable { .. } => Status::NoMemory,
        RegionError::Create { source, .. }
        | RegionError::Size { source, .. }
        | RegionError::Map { source, .. }
            if matches!(source.raw_os_error(), Some(libc::ENOMEM | libc::ENOSPC)) =>
        {
            Status::NoMemory
        }
        RegionError::Prepare { source, .. } => return prepare_refusal(source),
        _ => Status::Internal,
    };
    (status, chain(e))
}

fn prepare_refusal(e: &PrepareError) -> Refusal {
    match e {
        PrepareError::Run(RunError::Cancelled { .. }) => {
            (Status::Internal, "the daemon is shutting down".into())
        }
        PrepareError::Run(RunError::Work { .. }) => (Status::NoMemory, chain(e)),
        _ => (Status::Internal, chain(e)),
    }
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
