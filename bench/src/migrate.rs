//! `hugemem bench migrate`: how fast memory moves between nodes with 4 KiB,
//! 2 MiB and 1 GiB pages, and whether the clearing runner places pages on
//! its workers' node.
//!
//! # What is measured
//!
//! For each page size, a region of `size` bytes (rounded up to a whole
//! number of pages) is allocated on node A by [`guest_mem::Region::allocate`] (bound,
//! populated by workers pinned to A), stamped (32-byte stamps twice per 4 KiB), moved
//! A → B and back B → A with [`move_region`](::migrate::move_region), and checked. The time of each
//! leg is the mover's batch time (no planning, binding or verification),
//! after one untimed round trip that makes both nodes' pages warm: the first
//! touch of never-used physical memory is several times slower than reuse
//! on the hosts this runs on (docs/platform.md#first-touch). 4 KiB pages are shmem (a
//! 4 KiB memfd region); whether the kernel backs those with huge pages
//! depends on `shmem_enabled`, which the report records.
//!
//! The locality part allocates a small region on every node with memory and
//! reports the share of its pages that `move_pages` finds on that node:
//! 100% is expected, since the region is bound with `mbind` before the
//! pinned workers populate it.
//!
//! Nothing here fails as a whole: a page size that cannot run (no second
//! node, no free 1 GiB pages, a failed allocation) is reported with the
//! reason, so one run always says everything it could find out.

use std::path::Path;

use clearing::RunOptions;
use guest_mem::{PagePolicy, PageSize, Region, RegionSpec};
use numa::{NodeId, Topology};
use serde::Serialize;
use tracing::info;

use backend::diag::chain as error_chain;
use migrate::{memory_nodes, move_region, pattern, MoveOptions, MoveReport};

use crate::harness::rounds;

/// Bytes of the per-node locality regions.
pub const LOCALITY_BYTES: u64 = 64 << 20;

/// What to run.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchOptions {
    /// Bytes moved per page size (rounded up to whole pages).
    pub size: u64,
    /// Page sizes to measure, in this order.
    pub page_sizes: Vec<PageSize>,
    /// Source node; default: the first node with memory.
    pub from: Option<NodeId>,
    /// Target node; default: the next node with memory after `from`.
    pub to: Option<NodeId>,
    /// Grow the huge-page pools of both nodes through `numa::hugepages`
    /// when they have too few free pages (they stay grown).
    pub reserve: bool,
    /// One untimed round trip before the timed one.
    pub warmup: bool,
    /// Measure per-node placement of the clearing runner.
    pub locality: bool,
    /// Options of every move (rate limit, batch size).
    pub move_opts: MoveOptions,
}

impl BenchOptions {
    /// Every page size, reserving and warming up, default move options.
    pub fn new(size: u64) -> Self {
        Self {
            size,
            page_sizes: vec![PageSize::Base4K, PageSize::Huge2M, PageSize::Huge1G],
            from: None,
            to: None,
            reserve: true,
            warmup: true,
            locality: true,
            move_opts: MoveOptions::default(),
        }
    }
}

/// One timed move.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Leg {
    /// Source node.
    pub from: NodeId,
    /// Target node.
    pub to: NodeId,
    /// Pages moved.
    pub pages_moved: usize,
    /// Pages that did not move.
    pub pages_failed: usize,
    /// Bytes moved.
    pub bytes_moved: u64,
    /// Seconds of the move batches.
    pub seconds: f64,
    /// GB/s (10^9) moved.
    pub gb_per_s: f64,
    /// Failed pages by reason, most frequent first.
    pub failures: Vec<(String, usize)>,
}

impl Leg {
    fn new(from: NodeId, report: &MoveReport) -> Self {
        Self {
            from,
            to: report.target,
            pages_moved: report.pages_moved,
            pages_failed: report.pages_failed(),
            bytes_moved: report.bytes_moved,
            seconds: report.seconds,
            gb_per_s: report.gb_per_s,
            failures: report
                .failure_counts()
                .into_iter()
                .map(|(r, n)| (r.to_string(), n))
                .collect(),
        }
    }
}

/// Results of one page size.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SizeResult {
    /// `4K`, `2M` or `1G`.
    pub page_size: String,
    /// Bytes moved each way.
    pub bytes: u64,
    /// Pages.
    pub pages: usize,
    /// A → B.
    pub there: Option<Leg>,
    /// B → A.
    pub back: Option<Leg>,
    /// Both legs together: total bytes moved over total seconds, GB/s (not
    /// the mean of the two legs' rates, which overweights the faster leg).
    pub gb_per_s: Option<f64>,
    /// Whether every stamp survived both moves (`None`: not checked).
    pub data_intact: Option<bool>,
    /// Why this size was not measured.
    pub skipped: Option<String>,
    /// What went wrong while measuring it.
    pub error: Option<String>,
}

impl SizeResult {
    fn new(page_size: PageSize, bytes: u64) -> Self {
        Self {
            page_size: page_size.to_string(),
            bytes,
            pages: usize::try_from(bytes / page_size.bytes()).unwrap_or(usize::MAX),
            there: None,
            back: None,
            gb_per_s: None,
            data_intact: None,
            skipped: None,
            error: None,
        }
    }
}

/// Placement of the clearing runner's pages on one node.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeLocality {
    /// The node the region was bound to and the workers pinned to.
    pub node: NodeId,
    /// Page size the region got.
    pub page_size: Option<String>,
    /// Pages queried.
    pub pages: usize,
    /// Pages found on the node.
    pub on_node: usize,
    /// `on_node / pages`, percent.
    pub share_pct: f64,
    /// What went wrong, if anything.
    pub error: Option<String>,
}

/// The whole report, as `hugemem bench migrate --json` prints it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BenchReport {
    /// Bytes asked for per page size.
    pub size: u64,
    /// Nodes with memory.
    pub memory_nodes: Vec<NodeId>,
    /// Source node.
    pub from: Option<NodeId>,
    /// Target node.
    pub to: Option<NodeId>,
    /// One entry per page size.
    pub results: Vec<SizeResult>,
    /// 2 MiB throughput over 4 KiB throughput, when both ran.
    pub ratio_2m_over_4k: Option<f64>,
    /// 1 GiB throughput over 4 KiB throughput, when both ran.
    pub ratio_1g_over_4k: Option<f64>,
    /// Per-node placement of the clearing runner.
    pub locality: Vec<NodeLocality>,
    /// `/sys/kernel/mm/transparent_hugepage/shmem_enabled` (selected value).
    pub shmem_thp: Option<String>,
    /// Anything else worth knowing (pool growth, rounding).
    pub notes: Vec<String>,
}

impl BenchReport {
    /// Sizes that failed (not skipped) or lost data.
    pub fn failures(&self) -> Vec<String> {
        let mut out = Vec::new();
        for r in &self.results {
            if let Some(e) = &r.error {
                out.push(format!("{}: {e}", r.page_size));
            }
            if r.data_intact == Some(false) {
                out.push(format!("{}: data changed by the move", r.page_size));
            }
        }
        for l in &self.locality {
            if let Some(e) = &l.error {
                out.push(format!("locality node {}: {e}", l.node));
            }
        }
        out
    }

    /// Human-readable lines; `label` is appended to throughput lines (e.g.
    /// `(TCG emulation)`).
    pub fn lines(&self, label: &str) -> Vec<String> {
        let mut out = Vec::new();
        let route = match (self.from, self.to) {
            (Some(a), Some(b)) => format!("node {a} -> {b} -> {a}"),
            _ => "no second node".to_string(),
        };
        for r in &self.results {
            let mut line = format!("migrate {:>2} {} MiB {route}: ", r.page_size, r.bytes >> 20);
            match (&r.there, &r.back, &r.skipped, &r.error) {
                (_, _, Some(why), _) => line.push_str(&format!("skipped: {why}")),
                (_, _, _, Some(e)) => line.push_str(&format!("error: {e}")),
                (Some(t), Some(b), _, _) => {
                    line.push_str(&format!(
                        "{:.2} GB/s there ({} pages, {} failed), {:.2} GB/s back ({} failed); data {} {label}",
                        t.gb_per_s,
                        t.pages_moved,
                        t.pages_failed,
                        b.gb_per_s,
                        b.pages_failed,
                        match r.data_intact {
                            Some(true) => "intact",
                            Some(false) => "CHANGED",
                            None => "not checked",
                        }
                    ));
                }
                _ => line.push_str("no result"),
            }
            out.push(line.trim_end().to_string());
        }
        if let Some(x) = self.ratio_2m_over_4k {
            out.push(
                format!("2M / 4K throughput: {x:.2}x {label}")
                    .trim_end()
                    .to_string(),
            );
        }
        if let Some(x) = self.ratio_1g_over_4k {
            out.push(
                format!("1G / 4K throughput: {x:.2}x {label}")
                    .trim_end()
                    .to_string(),
            );
        }
        for l in &self.locality {
            match &l.error {
                Some(e) => out.push(format!("locality node {}: error: {e}", l.node)),
                None => out.push(format!(
                    "locality node {}: {} of {} {} pages on the node ({:.1}%)",
                    l.node,
                    l.on_node,
                    l.pages,
                    l.page_size.as_deref().unwrap_or("?"),
                    l.share_pct
                )),
            }
        }
        if let Some(s) = &self.shmem_thp {
            out.push(format!("shmem_enabled: {s}"));
        }
        out.extend(self.notes.iter().map(|n| format!("note: {n}")));
        out
    }
}

/// The selected value of a sysfs choice file (`always [never] advise` → `never`).
fn selected_choice(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let start = text.find('[')?;
    let end = text[start..].find(']')? + start;
    Some(text[start + 1..end].to_string())
}

/// Runs the benchmark: see the module docs. Never fails as a whole; what
/// could not run is said in the report.
pub fn run_bench(topology: &Topology, opts: &BenchOptions) -> BenchReport {
    let nodes = memory_nodes(topology);
    let from = opts.from.or_else(|| nodes.first().copied());
    let to = opts
        .to
        .or_else(|| nodes.iter().copied().find(|&n| Some(n) != from));
    let mut report = BenchReport {
        size: opts.size,
        memory_nodes: nodes.clone(),
        from,
        to,
        results: Vec::new(),
        ratio_2m_over_4k: None,
        ratio_1g_over_4k: None,
        locality: Vec::new(),
        shmem_thp: selected_choice(Path::new(
            "/sys/kernel/mm/transparent_hugepage/shmem_enabled",
        )),
        notes: Vec::new(),
    };
    for &page_size in &opts.page_sizes {
        let ps = page_size.bytes();
        let bytes = opts.size.max(1).div_ceil(ps) * ps;
        if bytes != opts.size {
            report.notes.push(format!(
                "{page_size}: {} bytes rounded up to {bytes} (whole pages)",
                opts.size
            ));
        }
        let mut result = SizeResult::new(page_size, bytes);
        match (from, to) {
            (Some(a), Some(b)) if a != b => measure(
                topology,
                opts,
                page_size,
                a,
                b,
                &mut result,
                &mut report.notes,
            ),
            _ => {
                result.skipped = Some(format!(
                    "needs two nodes with memory (this host has {nodes:?})"
                ))
            }
        }
        info!(page_size = %page_size, ?result, "bench migrate");
        report.results.push(result);
    }
    let rate = |name: &str| {
        report
            .results
            .iter()
            .find(|r| r.page_size == name)
            .and_then(|r| r.gb_per_s)
    };
    if let (Some(base), Some(m2)) = (rate("4K"), rate("2M")) {
        report.ratio_2m_over_4k = (base > 0.0).then(|| m2 / base);
    }
    if let (Some(base), Some(g1)) = (rate("4K"), rate("1G")) {
        report.ratio_1g_over_4k = (base > 0.0).then(|| g1 / base);
    }
    if opts.locality {
        for &node in &nodes {
            report.locality.push(locality(topology, node, opts.reserve));
        }
    }
    report
}

/// Makes sure `pages` of `page_size` are free on `node`; a note or the reason it cannot.
fn ensure_pool(
    page_size: PageSize,
    pages: u64,
    node: NodeId,
    reserve: bool,
) -> Result<Option<String>, String> {
    let free = guest_mem::PoolCounts::read(page_size, Some(node))
        .map_err(|e| e.to_string())?
        .map_or(0, |p| p.free);
    if free >= pages {
        return Ok(None);
    }
    if !reserve {
        return Err(format!(
            "node {node} has {free} free {page_size} pages, {pages} needed (reserving is off)"
        ));
    }
    let r = guest_mem::ensure_free(page_size, pages, Some(node)).map_err(|e| e.to_string())?;
    if !r.met {
        return Err(format!(
            "node {node} has {} free {page_size} pages after growing its pool, {pages} needed",
            r.free
        ));
    }
    Ok(Some(format!(
        "node {node} {page_size} pool grown to {} pages ({} free)",
        r.total, r.free
    )))
}

fn measure(
    topology: &Topology,
    opts: &BenchOptions,
    page_size: PageSize,
    a: NodeId,
    b: NodeId,
    result: &mut SizeResult,
    notes: &mut Vec<String>,
) {
    if page_size.is_huge() {
        for node in [a, b] {
            match ensure_pool(page_size, result.pages as u64, node, opts.reserve) {
                Ok(Some(note)) => notes.push(note),
                Ok(None) => {}
                Err(why) => {
                    result.skipped = Some(why);
                    return;
                }
            }
        }
    }
    let spec = RegionSpec::new(format!("bench-migrate-{page_size}"), result.bytes, Some(a))
        .with_policy(PagePolicy::Strict(page_size));
    let region = match Region::allocate(topology, &spec, &RunOptions::default()) {
        Ok((region, _)) => region,
        Err(e) => {
            result.error = Some(error_chain(&e));
            return;
        }
    };
    let seed = 0x6d69_6772_6174_6500 ^ page_size.bytes();
    // SAFETY: the region was just created by this function and is not
    // shared: no guest maps it, no scrubber or preparer runs on it, and no
    // other slice of it exists while this one lives (it ends with the call).
    pattern::write_slice(unsafe { region.as_mut_slice() }, seed);

    let round_trip = |timed: bool| -> Result<Option<(Leg, Leg)>, String> {
        let there = move_region(topology, &region, b, &opts.move_opts, None, None)
            .map_err(|e| error_chain(&e))?;
        let back = move_region(topology, &region, a, &opts.move_opts, None, None)
            .map_err(|e| error_chain(&e))?;
        Ok(timed.then(|| (Leg::new(a, &there), Leg::new(b, &back))))
    };
    if opts.warmup {
        let mut log = |line: &str| info!("{line}");
        let warm = rounds::warm_up(&mut log, "one round trip", || round_trip(false));
        if let Err(e) = warm {
            result.error = Some(format!("warm-up: {e}"));
            return;
        }
    }
    match round_trip(true) {
        Ok(Some((there, back))) => {
            result.gb_per_s = combined_gb_per_s(&there, &back);
            result.there = Some(there);
            result.back = Some(back);
        }
        Ok(None) => {}
        Err(e) => result.error = Some(e),
    }
    // SAFETY: as above; the moves have returned, and migration never
    // changes contents, so reading through our mapping is plain reading.
    let bad = pattern::check_slice(unsafe { region.as_slice() }, seed);
    result.data_intact = Some(bad.is_none());
    if let Some(off) = bad {
        result.error = Some(format!("stamp at offset {off:#x} changed"));
    }
}

fn locality(topology: &Topology, node: NodeId, reserve: bool) -> NodeLocality {
    let mut out = NodeLocality {
        node,
        page_size: None,
        pages: 0,
        on_node: 0,
        share_pct: 0.0,
        error: None,
    };
    let pages_2m = LOCALITY_BYTES / PageSize::Huge2M.bytes();
    if reserve {
        // Best effort: without 2 MiB pages the region falls back to 4 KiB.
        let _ = ensure_pool(PageSize::Huge2M, pages_2m, node, true);
    }
    let spec = RegionSpec::new(format!("bench-locality-{node}"), LOCALITY_BYTES, Some(node));
    let region = match Region::allocate(topology, &spec, &RunOptions::default()) {
        Ok((region, _)) => region,
        Err(e) => {
            out.error = Some(error_chain(&e));
            return out;
        }
    };
    out.page_size = Some(region.page_size().to_string());
    match region.verify_placement() {
        Ok(p) => {
            out.pages = p.pages;
            out.on_node = p.on_node;
            // Page counts are far below 2^53.
            #[allow(clippy::cast_precision_loss)]
            let share = if p.pages > 0 {
                100.0 * p.on_node as f64 / p.pages as f64
            } else {
                0.0
            };
            out.share_pct = share;
        }
        Err(e) => out.error = Some(error_chain(&e)),
    }
    out
}

/// GB/s (10^9) of both legs together: total bytes over total time.
fn combined_gb_per_s(there: &Leg, back: &Leg) -> Option<f64> {
    let seconds = there.seconds + back.seconds;
    (seconds > 0.0)
        .then(|| guest_mem::size::gb_per_s(there.bytes_moved + back.bytes_moved, seconds))
}

#[cfg(test)]
mod tests {
    #[test]
    fn both_legs_rate_is_total_bytes_over_total_time() {
        let leg = |bytes_moved, seconds| Leg {
            from: 0,
            to: 1,
            pages_moved: 1,
            pages_failed: 0,
            bytes_moved,
            seconds,
            gb_per_s: 0.0,
            failures: vec![],
        };
        // 1 GB in 1 s there, 1 GB in 3 s back: 2 GB in 4 s = 0.5 GB/s, where
        // the mean of the rates (1 and 0.333) would say 0.667.
        let r = combined_gb_per_s(&leg(1_000_000_000, 1.0), &leg(1_000_000_000, 3.0));
        assert!(r.is_some_and(|r| (r - 0.5).abs() < 1e-12), "{r:?}");
        assert_eq!(combined_gb_per_s(&leg(0, 0.0), &leg(0, 0.0)), None);
    }

    use super::*;

    #[test]
    fn reads_the_selected_choice() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("shmem_enabled");
        std::fs::write(&path, "always within_size advise [never] deny force\n").expect("write");
        assert_eq!(selected_choice(&path).as_deref(), Some("never"));
        std::fs::write(&path, "no brackets\n").expect("write");
        assert_eq!(selected_choice(&path), None);
        assert_eq!(selected_choice(&dir.path().join("absent")), None);
    }

    #[test]
    fn lines_say_what_ran() {
        let leg = |from, to, gb| Leg {
            from,
            to,
            pages_moved: 4,
            pages_failed: 0,
            bytes_moved: 8 << 20,
            seconds: 0.1,
            gb_per_s: gb,
            failures: vec![],
        };
        let mut r2m = SizeResult::new(PageSize::Huge2M, 8 << 20);
        r2m.there = Some(leg(0, 1, 3.0));
        r2m.back = Some(leg(1, 0, 3.0));
        r2m.gb_per_s = Some(3.0);
        r2m.data_intact = Some(true);
        let mut r1g = SizeResult::new(PageSize::Huge1G, 1 << 30);
        r1g.skipped = Some("node 1 has 0 free 1G pages".into());
        let report = BenchReport {
            size: 8 << 20,
            memory_nodes: vec![0, 1],
            from: Some(0),
            to: Some(1),
            results: vec![r2m, r1g],
            ratio_2m_over_4k: Some(3.0),
            ratio_1g_over_4k: None,
            locality: vec![NodeLocality {
                node: 0,
                page_size: Some("2M".into()),
                pages: 32,
                on_node: 32,
                share_pct: 100.0,
                error: None,
            }],
            shmem_thp: Some("never".into()),
            notes: vec![],
        };
        let lines = report.lines("(TCG emulation)");
        assert_eq!(
            lines,
            vec![
                "migrate 2M 8 MiB node 0 -> 1 -> 0: 3.00 GB/s there (4 pages, 0 failed), 3.00 GB/s back (0 failed); data intact (TCG emulation)",
                "migrate 1G 1024 MiB node 0 -> 1 -> 0: skipped: node 1 has 0 free 1G pages",
                "2M / 4K throughput: 3.00x (TCG emulation)",
                "locality node 0: 32 of 32 2M pages on the node (100.0%)",
                "shmem_enabled: never",
            ]
        );
        assert!(report.failures().is_empty());
        let json = serde_json::to_value(&report).expect("serialize");
        assert_eq!(json["results"][0]["there"]["gb_per_s"], 3.0);
        assert_eq!(json["results"][1]["skipped"], "node 1 has 0 free 1G pages");
    }
}
