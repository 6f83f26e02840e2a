//! Counters, the STATS JSON's counter part, and `hugemem status`'s report.
//!
//! # Design
//!
//! Counters are lock-free `AtomicU64`s with `Relaxed` ordering grouped in one
//! struct (as Firecracker's metrics): the scrubbers bump them from their own
//! threads without touching the pool lock. Gauges that describe the pool
//! (bytes per node, size and state) are not kept as counters at all: they
//! are computed from the pool's entries when asked, so they cannot drift
//! from the truth.
//!
//! The Prometheus endpoint that exports them is [`super::exporter`].

use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::Value;

use numa::NodeId;

/// Daemon-wide counters (monotonic unless noted).
#[derive(Debug, Default)]
pub struct Metrics {
    /// Connections accepted (and allowed).
    pub sessions_total: AtomicU64,
    /// Live sessions (gauge).
    pub sessions_active: AtomicU64,
    /// Connections refused by the uid check.
    pub peers_refused: AtomicU64,
    /// Connections closed because of a protocol or transport error
    /// (malformed frame, handshake timeout, reply not deliverable).
    pub connection_errors: AtomicU64,
    /// ALLOC requests that succeeded.
    pub allocs_ok: AtomicU64,
    /// ALLOC requests that failed.
    pub allocs_failed: AtomicU64,
    /// Regions handed out from the clean pool.
    pub regions_pooled: AtomicU64,
    /// Regions handed out after clearing a dirty pooled region on the ALLOC path.
    pub regions_recleared: AtomicU64,
    /// Regions handed out after growing a smaller clean pooled region.
    pub regions_grown: AtomicU64,
    /// ALLOC parts that `best` served on a smaller page size than the
    /// largest allowed because the larger pages did not exist (neither free
    /// nor pooled).
    pub downgrades: AtomicU64,
    /// Released regions found damaged by their tenant (file size changed,
    /// holes that cannot be filled) and given back to the kernel unscrubbed.
    pub regions_discarded: AtomicU64,
    /// Pages punched out of released regions and refaulted fresh before
    /// reuse (`pool.detach_pages`), so that no pin keeps a reused page.
    pub pages_detached: AtomicU64,
    /// Released regions found withheld: no process holds them, yet another
    /// open description of the file exists (an fd in flight). They stay
    /// quarantined and are re-checked; counted once per release.
    pub regions_withheld: AtomicU64,
    /// Region files of an earlier daemon instance found at start and unlinked.
    pub leftover_files_released: AtomicU64,
    /// Bytes those files held.
    pub leftover_bytes_released: AtomicU64,
    /// Regions created fresh from the kernel.
    pub regions_fresh: AtomicU64,
    /// FREE requests that succeeded.
    pub frees: AtomicU64,
    /// Bytes of regions created fresh.
    pub bytes_created: AtomicU64,
    /// Bytes of regions given back to the kernel.
    pub bytes_released: AtomicU64,
    /// Quarantine scans of `/proc`.
    pub quarantine_scans: AtomicU64,
}

impl Metrics {
    /// Adds `n` to a counter.
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Reads a counter.
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// Per-node scrubber counters.
#[derive(Debug)]
pub struct ScrubCounters {
    /// The node.
    pub node: NodeId,
    /// Scrubber threads.
    pub threads: usize,
    /// Bytes cleared.
    pub bytes: AtomicU64,
    /// Nanoseconds spent inside clearing kernels, summed over threads.
    pub nanos: AtomicU64,
    /// Kernel calls (batches).
    pub batches: AtomicU64,
}

impl ScrubCounters {
    /// New, zeroed.
    pub fn new(node: NodeId, threads: usize) -> Self {
        Self {
            node,
            threads,
            bytes: AtomicU64::new(0),
            nanos: AtomicU64::new(0),
            batches: AtomicU64::new(0),
        }
    }

    /// Bytes per second of clearing time, in GB/s (10^9).
    pub fn gb_per_s(&self) -> f64 {
        gb_per_s(Metrics::get(&self.bytes), Metrics::get(&self.nanos))
    }
}

/// GB/s (10^9) from bytes and nanoseconds; 0 without time.
pub fn gb_per_s(bytes: u64, nanos: u64) -> f64 {
    if nanos == 0 {
        return 0.0;
    }
    // Rates: precision loss above 2^53 is irrelevant.
    #[allow(clippy::cast_precision_loss)]
    let r = bytes as f64 / nanos as f64;
    r
}

/// `hugemem status` without `--json`: the STATS document as a short report.
pub fn render_status(stats: &Value) -> String {
    use crate::size::format_size;
    let u = |v: &Value, k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
    let f = |v: &Value, k: &str| v.get(k).and_then(Value::as_f64).unwrap_or(0.0);
    let null = Value::Null;
    let mut out = format!(
        "hugemem {} pid {}, up {:.0} s, socket {}\n",
        stats.get("version").and_then(Value::as_str).unwrap_or("?"),
        u(stats, "pid"),
        f(stats, "uptime_s"),
        stats.get("socket").and_then(Value::as_str).unwrap_or("?"),
    );
    let sessions = stats.get("sessions").unwrap_or(&null);
    let allocs = stats.get("allocations").unwrap_or(&null);
    out.push_str(&format!(
        "sessions: {} active, {} total, {} refused; allocations: {} active ({})\n\n",
        u(sessions, "active"),
        u(sessions, "total"),
        u(sessions, "refused"),
        u(allocs, "active"),
        format_size(u(allocs, "bytes")),
    ));
    out.push_str(&format!(
        "{:<5} {:<5} {:>9} {:>9} {:>12} {:>9} {:>9} {:>9}\n",
        "node", "size", "clean", "dirty", "quarantined", "in use", "target", "limit"
    ));
    let pools = stats
        .get("pools")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    if pools.is_empty() {
        out.push_str("(no regions)\n");
    }
    for p in &pools {
        out.push_str(&format!(
            "{:<5} {:<5} {:>9} {:>9} {:>12} {:>9} {:>9} {:>9}\n",
            u(p, "node"),
            p.get("page_size").and_then(Value::as_str).unwrap_or("?"),
            format_size(u(p, "clean_bytes")),
            format_size(u(p, "dirty_bytes")),
            format_size(u(p, "quarantined_bytes")),
            format_size(u(p, "in_use_bytes")),
            format_size(u(p, "target_bytes")),
            format_size(u(p, "limit_bytes")),
        ));
    }
    let scrub = stats.get("scrub").unwrap_or(&null);
    out.push_str(&format!(
        "\nscrub ({}): {} cleared in {:.3} s of clearing, {:.2} GB/s; {} pending\n",
        scrub.get("kernel").and_then(Value::as_str).unwrap_or("?"),
        format_size(u(scrub, "bytes")),
        f(scrub, "seconds"),
        f(scrub, "gb_per_s"),
        format_size(u(scrub, "pending_bytes")),
    ));
    for n in scrub
        .get("nodes")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
    {
        out.push_str(&format!(
            "  node {}: {} thread(s), {} cleared, {:.2} GB/s, {} pending\n",
            u(&n, "node"),
            u(&n, "threads"),
            format_size(u(&n, "bytes")),
            f(&n, "gb_per_s"),
            format_size(u(&n, "pending_bytes")),
        ));
    }
    let q = stats
        .get("quarantine")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    for r in &q {
        out.push_str(&format!(
            "quarantined: region {} ({}) for {:.1} s, held by pid {}\n",
            u(r, "region"),
            format_size(u(r, "bytes")),
            f(r, "seconds"),
            r.get("holder_pid")
                .and_then(Value::as_i64)
                .map_or_else(|| "-".to_string(), |p| p.to_string()),
        ));
    }
    for r in stats
        .get("regions")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|r| r.get("state").and_then(Value::as_str) != Some("in_use"))
    {
        out.push_str(&format!(
            "region {} ({}, {} pages, node {}): {}\n",
            u(r, "id"),
            format_size(u(r, "bytes")),
            r.get("page_size").and_then(Value::as_str).unwrap_or("?"),
            u(r, "node"),
            r.get("why").and_then(Value::as_str).unwrap_or("?"),
        ));
    }
    for r in stats
        .get("given_back")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .take(5)
    {
        out.push_str(&format!(
            "region {} ({}, {} pages, node {}), {:.0} s ago: {}\n",
            u(r, "region"),
            format_size(u(r, "bytes")),
            r.get("page_size").and_then(Value::as_str).unwrap_or("?"),
            u(r, "node"),
            f(r, "seconds_ago"),
            r.get("why").and_then(Value::as_str).unwrap_or("?"),
        ));
    }
    if let Some(refill) = stats
        .get("refill")
        .filter(|r| r["enabled"] == Value::Bool(true))
    {
        match refill.get("current").filter(|c| !c.is_null()) {
            Some(c) => out.push_str(&format!(
                "refill: making {} on {} pages for node {}: {} done\n",
                format_size(u(c, "bytes")),
                c.get("page_size").and_then(Value::as_str).unwrap_or("?"),
                u(c, "node"),
                format_size(u(c, "done_bytes")),
            )),
            None => out.push_str(&format!(
                "refill: idle; {} regions ({}) made ahead of demand, yielded to an ALLOC {} times\n",
                u(refill, "regions"),
                format_size(u(refill, "bytes")),
                u(refill, "yielded"),
            )),
        }
    }
    out.push_str(&super::rebalance::render_regions(stats));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_renders_pool_figures() {
        let stats = serde_json::json!({
            "pools": [{"node": 0, "page_size": "2M", "clean_bytes": 4194304, "dirty_bytes": 0,
                       "quarantined_bytes": 0, "in_use_bytes": 2097152,
                       "regions": {"clean": 1, "dirty": 0, "quarantined": 0, "in_use": 1}}],
            "counters": {"allocs_ok": 3, "sessions_active": 1},
            "scrub": {"nodes": [{"node": 0, "bytes": 10, "seconds": 0.5, "pending_bytes": 0}]},
            "sessions": {"active": 1, "total": 2}
        });
        let table = render_status(&stats);
        assert!(table.contains("2M"), "{table}");
        assert!(table.contains("4M"), "{table}");
    }

    #[test]
    fn status_says_why_each_region_is_where_it_is() {
        let stats = serde_json::json!({
            "regions": [
                {"id": 3, "node": 0, "page_size": "1G", "bytes": 2147483648u64, "state": "quarantined",
                 "why": "quarantined: pid 1234 maps it (at 0x7f0000000000)"},
                {"id": 4, "node": 0, "page_size": "2M", "bytes": 4194304, "state": "in_use",
                 "why": "in use: allocation 9"}
            ],
            "given_back": [{"region": 2, "node": 0, "page_size": "4K", "bytes": 1048576,
                            "why": "given back: over the 4K limit (0 bytes)", "seconds_ago": 1.0}],
            "refill": {"enabled": true, "current": {"node": 0, "page_size": "1G",
                       "bytes": 2147483648u64, "done_bytes": 1073741824u64},
                       "regions": 0, "bytes": 0, "yielded": 0}
        });
        let table = render_status(&stats);
        assert!(
            table.contains("region 3 (2G, 1G pages, node 0): quarantined: pid 1234 maps it"),
            "{table}"
        );
        assert!(
            !table.contains("in use: allocation 9"),
            "in-use regions have their own table: {table}"
        );
        assert!(
            table.contains(
                "region 2 (1M, 4K pages, node 0), 1 s ago: given back: over the 4K limit"
            ),
            "{table}"
        );
        assert!(
            table.contains("refill: making 2G on 1G pages for node 0: 1G done"),
            "{table}"
        );
    }
}
