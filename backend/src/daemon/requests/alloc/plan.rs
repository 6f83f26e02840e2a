//! Planning and obtaining an ALLOC: validate a request into per-node
//! parts ([`plan`]), have the pool take one region per part
//! ([`Pool::take`](crate::daemon::pool::Pool::take), **the one place that
//! decides which region serves a request**, by the rule of
//! `crate::daemon::pool::take`), then lock the memory if asked
//! ([`obtain_all`]).
//!
//! [`obtain_all`] blocks (clearing, populating, `/proc` scans, `mmap`,
//! locking): [`crate::daemon::requests::alloc::serve()`] calls it through
//! `spawn_blocking`, whose thread only waits for the pinned workers of
//! [`clearing::run_jobs`]. A cancel token stops a long prepare at daemon
//! shutdown.

use std::io;
use std::time::Instant;

use clearing::{CancelToken, RunOptions};
use guest_mem::{LockOptions, LockRange, PagePolicy as RegionPolicy, PageSize, Region};
use numa::{NodeId, Topology};

use super::room::Alloc;
use crate::diag::chain;
use crate::proto::messages::{AllocRequest, ClearMode, PagePolicy};
use crate::proto::{Status, ANY_NODE};

use crate::daemon::pool::{set_access_all, Access, Obtained, Part, Refusal};

/// Checks a request against the host and the limits; nothing is allocated.
///
/// # Errors
///
/// `BadNode` for nodes that do not exist or have
/// no memory, `Invalid` for sizes that do not fit the page size, `NoMemory`
/// above the per-allocation limit.
pub fn plan(room: &Alloc, req: &AllocRequest) -> Result<Vec<Part>, Refusal> {
    if req.total_size > room.max_alloc {
        return Err((
            Status::NoMemory,
            format!(
                "{} bytes asked, at most {} per allocation on this host",
                req.total_size, room.max_alloc
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
    let available: Vec<NodeId> = room
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
                .filter(|p| room.hugetlbfs_dir(*p).is_some())
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
            None
        } else {
            match room.topology.nodes().iter().find(|n| n.id == node) {
                None => {
                    return Err((Status::BadNode, format!("part {i}: NUMA node {node} does not exist (this host has nodes {available:?})")))
                }
                Some(n) if n.is_memoryless() => {
                    return Err((Status::BadNode, format!("part {i}: NUMA node {node} has no memory (nodes with memory: {available:?})")))
                }
                Some(_) => Some(node),
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

/// Obtains every part (blocking): the pool takes a region for each
/// ([`Pool::take`](crate::daemon::pool::Pool::take)), waiting at most until
/// `deadline`; every region's file is handed to `owner`, and the memory is
/// locked when `lock`. On error every region taken so far goes back to the
/// pool; on success all are `Reserved` for the caller to commit.
///
/// # Errors
///
/// The first part's refusal.
pub fn obtain_all(
    room: &Alloc,
    parts: &[Part],
    lock: bool,
    owner: (u32, u32),
    deadline: Instant,
    cancel: &CancelToken,
) -> Result<Vec<Obtained>, Refusal> {
    let taken = room.pool.take(parts, deadline, cancel)?;
    let ids = |taken: &[Obtained]| taken.iter().map(|o| o.taken.id).collect::<Vec<_>>();
    // Every region's file belongs to the client while it uses it (mode
    // 0600), so that a VMM running as an allowed non-root uid can open it
    // again (QEMU's `mem-path=/proc/self/fd/N`, a hugetlbfs path); the pool
    // takes it back on release, before quarantine.
    let access = Access::Tenant {
        uid: owner.0,
        gid: owner.1,
    };
    if let Err((i, e)) = set_access_all(
        taken.iter().map(|o| &*o.taken.region),
        access,
        Access::Daemon,
    ) {
        let id = taken.get(i).map(|o| o.taken.id).unwrap_or_default();
        room.pool.put_back(&ids(&taken));
        return Err((
            Status::Internal,
            format!("cannot hand region {id} to uid {}: {e}", owner.0),
        ));
    }
    if lock {
        let regions: Vec<&Region> = taken.iter().map(|o| &*o.taken.region).collect();
        if let Err(e) = lock_regions(&room.topology, &regions, true, 0, Some(cancel)) {
            // Undo what was locked; unlocking memory that is not locked is fine.
            let _ = lock_regions(&room.topology, &regions, false, 0, None);
            room.pool.put_back(&ids(&taken));
            return Err(e);
        }
    }
    Ok(taken)
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

/// `io::Error` for a join failure of a blocking task.
pub fn join_error(e: &tokio::task::JoinError) -> io::Error {
    io::Error::other(format!("blocking task failed: {e}"))
}
