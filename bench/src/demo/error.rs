//! Why the demo failed.

use std::path::PathBuf;
use std::time::Duration;

use backend::client::ClientError;
use backend::daemon::DaemonError;
use backend::guest_memory::GuestMemoryError;

/// Errors of the demo.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// No page size at all could be used.
    #[error("no memory could be set aside for the demo: {0}")]
    NoPages(String),
    /// The size is not usable.
    #[error("demo size {0} must be a non-zero multiple of 2M")]
    Size(u64),
    /// Making the private socket directory failed.
    #[error("cannot create the demo's socket directory {path}")]
    SocketDir {
        /// The directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The daemon did not start.
    #[error("cannot start the daemon")]
    Daemon(#[from] DaemonError),
    /// A request to the daemon failed.
    #[error("request to the daemon failed")]
    Client(#[from] ClientError),
    /// Mapping the allocation failed.
    #[error("cannot map the allocation")]
    Map(#[from] GuestMemoryError),
    /// The guest run failed.
    #[error("the micro-guest run failed")]
    Guest(#[from] microguest::Error),
    /// The guest read memory that was not clean.
    #[error("guest #{0} read non-zero memory: the allocation was not clean")]
    NotClean(u32),
    /// The warm-up populate (the outer host's first touch) failed.
    #[error("the warm-up populate failed: {0}")]
    WarmUp(String),
    /// The floor's memory (a populated hugetlb memfd) could not be made.
    #[error("cannot make the floor's memory: {0}")]
    Floor(String),
    /// Reading what the pooled ALLOC's fds hold failed.
    #[error("cannot read what the pooled ALLOC handed out: {0}")]
    HandOut(String),
    /// The pool did not become clean in time.
    #[error("the pool did not show the freed memory clean within {0:?} (last stats: {1})")]
    CleanTimeout(Duration, String),
}
