//! Why the alloc bench failed.

use std::time::Duration;

use backend::client::ClientError;
use backend::daemon::DaemonError;
use clearing::RunError;

/// Errors of the alloc benchmark.
#[derive(Debug, thiserror::Error)]
pub enum AllocBenchError {
    /// Zero size or repetitions.
    #[error("size and repetitions must be non-zero, and size a multiple of 2M")]
    Size,
    /// No huge pages could be had.
    #[error("no huge pages could be had for the run: {0}")]
    NoPages(String),
    /// Reading the topology failed.
    #[error("cannot read the NUMA topology")]
    Topology(#[from] numa::TopologyError),
    /// Creating or populating a region failed.
    #[error("daemon-less allocation failed")]
    Region(#[from] guest_mem::RegionError),
    /// The cloud-hypervisor-style mapping failed.
    #[error("cloud-hypervisor-style prefault failed")]
    Mapping(#[from] guest_mem::MappingError),
    /// A prefault thread panicked.
    #[error("a prefault thread panicked")]
    Panicked,
    /// The daemon did not start.
    #[error("cannot start the daemon")]
    Daemon(#[from] DaemonError),
    /// A daemon request failed.
    #[error("daemon request failed")]
    Client(#[from] ClientError),
    /// The pool did not come back clean.
    #[error("the pool did not show the freed memory clean within {0:?}")]
    CleanTimeout(Duration),
    /// Binding a scaling run's memory to its node failed.
    #[error("cannot bind memory to its node")]
    Policy(#[from] numa::PolicyError),
    /// A `--threads` count of 0.
    #[error("worker counts must be at least 1")]
    Threads,
    /// The node-local populate workers of a scaling run failed.
    #[error("populate workers failed")]
    Workers(#[from] RunError<guest_mem::MappingError>),
    /// Mapping the daemon's memory as a VMM would failed.
    #[error("cannot map the allocation as guest memory")]
    GuestMemory(#[from] backend::guest_memory::GuestMemoryError),
    /// Reading the process CPU clock failed.
    #[error("cannot read the process CPU clock")]
    Clock(#[source] std::io::Error),
    /// Reading what a hand-out's fds hold failed.
    #[error("cannot fstat a handed-out fd")]
    Fstat(#[source] std::io::Error),
    /// Writing a page of a hand-out failed.
    #[error("cannot touch a handed-out page: {0}")]
    Touch(String),
    /// The memory-bandwidth clear failed.
    #[error("the memory-bandwidth clear failed: {0}")]
    Bandwidth(String),
}
