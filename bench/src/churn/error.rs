//! Why a churn failed.

use backend::client::ClientError;
use backend::daemon::DaemonError;

use super::plan::Side;
use crate::harness::serve::ServeChildError;

/// Errors of the churn benchmark.
#[derive(Debug, thiserror::Error)]
pub enum ChurnError {
    /// Bad options.
    #[error("{0}")]
    Options(String),
    /// Something the run needs is missing.
    #[error("cannot run: {0}")]
    Missing(String),
    /// The private daemon did not start.
    #[error("cannot start a private daemon")]
    Daemon(#[from] DaemonError),
    /// The private daemon's process did not start or answer.
    #[error("cannot run a private daemon")]
    Serve(#[from] ServeChildError),
    /// The floor's memory could not be made ready.
    #[error("the floor needs {count} x {size} of {page} pages")]
    Floor {
        /// Memfds (launches at once).
        count: usize,
        /// Size of each.
        size: String,
        /// Their page size.
        page: String,
        /// The cause.
        #[source]
        source: crate::floor::FloorError,
    },
    /// Talking to the daemon failed.
    #[error("daemon request failed")]
    Client(#[from] ClientError),
    /// Files, processes, pipes.
    #[error("{what}")]
    Io {
        /// What was being done.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A launch did not run its guest to a normal end.
    #[error("{side} launch {index}: {why}")]
    Launch {
        /// `hugemem`, `baseline` or `floor`.
        side: &'static str,
        /// Which launch (`warm-up` = the untimed one).
        index: String,
        /// What went wrong.
        why: String,
    },
}

pub(super) fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ChurnError {
    let what = what.into();
    move |source| ChurnError::Io { what, source }
}

pub(super) fn launch_error(side: Side, index: String) -> impl FnOnce(String) -> ChurnError {
    move |why| ChurnError::Launch {
        side: side.name(),
        index,
        why,
    }
}
