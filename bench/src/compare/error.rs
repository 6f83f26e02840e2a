//! Why the comparison failed.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use backend::client::ClientError;
use backend::daemon::DaemonError;
use backend::guest_memory::GuestMemoryError;
use hugemem::launch::BuildError;

/// Errors of the comparison benchmark.
#[derive(Debug, thiserror::Error)]
pub enum CompareError {
    /// Zero or unaligned size, or zero repetitions.
    #[error("size must be a non-zero multiple of 2M and repetitions non-zero")]
    Size,
    /// Neither 1 GiB nor 2 MiB pages could be reserved at the full size.
    #[error("no huge pages could be had for the run: {0}")]
    NoPages(String),
    /// The private work directory could not be made or written.
    #[error("cannot prepare the work directory {path}")]
    WorkDir {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The guest image could not be built.
    #[error("cannot build the micro-guest's PVH image")]
    Image(#[from] microguest::ConfigError),
    /// The warm-up mapping failed.
    #[error("warm-up populate failed")]
    Mapping(#[from] guest_mem::MappingError),
    /// The floor's memory could not be made ready.
    #[error("cannot make the floor's memory ready")]
    Floor(#[from] crate::floor::FloorError),
    /// The daemon did not start.
    #[error("cannot start the daemon")]
    Daemon(#[from] DaemonError),
    /// A daemon request failed.
    #[error("daemon request failed")]
    Client(#[from] ClientError),
    /// The pool did not show the freed memory clean in time.
    #[error("the pool did not show the freed memory clean within {0:?}")]
    CleanTimeout(Duration),
    /// The VMM command line could not carry hugemem's memory.
    #[error("cannot build the VMM command line")]
    Build(#[from] BuildError),
    /// Mapping the allocation for the client variant failed.
    #[error("cannot map the allocation")]
    Map(#[from] GuestMemoryError),
    /// The in-process micro-guest run failed.
    #[error("the micro-guest run failed")]
    Guest(#[from] microguest::Error),
    /// A VMM could not be started.
    #[error("cannot start {program:?}")]
    Spawn {
        /// The program.
        program: OsString,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Reading a VMM's output or waiting for it failed.
    #[error("cannot read from or wait for the VMM")]
    Wait(#[source] std::io::Error),
    /// A variant did not end the way the guest reports success.
    #[error("{variant}: {why}")]
    Failed {
        /// The variant's key.
        variant: &'static str,
        /// What went wrong, with the VMM's output.
        why: String,
    },
    /// The plot script failed.
    #[error("the plot script {script} failed: {why}")]
    Plot {
        /// The script.
        script: PathBuf,
        /// Why.
        why: String,
    },
}
