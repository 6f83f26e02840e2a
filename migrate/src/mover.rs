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

mod engine;
mod error;
mod options;
mod span;
mod tally;

use clearing::{CancelToken, Progress};
use guest_mem::Region;
use numa::{NodeId, PageLocation, Topology};
use serde::Serialize;

use crate::mm::Host;
use crate::plan::{validate_range, validate_target, ByteRange, MovePlan, PageSpan};
use crate::report::MoveReport;
use engine::{page_count, plan_with, query_pages, run, Request};

pub use error::{MigrateError, Result};
pub use options::{MoveOptions, AUTO_BATCH_BYTES};
pub use span::MoveSpan;

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

#[cfg(test)]
mod tests;
