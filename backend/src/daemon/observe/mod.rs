//! What an operator observes: the counters and latency histograms, the
//! STATS document and the Prometheus endpoint.

pub mod exporter;
pub mod latency;
pub mod metrics;
pub mod stats;
