//! Populating and clearing a region's pages on node-pinned workers, and
//! checking where they are.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use clearing::{Chunk, ClearKernel, Job, RunOptions};
use numa::{PageLocation, PolicyError, Topology};
use tracing::{debug, info, warn};

use crate::state::PageState;
use crate::sys;

use super::*;

impl Region {
    /// Populates every `Unpopulated` page and clears every `Dirty` page, in
    /// parallel, with workers pinned to the region's node; `Clean`, `Mapped`
    /// and pages another thread holds in `Clearing` are skipped.
    ///
    /// Fresh pages are populated with `MADV_POPULATE_WRITE` (the kernel
    /// allocates them under the region's policy and zeroes them; clearing them
    /// again would write each page twice). Reused pages are cleared with
    /// [`ClearKernel::default_kernel`]. Each page is claimed through its state
    /// (`→ Clearing`) first, so a scrubber running at the same time never
    /// clears the same page.
    ///
    /// # Errors
    ///
    /// [`PrepareError::Run`]: a page could not be populated (`EFAULT`/`ENOMEM`:
    /// the node's pool is empty), a worker could not be pinned, the run was
    /// cancelled. A page that failed goes back to `Dirty`; pages finished
    /// before the error stay `Clean`.
    pub fn prepare_eager(
        &self,
        topology: &Topology,
        opts: &RunOptions<'_>,
    ) -> Result<PrepareReport, PrepareError> {
        let started = Instant::now();
        let unit = state_unit(self.page_size);
        // The unit is a power of two of at most 1 GiB, so it fits usize.
        let unit_usize = unit as usize;
        let threads = std::thread::available_parallelism().map_or(1, usize::from);
        let job = Job {
            start: self.addr as usize,
            // Checked to fit usize at creation.
            len: self.len as usize,
            align: unit_usize,
            min_chunk: unit_usize,
            max_threads: threads,
            node: self.node(),
        };
        let populated = AtomicUsize::new(0);
        let cleared = AtomicUsize::new(0);
        let bytes = AtomicU64::new(0);
        let kernel = ClearKernel::default_kernel();
        let base = self.addr as usize;
        let run = clearing::run_jobs(topology, &[job], opts, |chunk: &Chunk| {
            let first = (chunk.start - base) / unit_usize;
            let last = (chunk.start - base + chunk.len).div_ceil(unit_usize);
            for page in first..last {
                let Some(was) = self.states.claim_for_prepare(page) else {
                    continue;
                };
                let (offset, len) = self.page_range(page);
                // SAFETY: offset..offset+len lies inside our live mapping
                // (page_range clips to the region length).
                let ptr = unsafe { self.addr.add(offset as usize) };
                let result = if was == PageState::Unpopulated {
                    // SAFETY: the range lies in our mapping; POPULATE_WRITE
                    // only faults pages in, it never changes contents.
                    unsafe { sys::madvise(ptr, len as usize, sys::MADV_POPULATE_WRITE) }
                } else {
                    // SAFETY: the range lies in our mapping (mapped
                    // read-write, backed: the file was sized and reserved),
                    // and this thread owns the page through its `Clearing`
                    // state: by the state protocol no guest has it mapped
                    // (it is not `Mapped`), no other clearer can claim it, and
                    // no Rust reference to it exists (only the unsafe
                    // accessors hand those out, under the same rule).
                    unsafe { clearing::clear_raw(kernel, ptr, len as usize) };
                    Ok(())
                };
                if let Err(source) = result {
                    // Maybe partly populated: must be cleared before use.
                    let _ = self
                        .states
                        .try_transition(page, PageState::Clearing, PageState::Dirty);
                    return Err(PageFailure {
                        page,
                        offset,
                        len,
                        source,
                    });
                }
                if let Err(e) =
                    self.states
                        .try_transition(page, PageState::Clearing, PageState::Clean)
                {
                    // Only the owner leaves Clearing, so this cannot happen.
                    debug!(error = %e, "page left Clearing under its owner");
                }
                if was == PageState::Unpopulated {
                    &populated
                } else {
                    &cleared
                }
                .fetch_add(1, Ordering::Relaxed);
                bytes.fetch_add(len, Ordering::Relaxed);
            }
            Ok(())
        })
        .map_err(PrepareError::Run)?;
        let populated = populated.into_inner();
        let cleared = cleared.into_inner();
        let report = PrepareReport {
            populated,
            cleared,
            skipped: self.states.len() - populated - cleared,
            bytes: bytes.into_inner(),
            seconds: started.elapsed().as_secs_f64(),
            run,
        };
        info!(
            region = %self.name,
            populated = report.populated,
            cleared = report.cleared,
            skipped = report.skipped,
            seconds = report.seconds,
            gb_per_s = report.gb_per_s(),
            "region prepared"
        );
        Ok(report)
    }

    /// Where the pages are: one `move_pages` query address per huge page (per
    /// 4 KiB page for base-page regions). For a bound region every present
    /// page must be on the node; for an unbound region any node is fine.
    /// Pages not present are expected in `Unpopulated` granules only.
    ///
    /// # Errors
    ///
    /// Errors of the `move_pages` call as a whole.
    pub fn verify_placement(&self) -> Result<PlacementReport, PolicyError> {
        let started = Instant::now();
        let step = self.page_size.bytes();
        let unit = state_unit(self.page_size);
        let count = usize::try_from(self.len / step).unwrap_or(usize::MAX);
        let base = self.addr as usize;
        let mut report = PlacementReport {
            node: self.node(),
            pages: count,
            on_node: 0,
            not_present: 0,
            misplaced: Vec::new(),
            seconds: 0.0,
        };
        let mut addrs = Vec::with_capacity(count.min(QUERY_BATCH));
        let mut first = 0;
        while first < count {
            let end = (first + QUERY_BATCH).min(count);
            addrs.clear();
            // step * i < len, which fits usize.
            addrs.extend((first..end).map(|i| base + i * step as usize));
            let locations = numa::move_pages_query(None, &addrs)?;
            for (i, loc) in (first..end).zip(locations) {
                match loc {
                    PageLocation::Node(n) if self.node().is_none_or(|want| want == n) => {
                        report.on_node += 1
                    }
                    PageLocation::Error(e) if e == -libc::ENOENT => {
                        let granule = (i as u64 * step / unit) as usize;
                        if self.states.get(granule) == Ok(PageState::Unpopulated) {
                            report.not_present += 1;
                        } else {
                            report.misplaced.push((i, loc));
                        }
                    }
                    other => report.misplaced.push((i, other)),
                }
            }
            first = end;
        }
        report.seconds = started.elapsed().as_secs_f64();
        if report.misplaced.is_empty() {
            debug!(region = %self.name, pages = report.pages, seconds = report.seconds, "placement verified");
        } else {
            warn!(
                region = %self.name,
                node = ?self.node(),
                misplaced = report.misplaced.len(),
                pages = report.pages,
                "pages of the region are not on its node"
            );
        }
        Ok(report)
    }
}
