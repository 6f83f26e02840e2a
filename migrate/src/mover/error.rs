//! What goes wrong in a move: [`MigrateError`], which says for each case
//! whether anything changed before it, and carries the report of what was
//! done for the errors that come after pages may have moved.

use guest_mem::PoolError;
use numa::{NodeId, PolicyError};

use crate::plan::{MovePlan, PlanError};
use crate::report::MoveReport;

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
