//! What `hugemem bench churn` reports.

use std::collections::BTreeMap;

use serde::Serialize;

use super::ChurnVmm;
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

/// One span of every launch (see [`ChurnReport::ready`]) on both sides.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct SpanReport {
    /// hugemem side, ms.
    pub hugemem: Spread,
    /// Baseline side (the VMM's own preallocation), ms.
    pub baseline: Spread,
    /// `baseline.p50 / hugemem.p50`: above 1 = hugemem sooner.
    pub speedup_p50: f64,
    /// `baseline.p99 / hugemem.p99`.
    pub speedup_p99: f64,
    /// `hugemem.p99 / hugemem.p50`.
    pub p99_over_p50: f64,
}

impl SpanReport {
    /// The span `span` of each side; `None` when a launch lacks it.
    pub(super) fn of(
        hugemem: &[LaunchSample],
        baseline: &[LaunchSample],
        span: impl Fn(&LaunchSample) -> Option<f64> + Copy,
    ) -> Option<Self> {
        let h = Spread::of_span(hugemem, span)?;
        let b = Spread::of_span(baseline, span)?;
        Some(Self {
            hugemem: h,
            baseline: b,
            speedup_p50: crate::stats::ratio(b.p50, h.p50),
            speedup_p99: crate::stats::ratio(b.p99, h.p99),
            p99_over_p50: crate::stats::ratio(h.p99, h.p50),
        })
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
        )
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
