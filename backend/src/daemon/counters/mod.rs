//! The daemon's counters and latency histograms, lock-free: what STATS and
//! the Prometheus endpoint (`crate::daemon::process::exporter`) report.

pub mod latency;
pub mod metrics;
