//! `hugemem status` without `--json`: the STATS document rendered for an
//! operator (pools, scrub, quarantine with reasons, what was given back,
//! refill progress, and one line per in-use region with its placement).
//! Only reads the JSON: no daemon internals.

use serde_json::Value;

/// `hugemem status` without `--json`: the STATS document as a short report.
pub fn render_status(stats: &Value) -> String {
    use guest_mem::size::format_size;
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
    out.push_str(&render_regions(stats));
    out
}

/// The in-use part of `hugemem status`: one line per region with its
/// placement (from the STATS `regions` list).
pub fn render_regions(stats: &Value) -> String {
    use guest_mem::size::format_size;
    let regions: Vec<&Value> = stats
        .get("regions")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter(|r| r.get("alloc_id").is_some()).collect())
        .unwrap_or_default();
    if regions.is_empty() {
        return String::new();
    }
    let u = |v: &Value, k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
    let mut out = format!(
        "\n{:<7} {:<6} {:>9} {:<5} {:<5} placement\n",
        "region", "alloc", "size", "page", "node"
    );
    for r in regions {
        let placement = match r.get("placement").and_then(Value::as_object) {
            Some(p) if !p.is_empty() => p
                .iter()
                .map(|(n, c)| format!("node {n}: {}", c.as_u64().unwrap_or(0)))
                .collect::<Vec<_>>()
                .join(", "),
            Some(_) => "no page present".to_string(),
            None => r
                .get("placement_error")
                .and_then(Value::as_str)
                .map_or_else(|| "?".to_string(), |e| format!("unknown: {e}")),
        };
        let mut extra = String::new();
        let np = u(r, "not_present");
        if np > 0 {
            extra.push_str(&format!(", {np} not present"));
        }
        if r.get("split").and_then(Value::as_bool) == Some(true) {
            extra.push_str(" (split)");
        }
        if r.get("moving").and_then(Value::as_bool) == Some(true) {
            extra.push_str(" (moving)");
        }
        out.push_str(&format!(
            "{:<7} {:<6} {:>9} {:<5} {:<5} {placement}{extra}\n",
            u(r, "id"),
            u(r, "alloc_id"),
            format_size(u(r, "bytes")),
            r.get("page_size").and_then(Value::as_str).unwrap_or("?"),
            r.get("bound_node")
                .and_then(Value::as_u64)
                .map_or_else(|| "-".to_string(), |n| n.to_string()),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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

    #[test]
    fn status_lines_show_placement() {
        let stats = json!({
            "regions": [
                {"id": 3, "alloc_id": 1, "bytes": 16u64 << 20, "page_size": "2M", "bound_node": 0,
                 "placement": {"0": 4, "1": 4}, "not_present": 0, "split": true, "moving": false},
                {"id": 4, "bytes": 2u64 << 20, "page_size": "2M", "state": "clean"},
            ]
        });
        let text = render_regions(&stats);
        assert!(text.contains("node 0: 4, node 1: 4 (split)"), "{text}");
        assert!(
            !text.contains("\n4 "),
            "pooled regions are not listed: {text}"
        );
        assert_eq!(render_regions(&json!({})), "");
    }

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
}
