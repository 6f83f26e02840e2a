//! The report of a churn whose launches all ended normally, from every
//! side's samples.

use std::collections::BTreeMap;

use super::floor_side::FloorOutcome;
use super::options::{ChurnConfig, ChurnVmm};
use super::pages::PagesAtStart;
use super::plan::policy_text;
use super::report::{
    page_key, ChurnLimits, ChurnReport, FloorReport, LaunchSample, OverFloor, SpanReport, Spread,
};

/// The daemon's `downgrades` counter; `None` from a daemon whose STATS has
/// none (read by key: the typed `Counters` would say 0).
fn downgrade_counter(stats: &serde_json::Value) -> Option<u64> {
    stats.get("counters")?.get("downgrades")?.as_u64()
}

/// The hugemem side's launches, with the daemon's STATS around the timed ones.
pub(super) struct HugememSide {
    pub(super) warm: LaunchSample,
    pub(super) before: serde_json::Value,
    pub(super) after: serde_json::Value,
    pub(super) launches: Vec<LaunchSample>,
}

/// Every side's launches.
pub(super) struct Sides {
    pub(super) base_warm: LaunchSample,
    pub(super) baseline: Vec<LaunchSample>,
    pub(super) floor: FloorOutcome,
    pub(super) hugemem: HugememSide,
}

/// The floor's figures (all `None`, the reason set, where it was skipped),
/// against the hugemem side's launches.
struct FloorFigures {
    floor: Option<FloorReport>,
    skipped: Option<String>,
    over_floor: Option<OverFloor>,
    limits: Option<ChurnLimits>,
    launches: Vec<LaunchSample>,
}

fn floor_figures(
    outcome: FloorOutcome,
    hugemem: &[LaunchSample],
    pages: &PagesAtStart,
    size: u64,
) -> FloorFigures {
    let (warm, launches, zeroing_ms) = match outcome {
        FloorOutcome::Ran {
            warm,
            launches,
            zeroing_ms,
        } => (warm, launches, zeroing_ms),
        FloorOutcome::Skipped(why) => {
            return FloorFigures {
                floor: None,
                skipped: Some(why),
                over_floor: None,
                limits: None,
                launches: Vec::new(),
            }
        }
    };
    let (h, f) = (Spread::of(hugemem), Spread::of(&launches));
    let over = |span: fn(&LaunchSample) -> Option<f64>| {
        Some(Spread::of_span(hugemem, span)?.p50 - Spread::of_span(&launches, span)?.p50)
    };
    FloorFigures {
        floor: Some(FloorReport {
            p50_ms: f.p50,
            p99_ms: f.p99,
            max_ms: f.max,
            warmup_ms: warm.ms,
            page_size: pages.baseline.to_string(),
            stale_reads: launches.iter().filter(|l| l.stale).count(),
            memory: "a hugetlb memfd populated before the clock (MADV_POPULATE_WRITE), handed to the VMM as /dev/fd/N like hugemem's fds, no daemon; between launches punched (FALLOC_FL_PUNCH_HOLE) and populated again, off the clock",
        }),
        skipped: None,
        over_floor: Some(OverFloor {
            p50_ms: h.p50 - f.p50,
            ready_p50_ms: over(|l| l.ready_ms),
            touched_p50_ms: over(|l| l.touched_ms),
        }),
        limits: Some(ChurnLimits::of(size, zeroing_ms)),
        launches,
    }
}

/// The report of a run whose launches all ended normally.
pub(super) fn report(
    cfg: &ChurnConfig,
    vmm: ChurnVmm,
    pages: &PagesAtStart,
    sides: Sides,
) -> ChurnReport {
    let Sides {
        base_warm,
        baseline,
        floor,
        hugemem:
            HugememSide {
                warm,
                before,
                after,
                launches,
            },
    } = sides;
    let expected = pages.expected;
    let (downgrades, source) = match (downgrade_counter(&before), downgrade_counter(&after)) {
        (Some(b), Some(a)) => (a.saturating_sub(b), "daemon"),
        _ => (
            launches
                .iter()
                .filter(|l| l.page_sizes.iter().any(|&p| p < expected.bytes()))
                .count() as u64,
            "replies",
        ),
    };
    let mut page_sizes = BTreeMap::new();
    for l in &launches {
        *page_sizes.entry(page_key(&l.page_sizes)).or_insert(0) += 1;
    }
    let (h, b) = (Spread::of(&launches), Spread::of(&baseline));
    let floor = floor_figures(floor, &launches, pages, cfg.size);
    let ready = SpanReport::of(&launches, &baseline, &floor.launches, |l| l.ready_ms);
    let touched = SpanReport::of(&launches, &baseline, &floor.launches, |l| l.touched_ms);
    let allocs: Vec<f64> = launches.iter().filter_map(|l| l.alloc_ms).collect();
    ChurnReport {
        vmm,
        vms: cfg.vms,
        parallel: cfg.parallel,
        size_bytes: cfg.size,
        page_policy: policy_text(cfg.page_policy).into(),
        daemon: cfg
            .socket
            .as_ref()
            .map_or_else(|| "private".into(), |s| s.display().to_string()),
        expected_page_size: expected.to_string(),
        page_sizes,
        downgrades,
        downgrades_source: source,
        stale_reads: launches.iter().filter(|l| l.stale).count(),
        baseline_stale_reads: baseline.iter().filter(|l| l.stale).count(),
        p50_ms: h.p50,
        p99_ms: h.p99,
        max_ms: h.max,
        alloc_p50_ms: crate::stats::median(&allocs),
        baseline_p50_ms: b.p50,
        baseline_p99_ms: b.p99,
        baseline_max_ms: b.max,
        baseline_page_size: pages.baseline.to_string(),
        speedup_p50: crate::stats::ratio(b.p50, h.p50),
        speedup_p99: crate::stats::ratio(b.p99, h.p99),
        p99_over_p50: crate::stats::ratio(h.p99, h.p50),
        host_vm_fits: pages.host_vm_fits,
        ready,
        touched,
        warmup_ms: warm.ms,
        warmup_page_sizes: warm.page_sizes,
        baseline_warmup_ms: base_warm.ms,
        launches,
        baseline,
        floor: floor.floor,
        floor_skipped: floor.skipped,
        over_floor: floor.over_floor,
        limits: floor.limits,
        floor_launches: floor.launches,
    }
}
