//! The limits the alloc bench's figures stand beside, measured in the same
//! run: the kernel's fault-time zeroing with the threads a figure used, and
//! the memory bandwidth (the non-temporal clear with all CPUs).

use clearing::{ClearKernel, RunOptions};
use guest_mem::AnonMapping;
use serde::Serialize;

use super::error::AllocBenchError;
use crate::harness::rounds;
use crate::stats::{best, ratio};

/// What no way of getting this memory ready can beat on this machine.
#[derive(Debug, Clone, Serialize)]
pub struct AllocLimits {
    /// Threads that touched each hand-out's pages (one write per page).
    pub touch_threads: usize,
    /// The kernel zeroing `size` bytes at fault time with `touch_threads`
    /// node-local workers (the scaling run's point), best s: the limit of a
    /// touch of a hand-out with holes.
    pub kernel_zeroing_touch_threads_s: f64,
    /// Its rate, GB/s.
    pub kernel_zeroing_touch_threads_gbps: f64,
    /// Workers of the next figure: all CPUs.
    pub all_cpus: usize,
    /// The kernel's fault-time zeroing with all CPUs, best s: the limit of
    /// every fresh populate.
    pub kernel_zeroing_all_cpus_s: f64,
    /// Its rate, GB/s.
    pub kernel_zeroing_all_cpus_gbps: f64,
    /// The cloud-hypervisor-style prefault's thread count.
    pub cloud_hypervisor_threads: usize,
    /// The kernel's fault-time zeroing with that many node-local workers,
    /// best s: the limit of that prefault.
    pub kernel_zeroing_cloud_hypervisor_threads_s: f64,
    /// Memory bandwidth: `size` bytes of populated huge pages cleared with
    /// `memory_bandwidth_kernel` by all CPUs (`clearing::clear_parallel`),
    /// best of reps, GB/s.
    pub memory_bandwidth_gbps: f64,
    /// The clearing kernel of that figure (`nt` where the CPU has it).
    pub memory_bandwidth_kernel: String,
}

/// The worker counts of the scaling run: those asked for, plus 1 (the
/// touch's thread), all CPUs and `ch_threads`, the limits' counts.
pub(super) fn scaling_counts(asked: &[usize], cpus: usize, ch_threads: usize) -> Vec<usize> {
    let mut counts: Vec<usize> = if asked.is_empty() {
        (1..=cpus.max(1)).collect()
    } else {
        asked.to_vec()
    };
    for needed in [1, cpus.max(1), ch_threads.max(1)] {
        if !counts.contains(&needed) {
            counts.push(needed);
        }
    }
    counts
}

/// The limits from the scaling run (`at(threads)`: its best seconds with
/// that many workers, 0 where not measured) and a bandwidth measurement.
pub(super) fn limits(
    at: impl Fn(usize) -> f64,
    size: u64,
    cpus: usize,
    ch_threads: usize,
    bandwidth: (f64, ClearKernel),
) -> AllocLimits {
    #[allow(clippy::cast_precision_loss)] // rates
    let gb = size as f64 / 1e9;
    let (touch_s, all_s) = (at(1), at(cpus.max(1)));
    AllocLimits {
        touch_threads: 1,
        kernel_zeroing_touch_threads_s: touch_s,
        kernel_zeroing_touch_threads_gbps: ratio(gb, touch_s),
        all_cpus: cpus.max(1),
        kernel_zeroing_all_cpus_s: all_s,
        kernel_zeroing_all_cpus_gbps: ratio(gb, all_s),
        cloud_hypervisor_threads: ch_threads.max(1),
        kernel_zeroing_cloud_hypervisor_threads_s: at(ch_threads.max(1)),
        memory_bandwidth_gbps: bandwidth.0,
        memory_bandwidth_kernel: bandwidth.1.name().to_string(),
    }
}

/// Memory bandwidth: `size` bytes of `page` pages, populated once, then
/// cleared `reps` times by all CPUs with the non-temporal kernel (the
/// default kernel where the CPU lacks it); best GB/s and the kernel.
pub(super) fn memory_bandwidth(
    topology: &numa::Topology,
    size: u64,
    page: guest_mem::PageSize,
    cpus: usize,
    reps: usize,
) -> Result<(f64, ClearKernel), AllocBenchError> {
    let len = usize::try_from(size).map_err(|_| AllocBenchError::Size)?;
    let kernel = if ClearKernel::NonTemporal.is_available() {
        ClearKernel::NonTemporal
    } else {
        ClearKernel::default_kernel()
    };
    let mut map = AnonMapping::new(len, page)?;
    map.populate_write(0, len)?;
    let samples = rounds::collect(reps, |_| {
        rounds::seconds(|| {
            clearing::clear_parallel(
                topology,
                map.as_mut_slice(),
                None,
                cpus.max(1),
                kernel,
                &RunOptions::default(),
            )
            .map(drop)
            .map_err(|e| AllocBenchError::Bandwidth(e.to_string()))
        })
    })?;
    #[allow(clippy::cast_precision_loss)] // rates
    Ok((ratio(size as f64 / 1e9, best(&samples)), kernel))
}
