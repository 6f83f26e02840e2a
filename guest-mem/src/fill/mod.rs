//! Filling a region from files: parking a VM whose memory is a VMM's own
//! memfd, restoring one from files on disk.
//!
//! Every byte of the region ends up either read from a source or zero.
//! Bytes a source supplies are read straight into the region's mapping with
//! `pread`, never zeroed first; holes in a source (`SEEK_DATA`/`SEEK_HOLE`:
//! shmem and memfds, ext4, xfs) and bytes no source covers are zeroed with
//! the [`clearing`] kernels, or skipped when the region is known to be zero
//! ([`FillOptions::dest_is_zero`], or an `Unpopulated` unit, which the kernel
//! zeroes as it populates it).
//!
//! # Design
//!
//! **`pread`, never `mmap`, of the peer's file.** The files come from an
//! untrusted peer, which can truncate its memfd at any moment: a mapping of
//! it would then SIGBUS the daemon, where a read just comes back short. A
//! short read is an error naming the source and offset, and the rest of the
//! unit is zeroed so nothing stale remains. A file that grows meanwhile is
//! fine: only the claimed range is read.
//!
//! **One state unit at a time, claimed.** [`fill_unit`] claims a unit the
//! way the lazy clearing claims a page (`Unpopulated`/`Dirty → Clearing`,
//! one `compare_exchange`), fills it and marks it `Clean`: a page fault that
//! asks for one unit and background workers filling the rest in address
//! order fill each unit exactly once. `Clean` after a fill means "holds its
//! final contents" (not zero, as it means in the pool: a filled region goes
//! back to a pool only through [`Region::mark_all_dirty`]); so a region whose
//! pages are clean (zero) is first marked with [`mark_for_fill`], which also
//! says whether its bytes are all zero.
//!
//! **Parallel and NUMA-local.** [`fill_region`] runs [`fill_unit`] over the
//! region on the [`clearing`] job runner: chunks of whole units, workers
//! pinned to the region's node (so the copy's writes and the page cache's
//! reads stay local), pulled in address order from one counter, each chunk
//! written by its worker only. Progress is reported by bytes, not by time.
//!
//! **Read-ahead.** For files on disk, each chunk's file ranges are handed to
//! the kernel with `POSIX_FADV_WILLNEED` before they are read
//! ([`Readahead`]), which keeps the device's queue full while the workers
//! copy; docs/benchmarks.md (`bench fill`) has the measurements.

mod error;
mod plan;
mod unit;

pub use error::FillError;
pub use plan::{FillPlan, FillSource};
pub use unit::fill_unit;

use std::ops::AddAssign;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use clearing::{CancelToken, Chunk, Job, RunError, RunOptions};
use numa::Topology;
use tracing::{debug, info};

use crate::region::Region;
use crate::state::PageState;
use crate::sys;

/// Default [`FillOptions::chunk`]: 16 MiB, eight 2 MiB units; large enough
/// that each worker's reads stream, small enough that a few GiB still spread
/// over every worker of a node.
pub const DEFAULT_FILL_CHUNK: u64 = 16 << 20;

/// Default [`FillOptions::progress_every`]: 1 GiB.
pub const DEFAULT_PROGRESS_EVERY: u64 = 1 << 30;

/// Hints to the kernel about how the sources will be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readahead {
    /// No hints: the kernel's own read-ahead of each `pread`.
    None,
    /// `POSIX_FADV_SEQUENTIAL` on every source's range once (doubles the
    /// read-ahead window of the file description).
    Sequential,
    /// `POSIX_FADV_WILLNEED` on each chunk's file ranges as a worker takes it:
    /// the chunk's reads are all queued to the device at once.
    WillNeed,
}

/// How a fill runs.
#[derive(Clone, Copy)]
pub struct FillOptions<'a> {
    /// The region's bytes are all zero (taken clean from the pool, see
    /// [`mark_for_fill`]): holes and uncovered bytes are skipped, not zeroed.
    pub dest_is_zero: bool,
    /// Most workers of [`fill_region`] (the region is on one node; the node's
    /// CPUs bound it too).
    pub max_threads_per_node: usize,
    /// Bytes per chunk a worker takes; rounded up to whole state units.
    pub chunk: u64,
    /// Read-ahead hints.
    pub readahead: Readahead,
    /// Called with the progress every `progress_every` bytes of the region
    /// and at the end; calls are serialized. Keep it cheap: workers wait.
    pub progress: Option<&'a (dyn Fn(&FillProgress) + Sync)>,
    /// Bytes between progress reports (also logged with `tracing`); 0 for none.
    pub progress_every: u64,
    /// Stops [`fill_region`] between chunks.
    pub cancel: Option<&'a CancelToken>,
}

impl Default for FillOptions<'_> {
    fn default() -> Self {
        Self {
            dest_is_zero: false,
            max_threads_per_node: std::thread::available_parallelism().map_or(1, usize::from),
            chunk: DEFAULT_FILL_CHUNK,
            readahead: Readahead::WillNeed,
            progress: None,
            progress_every: DEFAULT_PROGRESS_EVERY,
            cancel: None,
        }
    }
}

impl std::fmt::Debug for FillOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FillOptions")
            .field("dest_is_zero", &self.dest_is_zero)
            .field("max_threads_per_node", &self.max_threads_per_node)
            .field("chunk", &self.chunk)
            .field("readahead", &self.readahead)
            .field("progress", &self.progress.map(|_| "Fn(&FillProgress)"))
            .field("progress_every", &self.progress_every)
            .field("cancel", &self.cancel)
            .finish()
    }
}

/// How far a [`fill_region`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FillProgress {
    /// Bytes of the region whose units are done (filled or skipped).
    pub bytes_done: u64,
    /// The region's length.
    pub bytes_total: u64,
}

/// What was written, per unit or summed over a region.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FillCounts {
    /// Bytes read from the sources into the region.
    pub bytes_read: u64,
    /// Bytes zeroed (holes and uncovered bytes of units that may hold stale data).
    pub bytes_zeroed: u64,
    /// Bytes of the sources' ranges that were holes, zeroed or skipped.
    pub hole_bytes: u64,
}

impl AddAssign for FillCounts {
    fn add_assign(&mut self, rhs: Self) {
        self.bytes_read += rhs.bytes_read;
        self.bytes_zeroed += rhs.bytes_zeroed;
        self.hole_bytes += rhs.hole_bytes;
    }
}

/// What [`fill_unit`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnitFill {
    /// This call filled the unit; it is `Clean` now.
    Filled(FillCounts),
    /// Another thread holds the unit in `Clearing` (filling it): it turns
    /// `Clean` when that thread is done.
    Busy,
    /// The unit was already `Clean` or `Mapped`: nothing done.
    Done(PageState),
}

/// What [`fill_region`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FillReport {
    /// Bytes read, zeroed, and in holes, over all units this call filled.
    pub counts: FillCounts,
    /// Units this call filled.
    pub units_filled: usize,
    /// Units it left: already `Clean`/`Mapped`, or held by another filler.
    pub units_skipped: usize,
    /// Workers that ran.
    pub threads: usize,
    /// Wall time of the whole call.
    pub elapsed: Duration,
}

impl FillReport {
    /// Bytes read per second, in GB/s (10^9 bytes).
    pub fn read_gbps(&self) -> f64 {
        let seconds = self.elapsed.as_secs_f64();
        if seconds > 0.0 {
            // Precision loss above 2^53 bytes is irrelevant for a rate.
            #[allow(clippy::cast_precision_loss)]
            let bytes = self.counts.bytes_read as f64;
            bytes / 1e9 / seconds
        } else {
            0.0
        }
    }
}

/// Moves every `Clean` and `Mapped` unit to `Dirty` so that [`fill_unit`]
/// and [`fill_region`] fill it; `Unpopulated` units stay (they are filled as
/// they are populated). Returns true when every unit was `Clean` or
/// `Unpopulated` before, i.e. the region's bytes are all zero: pass it as
/// [`FillOptions::dest_is_zero`] so nothing is zeroed twice.
///
/// For the owner of the region, before any filler runs; a unit another
/// thread holds in `Clearing` is left alone and makes the answer false.
///
/// `Clean` is taken to mean zero, as the pool means it: call this only on a
/// region that came from the pool. A region an earlier fill left `Clean`
/// holds that fill's bytes; it must not be returned to a pool, nor filled
/// again with `dest_is_zero`, before [`Region::mark_all_dirty`].
pub fn mark_for_fill(region: &Region) -> bool {
    let states = region.states();
    let mut all_zero = true;
    for unit in 0..states.len() {
        loop {
            match states.get(unit) {
                Ok(PageState::Unpopulated) => break,
                Ok(state @ (PageState::Clean | PageState::Mapped)) => {
                    all_zero &= state == PageState::Clean;
                    if states.try_transition(unit, state, PageState::Dirty).is_ok() {
                        break;
                    }
                    // Changed under us: look again.
                }
                _ => {
                    all_zero = false;
                    break;
                }
            }
        }
    }
    all_zero
}

/// Fills `region` from `sources`, in parallel on workers pinned to the
/// region's node: every `Dirty` or `Unpopulated` unit gets the sources'
/// bytes, and zeros where they supply none (see [`fill_unit`]); units end
/// `Clean`. `Clean`, `Mapped` units and units another thread is filling are
/// skipped (counted in [`FillReport::units_skipped`]).
///
/// # Errors
///
/// As [`FillPlan::new`] before anything is written; then the first error of
/// [`fill_unit`] (the other workers stop after their current chunk; units
/// not filled stay `Dirty` or `Unpopulated`), or [`FillError::Run`].
pub fn fill_region(
    topology: &Topology,
    region: &Region,
    sources: &[FillSource<'_>],
    opts: &FillOptions<'_>,
) -> Result<FillReport, FillError> {
    let plan = FillPlan::new(region, sources)?;
    fill_region_planned(topology, region, &plan, opts)
}

/// [`fill_region`] with sources checked before.
///
/// # Errors
///
/// As [`fill_region`], plus [`FillError::WrongRegion`].
pub fn fill_region_planned(
    topology: &Topology,
    region: &Region,
    plan: &FillPlan<'_>,
    opts: &FillOptions<'_>,
) -> Result<FillReport, FillError> {
    let started = Instant::now();
    if plan.region_len() != region.len() {
        return Err(FillError::WrongRegion {
            planned: plan.region_len(),
            actual: region.len(),
        });
    }
    if opts.readahead == Readahead::Sequential {
        for p in plan.sources() {
            advise(
                p.source.file,
                p.source.file_offset,
                p.source.len,
                libc::POSIX_FADV_SEQUENTIAL,
            );
        }
    }
    let unit = region.state_unit();
    // A unit is a power of two of at most 1 GiB; the region's length was
    // checked to fit usize when it was made.
    let chunk = opts.chunk.max(1).div_ceil(unit).saturating_mul(unit) as usize;
    let job = Job {
        start: region.as_ptr() as usize,
        len: region.len() as usize,
        align: unit as usize,
        min_chunk: chunk,
        max_threads: opts.max_threads_per_node.max(1),
        node: region.node(),
    };
    let run_opts = RunOptions {
        cancel: opts.cancel,
        progress: None,
        max_chunk: chunk,
    };
    let tally = Tally::new(region.len(), opts);
    let base = region.as_ptr() as usize;
    let run = clearing::run_jobs(topology, &[job], &run_opts, |c: &Chunk| {
        let first = ((c.start - base) as u64 / unit) as usize;
        let last = ((c.start - base + c.len) as u64).div_ceil(unit) as usize;
        if opts.readahead == Readahead::WillNeed {
            let (start, end) = ((c.start - base) as u64, (c.start - base + c.len) as u64);
            for p in plan.covering(start, end) {
                let s = &p.source;
                let from = s.dest_offset.max(start);
                let to = (s.dest_offset + s.len).min(end);
                advise(
                    s.file,
                    s.file_offset + (from - s.dest_offset),
                    to - from,
                    libc::POSIX_FADV_WILLNEED,
                );
            }
        }
        for u in first..last {
            let outcome = fill_unit(region, plan, u, opts)?;
            tally.unit_done(outcome, region.page_range(u).1);
        }
        Ok(())
    })
    .map_err(|e| match e {
        RunError::Work { source, .. } => source,
        other => FillError::Run(Box::new(other)),
    })?;
    let report = tally.report(run.nodes.iter().map(|n| n.threads).sum(), started.elapsed());
    info!(
        region = %region.name(),
        bytes_read = report.counts.bytes_read,
        bytes_zeroed = report.counts.bytes_zeroed,
        hole_bytes = report.counts.hole_bytes,
        units_filled = report.units_filled,
        units_skipped = report.units_skipped,
        threads = report.threads,
        seconds = report.elapsed.as_secs_f64(),
        "region filled"
    );
    Ok(report)
}

/// A read-ahead hint; a file that takes none (hugetlbfs) is no error.
fn advise(file: std::os::fd::BorrowedFd<'_>, offset: u64, len: u64, advice: libc::c_int) {
    if let Err(e) = sys::fadvise(file, offset, len, advice) {
        debug!(error = %e, advice, "read-ahead hint refused");
    }
}

/// The workers' running totals, and the progress reports made from them.
struct Tally<'a> {
    total: u64,
    done: AtomicU64,
    counts: Mutex<(FillCounts, usize, usize)>,
    every: u64,
    progress: Option<&'a (dyn Fn(&FillProgress) + Sync)>,
    /// Serializes the progress calls.
    reporting: Mutex<()>,
}

impl<'a> Tally<'a> {
    fn new(total: u64, opts: &FillOptions<'a>) -> Self {
        Self {
            total,
            done: AtomicU64::new(0),
            counts: Mutex::new((FillCounts::default(), 0, 0)),
            every: opts.progress_every,
            progress: opts.progress,
            reporting: Mutex::new(()),
        }
    }

    fn unit_done(&self, outcome: UnitFill, len: u64) {
        {
            let mut c = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
            match outcome {
                UnitFill::Filled(counts) => {
                    c.0 += counts;
                    c.1 += 1;
                }
                UnitFill::Busy | UnitFill::Done(_) => c.2 += 1,
            }
        }
        let before = self.done.fetch_add(len, Ordering::Relaxed);
        let after = before + len;
        let crossed = self.every > 0 && after / self.every > before / self.every;
        if crossed || after == self.total {
            let _serial = self
                .reporting
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let progress = FillProgress {
                bytes_done: self.done.load(Ordering::Relaxed),
                bytes_total: self.total,
            };
            info!(
                bytes_done = progress.bytes_done,
                bytes_total = progress.bytes_total,
                "filling"
            );
            if let Some(f) = self.progress {
                f(&progress);
            }
        }
    }

    fn report(self, threads: usize, elapsed: Duration) -> FillReport {
        let (counts, units_filled, units_skipped) = self
            .counts
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner);
        FillReport {
            counts,
            units_filled,
            units_skipped,
            threads,
            elapsed,
        }
    }
}
