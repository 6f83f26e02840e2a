//! Why a step of restoring or exporting a parked VM failed. Each is said to
//! the peer as its refusal's message, and the VM stays parked.

use std::error::Error;

use crate::daemon::requests::parked::loads::LoadFailed;

/// A boxed cause, for the steps whose sources have many types.
pub type Cause = Box<dyn Error + Send + Sync>;

/// Why restoring, exporting or filling a parked VM failed.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// The parked VM holds no region.
    #[error("the parked VM has no memory")]
    NoMemory,
    /// A slot of the VM names a region it does not hold.
    #[error("slot {0} names no region")]
    NoRegionForSlot(u32),
    /// A VM parked on demand has files for more regions than it holds.
    #[error("the VM's files fill {files} regions, it holds {holds}")]
    FillRegions {
        /// Regions its files fill.
        files: usize,
        /// Regions it holds.
        holds: usize,
    },
    /// Some unit is still being filled after the fill ended.
    #[error("some of the VM's memory is still being filled")]
    StillFilling,
    /// The request carries the wrong number of fds.
    #[error("this RESTORE carries {want} fd(s), not {got}")]
    FdCount {
        /// What the request's flags ask for.
        want: usize,
        /// What came.
        got: usize,
    },
    /// A VM parked on demand whose files are gone and whose memory was
    /// never filled.
    #[error("{0:?} was parked on demand and its files are gone (a daemon before this one did not pass them on): its memory was never filled; UNPARK it and park it again from its directory")]
    FilesGone(String),
    /// A fill from the VM's files failed (the files and offsets named).
    #[error("filling the VM's memory: {0} (it stays parked)")]
    Fill(#[source] LoadFailed),
    /// A fault-driven fill left a unit unfilled.
    #[error("filling the VM's memory: a page the guest asked for could not be read (see the daemon's log; it stays parked)")]
    FaultFill,
    /// A worker thread panicked.
    #[error("the {0} panicked")]
    Panicked(&'static str),
    /// The receiver refused the VM or went away.
    #[error("the receiver did not take the VM (it stays parked): {0}")]
    NotTaken(#[source] Cause),
    /// The receiver did not take the fault connection.
    #[error("the receiver did not take the VM (it stays parked): the fault connection: {0}")]
    FaultConnectionNotTaken(#[source] Cause),
    /// The receiver's fault connection ended with an error, not with its
    /// close once it had every page: its guest can never get the pages it
    /// did not take.
    #[error("the receiver's fault connection ended before it had every page ({0}): its guest cannot get the rest, so the restore failed (it stays parked)")]
    FaultConnectionBroken(#[source] Cause),
    /// Another step failed: what it was, and why.
    #[error("{what}: {cause}")]
    Failed {
        /// The step.
        what: &'static str,
        /// Why.
        #[source]
        cause: Cause,
    },
}

impl StepError {
    /// A `map_err` for a step named `what`.
    pub fn failed<E: Into<Cause>>(what: &'static str) -> impl FnOnce(E) -> StepError {
        move |e| StepError::Failed {
            what,
            cause: e.into(),
        }
    }

    /// A `map_err` for the receiver's refusal.
    pub fn not_taken<E: Into<Cause>>(e: E) -> StepError {
        StepError::NotTaken(e.into())
    }
}
