//! What `hugemem bench churn` reports.

use std::collections::BTreeMap;

use serde::Serialize;

use super::options::ChurnVmm;
use guest_mem::size::format_size;

/// One launch.
#[derive(Debug, Clone, Serialize)]
pub struct LaunchSample {
    /// Launch start to its end after the guest's power-off, ms.
    pub ms: f64,
    /// Launch start to the guest's first instruction, ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ready_ms: Option<f64>,
    /// Launch start to the guest having touched every 2 MiB of its RAM, ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub touched_ms: Option<f64>,
    /// connect + ALLOC, ms (hugemem side only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alloc_ms: Option<f64>,
    /// Page size of each region served, bytes (hugemem side; the baseline's
    /// is `baseline_page_size`).
    pub page_sizes: Vec<u64>,
    /// 2 MiB strides the guest probed and wrote.
    pub guest_pages: u64,
    /// The guest read an earlier guest's marker.
    pub stale: bool,
    /// How it ended.
    pub exit: String,
}

/// Median, nearest-rank p99 and max of one side, ms.
#[derive(Debug, Clone, Copy, Serialize, Default)]
pub struct Spread {
    /// p50.
    pub p50: f64,
    /// p99 (nearest rank: the max below 100 samples).
    pub p99: f64,
    /// Max.
    pub max: f64,
}

impl Spread {
    pub(super) fn of(samples: &[LaunchSample]) -> Self {
        Self::of_values(samples.iter().map(|s| s.ms).collect())
    }

    /// Of one span of every sample; `None` when a sample lacks it.
    pub(super) fn of_span(
        samples: &[LaunchSample],
        span: impl Fn(&LaunchSample) -> Option<f64>,
    ) -> Option<Self> {
        let v: Option<Vec<f64>> = samples.iter().map(span).collect();
        v.filter(|v| !v.is_empty()).map(Self::of_values)
    }

    fn of_values(mut v: Vec<f64>) -> Self {
        v.sort_by(f64::total_cmp);
        let rank = |q: f64| -> f64 {
            if v.is_empty() {
                return 0.0;
            }
            let i = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
            v[i]
        };
        Self {
            p50: crate::stats::median(&v),
            p99: rank(0.99),
            max: v.last().copied().unwrap_or(0.0),
        }
    }
}

/// One span of every launch (see [`ChurnReport::ready`]) on every side.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct SpanReport {
    /// hugemem side, ms.
    pub hugemem: Spread,
    /// Baseline side (the VMM's own preallocation), ms.
    pub baseline: Spread,
    /// Floor side (the same VMM and guest on a resident memfd, no daemon),
    /// ms; absent where the floor did not run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub floor: Option<Spread>,
    /// `baseline.p50 / hugemem.p50`: above 1 = hugemem sooner.
    pub speedup_p50: f64,
    /// `baseline.p99 / hugemem.p99`.
    pub speedup_p99: f64,
    /// `hugemem.p99 / hugemem.p50`.
    pub p99_over_p50: f64,
}

impl SpanReport {
    /// The span `span` of each side; `None` when a hugemem or baseline
    /// launch lacks it (`floor: None` when a floor launch does, or none ran).
    pub(super) fn of(
        hugemem: &[LaunchSample],
        baseline: &[LaunchSample],
        floor: &[LaunchSample],
        span: impl Fn(&LaunchSample) -> Option<f64> + Copy,
    ) -> Option<Self> {
        let h = Spread::of_span(hugemem, span)?;
        let b = Spread::of_span(baseline, span)?;
        Some(Self {
            hugemem: h,
            baseline: b,
            floor: Spread::of_span(floor, span),
            speedup_p50: crate::stats::ratio(b.p50, h.p50),
            speedup_p99: crate::stats::ratio(b.p99, h.p99),
            p99_over_p50: crate::stats::ratio(h.p99, h.p50),
        })
    }
}

/// The floor side: the same VMM (or runner) and guest as hugemem's side on
/// a hugetlb memfd of the same size and page size, populated before the
/// clock, handed over as hugemem's fds are, no daemon.
#[derive(Debug, Clone, Serialize)]
pub struct FloorReport {
    /// ms, as the hugemem side's `p50_ms`.
    pub p50_ms: f64,
    /// ms.
    pub p99_ms: f64,
    /// ms.
    pub max_ms: f64,
    /// The untimed first floor launch, ms.
    pub warmup_ms: f64,
    /// Page size of the memfd.
    pub page_size: String,
    /// Timed floor launches whose guest read non-zero memory (must be 0:
    /// the memfd is zeroed again between launches).
    pub stale_reads: usize,
    /// How the memory is made and zeroed between launches.
    pub memory: &'static str,
}

/// hugemem's p50 minus the floor's, ms: what hugemem adds to the VMM's own
/// start on memory that needs no preparation.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct OverFloor {
    /// Launch wall time (`p50_ms - floor.p50_ms`).
    pub p50_ms: f64,
    /// `ready.hugemem.p50 - ready.floor.p50`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ready_p50_ms: Option<f64>,
    /// `touched.hugemem.p50 - touched.floor.p50`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub touched_p50_ms: Option<f64>,
}

/// The limit beside "all RAM touched", measured in the same run.
#[derive(Debug, Clone, Serialize)]
pub struct ChurnLimits {
    /// The kernel's fault-time zeroing of the size on one thread
    /// (`MADV_POPULATE_WRITE` of a fresh floor memfd, after an untimed
    /// one), median, ms: the limit of a one-vCPU guest touching memory
    /// with holes.
    pub kernel_zeroing_1_thread_ms: f64,
    /// Every measurement of it, ms.
    pub kernel_zeroing_1_thread_samples_ms: Vec<f64>,
    /// The median as a rate, GB/s.
    pub kernel_zeroing_1_thread_gbps: f64,
}

impl ChurnLimits {
    pub(super) fn of(size: u64, samples_ms: Vec<f64>) -> Self {
        let ms = crate::stats::median(&samples_ms);
        #[allow(clippy::cast_precision_loss)] // a rate
        let gb = size as f64 / 1e9;
        Self {
            kernel_zeroing_1_thread_ms: ms,
            kernel_zeroing_1_thread_samples_ms: samples_ms,
            kernel_zeroing_1_thread_gbps: crate::stats::ratio(gb, ms / 1e3),
        }
    }
}

/// The result.
#[derive(Debug, Clone, Serialize)]
pub struct ChurnReport {
    /// The VMM.
    pub vmm: ChurnVmm,
    /// Timed launches per side.
    pub vms: usize,
    /// Launches at once.
    pub parallel: usize,
    /// Guest RAM per launch, bytes.
    pub size_bytes: u64,
    /// `best`, `1G`, `2M` or `4K`.
    pub page_policy: String,
    /// The daemon: `private` or its socket.
    pub daemon: String,
    /// See the module docs.
    pub expected_page_size: String,
    /// Timed hugemem launches per page size served (`"1G"`, `"2M+4K"`, …).
    pub page_sizes: BTreeMap<String, usize>,
    /// See the module docs.
    pub downgrades: u64,
    /// `daemon` or `replies`.
    pub downgrades_source: &'static str,
    /// Timed hugemem launches whose guest read an earlier guest's marker.
    pub stale_reads: usize,
    /// The same on the baseline side.
    pub baseline_stale_reads: usize,
    /// hugemem side, ms.
    pub p50_ms: f64,
    /// hugemem side, ms.
    pub p99_ms: f64,
    /// hugemem side, ms.
    pub max_ms: f64,
    /// Median connect + ALLOC, ms.
    pub alloc_p50_ms: f64,
    /// Baseline side, ms.
    pub baseline_p50_ms: f64,
    /// Baseline side, ms.
    pub baseline_p99_ms: f64,
    /// Baseline side, ms.
    pub baseline_max_ms: f64,
    /// Page size of the baseline's preallocation.
    pub baseline_page_size: String,
    /// `baseline_p50_ms / p50_ms`: above 1 = hugemem faster.
    pub speedup_p50: f64,
    /// `baseline_p99_ms / p99_ms`.
    pub speedup_p99: f64,
    /// `p99_ms / p50_ms`.
    pub p99_over_p50: f64,
    /// How many VMs of this size the host's pages of `expected_page_size`
    /// held at the start (free, plus idle in a live daemon's pool): 1 is
    /// an exact fit, 2 or more leaves pages to spare.
    pub host_vm_fits: u64,
    /// Launch start to the guest's first instruction (its port-0x3f0 mark
    /// through the VMM's debug console; `micro`: the runner's own timing).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ready: Option<SpanReport>,
    /// Launch start to the guest having touched every 2 MiB of its RAM.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub touched: Option<SpanReport>,
    /// The untimed first hugemem launch, ms, and its page sizes.
    pub warmup_ms: f64,
    /// Page sizes of the warm-up launch.
    pub warmup_page_sizes: Vec<u64>,
    /// The untimed first baseline launch, ms.
    pub baseline_warmup_ms: f64,
    /// Every timed hugemem launch, in start order.
    pub launches: Vec<LaunchSample>,
    /// Every timed baseline launch, in start order.
    pub baseline: Vec<LaunchSample>,
    /// The floor side; absent where it did not run (`floor_skipped`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub floor: Option<FloorReport>,
    /// Why the floor did not run (only with `--socket`: a live daemon may
    /// hold the pages it needs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub floor_skipped: Option<String>,
    /// hugemem's p50s over the floor's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub over_floor: Option<OverFloor>,
    /// The limits, measured with the floor's memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limits: Option<ChurnLimits>,
    /// Every timed floor launch, in start order.
    pub floor_launches: Vec<LaunchSample>,
}

impl ChurnReport {
    /// A human-readable summary.
    pub fn to_table(&self) -> String {
        let sizes: Vec<String> = self
            .page_sizes
            .iter()
            .map(|(k, v)| format!("{v} x {k}"))
            .collect();
        format!(
            "churn: {} VMs x {} on {} ({} at once), daemon {}\n\
             {:<22} {:>9} {:>9} {:>9}\n\
             {:<22} {:>9.1} {:>9.1} {:>9.1}\n\
             {:<22} {:>9.1} {:>9.1} {:>9.1}\n\
             speedup p50 {:.2}x, p99 {:.2}x; p99/p50 {:.2}\n\
             pages served: {} (expected {}); downgrades {} ({}); stale reads {} (baseline {}); host fits {} VM(s)\n{}",
            self.vms,
            format_size(self.size_bytes),
            self.vmm.name(),
            self.parallel,
            self.daemon,
            "ms",
            "p50",
            "p99",
            "max",
            "hugemem",
            self.p50_ms,
            self.p99_ms,
            self.max_ms,
            format!("baseline ({} prealloc)", self.baseline_page_size),
            self.baseline_p50_ms,
            self.baseline_p99_ms,
            self.baseline_max_ms,
            self.speedup_p50,
            self.speedup_p99,
            self.p99_over_p50,
            sizes.join(", "),
            self.expected_page_size,
            self.downgrades,
            self.downgrades_source,
            self.stale_reads,
            self.baseline_stale_reads,
            self.host_vm_fits,
            self.spans_table(),
        ) + &self.floor_table()
    }

    /// The floor and the limit, or why the floor did not run.
    fn floor_table(&self) -> String {
        let mut out = String::new();
        if let Some(why) = &self.floor_skipped {
            out.push_str(&format!("floor: skipped: {why}\n"));
        }
        if let (Some(f), Some(o)) = (&self.floor, &self.over_floor) {
            out.push_str(&format!(
                "floor ({} memfd, no daemon): p50 {:.1} p99 {:.1} max {:.1} ms; hugemem p50 over the floor {:+.1} ms; stale reads {}\n",
                f.page_size, f.p50_ms, f.p99_ms, f.max_ms, o.p50_ms, f.stale_reads
            ));
            for (name, span, over) in [
                ("ready", self.ready, o.ready_p50_ms),
                ("all RAM touched", self.touched, o.touched_p50_ms),
            ] {
                if let (Some(fl), Some(over)) = (span.and_then(|s| s.floor), over) {
                    out.push_str(&format!(
                        "floor {name}: p50 {:.1} p99 {:.1} ms; hugemem p50 over the floor {over:+.1} ms\n",
                        fl.p50, fl.p99
                    ));
                }
            }
        }
        if let Some(l) = &self.limits {
            out.push_str(&format!(
                "limit: the kernel zeroing {} on 1 thread {:.1} ms ({:.2} GB/s), the least a one-vCPU guest touching memory with holes takes\n",
                format_size(self.size_bytes),
                l.kernel_zeroing_1_thread_ms,
                l.kernel_zeroing_1_thread_gbps
            ));
        }
        out
    }

    fn spans_table(&self) -> String {
        let mut out = String::new();
        for (name, span) in [
            ("launch -> guest ready", self.ready),
            ("launch -> all RAM touched", self.touched),
        ] {
            if let Some(s) = span {
                out.push_str(&format!(
                    "{name}: hugemem p50 {:.1} p99 {:.1} ms; baseline p50 {:.1} p99 {:.1} ms; \
                     speedup p50 {:.2}x, p99 {:.2}x; p99/p50 {:.2}\n",
                    s.hugemem.p50,
                    s.hugemem.p99,
                    s.baseline.p50,
                    s.baseline.p99,
                    s.speedup_p50,
                    s.speedup_p99,
                    s.p99_over_p50
                ));
            }
        }
        out
    }
}

pub(super) fn page_key(sizes: &[u64]) -> String {
    sizes
        .iter()
        .map(|p| format_size(*p))
        .collect::<Vec<_>>()
        .join("+")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(ms: f64) -> LaunchSample {
        LaunchSample {
            ms,
            ready_ms: None,
            touched_ms: None,
            alloc_ms: None,
            page_sizes: vec![2 << 20],
            guest_pages: 1,
            stale: false,
            exit: String::new(),
        }
    }

    #[test]
    fn spreads() {
        let s = Spread::of(&[30.0, 10.0, 20.0].map(sample));
        assert_eq!((s.p50, s.p99, s.max), (20.0, 30.0, 30.0));
        let many: Vec<LaunchSample> = (1..=200).map(|i| sample(f64::from(i))).collect();
        let s = Spread::of(&many);
        assert_eq!((s.p50, s.p99, s.max), (100.5, 198.0, 200.0));
        let s = Spread::of(&[]);
        assert_eq!((s.p50, s.p99, s.max), (0.0, 0.0, 0.0));
        assert_eq!(page_key(&[1 << 30, 2 << 20]), "1G+2M");
    }
}
