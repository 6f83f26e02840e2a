//! `hugemem bench mlock`: one `mlock`/`munlock` call over a whole region
//! against the batched path ([`guest_mem::lock_ranges`]), on 4 KiB shmem and on
//! hugetlb, with the stall that another thread's `mmap`+`munmap` sees.
//!
//! # What is measured
//! For each backing, every repetition maps a fresh memfd (`MAP_SHARED`, so
//! locking has to populate it), locks it and unlocks it once in one call, then
//! does the same on another fresh memfd with the batched path; odd repetitions
//! run batched first, so drift hits both alike. The "single" path is the
//! batched code with one chunk as large as the region, so it is exactly one
//! system call; the report checks that.
//!
//! While each lock or unlock runs, a probe thread loops `mmap(4 KiB)` +
//! `munmap` and records its slowest iteration: that is the time another VMM
//! thread mapping memory would have been held up. The probe is started before
//! the call (a barrier, then a wait for its first iteration) and stopped after
//! it (an atomic flag); the iteration that was blocked when the call ended is
//! still counted. A probe run with no locking gives the noise floor
//! (`idle_max_stall_ms`): on a 2-CPU machine shared with builds, scheduling
//! alone can hold the probe up for milliseconds.
//!
//! # Figures
//! * times: best of `reps`, measured with the probe running (the situation the
//!   batching is for: letting the probe in between chunks costs the locker
//!   lock hand-overs and wake-ups), and again with no probe (`*_quiet_s`: the
//!   cost of batching alone). Each repetition runs single and batched under
//!   the probe, then single and batched quiet, each on a fresh memfd.
//! * `*_max_stall_ms`: for each repetition the worst probe iteration during the
//!   lock and during the unlock; the figure is the median over repetitions,
//!   `*_max_stall_worst_ms` the maximum, and the per-repetition values are
//!   listed.
//! * `populate_limit_s`, the limit for the lock times: `mlock` of a fresh
//!   `MAP_SHARED` memfd populates it (allocates and zeroes every page, with
//!   read faults on a shared mapping), the work the kernel does populating
//!   the same size of a fresh memfd of the same backing by itself
//!   (`MADV_POPULATE_WRITE`, one thread, no probe, no lock). Once per
//!   repetition, first on even repetitions and last on odd ones, between the
//!   locking passes; the best of the repetitions. The ratios give each
//!   path's lock time over it.
//!
//! Before anything is timed, the size is populated and freed once per backing:
//! the outer host backs never-touched memory lazily (see docs/benchmarks.md).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Barrier;
use std::thread;
use std::time::{Duration, Instant};

use clearing::RunOptions;
use guest_mem::{
    lock_ranges, unlock_ranges, AnonMapping, LockOptions, LockRange, LockReport, PageSize,
    Reservation, SharedMapping,
};
use numa::{MbindFlags, MemPolicyMode, NodeMask, Topology};
use serde::Serialize;

use crate::error::BenchError;
use crate::harness::rounds;
use crate::stats::{best, median, ratio};
use guest_mem::size::format_size;

mod table;

/// How long the probe runs alone to measure the noise floor.
const IDLE_PROBE: Duration = Duration::from_millis(300);

/// How long to wait for the probe thread's first iteration.
const PROBE_START_DEADLINE: Duration = Duration::from_secs(10);

/// What to measure.
#[derive(Debug, Clone)]
pub struct MlockBenchConfig {
    /// Bytes per region.
    pub size: u64,
    /// Repetitions (best time, median stall).
    pub reps: usize,
    /// Bytes per call of the batched path; `None` = guest-mem's default for
    /// the page size (8 MiB on 4 KiB pages, 32 MiB on huge pages).
    pub chunk: Option<usize>,
    /// Workers per node for the batched path.
    pub threads_per_node: usize,
    /// Measure hugetlb as well as 4 KiB shmem.
    pub hugetlb: bool,
    /// hugetlb page size; `None` tries 2 MiB, then 1 GiB.
    pub hugetlb_page: Option<PageSize>,
}

/// The figures of one backing.
#[derive(Debug, Clone, Serialize)]
pub struct BackingFigures {
    /// Page size of the backing.
    pub page_size: String,
    /// One `mlock` over the region, seconds (best of reps).
    pub single_lock_s: f64,
    /// Batched lock, seconds (best of reps).
    pub batched_lock_s: f64,
    /// One `munlock`, seconds (best of reps).
    pub single_unlock_s: f64,
    /// Batched unlock, seconds (best of reps).
    pub batched_unlock_s: f64,
    /// Worst probe stall during one call's lock or unlock, ms (median over reps).
    pub single_max_stall_ms: f64,
    /// Worst probe stall during the batched lock or unlock, ms (median over reps).
    pub batched_max_stall_ms: f64,
    /// Worst probe stall of the single call over all reps, ms.
    pub single_max_stall_worst_ms: f64,
    /// Worst probe stall of the batched path over all reps, ms.
    pub batched_max_stall_worst_ms: f64,
    /// One `mlock` with no probe running, seconds (best of reps).
    pub single_lock_quiet_s: f64,
    /// Batched lock with no probe running, seconds (best of reps).
    pub batched_lock_quiet_s: f64,
    /// One `munlock` with no probe running, seconds (best of reps).
    pub single_unlock_quiet_s: f64,
    /// Batched unlock with no probe running, seconds (best of reps).
    pub batched_unlock_quiet_s: f64,
    /// Per rep: worst stall during the single lock, ms.
    pub single_lock_stall_ms: Vec<f64>,
    /// Per rep: worst stall during the single unlock, ms.
    pub single_unlock_stall_ms: Vec<f64>,
    /// Per rep: worst stall during the batched lock, ms.
    pub batched_lock_stall_ms: Vec<f64>,
    /// Per rep: worst stall during the batched unlock, ms.
    pub batched_unlock_stall_ms: Vec<f64>,
    /// System calls per batched lock.
    pub batched_calls: u64,
    /// Chunk size the batched path used (rounded up to the page size).
    pub batched_chunk_bytes: usize,
    /// Worst probe iteration with nothing locking, ms (noise floor).
    pub idle_max_stall_ms: f64,
    /// The limit for the lock times: `MADV_POPULATE_WRITE` of a fresh memfd
    /// of the same size and backing, one thread, no probe, seconds (best of
    /// reps).
    pub populate_limit_s: f64,
    /// Per rep: that populate, seconds.
    pub populate_s: Vec<f64>,
}

/// Ratios of one backing's figures.
#[derive(Debug, Clone, Serialize)]
pub struct BackingRatios {
    /// `single_max_stall_ms / batched_max_stall_ms` (expectation: at least 10).
    pub stall_reduction: f64,
    /// `batched_lock_s / single_lock_s - 1`.
    pub lock_time_overhead: f64,
    /// `batched_unlock_s / single_unlock_s - 1`.
    pub unlock_time_overhead: f64,
    /// Lock plus unlock, batched over single, minus 1, with the probe running
    /// (expectation: at most 0.10).
    pub total_time_overhead: f64,
    /// The same with no probe running: the cost of batching alone.
    pub total_time_overhead_quiet: f64,
    /// Both expectations met (stall reduction, and total time with the probe).
    pub meets_expectation: bool,
    /// `single_lock_s / populate_limit_s`: the single call's lock over the
    /// kernel populating the same memory (1 = at the limit).
    pub single_lock_over_limit: f64,
    /// `batched_lock_s / populate_limit_s`.
    pub batched_lock_over_limit: f64,
    /// `single_lock_quiet_s / populate_limit_s` (no probe, as the limit).
    pub single_lock_quiet_over_limit: f64,
    /// `batched_lock_quiet_s / populate_limit_s`.
    pub batched_lock_quiet_over_limit: f64,
}

/// Ratios per backing.
#[derive(Debug, Clone, Serialize)]
pub struct MlockRatios {
    /// 4 KiB shmem.
    pub shmem_4k: BackingRatios,
    /// hugetlb, when it could be measured.
    pub hugetlb: Option<BackingRatios>,
}

/// The report; `--json` prints it as one object.
#[derive(Debug, Clone, Serialize)]
pub struct MlockBenchReport {
    /// Bytes per region.
    pub size_bytes: u64,
    /// Requested bytes per batched call (`null` = the per-page-size default;
    /// each backing reports the chunk it used in `batched_chunk_bytes`).
    pub chunk_bytes: Option<usize>,
    /// Repetitions.
    pub reps: usize,
    /// Online CPUs.
    pub cpus: usize,
    /// NUMA nodes with memory and CPUs (one batched job each).
    pub nodes: usize,
    /// Workers per node on the batched path.
    pub threads_per_node: usize,
    /// 4 KiB shmem (memfd, `MAP_SHARED`).
    pub shmem_4k: BackingFigures,
    /// hugetlb memfd, `null` when no pages could be reserved.
    pub hugetlb: Option<BackingFigures>,
    /// Why hugetlb is missing or not on the first choice of page size.
    pub hugetlb_note: Option<String>,
    /// Ratios.
    pub ratios: MlockRatios,
}

/// Runs `f` while a probe thread loops `mmap(4 KiB)` + `munmap`; returns `f`'s
/// result and the probe's slowest iteration.
fn with_probe<R>(f: impl FnOnce() -> R) -> Result<(R, Duration), BenchError> {
    let start = Barrier::new(2);
    let stop = AtomicBool::new(false);
    let iterations = AtomicU64::new(0);
    thread::scope(|s| {
        let probe = thread::Builder::new()
            .name("hm-stall-probe".into())
            .spawn_scoped(s, || -> Result<Duration, BenchError> {
                start.wait();
                let mut worst = Duration::ZERO;
                loop {
                    let t = Instant::now();
                    drop(AnonMapping::new(4096, PageSize::Base4K)?);
                    worst = worst.max(t.elapsed());
                    iterations.fetch_add(1, Ordering::Release);
                    if stop.load(Ordering::Acquire) {
                        return Ok(worst);
                    }
                }
            })
            .map_err(|e| BenchError::Runner(format!("cannot start the stall probe: {e}")))?;
        start.wait();
        // The probe is running once it has finished one iteration.
        let deadline = Instant::now() + PROBE_START_DEADLINE;
        while iterations.load(Ordering::Acquire) == 0 {
            if probe.is_finished() || Instant::now() > deadline {
                break;
            }
            std::hint::spin_loop();
        }
        let out = f();
        stop.store(true, Ordering::Release);
        let worst = probe
            .join()
            .map_err(|_| BenchError::Runner("the stall probe panicked".into()))??;
        Ok((out, worst))
    })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn worst(samples: &[f64]) -> f64 {
    samples.iter().copied().fold(0.0, f64::max)
}

/// Nodes the batched path runs a job on: those with memory and CPUs.
fn work_nodes(topology: &Topology) -> Vec<u32> {
    let nodes: Vec<u32> = topology
        .nodes()
        .iter()
        .filter(|n| !n.is_memoryless() && !n.cpus.is_empty())
        .map(|n| n.id)
        .collect();
    if nodes.is_empty() {
        vec![0]
    } else {
        nodes
    }
}

/// Splits the mapping into one range per node; with several nodes each part
/// is bound to its node first, so the single call and the batched path place
/// pages alike.
fn node_ranges(map: &SharedMapping, nodes: &[u32]) -> Result<Vec<LockRange>, BenchError> {
    let page = usize::try_from(map.page_size().bytes()).map_err(|_| BenchError::Size)?;
    let pages = map.len() / page;
    let base = map.addr().expose_provenance();
    let mut ranges = Vec::new();
    let mut offset = 0;
    for (i, &node) in nodes.iter().enumerate() {
        let share = pages / nodes.len() + usize::from(i < pages % nodes.len());
        if share == 0 {
            continue;
        }
        let len = share * page;
        if nodes.len() > 1 {
            numa::mbind(
                base + offset,
                len,
                MemPolicyMode::Bind,
                &NodeMask::single(node),
                MbindFlags::default(),
            )?;
        }
        ranges.push(LockRange {
            start: base + offset,
            len,
            page_size: map.page_size(),
            node: Some(node),
        });
        offset += len;
    }
    Ok(ranges)
}

/// One lock-then-unlock of a fresh memfd, each under the probe when `probe`.
struct Pass {
    lock: LockReport,
    lock_stall: Option<Duration>,
    unlock: LockReport,
    unlock_stall: Option<Duration>,
}

/// Runs `f`, under the stall probe when `probe`.
fn maybe_probe<R>(probe: bool, f: impl FnOnce() -> R) -> Result<(R, Option<Duration>), BenchError> {
    if probe {
        with_probe(f).map(|(r, d)| (r, Some(d)))
    } else {
        Ok((f(), None))
    }
}

fn pass(
    topology: &Topology,
    len: usize,
    page: PageSize,
    nodes: &[u32],
    opts: &LockOptions,
    single: bool,
    probe: bool,
) -> Result<Pass, BenchError> {
    let map = SharedMapping::memfd(len, page)?;
    let ranges = if single {
        node_ranges(&map, nodes)?;
        // One range, unpinned: the chunk is the whole region, so one call.
        vec![LockRange {
            start: map.addr().expose_provenance(),
            len,
            page_size: page,
            node: None,
        }]
    } else {
        node_ranges(&map, nodes)?
    };
    let run = RunOptions::default();
    // SAFETY: the ranges cover `map`, which this function owns and keeps
    // mapped until after the call returns.
    let (lock, lock_stall) = maybe_probe(probe, || unsafe {
        lock_ranges(topology, &ranges, opts, &run)
    })?;
    let lock = lock?;
    // SAFETY: as above.
    let (unlock, unlock_stall) = maybe_probe(probe, || unsafe {
        unlock_ranges(topology, &ranges, opts, &run)
    })?;
    let unlock = unlock?;
    if single && (lock.chunks != 1 || unlock.chunks != 1) {
        return Err(BenchError::Runner(format!(
            "the single path made {} lock and {} unlock calls, not one",
            lock.chunks, unlock.chunks
        )));
    }
    drop(map);
    Ok(Pass {
        lock,
        lock_stall,
        unlock,
        unlock_stall,
    })
}

/// The limit for a lock of `len` bytes: `MADV_POPULATE_WRITE` of a fresh
/// memfd of `page`, placed on `nodes` as the locking passes place it, with
/// one thread and no probe; seconds.
fn populate_limit(len: usize, page: PageSize, nodes: &[u32]) -> Result<f64, BenchError> {
    let map = SharedMapping::memfd(len, page)?;
    node_ranges(&map, nodes)?;
    let t = Instant::now();
    map.populate_write(0, len)?;
    Ok(t.elapsed().as_secs_f64())
}

/// Samples of one path (single or batched) under one condition (probe or quiet).
#[derive(Debug, Default)]
struct Samples {
    lock_s: Vec<f64>,
    unlock_s: Vec<f64>,
    lock_stall_ms: Vec<f64>,
    unlock_stall_ms: Vec<f64>,
}

impl Samples {
    fn push(&mut self, p: &Pass) {
        self.lock_s.push(p.lock.seconds);
        self.unlock_s.push(p.unlock.seconds);
        if let (Some(l), Some(u)) = (p.lock_stall, p.unlock_stall) {
            self.lock_stall_ms.push(ms(l));
            self.unlock_stall_ms.push(ms(u));
        }
    }

    /// Per rep, the worse of the lock and unlock stalls.
    fn per_rep_stall_ms(&self) -> Vec<f64> {
        self.lock_stall_ms
            .iter()
            .zip(&self.unlock_stall_ms)
            .map(|(l, u)| l.max(*u))
            .collect()
    }
}

/// Measures one backing.
fn measure(
    cfg: &MlockBenchConfig,
    topology: &Topology,
    page: PageSize,
    progress: &mut dyn FnMut(&str),
) -> Result<BackingFigures, BenchError> {
    let len = usize::try_from(cfg.size).map_err(|_| BenchError::Size)?;
    let nodes = work_nodes(topology);
    let single_opts = LockOptions::new().with_chunk(len)?;
    let mut batched_opts = LockOptions::new().with_threads_per_node(cfg.threads_per_node)?;
    if let Some(chunk) = cfg.chunk {
        batched_opts = batched_opts.with_chunk(chunk)?;
    }

    let what = format!(
        "{page}, populating and freeing {} once",
        format_size(cfg.size)
    );
    rounds::warm_up(progress, &what, || {
        SharedMapping::memfd(len, page)?.populate_write(0, len)
    })?;
    let ((), idle) = with_probe(|| {
        let end = Instant::now() + IDLE_PROBE;
        while Instant::now() < end {
            std::hint::spin_loop();
        }
    })?;

    // [single, batched] x [under the probe, quiet]
    let mut probed = [Samples::default(), Samples::default()];
    let mut quiet = [Samples::default(), Samples::default()];
    let mut batched_calls = 0;
    let mut batched_chunk_bytes = 0;
    let mut populate_s = Vec::with_capacity(cfg.reps);
    rounds::each(cfg.reps, |round| {
        // The populate limit before the passes in one round, after them in
        // the next; the single call before the batched path, then after.
        let populate = |populate_s: &mut Vec<f64>| -> Result<(), BenchError> {
            populate_s.push(populate_limit(len, page, &nodes)?);
            Ok(())
        };
        let passes = |_: &mut Vec<f64>| -> Result<(), BenchError> {
            for probe in [true, false] {
                for single in round.alternate(vec![true, false]) {
                    let opts = if single { &single_opts } else { &batched_opts };
                    let p = pass(topology, len, page, &nodes, opts, single, probe)?;
                    let samples = if probe { &mut probed } else { &mut quiet };
                    samples[usize::from(!single)].push(&p);
                    if !single {
                        batched_calls = p.lock.chunks;
                        batched_chunk_bytes = p.lock.chunk_bytes;
                    }
                    let stall = |d: Option<Duration>| {
                        d.map_or(String::new(), |d| format!(" (stall {:.1} ms)", ms(d)))
                    };
                    progress(&format!(
                        "{page} rep {round}{}: {} lock {:.3} s{}, unlock {:.3} s{}, {} calls",
                        if probe { ", probe" } else { ", quiet" },
                        if single { "single " } else { "batched" },
                        p.lock.seconds,
                        stall(p.lock_stall),
                        p.unlock.seconds,
                        stall(p.unlock_stall),
                        p.lock.chunks
                    ));
                }
            }
            Ok(())
        };
        round.both(&mut populate_s, populate, passes)?;
        progress(&format!(
            "{page} rep {round}: populate limit {:.3} s",
            populate_s.last().copied().unwrap_or_default()
        ));
        Ok::<_, BenchError>(())
    })?;
    let [single, batched] = probed;
    let [single_quiet, batched_quiet] = quiet;
    let (single_stalls, batched_stalls) = (single.per_rep_stall_ms(), batched.per_rep_stall_ms());
    Ok(BackingFigures {
        page_size: page.to_string(),
        single_lock_s: best(&single.lock_s),
        batched_lock_s: best(&batched.lock_s),
        single_unlock_s: best(&single.unlock_s),
        batched_unlock_s: best(&batched.unlock_s),
        single_max_stall_ms: median(&single_stalls),
        batched_max_stall_ms: median(&batched_stalls),
        single_max_stall_worst_ms: worst(&single_stalls),
        batched_max_stall_worst_ms: worst(&batched_stalls),
        single_lock_quiet_s: best(&single_quiet.lock_s),
        batched_lock_quiet_s: best(&batched_quiet.lock_s),
        single_unlock_quiet_s: best(&single_quiet.unlock_s),
        batched_unlock_quiet_s: best(&batched_quiet.unlock_s),
        single_lock_stall_ms: single.lock_stall_ms,
        single_unlock_stall_ms: single.unlock_stall_ms,
        batched_lock_stall_ms: batched.lock_stall_ms,
        batched_unlock_stall_ms: batched.unlock_stall_ms,
        batched_calls,
        batched_chunk_bytes,
        idle_max_stall_ms: ms(idle),
        populate_limit_s: best(&populate_s),
        populate_s,
    })
}

fn ratios(f: &BackingFigures) -> BackingRatios {
    let stall_reduction = if f.batched_max_stall_ms > 0.0 {
        f.single_max_stall_ms / f.batched_max_stall_ms
    } else {
        f64::INFINITY
    };
    let total_time_overhead =
        (f.batched_lock_s + f.batched_unlock_s) / (f.single_lock_s + f.single_unlock_s) - 1.0;
    let total_time_overhead_quiet = (f.batched_lock_quiet_s + f.batched_unlock_quiet_s)
        / (f.single_lock_quiet_s + f.single_unlock_quiet_s)
        - 1.0;
    BackingRatios {
        stall_reduction,
        total_time_overhead_quiet,
        lock_time_overhead: f.batched_lock_s / f.single_lock_s - 1.0,
        unlock_time_overhead: f.batched_unlock_s / f.single_unlock_s - 1.0,
        total_time_overhead,
        meets_expectation: stall_reduction >= 10.0 && total_time_overhead <= 0.10,
        single_lock_over_limit: ratio(f.single_lock_s, f.populate_limit_s),
        batched_lock_over_limit: ratio(f.batched_lock_s, f.populate_limit_s),
        single_lock_quiet_over_limit: ratio(f.single_lock_quiet_s, f.populate_limit_s),
        batched_lock_quiet_over_limit: ratio(f.batched_lock_quiet_s, f.populate_limit_s),
    }
}

/// Reserves hugetlb pages for the run: the configured size, else 2 MiB then 1 GiB.
fn reserve_hugetlb(
    cfg: &MlockBenchConfig,
    notes: &mut Vec<String>,
) -> Option<(PageSize, Reservation)> {
    let candidates = match cfg.hugetlb_page {
        Some(p) => vec![p],
        None => vec![PageSize::Huge2M, PageSize::Huge1G],
    };
    for page in candidates {
        if !page.is_huge() {
            notes.push(format!("{page} is not a hugetlb page size"));
            continue;
        }
        if !cfg.size.is_multiple_of(page.bytes()) {
            notes.push(format!(
                "{} is not a multiple of {page} pages",
                format_size(cfg.size)
            ));
            continue;
        }
        let pages = cfg.size / page.bytes();
        match Reservation::for_run(page, pages) {
            Ok(r) if r.report().met => return Some((page, r)),
            Ok(r) => notes.push(format!(
                "asked for {pages} free {page} pages, the kernel has {} free",
                r.report().free
            )),
            Err(e) => notes.push(format!("cannot reserve {page} pages: {e}")),
        }
    }
    None
}

/// Runs the benchmark. `progress` gets one line per step.
pub fn run(
    cfg: &MlockBenchConfig,
    progress: &mut dyn FnMut(&str),
) -> Result<MlockBenchReport, BenchError> {
    if cfg.size == 0 || cfg.reps == 0 || !cfg.size.is_multiple_of(4096) {
        return Err(BenchError::Size);
    }
    let topology = Topology::detect()?;
    let cpus: usize = topology.nodes().iter().map(|n| n.cpus.len()).sum();
    let nodes = work_nodes(&topology).len();
    progress(&format!(
        "{} per region, {} chunks, {} rep(s), {nodes} node(s), {} worker(s) per node",
        format_size(cfg.size),
        cfg.chunk
            .map_or("default".to_string(), |c| format_size(c as u64)),
        cfg.reps,
        cfg.threads_per_node
    ));

    let shmem_4k = measure(cfg, &topology, PageSize::Base4K, progress)?;

    let mut notes = Vec::new();
    let reserved = if cfg.hugetlb {
        reserve_hugetlb(cfg, &mut notes)
    } else {
        notes.push("hugetlb not asked for".to_string());
        None
    };
    let hugetlb = match reserved {
        Some((page, reservation)) => {
            let figures = measure(cfg, &topology, page, progress)?;
            drop(reservation);
            Some(figures)
        }
        None => {
            progress(&format!("hugetlb skipped: {}", notes.join("; ")));
            None
        }
    };
    Ok(MlockBenchReport {
        size_bytes: cfg.size,
        chunk_bytes: cfg.chunk,
        reps: cfg.reps,
        cpus,
        nodes,
        threads_per_node: cfg.threads_per_node,
        ratios: MlockRatios {
            shmem_4k: ratios(&shmem_4k),
            hugetlb: hugetlb.as_ref().map(ratios),
        },
        shmem_4k,
        hugetlb,
        hugetlb_note: (!notes.is_empty()).then(|| notes.join("; ")),
    })
}

#[cfg(test)]
mod tests;
