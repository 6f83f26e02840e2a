//! A parallel job runner in the shape of the Linux kernel's
//! `padata_do_multithreaded`, with NUMA-pinned workers.
//!
//! # Design
//! A [`Job`] is a range of addresses plus how it may be split: chunk
//! boundaries on multiples of `align`, chunks of at least `min_chunk` bytes,
//! at most `max_threads` workers, and optionally the NUMA node whose CPUs the
//! workers run on. [`run_jobs`] validates every job before any work runs, then
//! starts all jobs at once, each with its own workers, under one
//! `std::thread::scope`:
//!
//! * **Splitting** follows padata: `workers = min(max_threads, len / min_chunk,
//!   CPUs of the node)`; the chunk size aims at four chunks per worker (so a
//!   slow worker, or one sharing its CPU, does not hold up the job), is at
//!   least `min_chunk`, a multiple of `align`, and at most
//!   [`RunOptions::max_chunk`]. Every chunk boundary except the job's own start
//!   and end is a multiple of `align` in absolute terms; every chunk but the
//!   last of a job is at least `min_chunk` long.
//! * **Load balance**: workers pull chunk numbers from one atomic counter per
//!   job, so there is no lock and no up-front assignment.
//! * **Placement**: the workers of a job with `node: Some(n)` pin themselves
//!   to node `n`'s CPUs before starting, so that first-touch and the memory
//!   traffic stay on that node. For a node without CPUs (a memory-only node,
//!   such as CXL memory) they pin to the nearest node that has CPUs, by the
//!   kernel's distance table. `node: None` leaves workers unpinned.
//! * **Start and stop**: workers wait at a start gate so they begin together
//!   (per-node timings then measure the same interval). Between chunks each
//!   worker checks the caller's [`CancelToken`] and the run's internal stop
//!   flag; the first error (a failed chunk, a failed pin, a panic) sets that
//!   flag and is the one returned.
//!
//! The alternative, a global thread pool (rayon), would share threads between
//! nodes and could not pin them per job; the jobs here are few and long, so
//! per-run scoped threads cost nothing measurable and keep borrowing simple.
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Mutex, PoisonError};
use std::thread;

use numa::{NodeId, Topology};
use tracing::debug;

use crate::kernel::{clear_raw, ClearKernel};

mod job;
mod plan;
mod worker;

pub use job::{
    CancelToken, Chunk, Job, NodeStats, Progress, RunError, RunOptions, RunReport, CLEAR_ALIGN,
    CLEAR_MIN_CHUNK,
};
use plan::*;
use worker::*;
/// Runs `work` over every job, in parallel, and reports per-node throughput.
///
/// All jobs are validated first; then all run at once, each with its own
/// workers (pinned to the job's node when it names one). `work` is called once
/// per [`Chunk`], from worker threads; the chunks of a job are disjoint and
/// together cover it exactly. See the [module docs](self) for how jobs are
/// split.
///
/// # Errors
/// * [`RunError::InvalidJob`] before any work: `align` not a power of two,
///   `max_threads == 0`, a range that overflows, or a node the topology does
///   not have. Every job is checked, empty ones included; a valid job with
///   `len == 0` does nothing.
/// * [`RunError::Work`] with the chunk of the first `work` error; the other
///   workers stop after their current chunk.
/// * [`RunError::Cancelled`] when `opts.cancel` fired before everything was
///   done (a run that finished all chunks anyway returns `Ok`).
/// * [`RunError::Pin`], [`RunError::WorkerPanicked`], [`RunError::Spawn`] when
///   a worker could not be placed, panicked, or could not be created.
pub fn run_jobs<E, F>(
    topology: &Topology,
    jobs: &[Job],
    opts: &RunOptions<'_>,
    work: F,
) -> Result<RunReport, RunError<E>>
where
    F: Fn(&Chunk) -> Result<(), E> + Sync,
    E: std::error::Error + Send + 'static,
{
    let planned = plan_jobs::<E>(topology, jobs, opts.max_chunk)?;
    let total: u64 = planned
        .iter()
        .map(|p| to_u64(p.plan.end - p.plan.start))
        .sum();
    for p in &planned {
        debug!(
            job = p.index,
            node = ?jobs[p.index].node,
            pin_node = ?p.pin_node,
            start = p.plan.start,
            len = p.plan.end - p.plan.start,
            workers = p.plan.workers,
            chunk_size = p.plan.chunk_size,
            chunks = p.plan.chunks,
            "starting job"
        );
    }
    if total == 0 {
        return Ok(RunReport {
            nodes: Vec::new(),
            bytes: 0,
            seconds: 0.0,
        });
    }

    let shared = Shared {
        total,
        done: AtomicU64::new(0),
        stop: AtomicBool::new(false),
        first_error: Mutex::new(None),
        progress: Mutex::new(ProgressState {
            last_at: None,
            last_bytes: 0,
        }),
        cursors: jobs.iter().map(|_| AtomicUsize::new(0)).collect(),
        gate: StartGate::default(),
    };

    let records = thread::scope(|scope| {
        let mut handles = Vec::new();
        'spawn: for p in &planned {
            for w in 0..p.plan.workers {
                let (shared, work) = (&shared, &work);
                let spawned = thread::Builder::new()
                    .name(format!("hm-clear-{}-{w}", p.index))
                    .spawn_scoped(scope, move || worker(shared, p, topology, opts, work));
                match spawned {
                    Ok(h) => handles.push((p.index, h)),
                    Err(e) => {
                        shared.fail(RunError::Spawn(e));
                        break 'spawn;
                    }
                }
            }
        }
        // Always reached, so the workers already started are released (and
        // see the stop flag if spawning failed).
        shared.gate.expect(handles.len());
        let mut records = Vec::with_capacity(handles.len());
        for (job, h) in handles {
            match h.join() {
                Ok(rec) => records.push(rec),
                // Worker bodies catch panics; this is the last line of defence.
                Err(payload) => shared.fail(RunError::WorkerPanicked {
                    job,
                    message: panic_message(&*payload),
                }),
            }
        }
        records
    });

    let first_error = shared
        .first_error
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner);
    if let Some(err) = first_error {
        return Err(err);
    }
    let bytes_done = shared.done.into_inner();
    if bytes_done < total {
        return Err(RunError::Cancelled { bytes_done });
    }
    let report = build_report(jobs, &records, bytes_done);
    for n in &report.nodes {
        debug!(
            node = ?n.node,
            bytes = n.bytes,
            seconds = n.seconds,
            threads = n.threads,
            chunks = n.chunks,
            gib_per_s = n.gib_per_s(),
            "node finished"
        );
    }
    Ok(report)
}

/// Rejects jobs whose ranges overlap (empty jobs never overlap).
fn check_disjoint(jobs: &[Job]) -> Result<(), RunError<Infallible>> {
    let mut ranges: Vec<(usize, usize, usize)> = jobs
        .iter()
        .enumerate()
        .filter(|(_, j)| j.len > 0)
        .map(|(i, j)| (j.start, j.start.saturating_add(j.len), i))
        .collect();
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        let ((_, a_end, a), (b_start, _, b)) = (w[0], w[1]);
        if b_start < a_end {
            return Err(RunError::InvalidJob {
                job: a.max(b),
                reason: format!("its range overlaps job {}", a.min(b)),
            });
        }
    }
    Ok(())
}

/// A raw pointer that may be shared with the workers of [`clear_parallel`].
#[derive(Clone, Copy)]
struct SharedBase(*mut u8);

// SAFETY: the pointer is only used to write disjoint chunks of a buffer that
// `clear_parallel` borrows mutably for the whole run; no two threads touch
// the same byte, and the borrow outlives the scoped workers.
unsafe impl Send for SharedBase {}
// SAFETY: as for `Send`: shared access only ever derives disjoint sub-ranges.
unsafe impl Sync for SharedBase {}

impl SharedBase {
    // A method, not field access, so closures capture the whole `Sync` struct
    // rather than the bare pointer field.
    fn at(self, offset: usize) -> *mut u8 {
        self.0.wrapping_add(offset)
    }
}

/// Zeroes `buf` with `kernel` using up to `max_threads` workers, pinned to
/// `node` if given. Chunks are [`CLEAR_ALIGN`]-aligned and at least
/// [`CLEAR_MIN_CHUNK`] long.
///
/// # Errors
/// As for [`run_jobs`]: `InvalidJob` for `max_threads == 0` or an unknown
/// node, `Cancelled`, `Pin`, `WorkerPanicked`, `Spawn`.
pub fn clear_parallel(
    topology: &Topology,
    buf: &mut [u8],
    node: Option<NodeId>,
    max_threads: usize,
    kernel: ClearKernel,
    opts: &RunOptions<'_>,
) -> Result<RunReport, RunError<Infallible>> {
    let len = buf.len();
    let base = SharedBase(buf.as_mut_ptr());
    let base_addr = buf.as_mut_ptr() as usize;
    let job = Job {
        start: base_addr,
        len,
        align: CLEAR_ALIGN,
        min_chunk: CLEAR_MIN_CHUNK,
        max_threads,
        node,
    };
    run_jobs(topology, &[job], opts, move |c: &Chunk| {
        let offset = c.start - base_addr;
        debug_assert!(offset + c.len <= len);
        // SAFETY: the runner's chunks are disjoint sub-ranges of the one job,
        // which is exactly `buf`; `buf` is mutably borrowed for the whole run,
        // so each chunk is writable and touched by this worker only.
        unsafe { clear_raw(kernel, base.at(offset), c.len) };
        Ok(())
    })
}

/// Zeroes the memory of every job with `kernel`, in parallel (see
/// [`run_jobs`]). `Job::start` is the address of the range.
///
/// Ranges of different jobs must not overlap; that is checked, and reported as
/// [`RunError::InvalidJob`] before anything is written.
///
/// # Safety
/// For every job, `start..start + len` must be mapped writable in this process
/// (a hugetlb or file mapping must also be backed, or the write raises
/// SIGBUS), and nothing else may read or write it, nor hold a Rust reference
/// to it, until this returns. The address is turned into a pointer with
/// exposed provenance, so it must come from a pointer whose provenance was
/// exposed (`ptr as usize` or `expose_provenance`), as `mmap` results are.
///
/// # Errors
/// As for [`run_jobs`]; `Work` cannot happen.
pub unsafe fn clear_jobs(
    topology: &Topology,
    jobs: &[Job],
    kernel: ClearKernel,
    opts: &RunOptions<'_>,
) -> Result<RunReport, RunError<Infallible>> {
    check_disjoint(jobs)?;
    run_jobs(topology, jobs, opts, |c: &Chunk| {
        let ptr = std::ptr::with_exposed_provenance_mut::<u8>(c.start);
        // SAFETY: `c` lies inside one job's range (the runner's chunks are
        // disjoint and within their job), which the caller guarantees is
        // mapped writable and not accessed by anyone else; jobs were checked
        // not to overlap, so no other worker writes these bytes.
        unsafe { clear_raw(kernel, ptr, c.len) };
        Ok(())
    })
}

#[cfg(test)]
mod tests;
