//! `hugemem bench alloc`: time until a VM's RAM is ready, four ways, in one run.
//!
//! * `fresh_eager_s`: hugemem without the daemon: [`Region::allocate`] per
//!   NUMA node (memfd, `mbind`, then `MADV_POPULATE_WRITE` by workers pinned
//!   to the node; the kernel zeroes each new huge page), all nodes at once.
//! * `fresh_eager_daemon_s`: the same through the daemon: ALLOC on a daemon
//!   whose pool is empty (socket round trip, pool bookkeeping, fd passing).
//! * `pooled_eager_s`: ALLOC on the same daemon after a FREE of the same size
//!   and after its scrubbers have cleaned it: the clean-pool hand-out. Its
//!   price is paid after the FREE: `free_to_clean_s` (wall) and
//!   `scrub_cpu_s_per_gib` (CPU seconds of the daemon per GiB scrubbed).
//!
//! Every variant is timed to the same point: the memory mapped in this
//! process and ready for a VMM. The daemon-less ones end with their own
//! populated mapping; both daemon ALLOCs include receiving the fds and
//! mapping them as a rust-vmm VMM does (`Allocation::guest_memory`). What
//! still differs: the daemon variants' page tables in the VMM's mapping are
//! filled by minor faults later (the pages exist; nothing is zeroed then).
//! * `cloud_hypervisor_style_s`: what cloud-hypervisor does with
//!   `prefault=on` today: a hugetlb memfd mapped shared, then
//!   `threads = min(CPUs, 16, pages, size / 4 GiB)` (at least 1) unpinned
//!   threads, each `MADV_POPULATE_WRITE` over its share of the pages.
//!
//! **Scaling** (`scaling`, `--threads 1,2,…`): the daemon-less fresh
//! populate again, with exactly N workers pinned to the nodes (N split over
//! the nodes with memory and CPUs; each node's memfd `mbind`-ed to it, then
//! `MADV_POPULATE_WRITE` chunk by chunk through [`clearing::run_jobs`], the
//! mechanism [`Region::prepare_eager`] uses with all CPUs), best and median
//! of `reps` per count, and GB/s relative to the first count.
//!
//! Every figure is the best of `reps`; each repetition runs all four, in
//! alternating order (even repetitions daemon-less first, odd ones daemon
//! first), so drift hits them alike. Before anything is timed the whole size
//! is populated and freed once, because the outer host backs never-touched
//! memory lazily (docs/platform.md#first-touch: a first 1 GiB fault ~1.5 s, later ones ~0.2 s).
//! At most `size` bytes of huge pages are held at any time, so the run needs
//! `size / page` free pages, which it reserves through `numa::hugepages`.
//!
//! # Page size and size fallback
//!
//! 1 GiB pages at the asked size first; then 2 MiB pages at the asked size;
//! then the largest size the kernel's free 1 GiB (then 2 MiB) pages allow.
//! Any change is reported in `page_size`, `size_bytes` and `note`, never
//! silently.

use std::sync::Barrier;
use std::time::{Duration, Instant};

use clearing::{Chunk, Job, RunError, RunOptions};
use guest_mem::{
    PagePolicy as RegionPolicy, PageSize, Region, RegionSpec, Reservation, SharedMapping,
};
use hugemem_client::stats::Stats;
use numa::{MbindFlags, MemPolicyMode, NodeMask, Topology};
use serde::Serialize;

use crate::stats::{best, median, ratio};
use backend::client::{Client, ClientError};
use backend::daemon::config::PoolConfig;
use backend::daemon::{ByteSize, Config, Daemon, DaemonError, DaemonHandle};
use backend::proto::{AllocPart, AllocRequest, ClearMode, PagePolicy};
use guest_mem::size::format_size;

/// The report as a table for operators.
mod table;

/// cloud-hypervisor's cap on prefault threads.
const CH_MAX_PREFAULT_THREADS: usize = 16;
/// cloud-hypervisor gives each prefault thread at least this much memory.
const CH_BYTES_PER_THREAD: u64 = 4 << 30;
/// Bytes in a GiB, for per-GiB figures.
const GIB: f64 = (1u64 << 30) as f64;
/// Longest wait for a FREE to come back clean.
const CLEAN_DEADLINE: Duration = Duration::from_secs(120);

/// Errors of the alloc benchmark.
#[derive(Debug, thiserror::Error)]
pub enum AllocBenchError {
    /// Zero size or repetitions.
    #[error("size and repetitions must be non-zero, and size a multiple of 2M")]
    Size,
    /// No huge pages could be had.
    #[error("no huge pages could be had for the run: {0}")]
    NoPages(String),
    /// Reading the topology failed.
    #[error("cannot read the NUMA topology")]
    Topology(#[from] numa::TopologyError),
    /// Creating or populating a region failed.
    #[error("daemon-less allocation failed")]
    Region(#[from] guest_mem::RegionError),
    /// The cloud-hypervisor-style mapping failed.
    #[error("cloud-hypervisor-style prefault failed")]
    Mapping(#[from] guest_mem::MappingError),
    /// A prefault thread panicked.
    #[error("a prefault thread panicked")]
    Panicked,
    /// The daemon did not start.
    #[error("cannot start the daemon")]
    Daemon(#[from] DaemonError),
    /// A daemon request failed.
    #[error("daemon request failed")]
    Client(#[from] ClientError),
    /// The pool did not come back clean.
    #[error("the pool did not show the freed memory clean within {0:?}")]
    CleanTimeout(Duration),
    /// Binding a scaling run's memory to its node failed.
    #[error("cannot bind memory to its node")]
    Policy(#[from] numa::PolicyError),
    /// A `--threads` count of 0.
    #[error("worker counts must be at least 1")]
    Threads,
    /// The node-local populate workers of a scaling run failed.
    #[error("populate workers failed")]
    Workers(#[from] RunError<guest_mem::MappingError>),
    /// Mapping the daemon's memory as a VMM would failed.
    #[error("cannot map the allocation as guest memory")]
    GuestMemory(#[from] backend::guest_memory::GuestMemoryError),
    /// Reading the process CPU clock failed.
    #[error("cannot read the process CPU clock")]
    Clock(#[source] std::io::Error),
}

/// What to measure.
#[derive(Debug, Clone)]
pub struct AllocBenchConfig {
    /// VM size.
    pub size: u64,
    /// Repetitions; the best of each is reported.
    pub reps: usize,
    /// Page size; `None` = 1 GiB, then 2 MiB (said out loud).
    pub page_size: Option<PageSize>,
    /// Worker counts for the fresh-populate scaling run; empty = 1..=all CPUs.
    pub threads: Vec<usize>,
}

/// One worker count of the scaling run.
#[derive(Debug, Clone, Serialize)]
pub struct ScalingPoint {
    /// Node-local workers, all nodes together.
    pub threads: usize,
    /// Fresh populate, best of reps, seconds.
    pub best_s: f64,
    /// Median of reps, seconds.
    pub median_s: f64,
    /// `size / best_s`, GB/s (10^9).
    pub gbps: f64,
    /// GB/s relative to the first worker count.
    pub speedup: f64,
}

/// Ratios of the figures of one run.
#[derive(Debug, Clone, Serialize)]
pub struct AllocRatios {
    /// `cloud_hypervisor_style_s / fresh_eager_s`: >1 means hugemem's fresh
    /// path is faster than cloud-hypervisor's prefault.
    pub cloud_hypervisor_style_over_fresh_eager: f64,
    /// `cloud_hypervisor_style_s / pooled_eager_s`.
    pub cloud_hypervisor_style_over_pooled_eager: f64,
    /// `fresh_eager_daemon_s / pooled_eager_s`: what the clean pool saves.
    pub fresh_eager_daemon_over_pooled_eager: f64,
    /// `fresh_eager_daemon_s / fresh_eager_s`: the daemon's overhead on a fresh ALLOC.
    pub fresh_eager_daemon_over_fresh_eager: f64,
}

/// The report; `--json` prints it as one object.
#[derive(Debug, Clone, Serialize)]
pub struct AllocBenchReport {
    /// Bytes per allocation actually measured.
    pub size_bytes: u64,
    /// Bytes asked for.
    pub requested_size_bytes: u64,
    /// Page size used.
    pub page_size: String,
    /// What changed from the request and why (`null` when nothing did).
    pub note: Option<String>,
    /// Repetitions.
    pub reps: usize,
    /// Online CPUs.
    pub cpus: usize,
    /// NUMA nodes with memory and CPUs (one region per node).
    pub nodes: usize,
    /// Daemon-less fresh allocation, best of reps, seconds.
    pub fresh_eager_s: f64,
    /// Fresh ALLOC through the daemon, best of reps, seconds.
    pub fresh_eager_daemon_s: f64,
    /// ALLOC from the clean pool, best of reps, seconds.
    pub pooled_eager_s: f64,
    /// cloud-hypervisor-style prefault, best of reps, seconds.
    pub cloud_hypervisor_style_s: f64,
    /// Threads the cloud-hypervisor-style prefault used.
    pub cloud_hypervisor_style_threads: usize,
    /// `size / fresh_eager_s`, GB/s (10^9).
    pub fresh_eager_gbps: f64,
    /// `size / cloud_hypervisor_style_s`, GB/s.
    pub cloud_hypervisor_style_gbps: f64,
    /// FREE to clean pool (scrub), best of reps, seconds.
    pub free_to_clean_s: f64,
    /// CPU seconds the scrub of one GiB cost (all the daemon's threads),
    /// median of reps: the price of the pooled figure, paid after FREE.
    pub scrub_cpu_s_per_gib: f64,
    /// Medians over the repetitions, seconds (same keys as `samples`).
    pub medians: AllocMedians,
    /// All repetitions, seconds, in order.
    pub samples: AllocSamples,
    /// Ratios.
    pub ratios: AllocRatios,
    /// Fresh populate with each `--threads` worker count.
    pub scaling: Vec<ScalingPoint>,
}

/// Median times over the repetitions.
#[derive(Debug, Clone, Serialize)]
pub struct AllocMedians {
    /// Daemon-less fresh.
    pub fresh_eager_s: f64,
    /// Daemon fresh.
    pub fresh_eager_daemon_s: f64,
    /// Daemon pooled.
    pub pooled_eager_s: f64,
    /// cloud-hypervisor style.
    pub cloud_hypervisor_style_s: f64,
    /// FREE to clean.
    pub free_to_clean_s: f64,
}

/// Per-repetition times.
#[derive(Debug, Clone, Serialize, Default)]
pub struct AllocSamples {
    /// Daemon-less fresh.
    pub fresh_eager_s: Vec<f64>,
    /// Daemon fresh.
    pub fresh_eager_daemon_s: Vec<f64>,
    /// Daemon pooled.
    pub pooled_eager_s: Vec<f64>,
    /// cloud-hypervisor style.
    pub cloud_hypervisor_style_s: Vec<f64>,
    /// FREE to clean.
    pub free_to_clean_s: Vec<f64>,
    /// CPU seconds of FREE to clean.
    pub free_to_clean_cpu_s: Vec<f64>,
}

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
fn reserve(
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
fn node_parts(topology: &Topology, size: u64, page: u64) -> Vec<AllocPart> {
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
fn fresh_eager(
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
fn fresh_eager_workers(
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
fn cloud_hypervisor_style(
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

/// (clean bytes, dirty + quarantined bytes) over every pool in a STATS document.
pub(super) fn pool_state(stats: &Stats) -> (u64, u64) {
    (
        stats.pool_sum(|p| p.clean_bytes),
        stats.pool_sum(|p| p.dirty_bytes + p.quarantined_bytes),
    )
}

fn wait_clean(daemon: &DaemonHandle, bytes: u64) -> Result<(), AllocBenchError> {
    let deadline = Instant::now() + CLEAN_DEADLINE;
    loop {
        let (clean, pending) = pool_state(&daemon.stats());
        if clean >= bytes && pending == 0 {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(AllocBenchError::CleanTimeout(CLEAN_DEADLINE));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Wall and CPU time of a FREE until the pool shows the memory clean.
#[derive(Debug, Clone, Copy)]
struct DaemonTimes {
    seconds: f64,
    /// CPU time of this whole process meanwhile: the in-process daemon's
    /// scrubbers, plus this thread's 1 ms polling (negligible).
    cpu_seconds: f64,
}

/// CPU time this process has used, all threads, seconds.
fn process_cpu_seconds() -> Result<f64, AllocBenchError> {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_PROCESS_CPUTIME_ID)
        .map_err(|e| AllocBenchError::Clock(e.into()))?;
    #[allow(clippy::cast_precision_loss)] // seconds of CPU time fit an f64 exactly
    Ok(t.tv_sec() as f64 + t.tv_nsec() as f64 * 1e-9)
}

/// Through a fresh daemon: fresh ALLOC, FREE, wait for clean, pooled ALLOC.
/// Returns (fresh seconds, free→clean times, pooled seconds).
fn through_daemon(
    size: u64,
    parts: &[AllocPart],
    page: PageSize,
) -> Result<(f64, DaemonTimes, f64), AllocBenchError> {
    let dir = std::env::temp_dir().join(format!("hugemem-bench-alloc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)
        .map_err(|e| AllocBenchError::NoPages(format!("socket dir: {e}")))?;
    let defaults = Config::default();
    // The pool must keep the freed VM, and look for other holders often.
    let config = Config {
        socket: dir.join("hugemem.sock"),
        pool: PoolConfig {
            target: defaults.pool.target.max(ByteSize(size)),
            limit: defaults.pool.limit.max(ByteSize(size)),
            recheck_ms: 10,
            ..defaults.pool.clone()
        },
        ..defaults
    };
    let daemon = Daemon::start(config)?;
    let result = (|| {
        let mut client = Client::connect(daemon.socket_path())?;
        let request = AllocRequest {
            total_size: size,
            page_policy: match page {
                PageSize::Huge1G => PagePolicy::Huge1G,
                PageSize::Huge2M => PagePolicy::Huge2M,
                PageSize::Base4K => PagePolicy::Base4K,
            },
            clear_mode: ClearMode::Eager,
            lock: false,
            parts: parts.to_vec(),
            want_paths: false,
        };
        // Both ALLOCs are timed to the point the daemon-less variants end
        // at: the memory mapped in this process and ready for a VMM (a
        // rust-vmm VMM's `GuestMemoryMmap`), not just the fds received.
        let t = Instant::now();
        let a = client.alloc(request.clone())?;
        let memory = a.guest_memory()?;
        let fresh = t.elapsed().as_secs_f64();
        let id = a.id;
        drop((memory, a));
        let (t, cpu) = (Instant::now(), process_cpu_seconds()?);
        client.free(id)?;
        wait_clean(&daemon, size)?;
        let clean = DaemonTimes {
            seconds: t.elapsed().as_secs_f64(),
            cpu_seconds: process_cpu_seconds()? - cpu,
        };
        let t = Instant::now();
        let a = client.alloc(request)?;
        let memory = a.guest_memory()?;
        let pooled = t.elapsed().as_secs_f64();
        let id = a.id;
        drop((memory, a));
        client.free(id)?;
        Ok((fresh, clean, pooled))
    })();
    if let Err(e) = daemon.shutdown() {
        tracing::warn!(error = %e, "daemon shutdown failed");
    }
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// Runs the benchmark. `progress` gets one line per step.
///
/// # Errors
///
/// See [`AllocBenchError`].
pub fn run(
    cfg: &AllocBenchConfig,
    progress: &mut dyn FnMut(&str),
) -> Result<AllocBenchReport, AllocBenchError> {
    if cfg.size == 0 || cfg.reps == 0 || !cfg.size.is_multiple_of(2 << 20) {
        return Err(AllocBenchError::Size);
    }
    if cfg.threads.contains(&0) {
        return Err(AllocBenchError::Threads);
    }
    let topology = Topology::detect()?;
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    let mut notes = Vec::new();
    let (page, size, _reservation) = reserve(cfg, &mut notes)?;
    let note = (!notes.is_empty()).then(|| notes.join("; "));
    let parts = node_parts(&topology, size, page.bytes());
    let ch_threads = cloud_hypervisor_threads(cpus, size, page.bytes());
    progress(&format!(
        "{} on {page} pages, {} node(s), cloud-hypervisor style with {ch_threads} thread(s){}",
        format_size(size),
        parts.len(),
        note.as_deref()
            .map(|n| format!(" (note: {n})"))
            .unwrap_or_default()
    ));

    progress("warm-up: populating and freeing the pages once");
    cloud_hypervisor_style(size, page, ch_threads)?;

    let mut s = AllocSamples::default();
    for rep in 0..cfg.reps {
        progress(&format!("repetition {}/{}", rep + 1, cfg.reps));
        let daemonless = |s: &mut AllocSamples| -> Result<(), AllocBenchError> {
            s.fresh_eager_s.push(fresh_eager(&topology, &parts, page)?);
            s.cloud_hypervisor_style_s
                .push(cloud_hypervisor_style(size, page, ch_threads)?);
            Ok(())
        };
        let daemon = |s: &mut AllocSamples| -> Result<(), AllocBenchError> {
            let (fresh, clean, pooled) = through_daemon(size, &parts, page)?;
            s.fresh_eager_daemon_s.push(fresh);
            s.free_to_clean_s.push(clean.seconds);
            s.free_to_clean_cpu_s.push(clean.cpu_seconds);
            s.pooled_eager_s.push(pooled);
            Ok(())
        };
        if rep % 2 == 0 {
            daemonless(&mut s)?;
            daemon(&mut s)?;
        } else {
            daemon(&mut s)?;
            daemonless(&mut s)?;
        }
        progress(&format!(
            "  fresh {:.3} s, fresh via daemon {:.3} s, pooled {:.4} s, cloud-hypervisor style {:.3} s",
            s.fresh_eager_s[rep], s.fresh_eager_daemon_s[rep], s.pooled_eager_s[rep], s.cloud_hypervisor_style_s[rep]
        ));
    }
    let counts: Vec<usize> = if cfg.threads.is_empty() {
        (1..=cpus.max(1)).collect()
    } else {
        cfg.threads.clone()
    };
    let mut per_count: Vec<Vec<f64>> = vec![Vec::new(); counts.len()];
    for rep in 0..cfg.reps {
        // Alternate the order of the worker counts between repetitions.
        let mut order: Vec<usize> = (0..counts.len()).collect();
        if rep % 2 == 1 {
            order.reverse();
        }
        for i in order {
            per_count[i].push(fresh_eager_workers(&topology, &parts, page, counts[i])?);
        }
    }
    let mut scaling: Vec<ScalingPoint> = counts
        .iter()
        .zip(&per_count)
        .map(|(&threads, samples)| {
            let best_s = best(samples);
            ScalingPoint {
                threads,
                best_s,
                median_s: median(samples),
                gbps: ratio(size as f64 / 1e9, best_s),
                speedup: 0.0,
            }
        })
        .collect();
    let base = scaling.first().map_or(0.0, |p| p.gbps);
    for p in &mut scaling {
        p.speedup = ratio(p.gbps, base);
        progress(&format!(
            "fresh populate, {} node-local worker(s): {:.3} s, {:.2} GB/s ({:.2}x)",
            p.threads, p.best_s, p.gbps, p.speedup
        ));
    }

    let fresh = best(&s.fresh_eager_s);
    let fresh_daemon = best(&s.fresh_eager_daemon_s);
    let pooled = best(&s.pooled_eager_s);
    let ch = best(&s.cloud_hypervisor_style_s);
    #[allow(clippy::cast_precision_loss)] // rates
    let gb = size as f64 / 1e9;
    Ok(AllocBenchReport {
        size_bytes: size,
        requested_size_bytes: cfg.size,
        page_size: page.to_string(),
        note,
        reps: cfg.reps,
        cpus,
        nodes: parts.len(),
        fresh_eager_s: fresh,
        fresh_eager_daemon_s: fresh_daemon,
        pooled_eager_s: pooled,
        cloud_hypervisor_style_s: ch,
        cloud_hypervisor_style_threads: ch_threads,
        fresh_eager_gbps: ratio(gb, fresh),
        cloud_hypervisor_style_gbps: ratio(gb, ch),
        free_to_clean_s: best(&s.free_to_clean_s),
        scrub_cpu_s_per_gib: ratio(median(&s.free_to_clean_cpu_s), size as f64 / GIB),
        ratios: AllocRatios {
            cloud_hypervisor_style_over_fresh_eager: ratio(ch, fresh),
            cloud_hypervisor_style_over_pooled_eager: ratio(ch, pooled),
            fresh_eager_daemon_over_pooled_eager: ratio(fresh_daemon, pooled),
            fresh_eager_daemon_over_fresh_eager: ratio(fresh_daemon, fresh),
        },
        medians: AllocMedians {
            fresh_eager_s: median(&s.fresh_eager_s),
            fresh_eager_daemon_s: median(&s.fresh_eager_daemon_s),
            pooled_eager_s: median(&s.pooled_eager_s),
            cloud_hypervisor_style_s: median(&s.cloud_hypervisor_style_s),
            free_to_clean_s: median(&s.free_to_clean_s),
        },
        samples: s,
        scaling,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cloud_hypervisor_thread_count() {
        const G: u64 = 1 << 30;
        // min(CPUs, 16, pages, size / 4 GiB), at least 1.
        assert_eq!(cloud_hypervisor_threads(2, 8 * G, G), 2);
        assert_eq!(cloud_hypervisor_threads(64, 8 * G, G), 2);
        assert_eq!(cloud_hypervisor_threads(64, 704 * G, G), 16);
        assert_eq!(cloud_hypervisor_threads(8, 2 * G, G), 1);
        assert_eq!(cloud_hypervisor_threads(8, 64 * G, 2 << 20), 8);
        assert_eq!(cloud_hypervisor_threads(1, 4 * G, G), 1);
    }

    #[test]
    fn node_parts_share_pages_evenly() {
        let topology = Topology::detect().expect("topology");
        let parts = node_parts(&topology, 8 << 30, 1 << 30);
        assert_eq!(parts.iter().map(|p| p.size).sum::<u64>(), 8 << 30);
        assert!(parts.iter().all(|p| p.size % (1 << 30) == 0));
    }

    #[test]
    fn node_local_workers_populate_every_part() {
        let topology = Topology::detect().expect("topology");
        // 4 KiB shmem stands in for hugetlb: the job split is the same code.
        let parts = node_parts(&topology, 8 << 20, 4096);
        for workers in [1, 3] {
            let secs = fresh_eager_workers(&topology, &parts, PageSize::Base4K, workers)
                .expect("populate");
            assert!(secs >= 0.0);
        }
    }

    #[test]
    fn prefault_threads_cover_every_page_once() {
        // 4 KiB shmem stands in for hugetlb: the split is the same code.
        let secs = cloud_hypervisor_style(8 << 20, PageSize::Base4K, 3).expect("prefault");
        assert!(secs >= 0.0);
    }
}
