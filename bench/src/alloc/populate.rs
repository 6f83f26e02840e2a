//! The daemon-less ways to get a VM's RAM ready: hugemem's own regions
//! (node-local workers) and cloud-hypervisor's `prefault=on`, and the huge
//! pages they need.

use std::sync::Barrier;
use std::time::Instant;

use backend::proto::AllocPart;
use clearing::{Chunk, Job, RunOptions};
use guest_mem::size::format_size;
use guest_mem::{
    PagePolicy as RegionPolicy, PageSize, Region, RegionSpec, Reservation, SharedMapping,
};
use numa::{MbindFlags, MemPolicyMode, NodeMask, Topology};

use super::config::AllocBenchConfig;
use super::error::AllocBenchError;

/// cloud-hypervisor's cap on prefault threads.
const CH_MAX_PREFAULT_THREADS: usize = 16;
/// cloud-hypervisor gives each prefault thread at least this much memory.
const CH_BYTES_PER_THREAD: u64 = 4 << 30;

/// Threads cloud-hypervisor's prefault uses for `size` bytes of `page` pages.
pub fn cloud_hypervisor_threads(cpus: usize, size: u64, page: u64) -> usize {
    let pages = usize::try_from(size / page).unwrap_or(usize::MAX);
    let by_size = usize::try_from(size / CH_BYTES_PER_THREAD).unwrap_or(usize::MAX);
    cpus.min(CH_MAX_PREFAULT_THREADS)
        .min(pages)
        .min(by_size)
        .max(1)
}

/// Reserves `size / page` pages; falls back as the module docs say.
pub(super) fn reserve(
    cfg: &AllocBenchConfig,
    notes: &mut Vec<String>,
) -> Result<(PageSize, u64, Reservation), AllocBenchError> {
    let candidates: Vec<PageSize> = match cfg.page_size {
        Some(p) => vec![p],
        None => vec![PageSize::Huge1G, PageSize::Huge2M],
    };
    let mut partial: Vec<(PageSize, u64, Reservation)> = Vec::new();
    for page in &candidates {
        let page = *page;
        if !page.is_huge() {
            notes.push(
                "4K pages are not measured: cloud-hypervisor prefaults hugetlb memory".into(),
            );
            continue;
        }
        if !cfg.size.is_multiple_of(page.bytes()) {
            notes.push(format!(
                "{} is not a multiple of {page} pages",
                format_size(cfg.size)
            ));
            continue;
        }
        let want = cfg.size / page.bytes();
        match Reservation::for_run(page, want) {
            Ok(r) if r.report().met => {
                if !notes.is_empty() {
                    notes.push(format!(
                        "measuring {} on {page} pages instead",
                        format_size(cfg.size)
                    ));
                }
                return Ok((page, cfg.size, r));
            }
            Ok(r) => {
                notes.push(format!(
                    "asked for {want} free {page} pages, the kernel has {}",
                    r.report().free
                ));
                let got = r.report().free.min(want);
                if got > 0 {
                    partial.push((page, got * page.bytes(), r));
                }
            }
            Err(e) => notes.push(format!("cannot reserve {page} pages: {e}")),
        }
    }
    // Neither page size at the full size: the largest size one of them allows
    // (1 GiB first when sizes tie).
    let best = partial
        .into_iter()
        .reduce(|a, b| if b.1 > a.1 { b } else { a });
    match best {
        Some((page, size, r)) => {
            notes.push(format!(
                "measuring {} on {page} pages instead of {}",
                format_size(size),
                format_size(cfg.size)
            ));
            Ok((page, size, r))
        }
        None => Err(AllocBenchError::NoPages(notes.join("; "))),
    }
}

/// One part per node with memory and CPUs, pages shared out evenly.
pub(super) fn node_parts(topology: &Topology, size: u64, page: u64) -> Vec<AllocPart> {
    let mut nodes: Vec<u32> = topology
        .nodes()
        .iter()
        .filter(|n| !n.is_memoryless() && !n.cpus.is_empty())
        .map(|n| n.id)
        .collect();
    if nodes.is_empty() {
        nodes.push(0);
    }
    let pages = size / page;
    let n = nodes.len() as u64;
    nodes
        .iter()
        .enumerate()
        .map(|(i, node)| AllocPart {
            node: *node,
            size: (pages / n + u64::from((i as u64) < pages % n)) * page,
        })
        .filter(|p| p.size > 0)
        .collect()
}

/// Daemon-less: one region per node, created and populated on all nodes at once.
pub(super) fn fresh_eager(
    topology: &Topology,
    parts: &[AllocPart],
    page: PageSize,
) -> Result<f64, AllocBenchError> {
    let started = Instant::now();
    let regions = std::thread::scope(|s| {
        let handles: Vec<_> = parts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                s.spawn(move || {
                    let spec = RegionSpec::new(format!("bench-alloc-{i}"), p.size, Some(p.node))
                        .with_policy(RegionPolicy::Strict(page));
                    Region::allocate(topology, &spec, &RunOptions::default()).map(|(r, _)| r)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| AllocBenchError::Panicked)?
                    .map_err(AllocBenchError::from)
            })
            .collect::<Result<Vec<_>, _>>()
    })?;
    let seconds = started.elapsed().as_secs_f64();
    drop(regions);
    Ok(seconds)
}

/// Daemon-less fresh populate with exactly `workers` node-local workers: one
/// memfd per part, bound to its node, populated chunk by chunk by workers
/// pinned to that node (`workers` split over the parts, at least one each).
pub(super) fn fresh_eager_workers(
    topology: &Topology,
    parts: &[AllocPart],
    page: PageSize,
    workers: usize,
) -> Result<f64, AllocBenchError> {
    let page_len = usize::try_from(page.bytes()).map_err(|_| AllocBenchError::Size)?;
    let per_part = workers.div_ceil(parts.len().max(1)).max(1);
    let started = Instant::now();
    let mut maps = Vec::with_capacity(parts.len());
    let mut jobs = Vec::with_capacity(parts.len());
    for p in parts {
        let len = usize::try_from(p.size).map_err(|_| AllocBenchError::Size)?;
        let map = SharedMapping::memfd(len, page)?;
        numa::mbind(
            map.addr() as usize,
            len,
            MemPolicyMode::Bind,
            &NodeMask::single(p.node),
            MbindFlags::default(),
        )?;
        // Offsets into the job's own mapping: `Chunk::job` picks the mapping.
        jobs.push(Job {
            start: 0,
            len,
            align: page_len,
            min_chunk: page_len,
            max_threads: per_part,
            node: Some(p.node),
        });
        maps.push(map);
    }
    clearing::run_jobs(topology, &jobs, &RunOptions::default(), |c: &Chunk| {
        maps[c.job].populate_write(c.start, c.len)
    })?;
    let seconds = started.elapsed().as_secs_f64();
    drop(maps);
    Ok(seconds)
}

/// cloud-hypervisor's prefault: memfd, shared mapping, `threads` unpinned
/// threads each populating its share of whole pages.
pub(crate) fn cloud_hypervisor_style(
    size: u64,
    page: PageSize,
    threads: usize,
) -> Result<f64, AllocBenchError> {
    let len = usize::try_from(size).map_err(|_| AllocBenchError::Size)?;
    let page_len = usize::try_from(page.bytes()).map_err(|_| AllocBenchError::Size)?;
    let started = Instant::now();
    let map = SharedMapping::memfd(len, page)?;
    let pages = len / page_len;
    let barrier = Barrier::new(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                // Pages split as evenly as possible, the first ones one more.
                let first = t * (pages / threads) + t.min(pages % threads);
                let count = pages / threads + usize::from(t < pages % threads);
                let (map, barrier) = (&map, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    map.populate_write(first * page_len, count * page_len)
                })
            })
            .collect();
        handles.into_iter().try_for_each(|h| {
            h.join()
                .map_err(|_| AllocBenchError::Panicked)?
                .map_err(AllocBenchError::from)
        })
    })?;
    let seconds = started.elapsed().as_secs_f64();
    drop(map);
    Ok(seconds)
}
