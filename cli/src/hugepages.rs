//! `hugemem hugepages`: reserve 1 GiB and 2 MiB huge pages (host-wide or on
//! one node) and mount hugetlbfs, with a report of what the kernel gave.
//!
//! The work is [`numa::HugePages`] (sysfs and the `mount` syscall); this module
//! runs it for the command line and renders the report as a table or JSON.
//! Exit status: 0 when every request was met, [`EXIT_FEWER`] (3) when the
//! kernel gave fewer pages than asked, 2 on bad usage (a wrong node id), 1
//! on any other error (not root, sysfs unreadable).
//!
//! [`EXIT_FEWER`]: crate::hugepages::EXIT_FEWER

use std::fmt::Write as _;
use std::path::PathBuf;

use numa::hugepages::size_label;
use numa::{
    HugePages, HugePagesError, MountReport, NodeId, PoolReport, ReserveMode, HUGE_PAGE_1G,
    HUGE_PAGE_2M,
};
use serde::Serialize;

/// Exit status when the kernel gave fewer pages than asked.
pub const EXIT_FEWER: i32 = 3;

/// What to reserve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HugepagesConfig {
    /// 1 GiB pages wanted (`None`: leave that pool alone).
    pub one_g: Option<u64>,
    /// 2 MiB pages wanted.
    pub two_m: Option<u64>,
    /// Reserve on this node only (`None`: host-wide).
    pub node: Option<NodeId>,
    /// What the counts mean.
    pub mode: ReserveMode,
    /// Mount hugetlbfs under this directory (`None`: do not mount).
    pub mount_root: Option<PathBuf>,
}

/// Errors of `hugemem hugepages`.
#[derive(Debug, thiserror::Error)]
pub enum HugepagesCmdError {
    /// `--free`/`--exact` without a count.
    #[error("--{0} needs --1g and/or --2m")]
    NoCount(&'static str),
    /// Reading, writing or mounting failed.
    #[error(transparent)]
    Pages(#[from] HugePagesError),
}

impl HugepagesCmdError {
    /// The exit status for this error: 2 for bad usage (no count, wrong
    /// node), 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::NoCount(_) | Self::Pages(HugePagesError::NoSuchNode { .. }) => 2,
            Self::Pages(_) => 1,
        }
    }
}

/// One node's share of a pool.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct NodeJson {
    /// The node.
    pub node: NodeId,
    /// `nr_hugepages`.
    pub total: u64,
    /// `free_hugepages`.
    pub free: u64,
    /// `surplus_hugepages`.
    pub surplus: u64,
}

/// One pool in the report.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct PoolJson {
    /// `1G` or `2M`.
    pub size: String,
    /// Page size in kB, as sysfs names the pool.
    pub page_kb: u64,
    /// The node asked for; `null` for host-wide.
    pub node: Option<NodeId>,
    /// `total`, `free` or `exact` (`shown` when nothing was asked).
    pub mode: String,
    /// Pages asked for.
    pub requested: u64,
    /// Pool size before.
    pub total_before: u64,
    /// Pool size after.
    pub total: u64,
    /// Free pages after.
    pub free: u64,
    /// Host-wide `resv_hugepages` after.
    pub reserved: u64,
    /// `free - reserved` after.
    pub available: u64,
    /// Surplus pages after.
    pub surplus: u64,
    /// Pages missing to meet the request.
    pub shortfall: u64,
    /// Whether memory was compacted because the first write fell short.
    pub compacted: bool,
    /// Whether the request was met.
    pub met: bool,
    /// Every node's share of this page size.
    pub nodes: Vec<NodeJson>,
}

/// One hugetlbfs mount point in the report.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct MountJson {
    /// `1G` or `2M`.
    pub size: String,
    /// The mount point.
    pub path: PathBuf,
    /// `mounted` or `already mounted`.
    pub state: String,
}

/// What `hugemem hugepages` did (the `--json` output).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct HugepagesReport {
    /// The pools, 1 GiB first.
    pub pools: Vec<PoolJson>,
    /// The hugetlbfs mounts.
    pub mounts: Vec<MountJson>,
    /// True when every request was met.
    pub all_met: bool,
}

impl PoolJson {
    fn from_report(r: &PoolReport, shown: bool) -> Self {
        Self {
            size: size_label(r.page_size),
            page_kb: r.page_size / 1024,
            node: r.node,
            mode: if shown { "shown" } else { r.mode.as_str() }.to_owned(),
            requested: r.requested,
            total_before: r.total_before,
            total: r.after.total,
            free: r.after.free,
            reserved: r.after.reserved,
            available: r.after.available(),
            surplus: r.after.surplus,
            shortfall: r.shortfall(),
            compacted: r.compacted,
            met: r.met,
            nodes: r
                .nodes
                .iter()
                .map(|n| NodeJson {
                    node: n.node,
                    total: n.total,
                    free: n.free,
                    surplus: n.surplus,
                })
                .collect(),
        }
    }
}

impl From<&MountReport> for MountJson {
    fn from(m: &MountReport) -> Self {
        Self {
            size: size_label(m.page_size),
            path: m.path.clone(),
            state: m.state.as_str().to_owned(),
        }
    }
}

/// Reserves what `cfg` asks on the host's pools (1 GiB first), then mounts
/// hugetlbfs. Without a count, both pools are only shown (nothing written).
///
/// # Errors
///
/// [`HugepagesCmdError`]; fewer pages than asked is not an error (see
/// [`HugepagesReport::exit_code`]).
pub fn run(cfg: &HugepagesConfig) -> Result<HugepagesReport, HugepagesCmdError> {
    run_on(&HugePages::host(), cfg)
}

/// [`run`] on any [`HugePages`].
///
/// # Errors
///
/// As [`run`].
pub fn run_on(
    pools: &HugePages,
    cfg: &HugepagesConfig,
) -> Result<HugepagesReport, HugepagesCmdError> {
    let requests: Vec<(u64, u64)> = [(HUGE_PAGE_1G, cfg.one_g), (HUGE_PAGE_2M, cfg.two_m)]
        .into_iter()
        .filter_map(|(size, count)| count.map(|c| (size, c)))
        .collect();
    let mut out = Vec::new();
    if requests.is_empty() {
        match cfg.mode {
            ReserveMode::Free => return Err(HugepagesCmdError::NoCount("free")),
            ReserveMode::Exact => return Err(HugepagesCmdError::NoCount("exact")),
            ReserveMode::Total => {}
        }
        // A floor of 0 never writes: this only reads both pools.
        for size in [HUGE_PAGE_1G, HUGE_PAGE_2M] {
            match pools.reserve(size, 0, cfg.node, ReserveMode::Total) {
                Ok(r) => out.push(PoolJson::from_report(&r, true)),
                Err(HugePagesError::NoPool { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
    } else {
        for r in pools.reserve_all(&requests, cfg.node, cfg.mode)? {
            out.push(PoolJson::from_report(&r, false));
        }
    }
    let mut mounts = Vec::new();
    if let Some(root) = &cfg.mount_root {
        for size in [HUGE_PAGE_1G, HUGE_PAGE_2M] {
            mounts.push(MountJson::from(&pools.mount_hugetlbfs(size, root)?));
        }
    }
    Ok(HugepagesReport {
        all_met: out.iter().all(|p| p.met),
        pools: out,
        mounts,
    })
}

impl HugepagesReport {
    /// 0 when every request was met, [`EXIT_FEWER`] otherwise.
    pub fn exit_code(&self) -> i32 {
        if self.all_met {
            0
        } else {
            EXIT_FEWER
        }
    }

    /// The human-readable report.
    pub fn to_table(&self) -> String {
        let mut t = String::new();
        let _ = writeln!(
            t,
            "{:<5} {:<7} {:>14} {:>7} {:>7} {:>9} {:>7}  result",
            "pages", "where", "asked", "total", "free", "available", "surplus"
        );
        for p in &self.pools {
            let place = p
                .node
                .map_or_else(|| "host".to_owned(), |n| format!("node {n}"));
            let asked = if p.mode == "shown" {
                "-".to_owned()
            } else {
                format!("{} {}", p.requested, p.mode)
            };
            let result = match (p.mode.as_str(), p.met) {
                ("shown", _) => String::new(),
                (_, true) if p.total == p.total_before => "met (unchanged)".to_owned(),
                (_, true) => format!("met (pool {} -> {})", p.total_before, p.total),
                (_, false) if p.shortfall == 0 => {
                    format!("{} pages in use stay (surplus)", p.total - p.requested)
                }
                (_, false) => format!(
                    "FEWER THAN ASKED: {} short{}",
                    p.shortfall,
                    if p.compacted {
                        " after compacting memory"
                    } else {
                        ""
                    }
                ),
            };
            let _ = writeln!(
                t,
                "{:<5} {:<7} {:>14} {:>7} {:>7} {:>9} {:>7}  {}",
                p.size, place, asked, p.total, p.free, p.available, p.surplus, result
            );
            if p.nodes.len() > 1 || (p.node.is_none() && !p.nodes.is_empty()) {
                let per_node: Vec<String> = p
                    .nodes
                    .iter()
                    .map(|n| format!("node {} {} total/{} free", n.node, n.total, n.free))
                    .collect();
                let _ = writeln!(t, "      per node: {}", per_node.join(", "));
            }
        }
        if !self.all_met {
            let _ = writeln!(
                t,
                "the kernel could not find enough (contiguous) free memory; reserve at boot or \
                 earlier, before memory fragments (docs/operations.md)"
            );
        }
        for m in &self.mounts {
            let _ = writeln!(
                t,
                "hugetlbfs {}: {} ({})",
                m.size,
                m.path.display(),
                m.state
            );
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(mode: &str, requested: u64, total: u64, met: bool, shortfall: u64) -> PoolJson {
        PoolJson {
            size: "1G".to_owned(),
            page_kb: 1 << 20,
            node: Some(1),
            mode: mode.to_owned(),
            requested,
            total_before: 0,
            total,
            free: total,
            reserved: 0,
            available: total,
            surplus: 0,
            shortfall,
            compacted: true,
            met,
            nodes: vec![
                NodeJson {
                    node: 0,
                    total: 0,
                    free: 0,
                    surplus: 0,
                },
                NodeJson {
                    node: 1,
                    total,
                    free: total,
                    surplus: 0,
                },
            ],
        }
    }

    #[test]
    fn fewer_pages_exit_3_and_say_so_per_node() {
        let report = HugepagesReport {
            pools: vec![pool("total", 8, 5, false, 3)],
            mounts: vec![],
            all_met: false,
        };
        assert_eq!(report.exit_code(), EXIT_FEWER);
        let table = report.to_table();
        assert!(
            table.contains("FEWER THAN ASKED: 3 short after compacting memory"),
            "{table}"
        );
        assert!(
            table.contains("node 0 0 total/0 free, node 1 5 total/5 free"),
            "{table}"
        );
        let json = serde_json::to_value(&report).expect("json");
        assert_eq!(json["pools"][0]["shortfall"], 3);
        assert_eq!(json["pools"][0]["nodes"][1]["total"], 5);
        assert_eq!(json["all_met"], false);
    }

    #[test]
    fn met_requests_exit_0() {
        let report = HugepagesReport {
            pools: vec![pool("total", 5, 5, true, 0)],
            mounts: vec![],
            all_met: true,
        };
        assert_eq!(report.exit_code(), 0);
        assert!(report.to_table().contains("met (pool 0 -> 5)"));
    }

    #[test]
    fn usage_errors_exit_2() {
        let no_count = HugepagesConfig {
            one_g: None,
            two_m: None,
            node: None,
            mode: ReserveMode::Exact,
            mount_root: None,
        };
        let e = run(&no_count).expect_err("exact without a count");
        assert_eq!(
            (e.exit_code(), e.to_string().as_str()),
            (2, "--exact needs --1g and/or --2m")
        );
        let e = HugepagesCmdError::from(HugePagesError::NoSuchNode {
            node: 9,
            available: vec![0],
        });
        assert_eq!(e.exit_code(), 2);
    }
}
