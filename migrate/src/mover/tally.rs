//! The running counts of a move ([`Tally`]): pages moved, failed, not
//! present, batches and time, from which every [`MoveReport`] of a move,
//! final or carried by an error, is made.

use std::time::Instant;

use numa::{NodeId, PageLocation};

use crate::plan::{MovePlan, PageSpan};
use crate::report::{gb_per_s, FailReason, FailedPage, MoveReport, StrayPage};

/// Running counts of a move.
pub(super) struct Tally {
    target: NodeId,
    page_size: u64,
    first_page: usize,
    pages_total: usize,
    already_there: usize,
    not_present: usize,
    moved: usize,
    pub(super) failed: Vec<FailedPage>,
    pub(super) batches: usize,
    pub(super) started: Instant,
    plan: String,
}

impl Tally {
    /// The counts at the start of a move of `pages` (of `page_size` bytes)
    /// to `target` following `plan`: nothing moved yet, the clock started.
    pub(super) fn start(target: NodeId, page_size: u64, pages: PageSpan, plan: &MovePlan) -> Self {
        Self {
            target,
            page_size,
            first_page: pages.first,
            pages_total: pages.count,
            already_there: plan.already_there,
            not_present: plan.not_present,
            moved: 0,
            failed: Vec::new(),
            batches: 0,
            started: Instant::now(),
            plan: plan.summary(),
        }
    }

    pub(super) fn report(&self, not_on_target: Vec<StrayPage>, verified: bool) -> MoveReport {
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

    pub(super) fn boxed(&self) -> Box<MoveReport> {
        Box::new(self.report(Vec::new(), false))
    }

    /// Counts one batch's results. Pages that stayed away from the target
    /// without a per-page errno get `unexplained`.
    pub(super) fn account(
        &mut self,
        pages: &[usize],
        locations: &[PageLocation],
        unexplained: FailReason,
    ) {
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
