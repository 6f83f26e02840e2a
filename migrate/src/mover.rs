//! Moving a range of a mapping to another NUMA node, one `move_pages` entry
//! per huge page, in batches.
//!
//! # Steps
//!
//! 1. Validate the request (target node, range, options): errors here
//!    come before any syscall.
//! 2. Ask where every page of the range is (`move_pages` without targets)
//!    and how many pages the target can take; build the [`MovePlan`]. With
//!    [`MoveOptions::allow_partial`] off, a plan that does not fit ends here
//!    with [`MigrateError::Insufficient`] and nothing changed.
//! 3. `mbind(MPOL_BIND, {target})` over the range, without `MPOL_MF_MOVE`:
//!    pages faulted from now on (during the move too) are allocated on the
//!    target. Moving is left to step 4, where it can be batched, paced,
//!    cancelled and accounted per page; `mbind(MPOL_MF_MOVE)` would do it
//!    all in one uninterruptible call with no per-page result.
//! 4. `move_pages` in batches of [`MoveOptions::batch_pages`] addresses,
//!    one per page (the kernel migrates a hugetlb page whole). Between
//!    batches: cancellation, progress, and a wait for the rate-limit
//!    deadline.
//! 5. Query every page again and report those not on the target.
//!
//! # Shared pages
//!
//! Guest RAM is mapped by hugemem *and* by the VMM, so its pages have a map
//! count above one, and `MPOL_MF_MOVE` refuses them (`EACCES`).
//! [`MoveOptions::move_all`] (default on) uses `MPOL_MF_MOVE_ALL`, which
//! needs `CAP_SYS_NICE`; the kernel then fixes up every mapping, the VMM's
//! included, and the guest sees the same data at the same address.
//!
//! # What a failed page means
//!
//! With hugetlb pages, "no page on the target" makes the whole call fail
//! with `ENOMEM` (`migrate_hugetlbs` gives up on the first one), after the
//! pages before it moved; the mover then asks where the batch's pages are
//! and counts those left behind as [`FailReason::NoFreeTargetPage`]. When
//! that happens with 1 GiB pages and the target pool is empty afterwards,
//! the rest of the range cannot move either and is reported the same way
//! without further calls. Other per-page errors come from the status array
//! ([`FailReason::from_errno`]). When the kernel instead returns a count of
//! pages it could not move, `numa::move_pages` re-queries the pages, so the
//! per-page reason is lost; those pages are reported as `NoFreeTargetPage`
//! when the target pool is empty afterwards, else as
//! [`FailReason::NotMigrated`].
//!
//! # What the mover does not change
//!
//! A [`guest_mem::Region`] keeps the node it was created for
//! ([`guest_mem::Region::node`]); after moving a whole region the caller
//! must record the new node itself (the region's `verify_placement` and
//! `prepare_eager` still use the old one). A policy set with `mbind` here
//! belongs to hugemem's mapping: for hugetlb it does not apply to faults
//! through the VMM's mapping (for 4 KiB shmem it is stored on the file and
//! does). After cancellation or an error the range stays bound to the target
//! and the pages moved so far stay moved; the error carries the counts.

use std::marker::PhantomData;
use std::time::Instant;

use clearing::{CancelToken, Progress};
use guest_mem::{PageSize, PoolError, Region, SharedMapping};
use numa::{NodeId, PageLocation, PolicyError, Topology};
use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};

use crate::mm::{Host, Mm};
use crate::pace;
use crate::plan::{
    validate_range, validate_target, ByteRange, Capacity, MovePlan, PageSpan, PlanError,
};
use crate::report::{gb_per_s, FailReason, FailedPage, MoveReport, StrayPage};

/// Pages per `move_pages` query (bounds the address and status buffers).
const QUERY_BATCH: usize = 1 << 16;

/// Bytes per batch when [`MoveOptions::batch_pages`] is 0.
pub const AUTO_BATCH_BYTES: u64 = 64 << 20;

/// Errors of a move.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    /// The request is invalid (range, node, options); nothing was done.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The target's pool counts could not be read; nothing was changed.
    #[error("cannot read the free pages of node {node}")]
    Pools {
        /// The target node.
        node: NodeId,
        /// The cause.
        #[source]
        source: PoolError,
    },
    /// Asking where the pages are failed; nothing was changed.
    #[error("cannot query where the pages are")]
    Query(#[source] PolicyError),
    /// The target cannot take every page and partial moves were not allowed;
    /// nothing was changed.
    #[error("the target cannot take every page: {plan}")]
    Insufficient {
        /// The plan that did not fit.
        plan: Box<MovePlan>,
    },
    /// Binding the range to the target failed; no page was moved.
    #[error("cannot bind the range to node {node}")]
    Bind {
        /// The target node.
        node: NodeId,
        /// The cause.
        #[source]
        source: PolicyError,
    },
    /// A `move_pages` call failed as a whole; pages moved before it stay moved.
    #[error("move_pages failed for the batch starting at page {page}")]
    Move {
        /// First page of the failed batch.
        page: usize,
        /// What was done before the failure.
        report: Box<MoveReport>,
        /// The cause.
        #[source]
        source: PolicyError,
    },
    /// The final placement query failed; the move itself finished.
    #[error("cannot verify placement after the move")]
    Verify {
        /// What the move did (not verified).
        report: Box<MoveReport>,
        /// The cause.
        #[source]
        source: PolicyError,
    },
    /// Cancelled between batches; pages moved so far stay moved.
    #[error("the move was cancelled after {} of {} pages", .report.pages_moved, .report.pages_total)]
    Cancelled {
        /// What was done before the cancellation.
        report: Box<MoveReport>,
    },
}

impl MigrateError {
    /// What was done before the error, for the errors that come after pages
    /// may have moved.
    pub fn report(&self) -> Option<&MoveReport> {
        match self {
            Self::Move { report, .. }
            | Self::Verify { report, .. }
            | Self::Cancelled { report } => Some(report),
            _ => None,
        }
    }
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, MigrateError>;

/// How to move.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct MoveOptions {
    /// Pages per `move_pages` call; cancellation, progress and the rate limit
    /// act between calls. 0 (the default) means 64 MiB worth of pages, at
    /// least one: 1 page of 1 GiB, 32 of 2 MiB, 16384 of 4 KiB.
    pub batch_pages: usize,
    /// Average bytes per second to stay under, or `None` for no limit.
    pub rate_limit_bytes_per_s: Option<u64>,
    /// `MPOL_MF_MOVE_ALL`: also move pages other processes (the VMM) map.
    /// Needs `CAP_SYS_NICE`. Default on: guest RAM is always shared.
    pub move_all: bool,
    /// Move what can move when the target cannot take every page (default
    /// on). Off: refuse before changing anything
    /// ([`MigrateError::Insufficient`]).
    pub allow_partial: bool,
}

impl Default for MoveOptions {
    fn default() -> Self {
        Self {
            batch_pages: 0,
            rate_limit_bytes_per_s: None,
            move_all: true,
            allow_partial: true,
        }
    }
}

impl MoveOptions {
    /// Pages per batch for pages of `page_size`.
    pub fn batch_for(&self, page_size: PageSize) -> usize {
        if self.batch_pages > 0 {
            return self.batch_pages;
        }
        usize::try_from(AUTO_BATCH_BYTES / page_size.bytes())
            .unwrap_or(1)
            .max(1)
    }

    /// Checks the options.
    ///
    /// # Errors
    ///
    /// [`PlanError::ZeroRate`] for a rate limit of 0.
    pub fn validate(&self) -> std::result::Result<(), PlanError> {
        if self.rate_limit_bytes_per_s == Some(0) {
            return Err(PlanError::ZeroRate);
        }
        Ok(())
    }
}

/// An address range of this process made of whole pages of one size: what
/// [`move_range`] works on. Borrowing the mapping it was made from keeps the
/// addresses valid for as long as the span lives.
#[derive(Debug, Clone, Copy)]
pub struct MoveSpan<'a> {
    addr: usize,
    len: u64,
    page_size: PageSize,
    _mapping: PhantomData<&'a ()>,
}

impl<'a> MoveSpan<'a> {
    /// The whole of hugemem's mapping of `region`.
    pub fn of_region(region: &'a Region) -> Self {
        Self {
            addr: region.as_ptr() as usize,
            len: region.len(),
            page_size: region.page_size(),
            _mapping: PhantomData,
        }
    }

    /// The whole of a [`SharedMapping`].
    pub fn of_mapping(mapping: &'a SharedMapping) -> Self {
        Self {
            addr: mapping.addr() as usize,
            // usize -> u64 is lossless on 64-bit hosts.
            len: mapping.len() as u64,
            page_size: mapping.page_size(),
            _mapping: PhantomData,
        }
    }
}

impl MoveSpan<'static> {
    /// A span from raw parts. The calls made on it (`mbind`, `move_pages`)
    /// change where memory is, never what it holds, and the kernel checks
    /// the addresses, so this is safe; but the range should be a mapping of
    /// `page_size` pages that this process owns for the duration.
    ///
    /// # Errors
    ///
    /// [`PlanError::BadSpan`] when `addr` or `len` is not page aligned, `len`
    /// is zero, or the range wraps the address space.
    pub fn from_raw(
        addr: usize,
        len: u64,
        page_size: PageSize,
    ) -> std::result::Result<Self, PlanError> {
        let ps = page_size.bytes();
        let fits = usize::try_from(len)
            .ok()
            .and_then(|l| addr.checked_add(l))
            .is_some();
        if len == 0 || !len.is_multiple_of(ps) || !(addr as u64).is_multiple_of(ps) || !fits {
            return Err(PlanError::BadSpan {
                addr,
                len,
                page_size,
            });
        }
        Ok(Self {
            addr,
            len,
            page_size,
            _mapping: PhantomData,
        })
    }
}

impl MoveSpan<'_> {
    /// Start address.
    pub fn addr(&self) -> usize {
        self.addr
    }
    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Always false: spans are not empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Page size.
    pub fn page_size(&self) -> PageSize {
        self.page_size
    }
    /// Address of page `page`. `page` is below `len / page_size`, so the
    /// result lies in the span (checked to fit the address space).
    fn page_addr(&self, page: usize) -> usize {
        // The page size is at most 1 GiB and fits usize.
        self.addr + page * self.page_size.bytes() as usize
    }
}

/// Where the pages of a span are, by node: what `hugemem status` shows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Placement {
    /// Page size in bytes.
    pub page_size: u64,
    /// Pages queried.
    pub pages: usize,
    /// Present pages per node.
    pub per_node: std::collections::BTreeMap<NodeId, usize>,
    /// Pages not present (never touched).
    pub not_present: usize,
    /// Pages the query could not locate (other errnos).
    pub unlocated: usize,
}

impl std::fmt::Display for Placement {
    /// `node 0: 30 pages, node 1: 2 pages, 0 not present`
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (node, n) in &self.per_node {
            write!(f, "node {node}: {n} pages, ")?;
        }
        write!(f, "{} not present", self.not_present)?;
        if self.unlocated > 0 {
            write!(f, ", {} unlocated", self.unlocated)?;
        }
        Ok(())
    }
}

/// Where every page of `span` is (one query address per page).
///
/// # Errors
///
/// [`MigrateError::Query`] when the query fails as a whole.
pub fn placement(span: &MoveSpan<'_>) -> Result<Placement> {
    let count = page_count(span);
    let locations =
        query_pages(&Host, span, PageSpan { first: 0, count }).map_err(MigrateError::Query)?;
    let mut placement = Placement {
        page_size: span.page_size.bytes(),
        pages: count,
        per_node: Default::default(),
        not_present: 0,
        unlocated: 0,
    };
    for loc in locations {
        match loc {
            PageLocation::Node(n) => *placement.per_node.entry(n).or_insert(0) += 1,
            PageLocation::Error(e) if e == -libc::ENOENT => placement.not_present += 1,
            PageLocation::Error(_) => placement.unlocated += 1,
        }
    }
    Ok(placement)
}

/// The plan [`move_range`] would follow, without changing anything: the
/// dry run of `hugemem rebalance`.
///
/// # Errors
///
/// [`MigrateError::Plan`], [`MigrateError::Query`], [`MigrateError::Pools`].
pub fn plan_move(
    topology: &Topology,
    span: &MoveSpan<'_>,
    range: ByteRange,
    target: NodeId,
) -> Result<MovePlan> {
    validate_target(topology, target)?;
    let pages = validate_range(span.len, span.page_size, range)?;
    plan_with(&Host, span, pages, target)
}

/// Moves `range` of `span` to node `target`: see the module docs for the
/// steps. `progress` is called after every batch with the bytes of the
/// pages attempted so far out of the bytes that had to move; it may cancel
/// `cancel`, which stops the move before the next batch.
///
/// # Errors
///
/// Before anything changes: [`MigrateError::Plan`] (unknown or memory-less
/// node, empty, unaligned or out-of-range range, zero rate),
/// [`MigrateError::Query`], [`MigrateError::Pools`],
/// [`MigrateError::Insufficient`]. After the range was bound:
/// [`MigrateError::Bind`], [`MigrateError::Move`],
/// [`MigrateError::Cancelled`], [`MigrateError::Verify`], each with the
/// report of what was done.
pub fn move_range(
    topology: &Topology,
    span: &MoveSpan<'_>,
    range: ByteRange,
    target: NodeId,
    opts: &MoveOptions,
    cancel: Option<&CancelToken>,
    progress: Option<&dyn Fn(&Progress)>,
) -> Result<MoveReport> {
    run(
        &Host,
        topology,
        &Request {
            span,
            range,
            target,
            opts,
            cancel,
            progress,
        },
    )
}

/// [`move_range`] over the whole of `region`.
///
/// # Errors
///
/// As [`move_range`].
pub fn move_region(
    topology: &Topology,
    region: &Region,
    target: NodeId,
    opts: &MoveOptions,
    cancel: Option<&CancelToken>,
    progress: Option<&dyn Fn(&Progress)>,
) -> Result<MoveReport> {
    let span = MoveSpan::of_region(region);
    move_range(
        topology,
        &span,
        ByteRange::whole(region.len()),
        target,
        opts,
        cancel,
        progress,
    )
}

/// One move request, as the engine sees it.
struct Request<'r> {
    span: &'r MoveSpan<'r>,
    range: ByteRange,
    target: NodeId,
    opts: &'r MoveOptions,
    cancel: Option<&'r CancelToken>,
    progress: Option<&'r dyn Fn(&Progress)>,
}

fn page_count(span: &MoveSpan<'_>) -> usize {
    // The span fits the address space (checked at construction).
    usize::try_from(span.len / span.page_size.bytes()).unwrap_or(usize::MAX)
}

fn query_pages<M: Mm>(
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

fn plan_with<M: Mm>(
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

/// Running counts of a move.
struct Tally {
    target: NodeId,
    page_size: u64,
    first_page: usize,
    pages_total: usize,
    already_there: usize,
    not_present: usize,
    moved: usize,
    failed: Vec<FailedPage>,
    batches: usize,
    started: Instant,
    plan: String,
}

impl Tally {
    fn report(&self, not_on_target: Vec<StrayPage>, verified: bool) -> MoveReport {
        let seconds = self.started.elapsed().as_secs_f64();
        let bytes_moved = self.moved as u64 * self.page_size;
        MoveReport {
            target: self.target,
            page_size: self.page_size,
            first_page: self.first_page,
            pages_total: self.pages_total,
            pages_moved: self.moved,
            already_there: self.already_there,
            not_present: self.not_present,
            failed: self.failed.clone(),
            not_on_target,
            verified,
            bytes_moved,
            seconds,
            gb_per_s: gb_per_s(bytes_moved, seconds),
            batches: self.batches,
            plan: self.plan.clone(),
        }
    }

    fn boxed(&self) -> Box<MoveReport> {
        Box::new(self.report(Vec::new(), false))
    }

    /// Counts one batch's results. Pages that stayed away from the target
    /// without a per-page errno get `unexplained`.
    fn account(&mut self, pages: &[usize], locations: &[PageLocation], unexplained: FailReason) {
        for (&page, loc) in pages.iter().zip(locations) {
            match *loc {
                PageLocation::Node(n) if n == self.target => self.moved += 1,
                PageLocation::Node(_) => self.failed.push(FailedPage {
                    page,
                    reason: unexplained,
                }),
                PageLocation::Error(e) if e == -libc::ENOENT => self.not_present += 1,
                PageLocation::Error(e) => self.failed.push(FailedPage {
                    page,
                    reason: FailReason::from_errno(e),
                }),
            }
        }
    }
}

/// True when `capacity` leaves no room for one more page of `page_size`.
fn target_full(capacity: &Capacity, page_size: u64) -> bool {
    match *capacity {
        Capacity::Pool { free, .. } => free == 0,
        Capacity::Memory { free_bytes } => free_bytes < page_size,
    }
}

fn run<M: Mm>(mm: &M, topology: &Topology, req: &Request<'_>) -> Result<MoveReport> {
    let span = req.span;
    let target = req.target;
    let opts = req.opts;
    let ps = span.page_size.bytes();
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
    let mut tally = Tally {
        target,
        page_size: ps,
        first_page: pages.first,
        pages_total: pages.count,
        already_there: plan.already_there,
        not_present: plan.not_present,
        moved: 0,
        failed: Vec::new(),
        batches: 0,
        started: Instant::now(),
        plan: plan.summary(),
    };
    if req.cancel.is_some_and(CancelToken::is_cancelled) {
        return Err(MigrateError::Cancelled {
            report: tally.boxed(),
        });
    }

    // The range was validated against the span, which fits the address space.
    let range_addr = span.addr + req.range.offset as usize;
    mm.bind(range_addr, req.range.len as usize, target)
        .map_err(|source| MigrateError::Bind {
            node: target,
            source,
        })?;

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
                // hugetlb: no page on the target for one of the batch's
                // pages; those before it moved. Ask which.
                debug!(
                    first_page = chunk[0],
                    "move_pages: ENOMEM, re-querying the batch"
                );
                let locations = mm.query(&addrs).map_err(|source| MigrateError::Move {
                    page: chunk[0],
                    report: tally.boxed(),
                    source,
                })?;
                tally.account(chunk, &locations, FailReason::NoFreeTargetPage);
                let capacity = mm.capacity(span.page_size, target).ok();
                let hopeless = matches!(
                    capacity,
                    Some(Capacity::Pool {
                        free: 0,
                        fresh_fallback: false,
                        ..
                    })
                );
                if hopeless {
                    let rest: Vec<usize> = chunks.by_ref().flatten().copied().collect();
                    warn!(
                        target,
                        pages = rest.len(),
                        "target pool is empty: the remaining pages cannot move"
                    );
                    // Given up on: they count as done for progress.
                    bytes_done += rest.len() as u64 * ps;
                    tally.failed.extend(rest.into_iter().map(|page| FailedPage {
                        page,
                        reason: FailReason::NoFreeTargetPage,
                    }));
                }
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

#[cfg(test)]
mod tests {
    use std::cell::{Cell, RefCell};
    use std::collections::{BTreeMap, BTreeSet};
    use std::time::Duration;

    use super::*;
    use test_support::fixture::SysTree;

    const M2: u64 = 2 << 20;
    const BASE: usize = 0x7f00_0000_0000;

    /// A simulated two-node kernel: pages by index, per-node free pools,
    /// busy and shared pages, and the two ways the kernel reports failure.
    struct Sim {
        ps: u64,
        /// Node of each page; `None` = not present.
        pages: RefCell<Vec<Option<NodeId>>>,
        shared: BTreeSet<usize>,
        busy: BTreeSet<usize>,
        free: RefCell<BTreeMap<NodeId, u64>>,
        fresh_fallback: bool,
        /// ENOMEM for the call (hugetlb) rather than a positive count.
        whole_call_enomem: bool,
        fail_bind: bool,
        /// Fail every call after this many with EIO.
        fail_after: Option<usize>,
        calls: RefCell<Vec<usize>>,
        bound: RefCell<Option<(usize, usize, NodeId)>>,
        queries: Cell<usize>,
    }

    impl Sim {
        fn new(ps: u64, pages: Vec<Option<NodeId>>, free: &[(NodeId, u64)]) -> Self {
            Self {
                ps,
                pages: RefCell::new(pages),
                shared: BTreeSet::new(),
                busy: BTreeSet::new(),
                free: RefCell::new(free.iter().copied().collect()),
                fresh_fallback: false,
                whole_call_enomem: true,
                fail_bind: false,
                fail_after: None,
                calls: RefCell::new(Vec::new()),
                bound: RefCell::new(None),
                queries: Cell::new(0),
            }
        }
        fn index(&self, addr: usize) -> usize {
            (addr - BASE) / self.ps as usize
        }
        fn location(&self, i: usize) -> PageLocation {
            match self.pages.borrow().get(i).copied().flatten() {
                Some(n) => PageLocation::Node(n),
                None => PageLocation::Error(-libc::ENOENT),
            }
        }
    }

    impl Mm for Sim {
        fn query(&self, addrs: &[usize]) -> std::result::Result<Vec<PageLocation>, PolicyError> {
            self.queries.set(self.queries.get() + 1);
            Ok(addrs
                .iter()
                .map(|&a| self.location(self.index(a)))
                .collect())
        }

        fn move_to(
            &self,
            addrs: &[usize],
            node: NodeId,
            move_all: bool,
        ) -> std::result::Result<Vec<PageLocation>, PolicyError> {
            let call = self.calls.borrow().len();
            self.calls.borrow_mut().push(addrs.len());
            if self.fail_after.is_some_and(|n| call >= n) {
                return Err(PolicyError::Io { op: "move_pages" });
            }
            let mut status = Vec::new();
            let mut not_moved = 0;
            for &a in addrs {
                let i = self.index(a);
                let here = self.pages.borrow()[i];
                let st = match here {
                    None => PageLocation::Error(-libc::ENOENT),
                    Some(n) if n == node => PageLocation::Node(n),
                    Some(_) if self.shared.contains(&i) && !move_all => {
                        PageLocation::Error(-libc::EACCES)
                    }
                    Some(_) if self.busy.contains(&i) => PageLocation::Error(-libc::EBUSY),
                    Some(src) => {
                        let mut free = self.free.borrow_mut();
                        let room = free.get(&node).copied().unwrap_or(0);
                        if room > 0 {
                            free.insert(node, room - 1);
                            *free.entry(src).or_insert(0) += 1;
                            self.pages.borrow_mut()[i] = Some(node);
                            PageLocation::Node(node)
                        } else if self.fresh_fallback {
                            self.pages.borrow_mut()[i] = Some(node);
                            PageLocation::Node(node)
                        } else if self.whole_call_enomem {
                            return Err(PolicyError::OutOfMemory { op: "move_pages" });
                        } else {
                            not_moved += 1;
                            PageLocation::Node(src)
                        }
                    }
                };
                status.push(st);
            }
            if not_moved > 0 {
                // What numa::move_pages does on a positive return.
                return self.query(addrs);
            }
            Ok(status)
        }

        fn bind(
            &self,
            addr: usize,
            len: usize,
            node: NodeId,
        ) -> std::result::Result<(), PolicyError> {
            if self.fail_bind {
                return Err(PolicyError::InvalidArgument { op: "mbind" });
            }
            *self.bound.borrow_mut() = Some((addr, len, node));
            Ok(())
        }

        fn capacity(
            &self,
            page_size: PageSize,
            node: NodeId,
        ) -> std::result::Result<Capacity, PoolError> {
            Ok(Capacity::Pool {
                free: self.free.borrow().get(&node).copied().unwrap_or(0),
                host_available: 1,
                fresh_fallback: page_size == PageSize::Huge2M && self.fresh_fallback,
            })
        }
    }

    fn two_nodes() -> (SysTree, Topology) {
        let tree = SysTree::new()
            .cpu_online("0-3")
            .node(0, "0-1", 1 << 22, &[10, 20], &[])
            .node(1, "2-3", 1 << 22, &[20, 10], &[]);
        let topo = tree.parse(numa::Topology::from_sysfs);
        (tree, topo)
    }

    fn span(pages: usize, ps: PageSize) -> MoveSpan<'static> {
        MoveSpan::from_raw(BASE, pages as u64 * ps.bytes(), ps).expect("span")
    }

    fn run_sim(
        sim: &Sim,
        span: &MoveSpan<'_>,
        range: ByteRange,
        target: NodeId,
        opts: &MoveOptions,
        cancel: Option<&CancelToken>,
        progress: Option<&dyn Fn(&Progress)>,
    ) -> Result<MoveReport> {
        let (_tree, topo) = two_nodes();
        run(
            sim,
            &topo,
            &Request {
                span,
                range,
                target,
                opts,
                cancel,
                progress,
            },
        )
    }

    #[test]
    fn moves_everything_in_batches() {
        let sim = Sim::new(M2, vec![Some(0); 10], &[(1, 10)]);
        let s = span(10, PageSize::Huge2M);
        let opts = MoveOptions {
            batch_pages: 4,
            ..MoveOptions::default()
        };
        let seen = RefCell::new(Vec::new());
        let progress = |p: &Progress| seen.borrow_mut().push((p.bytes_done, p.bytes_total));
        let report = run_sim(
            &sim,
            &s,
            ByteRange::whole(s.len()),
            1,
            &opts,
            None,
            Some(&progress),
        )
        .expect("move");
        assert_eq!(report.pages_moved, 10);
        assert!(report.complete(), "{report}");
        assert_eq!(report.bytes_moved, 10 * M2);
        assert_eq!(report.batches, 3);
        assert_eq!(*sim.calls.borrow(), vec![4, 4, 2]);
        assert_eq!(*sim.bound.borrow(), Some((BASE, 10 * M2 as usize, 1)));
        assert_eq!(
            *seen.borrow(),
            vec![(4 * M2, 10 * M2), (8 * M2, 10 * M2), (10 * M2, 10 * M2)]
        );
        assert_eq!(
            report.plan,
            "10 of 10 pages can move: node 1 has 10 free 2M pages (0 already there, 0 not present)"
        );
    }

    #[test]
    fn moves_only_the_range_and_skips_pages_already_there() {
        let mut pages = vec![Some(0); 8];
        pages[3] = Some(1);
        pages[4] = None;
        let sim = Sim::new(M2, pages, &[(1, 8)]);
        let s = span(8, PageSize::Huge2M);
        let range = ByteRange::new(2 * M2, 4 * M2); // pages 2..6
        let report =
            run_sim(&sim, &s, range, 1, &MoveOptions::default(), None, None).expect("move");
        assert_eq!(report.first_page, 2);
        assert_eq!(report.pages_total, 4);
        assert_eq!(
            (report.pages_moved, report.already_there, report.not_present),
            (2, 1, 1)
        );
        assert!(report.complete());
        // One call with the two pages that had to move; the rest untouched.
        assert_eq!(*sim.calls.borrow(), vec![2]);
        let after = sim.pages.borrow().clone();
        assert_eq!(
            after,
            vec![
                Some(0),
                Some(0),
                Some(1),
                Some(1),
                None,
                Some(1),
                Some(0),
                Some(0)
            ]
        );
        assert_eq!(
            *sim.bound.borrow(),
            Some((BASE + 2 * M2 as usize, 4 * M2 as usize, 1))
        );
    }

    #[test]
    fn all_already_there_makes_no_move_call() {
        let sim = Sim::new(M2, vec![Some(1); 4], &[]);
        let s = span(4, PageSize::Huge2M);
        let report = run_sim(
            &sim,
            &s,
            ByteRange::whole(s.len()),
            1,
            &MoveOptions::default(),
            None,
            None,
        )
        .expect("move");
        assert_eq!(report.already_there, 4);
        assert_eq!(report.pages_moved, 0);
        assert!(report.complete());
        assert!(sim.calls.borrow().is_empty());
        // The policy is still set, so later faults land on the target.
        assert!(sim.bound.borrow().is_some());
    }

    #[test]
    fn short_1g_pool_moves_what_fits_and_names_the_rest() {
        let sim = Sim::new(1 << 30, vec![Some(0); 4], &[(1, 3)]);
        let s = span(4, PageSize::Huge1G);
        let report = run_sim(
            &sim,
            &s,
            ByteRange::whole(s.len()),
            1,
            &MoveOptions::default(),
            None,
            None,
        )
        .expect("move");
        assert_eq!(
            report.plan,
            "3 of 4 pages can move: node 1 has 3 free 1G pages (0 already there, 0 not present)"
        );
        assert_eq!(report.pages_moved, 3);
        assert_eq!(
            report.failed,
            vec![FailedPage {
                page: 3,
                reason: FailReason::NoFreeTargetPage
            }]
        );
        assert_eq!(
            report.not_on_target,
            vec![StrayPage::new(3, PageLocation::Node(0))]
        );
        assert!(!report.complete());
    }

    #[test]
    fn empty_1g_pool_stops_after_the_first_enomem() {
        let sim = Sim::new(1 << 30, vec![Some(0); 5], &[(1, 0)]);
        let s = span(5, PageSize::Huge1G);
        let last = Cell::new((0, 0));
        let progress = |p: &Progress| last.set((p.bytes_done, p.bytes_total));
        let report = run_sim(
            &sim,
            &s,
            ByteRange::whole(s.len()),
            1,
            &MoveOptions::default(),
            None,
            Some(&progress),
        )
        .expect("move");
        assert_eq!(last.get(), (5 << 30, 5 << 30));
        assert_eq!(report.pages_moved, 0);
        assert_eq!(report.failed.len(), 5);
        assert!(report
            .failed
            .iter()
            .all(|f| f.reason == FailReason::NoFreeTargetPage));
        // One page per batch for 1 GiB pages, but only one call was made,
        // and progress still ends at the total.
        assert_eq!(*sim.calls.borrow(), vec![1]);
        assert_eq!(
            report.plan,
            "0 of 5 pages can move: node 1 has 0 free 1G pages (0 already there, 0 not present)"
        );
    }

    #[test]
    fn refuses_a_partial_move_before_changing_anything() {
        let sim = Sim::new(1 << 30, vec![Some(0); 2], &[(1, 1)]);
        let s = span(2, PageSize::Huge1G);
        let opts = MoveOptions {
            allow_partial: false,
            ..MoveOptions::default()
        };
        let err = run_sim(&sim, &s, ByteRange::whole(s.len()), 1, &opts, None, None)
            .expect_err("insufficient");
        assert_eq!(
            err.to_string(),
            "the target cannot take every page: 1 of 2 pages can move: node 1 has 1 free 1G pages \
             (0 already there, 0 not present)"
        );
        assert!(sim.bound.borrow().is_none());
        assert!(sim.calls.borrow().is_empty());
        assert_eq!(*sim.pages.borrow(), vec![Some(0), Some(0)]);
    }

    #[test]
    fn per_page_errors_map_to_reasons() {
        let mut sim = Sim::new(M2, vec![Some(0); 4], &[(1, 4)]);
        sim.shared = BTreeSet::from([1]);
        sim.busy = BTreeSet::from([2]);
        let s = span(4, PageSize::Huge2M);
        let opts = MoveOptions {
            move_all: false,
            ..MoveOptions::default()
        };
        let report =
            run_sim(&sim, &s, ByteRange::whole(s.len()), 1, &opts, None, None).expect("move");
        assert_eq!(report.pages_moved, 2);
        assert_eq!(
            report.failed,
            vec![
                FailedPage {
                    page: 1,
                    reason: FailReason::NeedsMoveAll
                },
                FailedPage {
                    page: 2,
                    reason: FailReason::Busy
                },
            ]
        );
        // With MOVE_ALL the shared page moves too.
        let report = run_sim(
            &sim,
            &s,
            ByteRange::whole(s.len()),
            1,
            &MoveOptions::default(),
            None,
            None,
        )
        .expect("move");
        assert_eq!(report.pages_moved, 1);
        assert_eq!(report.already_there, 2);
        assert_eq!(
            report.failed,
            vec![FailedPage {
                page: 2,
                reason: FailReason::Busy
            }]
        );
    }

    #[test]
    fn positive_count_failures_are_explained_by_the_pool() {
        // The kernel returned "n pages not moved" (no per-page status).
        let mut sim = Sim::new(M2, vec![Some(0); 3], &[(1, 2)]);
        sim.whole_call_enomem = false;
        let s = span(3, PageSize::Huge2M);
        let report = run_sim(
            &sim,
            &s,
            ByteRange::whole(s.len()),
            1,
            &MoveOptions::default(),
            None,
            None,
        )
        .expect("move");
        assert_eq!(report.pages_moved, 2);
        assert_eq!(
            report.failed,
            vec![FailedPage {
                page: 2,
                reason: FailReason::NoFreeTargetPage
            }]
        );
    }

    #[test]
    fn fresh_2m_pages_move_beyond_the_pool() {
        let mut sim = Sim::new(M2, vec![Some(0); 6], &[(1, 2)]);
        sim.fresh_fallback = true;
        let s = span(6, PageSize::Huge2M);
        let report = run_sim(
            &sim,
            &s,
            ByteRange::whole(s.len()),
            1,
            &MoveOptions::default(),
            None,
            None,
        )
        .expect("move");
        assert!(report
            .plan
            .contains("the other 4 may move if the kernel can allocate fresh 2M pages on node 1"));
        assert_eq!(report.pages_moved, 6);
        assert!(report.complete());
    }

    #[test]
    fn cancel_from_progress_stops_between_batches() {
        let sim = Sim::new(M2, vec![Some(0); 10], &[(1, 10)]);
        let s = span(10, PageSize::Huge2M);
        let opts = MoveOptions {
            batch_pages: 3,
            ..MoveOptions::default()
        };
        let cancel = CancelToken::new();
        let progress = |p: &Progress| {
            if p.bytes_done >= 6 * M2 {
                cancel.cancel();
            }
        };
        let err = run_sim(
            &sim,
            &s,
            ByteRange::whole(s.len()),
            1,
            &opts,
            Some(&cancel),
            Some(&progress),
        )
        .expect_err("cancelled");
        let MigrateError::Cancelled { report } = &err else {
            panic!("expected Cancelled, got {err:?}");
        };
        assert_eq!(report.pages_moved, 6);
        assert_eq!(report.batches, 2);
        assert!(!report.verified);
        assert_eq!(*sim.calls.borrow(), vec![3, 3]);
        assert_eq!(
            err.to_string(),
            "the move was cancelled after 6 of 10 pages"
        );
        assert_eq!(err.report().map(|r| r.pages_moved), Some(6));
    }

    #[test]
    fn cancelled_before_start_changes_nothing() {
        let sim = Sim::new(M2, vec![Some(0); 2], &[(1, 2)]);
        let s = span(2, PageSize::Huge2M);
        let cancel = CancelToken::new();
        cancel.cancel();
        let err = run_sim(
            &sim,
            &s,
            ByteRange::whole(s.len()),
            1,
            &MoveOptions::default(),
            Some(&cancel),
            None,
        )
        .expect_err("cancelled");
        assert!(matches!(err, MigrateError::Cancelled { .. }));
        assert!(sim.bound.borrow().is_none());
        assert!(sim.calls.borrow().is_empty());
    }

    #[test]
    fn cancel_interrupts_a_rate_limit_wait() {
        let sim = Sim::new(M2, vec![Some(0); 4], &[(1, 4)]);
        let s = span(4, PageSize::Huge2M);
        // 1 byte/s: the second batch would wait for ages.
        let opts = MoveOptions {
            batch_pages: 2,
            rate_limit_bytes_per_s: Some(1),
            ..MoveOptions::default()
        };
        let cancel = CancelToken::new();
        let progress = |_: &Progress| cancel.cancel();
        let t = Instant::now();
        let err = run_sim(
            &sim,
            &s,
            ByteRange::whole(s.len()),
            1,
            &opts,
            Some(&cancel),
            Some(&progress),
        )
        .expect_err("cancelled");
        assert!(t.elapsed() < Duration::from_secs(2));
        assert_eq!(err.report().map(|r| r.pages_moved), Some(2));
    }

    #[test]
    fn rate_limit_paces_batches() {
        let sim = Sim::new(M2, vec![Some(0); 6], &[(1, 6)]);
        let s = span(6, PageSize::Huge2M);
        // 2 pages (4 MiB) per batch at 80 MiB/s: batches at 0, 50, 100 ms.
        let opts = MoveOptions {
            batch_pages: 2,
            rate_limit_bytes_per_s: Some(80 << 20),
            ..MoveOptions::default()
        };
        let t = Instant::now();
        let report =
            run_sim(&sim, &s, ByteRange::whole(s.len()), 1, &opts, None, None).expect("move");
        let elapsed = t.elapsed();
        assert!(elapsed >= Duration::from_millis(100), "{elapsed:?}");
        assert!(elapsed < Duration::from_secs(2), "{elapsed:?}");
        assert_eq!(report.pages_moved, 6);
    }

    #[test]
    fn failed_call_keeps_the_partial_report() {
        let mut sim = Sim::new(M2, vec![Some(0); 6], &[(1, 6)]);
        sim.fail_after = Some(1);
        let s = span(6, PageSize::Huge2M);
        let opts = MoveOptions {
            batch_pages: 3,
            ..MoveOptions::default()
        };
        let err =
            run_sim(&sim, &s, ByteRange::whole(s.len()), 1, &opts, None, None).expect_err("EIO");
        assert!(matches!(err, MigrateError::Move { page: 3, .. }), "{err:?}");
        assert_eq!(err.report().map(|r| r.pages_moved), Some(3));
        assert_eq!(
            err.to_string(),
            "move_pages failed for the batch starting at page 3"
        );
    }

    #[test]
    fn bind_failure_moves_nothing() {
        let mut sim = Sim::new(M2, vec![Some(0); 2], &[(1, 2)]);
        sim.fail_bind = true;
        let s = span(2, PageSize::Huge2M);
        let err = run_sim(
            &sim,
            &s,
            ByteRange::whole(s.len()),
            1,
            &MoveOptions::default(),
            None,
            None,
        )
        .expect_err("bind");
        assert!(matches!(err, MigrateError::Bind { node: 1, .. }));
        assert!(sim.calls.borrow().is_empty());
    }

    #[test]
    fn invalid_requests_fail_before_any_call() {
        let sim = Sim::new(M2, vec![Some(0); 4], &[(1, 4)]);
        let s = span(4, PageSize::Huge2M);
        let whole = ByteRange::whole(s.len());
        let opts = MoveOptions::default();
        let cases: Vec<(ByteRange, NodeId, MoveOptions)> = vec![
            (whole, 5, opts),
            (ByteRange::new(0, 0), 1, opts),
            (ByteRange::new(4096, M2), 1, opts),
            (ByteRange::new(2 * M2, 4 * M2), 1, opts),
            (
                whole,
                1,
                MoveOptions {
                    rate_limit_bytes_per_s: Some(0),
                    ..opts
                },
            ),
        ];
        for (range, node, o) in cases {
            let err = run_sim(&sim, &s, range, node, &o, None, None).expect_err("invalid");
            assert!(matches!(err, MigrateError::Plan(_)), "{err:?}");
        }
        assert_eq!(sim.queries.get(), 0);
        assert!(sim.bound.borrow().is_none());
        let err = run_sim(&sim, &s, whole, 5, &opts, None, None).expect_err("node");
        assert_eq!(
            err.to_string(),
            "NUMA node 5 does not exist (this host has nodes [0, 1])"
        );
    }

    /// The real kernel path: a move to the node the pages are on reports
    /// that node for every page, with and without MOVE_ALL.
    #[test]
    fn host_move_to_the_same_node() {
        let topology = Topology::detect().expect("topology");
        let node = topology.nodes()[0].id;
        let spec = guest_mem::RegionSpec::new("mover-host", 1 << 20, Some(node))
            .with_policy(guest_mem::PagePolicy::Strict(PageSize::Base4K));
        let (region, _) =
            Region::allocate(&topology, &spec, &clearing::RunOptions::default()).expect("allocate");
        let span = MoveSpan::of_region(&region);
        let addrs: Vec<usize> = (0..256).map(|p| span.page_addr(p)).collect();
        for move_all in [false, true] {
            let locs = Host.move_to(&addrs, node, move_all).expect("move_pages");
            assert!(
                locs.iter().all(|l| *l == PageLocation::Node(node)),
                "{locs:?}"
            );
        }
        assert!(matches!(
            Host.capacity(PageSize::Base4K, node),
            Ok(Capacity::Memory { free_bytes }) if free_bytes > 0
        ));
        assert!(matches!(
            Host.capacity(PageSize::Huge2M, node),
            Ok(Capacity::Pool {
                fresh_fallback: true,
                ..
            })
        ));
    }

    #[test]
    fn spans_must_be_whole_pages() {
        assert!(MoveSpan::from_raw(BASE, M2, PageSize::Huge2M).is_ok());
        for (addr, len) in [
            (BASE + 4096, M2),
            (BASE, M2 + 1),
            (BASE, 0),
            (usize::MAX - 4095, M2),
        ] {
            assert!(
                matches!(
                    MoveSpan::from_raw(addr, len, PageSize::Huge2M),
                    Err(PlanError::BadSpan { .. })
                ),
                "{addr:#x}+{len:#x}"
            );
        }
    }

    #[test]
    fn auto_batch_is_64_mib() {
        let o = MoveOptions::default();
        assert_eq!(o.batch_for(PageSize::Huge1G), 1);
        assert_eq!(o.batch_for(PageSize::Huge2M), 32);
        assert_eq!(o.batch_for(PageSize::Base4K), 16384);
        let o = MoveOptions {
            batch_pages: 7,
            ..o
        };
        assert_eq!(o.batch_for(PageSize::Huge1G), 7);
    }

    #[test]
    fn options_round_trip_through_serde() {
        let o = MoveOptions {
            batch_pages: 8,
            rate_limit_bytes_per_s: Some(1 << 30),
            move_all: false,
            allow_partial: false,
        };
        let json = serde_json::to_string(&o).expect("serialize");
        let back: MoveOptions = serde_json::from_str(&json).expect("deserialize");
        assert_eq!(back, o);
        let defaults: MoveOptions = serde_json::from_str("{}").expect("defaults");
        assert_eq!(defaults, MoveOptions::default());
    }
}
