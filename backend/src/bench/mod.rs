//! Benchmarks behind `hugemem bench …`. They report ratios against a baseline
//! measured in the same run: absolute times on shared machines are noise.

pub mod alloc;
pub mod clear;
pub mod compare;
pub mod mlock;
/// `hugemem bench vmstart`: ALLOC to the guest's first instruction and to all pages touched, eager and lazy.
pub mod vmstart;

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

/// GB/s (10^9 bytes per second) for `bytes` in `seconds`.
pub(crate) fn gbps(bytes: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        bytes as f64 / seconds / 1e9
    } else {
        0.0
    }
}
