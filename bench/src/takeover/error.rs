//! Why the takeover bench failed.

use backend::client::ClientError;

use crate::harness::serve::ServeChildError;

/// Errors of the benchmark.
#[derive(Debug, thiserror::Error)]
pub enum TakeoverError {
    /// Bad options.
    #[error("{0}")]
    Options(String),
    /// The huge pages could not be had.
    #[error("no huge pages could be had for the run: {0}")]
    NoPages(String),
    /// A daemon process did not start or answer.
    #[error("cannot run a private daemon")]
    Serve(#[from] ServeChildError),
    /// A request failed where it must not (setup, the new daemon's STATS).
    #[error("{what}")]
    Client {
        /// What was being done.
        what: String,
        /// The cause.
        #[source]
        source: ClientError,
    },
    /// Files and directories.
    #[error("{what}")]
    Io {
        /// What was being done.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The run could not go on (a wait timed out, memory not mappable).
    #[error("{0}")]
    Run(String),
}

pub(super) fn client_err(what: impl Into<String>) -> impl FnOnce(ClientError) -> TakeoverError {
    let what = what.into();
    move |source| TakeoverError::Client { what, source }
}
