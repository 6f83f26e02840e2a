//! The whole region: marking it for a fill, and filling it on node-pinned
//! workers with progress by bytes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use clearing::{Chunk, Job, RunError, RunOptions};
use numa::Topology;
use tracing::{debug, info};

use super::error::FillError;
use super::options::{FillCounts, FillOptions, FillProgress, FillReport, Readahead, UnitFill};
use super::plan::{FillPlan, FillSource};
use super::unit::fill_unit;
use crate::region::Region;
use crate::state::PageState;
use crate::sys;

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
    let plan = if opts.direct_io {
        plan.with_direct_io()
    } else {
        plan
    };
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
        for p in plan.sources().iter().filter(|p| p.direct.is_none()) {
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
            for p in plan
                .covering(start, end)
                .iter()
                .filter(|p| p.direct.is_none())
            {
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
            let outcome = fill_unit(region, plan, u, opts);
            if let (Some(done), Ok(UnitFill::Filled(_)) | Err(_)) = (opts.unit_done, &outcome) {
                done(u);
            }
            tally.unit_done(outcome?, region.page_range(u).1);
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
        bytes_read_direct = report.counts.bytes_read_direct,
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
