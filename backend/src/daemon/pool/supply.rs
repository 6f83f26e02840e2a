//! How the pool gets a region from each source its choice ([`super::take`])
//! can pick: a clean pooled region (re-scanned when it can be opened by
//! path), a smaller clean pooled region grown in place, a dirty pooled
//! region cleared now, a fresh region from the kernel, and lazy mode's
//! dirty-but-resident and fresh-unpopulated regions; and how their errors
//! become refusals. Nothing here chooses between sources.

use std::time::Instant;

use clearing::{CancelToken, RunError, RunOptions};
use guest_mem::size::format_size;
use guest_mem::{
    Backing, PagePolicy as RegionPolicy, PageSize, PoolCounts, PrepareError, Region, RegionError,
    RegionSpec,
};
use numa::NodeId;
use tracing::{debug, info, warn};

use super::reserve::Taken;
use super::table::Pool;
use crate::daemon::counters::metrics::Metrics;
use crate::daemon::ids::{PoolKey, RegionId};
use crate::daemon::peers::holders::{self, Owned};
use crate::diag::chain;
use crate::fault::dirty_pages_resident;
use crate::proto::Status;

/// A refusal: status and the message for the client.
pub type Refusal = (Status, String);

/// A clean pooled region of `key` and exactly `size` bytes. Path-backed
/// ones (a path can be opened) and, with `pool.recheck_on_reuse`, memfds
/// too are scanned for holders once more; a held one goes back to
/// quarantine and the next is tried.
pub(super) fn take_clean_checked(pool: &Pool, key: PoolKey, size: u64) -> Option<Taken> {
    while let Some(t) = pool.take_clean(key, size) {
        if pool.config().recheck_on_reuse || key.paths {
            if let Some(owned) = pool.owned(t.id) {
                if let Some(holder) = holders::scan_for_reuse(
                    std::slice::from_ref(&owned),
                    pool.sources.predecessor.get(),
                )
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
            node = key.node,
            size,
            "ALLOC served from the clean pool"
        );
        Metrics::add(&pool.metrics.regions_pooled, 1);
        return Some(t);
    }
    None
}

/// A dirty pooled region of `key` and exactly `size` bytes, cleared here
/// with [`Region::prepare_eager`] (all CPUs of the node), waiting (at most
/// 60 s) for pages a scrubber already holds. `Ok(None)` when there is none.
///
/// # Errors
///
/// The clear failed or did not finish in time; the region is back in the
/// pool (dirty, for the scrubbers).
pub(super) fn reclear_dirty(
    pool: &Pool,
    key: PoolKey,
    size: u64,
    cancel: &CancelToken,
) -> Result<Option<Taken>, Refusal> {
    let Some(t) = pool.take_dirty(key, size) else {
        return Ok(None);
    };
    let opts = RunOptions {
        cancel: Some(cancel),
        ..RunOptions::default()
    };
    let cleared = t.region.prepare_eager(&pool.sources.topology, &opts);
    // A scrubber finishing its batch takes at most one batch's time.
    let clean = cleared.is_ok()
        && pool.wait_clean(
            &t.region,
            Instant::now() + std::time::Duration::from_secs(60),
        );
    if !clean {
        pool.put_back(&[t.id]);
        return Err(match cleared {
            Err(e) => prepare_refusal(&e),
            Ok(_) => (
                Status::Internal,
                format!(
                    "region {} ({} on {} pages, node {}) did not become clean in time",
                    t.id,
                    format_size(size),
                    key.page_size,
                    key.node
                ),
            ),
        });
    }
    info!(
        region = t.id,
        node = key.node,
        size,
        "ALLOC cleared a dirty pooled region"
    );
    Metrics::add(&pool.metrics.regions_recleared, 1);
    Ok(Some(t))
}

/// The largest clean pooled region of `key` smaller than `size`, grown to
/// it and its new pages prepared. `None` (the region, if any, is back in
/// the pool) when there is none or anything fails.
pub(super) fn grow_pooled(
    pool: &Pool,
    key: PoolKey,
    size: u64,
    cancel: &CancelToken,
) -> Option<Taken> {
    let mut d = pool.detach_smaller_clean(key, size)?;
    let old_len = d.region.len();
    if pool.config().recheck_on_reuse || key.paths {
        if let Ok(owned) = Owned::region(
            d.region.fd(),
            d.region.as_ptr() as usize,
            usize::try_from(old_len).unwrap_or(usize::MAX),
        ) {
            if let Some(holder) = holders::scan_for_reuse(
                std::slice::from_ref(&owned),
                pool.sources.predecessor.get(),
            )
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
    // The new pages are reserved at the grow's mmap (see `ReserveGate`).
    let grown = pool
        .gate
        .run(|| d.region.grow(&pool.sources.topology, size));
    if let Err(e) = grown {
        info!(
            region = d.id,
            node = key.node,
            from = old_len,
            to = size,
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
    let prepared = d.region.prepare_eager(&pool.sources.topology, &opts);
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
            node = key.node,
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
                node = key.node,
                page_size = %key.page_size,
                "grown pooled region {} -> {}",
                format_size(old_len),
                format_size(size)
            );
            Metrics::add(&pool.metrics.regions_grown, 1);
            Some(t)
        }
        Err(e) => {
            warn!(region = id, error = %e, "cannot keep a grown region; it went back to the kernel");
            None
        }
    }
}

/// A fresh region of `size` bytes on `node` from the kernel (`policy`
/// decides the page size; a path-backed one needs a strict size with a
/// mount), populated by node-pinned workers (`opts`: progress, cancel) and
/// inserted `Reserved`.
///
/// # Errors
///
/// As [`Region::allocate`].
pub(super) fn create(
    pool: &Pool,
    node: NodeId,
    size: u64,
    paths: bool,
    policy: RegionPolicy,
    opts: &RunOptions<'_>,
) -> Result<Taken, RegionError> {
    let id = pool.next_region_id();
    let mut spec = RegionSpec::new(format!("hugemem-r{id}"), size, Some(node)).with_policy(policy);
    if paths {
        if let Some(dir) = match policy {
            RegionPolicy::Strict(p) => pool.sources.hugetlbfs_dir(p),
            RegionPolicy::Best => None,
        } {
            spec = spec.with_backing(Backing::HugetlbfsDir(dir.to_path_buf()));
        }
    }
    // Pages are reserved at the region's mmap (see `ReserveGate`).
    let region = pool
        .gate
        .run(|| Region::create(&pool.sources.topology, &spec))?;
    let report = region
        .prepare_eager(&pool.sources.topology, opts)
        .map_err(|source| RegionError::Prepare {
            name: spec.name.clone(),
            source,
        })?;
    match region.verify_placement() {
        Ok(p) if !p.misplaced.is_empty() => {
            warn!(
                region = id,
                node,
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
    let taken = pool
        .insert_fresh(id, region)
        .map_err(|source| RegionError::Create {
            name: spec.name.clone(),
            source,
        })?;
    Metrics::add(&pool.metrics.regions_fresh, 1);
    Ok(taken)
}

// Called by the refill (`crate::daemon::background::refill`).
impl Pool {
    /// Refill (`crate::daemon::background::refill`): a fresh region of `bytes` on `node`
    /// in `page_size` pages, populated with `opts` (progress, cancel), put
    /// straight into the clean pool. Returns its id.
    ///
    /// # Errors
    ///
    /// As [`Region::allocate`]; nothing is pooled then.
    pub fn add_fresh(
        &self,
        node: NodeId,
        page_size: PageSize,
        bytes: u64,
        opts: &RunOptions<'_>,
    ) -> Result<RegionId, RegionError> {
        let t = create(
            self,
            node,
            bytes,
            false,
            RegionPolicy::Strict(page_size),
            opts,
        )?;
        // Fresh and populated: every page is clean; into the pool.
        self.put_back(&[t.id]);
        Ok(t.id)
    }
}

/// Lazy mode's first choice for one part: a dirty pooled region of exactly
/// `size` on `node` in one of the huge `candidates` (largest first) whose
/// dirty pages are all resident and none is being scrubbed. It is handed out
/// uncleared (flag LAZY); `None` when there is none.
///
/// The pool's scrubbers may still be clearing some of its pages: the fault
/// service defers faults on those until they are clean, and its own
/// scrubbers install them. A dirty page out of the page cache would not raise
/// a MINOR fault (see [`crate::fault::FaultService::start`]): such a region is put
/// back.
pub(super) fn take_lazy_dirty(
    pool: &Pool,
    node: NodeId,
    size: u64,
    candidates: &[PageSize],
    paths: bool,
) -> Option<Taken> {
    for &page_size in candidates.iter().filter(|p| p.is_huge()) {
        let key = PoolKey {
            node,
            page_size,
            paths,
        };
        let Some(t) = pool.take_dirty(key, size) else {
            continue;
        };
        // Pages a pool scrubber is still clearing are fine: faults on them
        // are re-checked until the scrubber finishes, then installed.
        match dirty_pages_resident(&t.region) {
            Ok(()) => return Some(t),
            Err(page) => warn!(
                region = t.id,
                page, "dirty pooled region has a page out of the page cache; not lazy"
            ),
        }
        pool.put_back(&[t.id]);
    }
    None
}

/// Lazy mode without dirty pooled memory: a fresh region of the first huge
/// candidate the kernel can give (largest first), created but **not
/// populated**; the kernel zeroes each page at its first fault (flag CLEAN,
/// no uffd needed): the VMM's first touch, or, with `pool.refault_ahead`,
/// the node's fault helpers faulting the region in ahead of the guest,
/// lowest offset first ([`Pool::fill_fresh`]), whichever comes first. A
/// page the VMM touches first is placed by the VMM's memory policy, not
/// bound to `node`. `None` when it cannot be created (the eager path then
/// tries, and says why).
pub(super) fn fresh_demand(
    pool: &Pool,
    node: NodeId,
    size: u64,
    candidates: &[PageSize],
) -> Option<Taken> {
    let id = pool.next_region_id();
    for &page_size in candidates.iter().filter(|p| p.is_huge()) {
        let spec = RegionSpec::new(format!("hugemem-r{id}"), size, Some(node))
            .with_policy(guest_mem::PagePolicy::Strict(page_size));
        // Pages are reserved at the region's mmap (see `ReserveGate`).
        let created = pool
            .gate
            .run(|| Region::create(&pool.sources.topology, &spec));
        match created {
            Ok(region) => {
                let taken = pool.insert_fresh(id, region).ok()?;
                pool.fill_fresh(taken.id);
                return Some(taken);
            }
            Err(e) => {
                info!(node, size, %page_size, error = %e, "lazy ALLOC: no fresh region for kernel demand faults")
            }
        }
    }
    None
}

/// Free pages of `page_size` on `node` a new region could get now (4 KiB:
/// unbounded here; the kernel says at creation).
pub fn free_pages(page_size: PageSize, node: NodeId) -> u64 {
    if !page_size.is_huge() {
        return u64::MAX / page_size.bytes();
    }
    let node_free = PoolCounts::read(page_size, Some(node))
        .ok()
        .flatten()
        .map_or(0, |c| c.free);
    let host = PoolCounts::read(page_size, None)
        .ok()
        .flatten()
        .map_or(0, |c| c.available());
    node_free.min(host)
}

/// The kernel had no pages (or memory) for the region.
pub(super) fn is_shortage(e: &RegionError) -> bool {
    match e {
        RegionError::Unavailable { .. } => true,
        RegionError::Map { source, .. } => source.raw_os_error() == Some(libc::ENOMEM),
        RegionError::Prepare { source, .. } => {
            !matches!(source, PrepareError::Run(RunError::Cancelled { .. }))
        }
        _ => false,
    }
}

/// The refusal for a creation error.
pub(super) fn region_refusal(e: &RegionError) -> Refusal {
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

/// The refusal for a clearing or populating error.
pub(super) fn prepare_refusal(e: &PrepareError) -> Refusal {
    match e {
        PrepareError::Run(RunError::Cancelled { .. }) => {
            (Status::Internal, "the daemon is shutting down".into())
        }
        PrepareError::Run(RunError::Work { .. }) => (Status::NoMemory, chain(e)),
        _ => (Status::Internal, chain(e)),
    }
}
