//! Errors of `hugemem bench refault`.

/// Why the bench could not run.
#[derive(Debug, thiserror::Error)]
pub enum RefaultBenchError {
    /// Not enough huge pages, or the size does not fit the page size.
    #[error("cannot get the pages: {0}")]
    NoPages(String),
    /// A system call failed.
    #[error("{0}")]
    Io(#[source] std::io::Error),
    /// A region could not be made.
    #[error("region: {0}")]
    Region(#[from] guest_mem::RegionError),
    /// A mapping could not be made.
    #[error("mapping: {0}")]
    Mapping(#[from] guest_mem::MappingError),
    /// The topology could not be read.
    #[error("topology: {0}")]
    Topology(#[from] numa::TopologyError),
    /// The private daemon failed.
    #[error("daemon: {0}")]
    Daemon(#[from] backend::daemon::DaemonError),
    /// A client request failed.
    #[error("client: {0}")]
    Client(#[from] backend::client::ClientError),
    /// A worker thread panicked.
    #[error("a worker thread panicked")]
    Panicked,
    /// Stopped before it was ready.
    #[error("stopped")]
    Stopped,
    /// The daemon did not finish a refault in time.
    #[error("the daemon did not refault {0} bytes within {1:?}")]
    Timeout(u64, std::time::Duration),
}
