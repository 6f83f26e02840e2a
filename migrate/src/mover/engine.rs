//! The engine behind [`move_range`](super::move_range): the request as it
//! sees it, the page queries, the plan, and the steps of the
//! [`mover`](super) module docs (plan, bind, move in batches, verify), each
//! a function of its own, run over the kernel calls of [`Mm`].

use std::slice::Chunks;
use std::time::Instant;

use clearing::{CancelToken, Progress};
use guest_mem::PageSize;
use numa::{NodeId, PageLocation, PolicyError, Topology};
use tracing::{debug, info, warn};

use super::error::{MigrateError, Result};
use super::options::MoveOptions;
use super::span::MoveSpan;
use super::tally::Tally;
use crate::mm::Mm;
use crate::pace;
use crate::plan::{validate_range, validate_target, ByteRange, Capacity, MovePlan, PageSpan};
use crate::report::{FailReason, FailedPage, MoveReport, StrayPage};

/// Pages per `move_pages` query (bounds the address and status buffers).
const QUERY_BATCH: usize = 1 << 16;

/// One move request, as the engine sees it.
pub(super) struct Request<'r> {
    pub(super) span: &'r MoveSpan<'r>,
    pub(super) range: ByteRange,
    pub(super) target: NodeId,
    pub(super) opts: &'r MoveOptions,
    pub(super) cancel: Option<&'r CancelToken>,
    pub(super) progress: Option<&'r dyn Fn(&Progress)>,
}

pub(super) fn page_count(span: &MoveSpan<'_>) -> usize {
    // The span fits the address space (checked at construction).
    usize::try_from(span.len / span.page_size.bytes()).unwrap_or(usize::MAX)
}

pub(super) fn query_pages<M: Mm>(
    mm: &M,
    span: &MoveSpan<'_>,
    pages: PageSpan,
) -> std::result::Result<Vec<PageLocation>, PolicyError> {
    let mut out = Vec::with_capacity(pages.count);
    let mut addrs = Vec::with_capacity(pages.count.min(QUERY_BATCH));
    let end = pages.first + pages.count;
    let mut first = pages.first;
    while first < end {
        let last = (first + QUERY_BATCH).min(end);
        addrs.clear();
        addrs.extend((first..last).map(|p| span.page_addr(p)));
        out.extend(mm.query(&addrs)?);
        first = last;
    }
    Ok(out)
}

pub(super) fn plan_with<M: Mm>(
    mm: &M,
    span: &MoveSpan<'_>,
    pages: PageSpan,
    target: NodeId,
) -> Result<MovePlan> {
    let locations = query_pages(mm, span, pages).map_err(MigrateError::Query)?;
    let capacity = mm
        .capacity(span.page_size, target)
        .map_err(|source| MigrateError::Pools {
            node: target,
            source,
        })?;
    Ok(MovePlan::build(
        span.page_size,
        pages.first,
        &locations,
        target,
        capacity,
    ))
}

/// True when `capacity` leaves no room for one more page of `page_size`.
fn target_full(capacity: &Capacity, page_size: u64) -> bool {
    match *capacity {
        Capacity::Pool { free, .. } => free == 0,
        Capacity::Memory { free_bytes } => free_bytes < page_size,
    }
}

/// Moves as [`move_range`](super::move_range) says, over `mm`.
pub(super) fn run<M: Mm>(mm: &M, topology: &Topology, req: &Request<'_>) -> Result<MoveReport> {
    let (pages, plan) = plan_request(mm, topology, req)?;
    let mut tally = Tally::start(req.target, req.span.page_size.bytes(), pages, &plan);
    if req.cancel.is_some_and(CancelToken::is_cancelled) {
        return Err(MigrateError::Cancelled {
            report: tally.boxed(),
        });
    }
    bind_range(mm, req)?;
    move_batches(mm, req, &plan, &mut tally)?;
    verify(mm, req, pages, &tally)
}

/// Steps 1 and 2: checks the request and plans the move; a plan that does
/// not fit ends here unless partial moves are allowed.
fn plan_request<M: Mm>(
    mm: &M,
    topology: &Topology,
    req: &Request<'_>,
) -> Result<(PageSpan, MovePlan)> {
    let span = req.span;
    let target = req.target;
    let opts = req.opts;
    opts.validate()?;
    validate_target(topology, target)?;
    let pages = validate_range(span.len, span.page_size, req.range)?;

    let plan = plan_with(mm, span, pages, target)?;
    info!(
        target,
        range = %req.range,
        page_size = %span.page_size,
        plan = %plan,
        "moving pages"
    );
    if !plan.fits() && !opts.allow_partial {
        return Err(MigrateError::Insufficient {
            plan: Box::new(plan),
        });
    }
    Ok((pages, plan))
}

/// Step 3: binds the range to the target, so that pages faulted from now
/// on are allocated there.
fn bind_range<M: Mm>(mm: &M, req: &Request<'_>) -> Result<()> {
    let target = req.target;
    // The range was validated against the span, which fits the address space.
    let range_addr = req.span.addr + req.range.offset as usize;
    mm.bind(range_addr, req.range.len as usize, target)
        .map_err(|source| MigrateError::Bind {
            node: target,
            source,
        })
}

/// Step 4: `move_pages` over the plan's pages in batches; between batches,
/// the rate-limit wait, cancellation and progress.
fn move_batches<M: Mm>(
    mm: &M,
    req: &Request<'_>,
    plan: &MovePlan,
    tally: &mut Tally,
) -> Result<()> {
    let span = req.span;
    let target = req.target;
    let opts = req.opts;
    let ps = span.page_size.bytes();
    let batch = opts.batch_for(span.page_size);
    let bytes_total = plan.to_move.len() as u64 * ps;
    let mut bytes_done = 0u64;
    let mut addrs = Vec::with_capacity(batch.min(plan.to_move.len()));
    let mut chunks = plan.to_move.chunks(batch);
    while let Some(chunk) = chunks.next() {
        let wait = pace::wait_before(
            tally.started.elapsed(),
            bytes_done,
            opts.rate_limit_bytes_per_s,
        );
        if !pace::wait_until(Instant::now(), wait, req.cancel) {
            return Err(MigrateError::Cancelled {
                report: tally.boxed(),
            });
        }
        addrs.clear();
        addrs.extend(chunk.iter().map(|&p| span.page_addr(p)));
        tally.batches += 1;
        match mm.move_to(&addrs, target, opts.move_all) {
            Ok(locations) => {
                let stayed = locations
                    .iter()
                    .any(|l| matches!(l, PageLocation::Node(n) if *n != target));
                let reason = if stayed && target_is_full(mm, span.page_size, target) {
                    FailReason::NoFreeTargetPage
                } else {
                    FailReason::NotMigrated
                };
                tally.account(chunk, &locations, reason);
            }
            Err(PolicyError::OutOfMemory { .. }) => {
                bytes_done += after_out_of_memory(mm, req, chunk, &addrs, &mut chunks, tally)?;
            }
            Err(source) => {
                return Err(MigrateError::Move {
                    page: chunk[0],
                    report: tally.boxed(),
                    source,
                })
            }
        }
        bytes_done += chunk.len() as u64 * ps;
        if let Some(report) = req.progress {
            report(&Progress {
                bytes_done,
                bytes_total,
            });
        }
    }
    Ok(())
}

/// A batch whose `move_pages` failed with `ENOMEM` (hugetlb: no page on the
/// target for one of the batch's pages; those before it moved): asks where
/// the batch's pages are and counts them; when the target's pool is then
/// empty for good, gives up on every page still to come (`rest`). Returns
/// the bytes given up on, which count as done for progress.
fn after_out_of_memory<M: Mm>(
    mm: &M,
    req: &Request<'_>,
    chunk: &[usize],
    addrs: &[usize],
    rest: &mut Chunks<'_, usize>,
    tally: &mut Tally,
) -> Result<u64> {
    let target = req.target;
    debug!(
        first_page = chunk[0],
        "move_pages: ENOMEM, re-querying the batch"
    );
    let locations = mm.query(addrs).map_err(|source| MigrateError::Move {
        page: chunk[0],
        report: tally.boxed(),
        source,
    })?;
    tally.account(chunk, &locations, FailReason::NoFreeTargetPage);
    let capacity = mm.capacity(req.span.page_size, target).ok();
    let hopeless = matches!(
        capacity,
        Some(Capacity::Pool {
            free: 0,
            fresh_fallback: false,
            ..
        })
    );
    if !hopeless {
        return Ok(0);
    }
    let rest: Vec<usize> = rest.by_ref().flatten().copied().collect();
    warn!(
        target,
        pages = rest.len(),
        "target pool is empty: the remaining pages cannot move"
    );
    let given_up = rest.len() as u64 * req.span.page_size.bytes();
    tally.failed.extend(rest.into_iter().map(|page| FailedPage {
        page,
        reason: FailReason::NoFreeTargetPage,
    }));
    Ok(given_up)
}

/// Step 5: asks where every page is now and reports those not on the
/// target.
fn verify<M: Mm>(mm: &M, req: &Request<'_>, pages: PageSpan, tally: &Tally) -> Result<MoveReport> {
    let span = req.span;
    let target = req.target;
    let moved = tally.report(Vec::new(), false);
    let locations = match query_pages(mm, span, pages) {
        Ok(l) => l,
        Err(source) => {
            return Err(MigrateError::Verify {
                report: Box::new(moved),
                source,
            })
        }
    };
    let not_on_target: Vec<StrayPage> = (pages.first..)
        .zip(locations)
        .filter(|(_, loc)| match *loc {
            PageLocation::Node(n) => n != target,
            PageLocation::Error(e) => e != -libc::ENOENT,
        })
        .map(|(page, loc)| StrayPage::new(page, loc))
        .collect();
    let report = MoveReport {
        not_on_target,
        verified: true,
        ..moved
    };
    if report.complete() {
        info!(report = %report, "pages moved");
    } else {
        warn!(report = %report, "not every page reached the target");
    }
    Ok(report)
}

/// Whether the target has no room left, read after a batch with failures.
fn target_is_full<M: Mm>(mm: &M, page_size: PageSize, target: NodeId) -> bool {
    mm.capacity(page_size, target)
        .is_ok_and(|c| target_full(&c, page_size.bytes()))
}
