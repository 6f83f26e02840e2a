//! Benchmarks behind `hugemem bench …`. They report ratios against a baseline
//! measured in the same run: absolute times on shared machines are noise.

pub mod alloc;
/// `hugemem bench churn`: back-to-back launches against one daemon, stale reads, downgrades.
pub mod churn;
pub mod clear;
pub mod compare;
/// `hugemem bench migrate`: throughput per page size and runner locality.
pub mod migrate;
pub mod mlock;
pub mod report;
pub mod run_info;
/// A bench's private daemon: `hugemem serve` as a child process.
pub mod serve_child;
/// `hugemem bench takeover`: `serve --takeover` against a plain stop and start.
pub mod takeover;
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

/// The best (smallest) of `samples`; `+inf` for none.
pub(crate) fn best(samples: &[f64]) -> f64 {
    samples.iter().copied().fold(f64::INFINITY, f64::min)
}

/// The median of `samples`; 0 for none.
pub(crate) fn median(samples: &[f64]) -> f64 {
    let mut v = samples.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// `a / b`, or 0 when `b` is not positive (a missing baseline).
pub(crate) fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

pub(crate) use guest_mem::size::gb_per_s as gbps;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_median_and_ratio() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
        assert_eq!(best(&[3.0, 1.0, 2.0]), 1.0);
        assert_eq!(ratio(2.0, 0.5), 4.0);
        assert_eq!(ratio(2.0, 0.0), 0.0);
    }
}
