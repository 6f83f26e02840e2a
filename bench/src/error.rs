//! The error shared by the benches that map and clear memory themselves
//! (`clear`, `mlock`); the others have an error type of their own.

/// Errors of a benchmark run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// Zero or unrepresentable size or repetitions.
    #[error("size and repetitions must be non-zero and fit this machine's address space")]
    Size,
    /// No page size could be reserved for the run.
    #[error("no huge pages could be had for the run: {0}")]
    NoPages(String),
    /// Reading the topology failed.
    #[error("cannot read the NUMA topology")]
    Topology(#[from] numa::TopologyError),
    /// A memory-policy call failed.
    #[error("memory policy call failed")]
    Policy(#[from] numa::PolicyError),
    /// Mapping or populating memory failed.
    #[error("cannot map or populate memory")]
    Mapping(#[from] guest_mem::MappingError),
    /// The parallel runner failed.
    #[error("parallel runner failed: {0}")]
    Runner(String),
    /// Batched locking or unlocking failed.
    #[error("locking or unlocking memory failed")]
    Lock(#[from] guest_mem::LockError),
}
