//! `hugemem bench clear`: clearing kernels against the kernel's fault-time
//! clearing, measured in one run on huge pages reserved for it.
//!
//! Every figure is the best of `reps` repetitions, and the methods are
//! interleaved within each repetition so that drift (other load, the host's
//! lazy backing of guest memory) hits them alike. Before anything is timed the
//! memory is populated and freed once: on this project's machines the outer
//! host backs never-touched memory lazily and a first touch runs several times
//! slower than any later one (see docs/benchmarks.md).
//!
//! What each figure times, exactly:
//!
//! * the user-space kernels (`memset`, `rep stosb` per run and per 4 KiB,
//!   non-temporal stores): clearing one buffer that is already populated
//!   (the same buffer every time), on the calling thread, call to return;
//! * `kernel_refault`: the kernel zeroing that same populated buffer, its
//!   only way to: `MADV_DONTNEED` (the pages go back to the huge-page pool)
//!   and `MADV_POPULATE_WRITE` (fresh pages, zeroed at fault), both timed.
//!   Same input, same output, same thread as the user-space kernels;
//! * `kernel_fault`: `MADV_POPULATE_WRITE` of a mapping created just before
//!   the clock starts (the `mmap` is outside it), as a VMM prefaults fresh
//!   guest RAM: page allocation, zeroing and page tables of pages no mapping
//!   had;
//! * the parallel runner: `gbps` is timed around the whole `clear_jobs` call
//!   (worker spawn, pinning, clearing, join), the span of the single-thread
//!   figures; `runner_gbps` is the runner's own clock, which starts at the
//!   first worker's first chunk, after spawn and pinning.

use std::time::Instant;

use clearing::{ClearKernel, Job, RunOptions};
use guest_mem::{AnonMapping, PageSize, Reservation};
use numa::{MbindFlags, MemPolicyMode, NodeMask, Topology};
use serde::Serialize;

use crate::error::BenchError;
use crate::harness::rounds;
use crate::stats::{best, gbps};

/// What to measure.
#[derive(Debug, Clone)]
pub struct ClearBenchConfig {
    /// Bytes to clear.
    pub size: u64,
    /// Repetitions of each measurement (best is reported).
    pub reps: usize,
    /// Worker counts for the parallel runner; empty = 1..=all CPUs.
    pub threads: Vec<usize>,
    /// Page size; `None` picks 1 GiB, then 2 MiB, then 4 KiB.
    pub page_size: Option<PageSize>,
}

/// One parallel measurement.
#[derive(Debug, Clone, Serialize)]
pub struct ParallelPoint {
    /// Workers.
    pub threads: usize,
    /// Throughput, GB/s (10^9 bytes per second), timed around the whole
    /// `clear_jobs` call on the calling thread: worker spawn, pinning,
    /// clearing and join, the same span as the single-thread kernels' figures.
    pub gbps: f64,
    /// Throughput relative to one worker (`gbps`).
    pub speedup: f64,
    /// The runner's own clock: first worker's first chunk to the last
    /// worker's last, after spawn and pinning.
    pub runner_gbps: f64,
    /// `runner_gbps` relative to one worker's.
    pub runner_speedup: f64,
}

/// Ratios between figures of the same run.
#[derive(Debug, Clone, Serialize)]
pub struct ClearRatios {
    /// Multi-page `rep stosb` over the per-4 KiB loop.
    pub multipage_vs_per4k: f64,
    /// Default kernel over kernel fault-time clearing (fresh mapping).
    pub default_vs_kernel_fault: f64,
    /// Default kernel over the kernel re-zeroing the same populated buffer
    /// (`MADV_DONTNEED` + `MADV_POPULATE_WRITE`): the same work, input and
    /// output as the user-space kernels'.
    pub default_vs_kernel_refault: f64,
    /// Non-temporal over multi-page, when available.
    pub nt_vs_multipage: Option<f64>,
    /// glibc memset over kernel fault-time clearing.
    pub memset_vs_kernel_fault: f64,
}

/// The report; `--json` prints it as one object.
#[derive(Debug, Clone, Serialize)]
pub struct ClearBenchReport {
    /// Bytes cleared per measurement.
    pub size_bytes: u64,
    /// Page size used.
    pub page_size: String,
    /// Why the page size is not the one asked for, if it is not.
    pub page_size_note: Option<String>,
    /// Repetitions per figure.
    pub reps: usize,
    /// Online CPUs.
    pub cpus: usize,
    /// NUMA nodes with memory.
    pub nodes: usize,
    /// Fresh hugetlb pages populated by the kernel (`MADV_POPULATE_WRITE` on a
    /// mapping created just before, outside the clock): allocation, zeroing
    /// and page-table setup of pages no mapping had.
    pub kernel_fault_gbps: f64,
    /// The kernel re-zeroing the populated buffer the user-space kernels
    /// clear: `MADV_DONTNEED` (the pages go back to the huge-page pool) then
    /// `MADV_POPULATE_WRITE` (fresh zeroed pages), both inside the clock.
    pub kernel_refault_gbps: f64,
    /// glibc `memset` over populated memory.
    pub memset_gbps: f64,
    /// One `rep stosb` per run.
    pub multipage_gbps: f64,
    /// `rep stosb` one 4 KiB page at a time.
    pub per4k_gbps: f64,
    /// Non-temporal AVX-512/AVX2 stores (`null` when the CPU has neither).
    pub nt_gbps: Option<f64>,
    /// Name of the default kernel.
    pub default_kernel: String,
    /// The default kernel's figure.
    pub default_gbps: f64,
    /// The job runner with 1..=N workers, default kernel.
    pub parallel: Vec<ParallelPoint>,
    /// Ratios of the above.
    pub ratios: ClearRatios,
}

/// Picks the page size and reserves pages for the run, saying why it fell back.
fn reserve(
    cfg: &ClearBenchConfig,
    note: &mut Vec<String>,
) -> Result<(PageSize, Option<Reservation>), BenchError> {
    let candidates: Vec<PageSize> = match cfg.page_size {
        Some(p) => vec![p],
        None => PageSize::FALLBACK_ORDER.to_vec(),
    };
    for page in candidates {
        if !cfg.size.is_multiple_of(page.bytes()) {
            note.push(format!(
                "{} is not a multiple of {page} pages",
                guest_mem::size::format_size(cfg.size)
            ));
            continue;
        }
        if !page.is_huge() {
            return Ok((page, None));
        }
        let pages = cfg.size / page.bytes();
        match Reservation::for_run(page, pages) {
            Ok(r) if r.report().met => return Ok((page, Some(r))),
            Ok(r) => note.push(format!(
                "asked for {pages} free {page} pages, the kernel has {} free",
                r.report().free
            )),
            Err(e) => note.push(format!("cannot reserve {page} pages: {e}")),
        }
    }
    Err(BenchError::NoPages(note.join("; ")))
}

/// Splits the mapping into one part per memory node and binds each part to
/// its node before anything is populated (so the parallel runner's pinned
/// workers clear local memory). Returns the parts as (offset, len, node).
fn bind_per_node(
    map: &AnonMapping,
    topology: &Topology,
) -> Result<Vec<(usize, usize, u32)>, BenchError> {
    let nodes: Vec<u32> = topology
        .nodes()
        .iter()
        .filter(|n| !n.is_memoryless() && !n.cpus.is_empty())
        .map(|n| n.id)
        .collect();
    let nodes = if nodes.is_empty() { vec![0] } else { nodes };
    let page = usize::try_from(map.page_size().bytes()).map_err(|_| BenchError::Size)?;
    let pages = map.len() / page;
    let mut parts = Vec::new();
    let mut offset = 0;
    for (i, node) in nodes.iter().enumerate() {
        let share = pages / nodes.len() + usize::from(i < pages % nodes.len());
        if share == 0 {
            continue;
        }
        let len = share * page;
        if nodes.len() > 1 {
            numa::mbind(
                map.addr() as usize + offset,
                len,
                MemPolicyMode::Bind,
                &NodeMask::single(*node),
                MbindFlags::default(),
            )?;
        }
        parts.push((offset, len, *node));
        offset += len;
    }
    Ok(parts)
}

/// [`rounds::seconds`] for this bench's error.
fn time<F: FnOnce() -> Result<(), BenchError>>(f: F) -> Result<f64, BenchError> {
    rounds::seconds(f)
}

/// Runs the benchmark. `progress` gets one line per step.
pub fn run(
    cfg: &ClearBenchConfig,
    progress: &mut dyn FnMut(&str),
) -> Result<ClearBenchReport, BenchError> {
    if cfg.size == 0 || cfg.reps == 0 {
        return Err(BenchError::Size);
    }
    let len = usize::try_from(cfg.size).map_err(|_| BenchError::Size)?;
    let topology = Topology::detect()?;
    let cpus: usize = topology.nodes().iter().map(|n| n.cpus.len()).sum();
    let mut notes = Vec::new();
    let (page, _reservation) = reserve(cfg, &mut notes)?;
    progress(&format!(
        "{} on {page} pages{}",
        guest_mem::size::format_size(cfg.size),
        if notes.is_empty() {
            String::new()
        } else {
            format!(" ({})", notes.join("; "))
        }
    ));

    // Warm-up: the outer host backs never-touched memory lazily.
    rounds::warm_up(progress, "populating and freeing the pages once", || {
        AnonMapping::new(len, page)?.populate_write(0, len)
    })?;

    let kernels: Vec<ClearKernel> = ClearKernel::ALL
        .into_iter()
        .filter(|k| k.is_available())
        .collect();
    let SingleThread {
        fault,
        memset,
        refault,
        per_kernel,
    } = single_thread(cfg.reps, len, page, &kernels, progress)?;
    let figure = |k: ClearKernel| {
        kernels
            .iter()
            .position(|x| *x == k)
            .map(|i| gbps(cfg.size, best(&per_kernel[i])))
    };
    let default_kernel = ClearKernel::default_kernel();

    let parallel = parallel_runner(cfg, len, page, &topology, cpus, default_kernel, progress)?;

    let kernel_fault_gbps = gbps(cfg.size, best(&fault));
    let memset_gbps = gbps(cfg.size, best(&memset));
    let kernel_refault_gbps = gbps(cfg.size, best(&refault));
    let multipage_gbps = figure(ClearKernel::MultiPage).unwrap_or(0.0);
    let per4k_gbps = figure(ClearKernel::PerPage4K).unwrap_or(0.0);
    let nt_gbps = figure(ClearKernel::NonTemporal);
    let default_gbps = figure(default_kernel).unwrap_or(0.0);
    Ok(ClearBenchReport {
        size_bytes: cfg.size,
        page_size: page.to_string(),
        page_size_note: (!notes.is_empty()).then(|| notes.join("; ")),
        reps: cfg.reps,
        cpus,
        nodes: topology
            .nodes()
            .iter()
            .filter(|n| !n.is_memoryless())
            .count(),
        kernel_fault_gbps,
        kernel_refault_gbps,
        memset_gbps,
        multipage_gbps,
        per4k_gbps,
        nt_gbps,
        default_kernel: default_kernel.name().to_string(),
        default_gbps,
        ratios: ClearRatios {
            multipage_vs_per4k: multipage_gbps / per4k_gbps,
            default_vs_kernel_fault: default_gbps / kernel_fault_gbps,
            default_vs_kernel_refault: crate::stats::ratio(default_gbps, kernel_refault_gbps),
            nt_vs_multipage: nt_gbps.map(|nt| nt / multipage_gbps),
            memset_vs_kernel_fault: memset_gbps / kernel_fault_gbps,
        },
        parallel,
    })
}

/// Samples of one thread's ways to zero `len` bytes, one per repetition.
struct SingleThread {
    /// The kernel zeroing at first fault.
    fault: Vec<f64>,
    memset: Vec<f64>,
    /// The kernel zeroing the same buffer again: discard and fault in.
    refault: Vec<f64>,
    /// Each of `kernels`.
    per_kernel: Vec<Vec<f64>>,
}

/// `reps` repetitions of the kernel's fault, memset, every clearing kernel
/// and the kernel's re-zeroing, on `len` bytes of `page` pages.
fn single_thread(
    reps: usize,
    len: usize,
    page: PageSize,
    kernels: &[ClearKernel],
    progress: &mut dyn FnMut(&str),
) -> Result<SingleThread, BenchError> {
    let mut fault = Vec::new();
    let mut memset = Vec::new();
    let mut refault = Vec::new();
    let mut per_kernel: Vec<Vec<f64>> = vec![Vec::new(); kernels.len()];
    rounds::each(reps, |round| {
        progress(&format!(
            "repetition {round}: kernel fault, memset, {} kernels, kernel re-zero",
            kernels.len()
        ));
        fault.push({
            let fresh = AnonMapping::new(len, page)?;
            time(|| Ok(fresh.populate_write(0, len)?))?
        });
        let mut map = AnonMapping::new(len, page)?;
        map.populate_write(0, len)?;
        let buf = map.as_mut_slice();
        memset.push(time(|| {
            // SAFETY: buf is a live, exclusively borrowed slice of len bytes.
            unsafe { libc::memset(buf.as_mut_ptr().cast(), 0, buf.len()) };
            Ok(())
        })?);
        for (k, samples) in kernels.iter().zip(per_kernel.iter_mut()) {
            samples.push(time(|| {
                clearing::clear(*k, buf);
                Ok(())
            })?);
        }
        // The kernel's way to zero the same populated buffer: drop its pages
        // and fault in fresh ones, which the kernel zeroes.
        refault.push(time(|| {
            map.discard(0, len)?;
            Ok(map.populate_write(0, len)?)
        })?);
        Ok::<_, BenchError>(())
    })?;
    Ok(SingleThread {
        fault,
        memset,
        refault,
        per_kernel,
    })
}

/// The parallel runner with each worker count: one job per memory node,
/// the memory bound before it is populated; GB/s by the caller's clock and
/// by the runner's own, and the speedups over the first count.
fn parallel_runner(
    cfg: &ClearBenchConfig,
    len: usize,
    page: PageSize,
    topology: &Topology,
    cpus: usize,
    default_kernel: ClearKernel,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<ParallelPoint>, BenchError> {
    let thread_counts: Vec<usize> = if cfg.threads.is_empty() {
        (1..=cpus.max(1)).collect()
    } else {
        cfg.threads.clone()
    };
    let map = AnonMapping::new(len, page)?;
    let parts = bind_per_node(&map, topology)?;
    map.populate_write(0, len)?;
    let align = usize::try_from(page.bytes().min(2 << 20)).map_err(|_| BenchError::Size)?;
    let mut parallel = Vec::new();
    for &threads in &thread_counts {
        let per_node = threads.div_ceil(parts.len()).max(1);
        let jobs: Vec<Job> = parts
            .iter()
            .map(|&(offset, part_len, node)| Job {
                start: map.addr() as usize + offset,
                len: part_len,
                align,
                min_chunk: 16 << 20,
                max_threads: per_node,
                node: Some(node),
            })
            .collect();
        let (samples, runner_samples): (Vec<f64>, Vec<f64>) = rounds::collect(cfg.reps, |_| {
            let start = Instant::now();
            // SAFETY: every job range lies inside `map`, a live read-write
            // mapping owned here, and no Rust reference to it exists while the
            // jobs run.
            let report = unsafe {
                clearing::clear_jobs(topology, &jobs, default_kernel, &RunOptions::default())
            }
            .map_err(|e| BenchError::Runner(e.to_string()))?;
            Ok::<_, BenchError>((start.elapsed().as_secs_f64(), report.seconds))
        })?
        .into_iter()
        .unzip();
        let g = gbps(cfg.size, best(&samples));
        let runner_gbps = gbps(cfg.size, best(&runner_samples));
        progress(&format!(
            "parallel runner, {threads} worker(s): {g:.2} GB/s (runner's own clock {runner_gbps:.2})"
        ));
        parallel.push(ParallelPoint {
            threads,
            gbps: g,
            speedup: 0.0,
            runner_gbps,
            runner_speedup: 0.0,
        });
    }
    let base = parallel.first().map_or(0.0, |p| p.gbps);
    let runner_base = parallel.first().map_or(0.0, |p| p.runner_gbps);
    for p in &mut parallel {
        p.speedup = crate::stats::ratio(p.gbps, base);
        p.runner_speedup = crate::stats::ratio(p.runner_gbps, runner_base);
    }
    Ok(parallel)
}

impl ClearBenchReport {
    /// A small table for people.
    pub fn to_table(&self) -> String {
        let mut out = format!(
            "hugemem bench clear: {} on {} pages, best of {} ({} CPUs, {} node(s))\n",
            guest_mem::size::format_size(self.size_bytes),
            self.page_size,
            self.reps,
            self.cpus,
            self.nodes
        );
        if let Some(note) = &self.page_size_note {
            out += &format!("note: {note}\n");
        }
        out += "method                          GB/s   vs kernel fault\n";
        let mut row = |name: &str, v: f64| {
            out += &format!(
                "{name:<30} {v:>6.2}   {:>5.2}x\n",
                v / self.kernel_fault_gbps
            )
        };
        row("kernel fault (fresh mapping)", self.kernel_fault_gbps);
        row("kernel re-zero (same buffer)", self.kernel_refault_gbps);
        row("glibc memset", self.memset_gbps);
        row("multipage rep stosb", self.multipage_gbps);
        row("per-4K rep stosb", self.per4k_gbps);
        if let Some(nt) = self.nt_gbps {
            row("non-temporal stores", nt);
        }
        row(
            &format!("default ({})", self.default_kernel),
            self.default_gbps,
        );
        out += &format!(
            "multipage vs per-4K: {:.2}x\n",
            self.ratios.multipage_vs_per4k
        );
        out += "parallel runner  workers  GB/s   speedup  (runner's own clock: GB/s, speedup)\n";
        for p in &self.parallel {
            out += &format!(
                "                 {:>7}  {:>5.2}  {:>5.2}x  ({:>5.2}, {:>5.2}x)\n",
                p.threads, p.gbps, p.speedup, p.runner_gbps, p.runner_speedup
            );
        }
        out
    }
}
