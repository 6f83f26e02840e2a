//! The run of `hugemem bench refault` and its report.

use std::fmt::Write as _;
use std::time::Duration;

use guest_mem::{PageSize, Region, RegionSpec, Reservation};
use numa::Topology;
use serde::Serialize;

use super::daemon::{self, Responsiveness};
use super::error::RefaultBenchError;
use super::rates::{self, RatePoint, Rates};
use super::tenant::{self, TenantFigures};

/// What to measure.
#[derive(Debug, Clone)]
pub struct RefaultBenchConfig {
    /// Bytes of the region.
    pub size: u64,
    /// Huge page size.
    pub page_size: PageSize,
    /// Repetitions per figure.
    pub reps: usize,
    /// Bytes per chunk of work (the daemon's `scrub.batch`).
    pub chunk: u64,
    /// The tenant's window per measurement.
    pub tenant_window: Duration,
    /// Skip the daemon part (no socket, no private daemon).
    pub no_daemon: bool,
}

/// Everything one run measured.
#[derive(Debug, Clone, Serialize)]
pub struct RefaultBenchReport {
    /// Bytes of the region.
    pub size_bytes: u64,
    /// Its page size.
    pub page_size: String,
    /// CPUs of node 0 (the region's).
    pub cpus: usize,
    /// Bytes per chunk.
    pub chunk_bytes: u64,
    /// Repetitions.
    pub reps: usize,
    /// The rates.
    pub rates: Rates,
    /// Helpers on 2 threads over 1 (the issue expects at least 1.5 where
    /// bandwidth allows).
    pub helpers_2_over_1: Option<f64>,
    /// The bandwidth's own scaling from 1 to 2 threads (the limit of the
    /// figure above).
    pub nt_2_over_1: Option<f64>,
    /// The tenant on every CPU of the node, and on all but one.
    pub tenant: Vec<TenantFigures>,
    /// STATS while refaulting, helpers and scrubber thread.
    pub responsiveness: Vec<Responsiveness>,
}

fn at(points: &[RatePoint], threads: usize) -> Option<f64> {
    points.iter().find(|p| p.threads == threads).map(|p| p.gbps)
}

/// Runs the bench. `progress` gets one line per step.
pub fn run(
    cfg: &RefaultBenchConfig,
    progress: &mut dyn FnMut(&str),
) -> Result<RefaultBenchReport, RefaultBenchError> {
    let page = cfg.page_size;
    if cfg.size == 0 || !cfg.size.is_multiple_of(page.bytes()) || !page.is_huge() {
        return Err(RefaultBenchError::NoPages(format!(
            "{} is not a whole number of {page} huge pages",
            guest_mem::size::format_size(cfg.size)
        )));
    }
    let topology = Topology::detect()?;
    let node = topology
        .nodes()
        .iter()
        .find(|n| !n.is_memoryless())
        .ok_or_else(|| RefaultBenchError::NoPages("no node with memory".into()))?;
    let cpus = if node.cpus.is_empty() {
        numa::current_affinity().unwrap_or_default()
    } else {
        node.cpus.clone()
    };
    let pages = cfg.size / page.bytes();
    let reservation = Reservation::for_run(page, pages).map_err(|e| {
        RefaultBenchError::NoPages(format!("cannot reserve {pages} {page} pages: {e}"))
    })?;
    if !reservation.report().met {
        return Err(RefaultBenchError::NoPages(format!(
            "asked for {pages} free {page} pages, the kernel has {}",
            reservation.report().free
        )));
    }
    let chunk = cfg.chunk.max(page.bytes()) / page.bytes() * page.bytes();
    let (rates, tenant) = {
        let spec = RegionSpec::new("bench-refault", cfg.size, Some(node.id))
            .with_policy(guest_mem::PagePolicy::Strict(page));
        let region = Region::create(&topology, &spec)?;
        let rates = rates::measure(&region, &cpus, chunk, cfg.reps, progress)?;
        let mut tenant = Vec::new();
        progress("a CPU-bound tenant on every CPU of the node");
        tenant.push(tenant::measure(
            &region,
            &cpus,
            &cpus,
            chunk,
            cfg.tenant_window,
            cfg.reps,
        )?);
        if cpus.len() > 1 {
            progress("a CPU-bound tenant on all CPUs of the node but one");
            let some = &cpus[..cpus.len() - 1];
            tenant.push(tenant::measure(
                &region,
                &cpus,
                some,
                chunk,
                cfg.tenant_window,
                cfg.reps,
            )?);
        }
        (rates, tenant)
    };
    let mut responsiveness = Vec::new();
    if !cfg.no_daemon {
        for helpers in [true, false] {
            progress(&format!(
                "STATS while a private daemon refaults ({})",
                if helpers { "helpers" } else { "scrub thread" }
            ));
            responsiveness.push(daemon::measure(cfg.size, page, helpers, cfg.reps.max(3))?);
        }
    }
    drop(reservation);
    let ratio = |a: Option<f64>, b: Option<f64>| Some(a? / b?);
    Ok(RefaultBenchReport {
        size_bytes: cfg.size,
        page_size: page.to_string(),
        cpus: cpus.len(),
        chunk_bytes: chunk,
        reps: cfg.reps,
        helpers_2_over_1: ratio(at(&rates.helpers, 2), at(&rates.helpers, 1)),
        nt_2_over_1: ratio(at(&rates.nt_clear, 2), at(&rates.nt_clear, 1)),
        rates,
        tenant,
        responsiveness,
    })
}

impl RefaultBenchReport {
    /// The report as text tables.
    pub fn to_table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "refault of {} on {} pages, node of {} CPUs, chunks of {}, best of {}",
            guest_mem::size::format_size(self.size_bytes),
            self.page_size,
            self.cpus,
            guest_mem::size::format_size(self.chunk_bytes),
            self.reps
        );
        let _ = writeln!(
            s,
            "{:>8} {:>14} {:>16} {:>12} {:>22}",
            "threads", "helpers GB/s", "threads GB/s", "fallocate", "limit: NT clear GB/s"
        );
        for p in &self.rates.helpers {
            let _ = writeln!(
                s,
                "{:>8} {:>14.2} {:>16.2} {:>12.2} {:>22.2}",
                p.threads,
                p.gbps,
                at(&self.rates.threads, p.threads).unwrap_or(0.0),
                at(&self.rates.fallocate, p.threads).unwrap_or(0.0),
                at(&self.rates.nt_clear, p.threads).unwrap_or(0.0),
            );
        }
        let _ = writeln!(
            s,
            "helpers spawn + ready, all CPUs: {:.2} ms",
            self.rates.spawn_ms
        );
        if let (Some(h), Some(nt)) = (self.helpers_2_over_1, self.nt_2_over_1) {
            let _ = writeln!(
                s,
                "helpers 2 threads / 1: {h:.2}x (expected >= 1.5x where bandwidth allows; the bandwidth's own 2/1: {nt:.2}x)"
            );
        }
        for t in &self.tenant {
            let _ = writeln!(
                s,
                "tenant on {}/{} CPUs: {:.0} M iterations/s alone; with helpers {:.3} (limit >= 0.95; refaulted {:.2} GB/s meanwhile), with normal-priority threads {:.3} ({:.2} GB/s)",
                t.tenant_cpus, t.refault_cpus, t.alone_mips, t.with_helpers, t.helpers_gbps, t.with_threads, t.threads_gbps
            );
        }
        for r in &self.responsiveness {
            let _ = writeln!(
                s,
                "while refaulting ({}, {} thread(s)), {} samples: STATS p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms (idle: p50 {:.3}, p99 {:.3}); daemon's mmap p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms (idle p99 {:.3}); FREE to refaulted {:.3} s",
                r.mode, r.threads, r.samples, r.stats_p50_ms, r.stats_p99_ms, r.stats_max_ms, r.idle_p50_ms, r.idle_p99_ms,
                r.mmap_p50_ms, r.mmap_p99_ms, r.mmap_max_ms, r.idle_mmap_p99_ms, r.refault_s
            );
        }
        s
    }
}
