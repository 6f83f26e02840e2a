//! The alloc bench's report: best and median of every way to get a VM's
//! RAM ready, their ratios, the samples and the scaling run.

use serde::Serialize;

/// One worker count of the scaling run.
#[derive(Debug, Clone, Serialize)]
pub struct ScalingPoint {
    /// Node-local workers, all nodes together.
    pub threads: usize,
    /// Fresh populate, best of reps, seconds.
    pub best_s: f64,
    /// Median of reps, seconds.
    pub median_s: f64,
    /// `size / best_s`, GB/s (10^9).
    pub gbps: f64,
    /// GB/s relative to the first worker count.
    pub speedup: f64,
}

/// Ratios of the figures of one run.
#[derive(Debug, Clone, Serialize)]
pub struct AllocRatios {
    /// `cloud_hypervisor_style_s / fresh_eager_s`: >1 means hugemem's fresh
    /// path is faster than cloud-hypervisor's prefault.
    pub cloud_hypervisor_style_over_fresh_eager: f64,
    /// `cloud_hypervisor_style_s / pooled_eager_s`.
    pub cloud_hypervisor_style_over_pooled_eager: f64,
    /// `fresh_eager_daemon_s / pooled_eager_s`: what the clean pool saves.
    pub fresh_eager_daemon_over_pooled_eager: f64,
    /// `fresh_eager_daemon_s / fresh_eager_s`: the daemon's overhead on a fresh ALLOC.
    pub fresh_eager_daemon_over_fresh_eager: f64,
}

/// The report; `--json` prints it as one object.
#[derive(Debug, Clone, Serialize)]
pub struct AllocBenchReport {
    /// Bytes per allocation actually measured.
    pub size_bytes: u64,
    /// Bytes asked for.
    pub requested_size_bytes: u64,
    /// Page size used.
    pub page_size: String,
    /// What changed from the request and why (`null` when nothing did).
    pub note: Option<String>,
    /// Repetitions.
    pub reps: usize,
    /// Online CPUs.
    pub cpus: usize,
    /// NUMA nodes with memory and CPUs (one region per node).
    pub nodes: usize,
    /// Daemon-less fresh allocation, best of reps, seconds.
    pub fresh_eager_s: f64,
    /// Fresh ALLOC through the daemon, best of reps, seconds.
    pub fresh_eager_daemon_s: f64,
    /// ALLOC from the clean pool, best of reps, seconds.
    pub pooled_eager_s: f64,
    /// cloud-hypervisor-style prefault, best of reps, seconds.
    pub cloud_hypervisor_style_s: f64,
    /// Threads the cloud-hypervisor-style prefault used.
    pub cloud_hypervisor_style_threads: usize,
    /// `size / fresh_eager_s`, GB/s (10^9).
    pub fresh_eager_gbps: f64,
    /// `size / cloud_hypervisor_style_s`, GB/s.
    pub cloud_hypervisor_style_gbps: f64,
    /// FREE to clean pool (scrub), best of reps, seconds.
    pub free_to_clean_s: f64,
    /// CPU seconds the scrub of one GiB cost (all the daemon's threads),
    /// median of reps: the price of the pooled figure, paid after FREE.
    pub scrub_cpu_s_per_gib: f64,
    /// Medians over the repetitions, seconds (same keys as `samples`).
    pub medians: AllocMedians,
    /// All repetitions, seconds, in order.
    pub samples: AllocSamples,
    /// Ratios.
    pub ratios: AllocRatios,
    /// Fresh populate with each `--threads` worker count.
    pub scaling: Vec<ScalingPoint>,
}

/// Median times over the repetitions.
#[derive(Debug, Clone, Serialize)]
pub struct AllocMedians {
    /// Daemon-less fresh.
    pub fresh_eager_s: f64,
    /// Daemon fresh.
    pub fresh_eager_daemon_s: f64,
    /// Daemon pooled.
    pub pooled_eager_s: f64,
    /// cloud-hypervisor style.
    pub cloud_hypervisor_style_s: f64,
    /// FREE to clean.
    pub free_to_clean_s: f64,
}

/// Per-repetition times.
#[derive(Debug, Clone, Serialize, Default)]
pub struct AllocSamples {
    /// Daemon-less fresh.
    pub fresh_eager_s: Vec<f64>,
    /// Daemon fresh.
    pub fresh_eager_daemon_s: Vec<f64>,
    /// Daemon pooled.
    pub pooled_eager_s: Vec<f64>,
    /// cloud-hypervisor style.
    pub cloud_hypervisor_style_s: Vec<f64>,
    /// FREE to clean.
    pub free_to_clean_s: Vec<f64>,
    /// CPU seconds of FREE to clean.
    pub free_to_clean_cpu_s: Vec<f64>,
}
