//! The alloc bench's report: best and median of every way to get a VM's
//! RAM ready, their ratios, the samples and the scaling run.

use serde::Serialize;

use super::handout::HandOut;
use super::limits::AllocLimits;

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
    /// `fresh_eager_daemon_s / pooled_resident_s`.
    pub fresh_eager_daemon_over_pooled_resident: f64,
    /// `cloud_hypervisor_style_s / pooled_resident_touched_s`: the VMM's
    /// own prefault against a resident hand-out with every page touched.
    pub cloud_hypervisor_style_over_pooled_resident_touched: f64,
    /// `cloud_hypervisor_style_s / pooled_holes_touched_s`.
    pub cloud_hypervisor_style_over_pooled_holes_touched: f64,
    /// `pooled_holes_touched_s / limits.kernel_zeroing_touch_threads_s`:
    /// the touch of a hand-out with holes against the kernel zeroing the
    /// same bytes with as many threads (1.0 = at the limit).
    pub pooled_holes_touched_over_kernel_zeroing: f64,
    /// `fresh_eager_s / limits.kernel_zeroing_all_cpus_s`.
    pub fresh_eager_over_kernel_zeroing: f64,
    /// `cloud_hypervisor_style_s /
    /// limits.kernel_zeroing_cloud_hypervisor_threads_s`: against the
    /// kernel's zeroing with as many threads as it used.
    pub cloud_hypervisor_style_over_kernel_zeroing: f64,
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
    /// ALLOC from the clean pool, best of reps, seconds: the ALLOC right
    /// after the pool shows the freed region clean, on a daemon with its
    /// defaults; `pooled_eager` says what it handed out.
    pub pooled_eager_s: f64,
    /// What the best `pooled_eager_s` hand-out held (resident / hole bytes).
    pub pooled_eager: HandOut,
    /// ALLOC of a resident hand-out (the region refaulted and zero before
    /// the ALLOC), best of reps, seconds.
    pub pooled_resident_s: f64,
    /// ALLOC sent to every page of that hand-out written once, best s.
    pub pooled_resident_touched_s: f64,
    /// What the best `pooled_resident_s` hand-out held.
    pub pooled_resident: HandOut,
    /// ALLOC of a hand-out with holes (`pool.refault_ahead = false`, the
    /// ALLOC right after clean), best of reps, seconds.
    pub pooled_holes_s: f64,
    /// ALLOC sent to every page of that hand-out written once (the kernel
    /// zeroes each hole at that touch), best s.
    pub pooled_holes_touched_s: f64,
    /// What the best `pooled_holes_s` hand-out held.
    pub pooled_holes: HandOut,
    /// What no way of getting this memory ready can beat here, same run.
    pub limits: AllocLimits,
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
    /// Resident hand-out.
    pub pooled_resident_s: f64,
    /// Resident hand-out, every page touched.
    pub pooled_resident_touched_s: f64,
    /// Hand-out with holes.
    pub pooled_holes_s: f64,
    /// Hand-out with holes, every page touched.
    pub pooled_holes_touched_s: f64,
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
    /// Every hand-out of each kind, in order (times and bytes).
    pub hand_outs: HandOutSamples,
    /// cloud-hypervisor style.
    pub cloud_hypervisor_style_s: Vec<f64>,
    /// FREE to clean.
    pub free_to_clean_s: Vec<f64>,
    /// CPU seconds of FREE to clean.
    pub free_to_clean_cpu_s: Vec<f64>,
}

/// Every pooled hand-out of a run, per kind.
#[derive(Debug, Clone, Serialize, Default)]
pub struct HandOutSamples {
    /// The ALLOC right after clean, daemon defaults.
    pub pooled_eager: Vec<HandOut>,
    /// Resident hand-outs.
    pub pooled_resident: Vec<HandOut>,
    /// Hand-outs with holes.
    pub pooled_holes: Vec<HandOut>,
}
