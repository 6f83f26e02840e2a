//! `hugemem status` without `--json`: the STATS document rendered for an
//! operator (pools, scrub, quarantine with reasons, what was given back,
//! refill progress, and one line per in-use region with its placement).
//! Only reads the JSON: no daemon internals.

use hugemem_client::stats::Stats;

/// One line per parked VM.
fn render_parked(stats: &Stats, out: &mut String) {
    use guest_mem::size::format_size;
    for p in &stats.parked {
        let clones = match p.shared_clones {
            0 => String::new(),
            n => format!(
                "; the template of {n} running shared clone(s), which wrote {}",
                format_size(p.shared_clone_written_bytes)
            ),
        };
        let vmm = p
            .vmm
            .as_deref()
            .map(|v| format!(", {v}"))
            .unwrap_or_default();
        let filling = match p.copy_clones_filling {
            0 => String::new(),
            n => format!("; {n} copy clone(s) still being filled from it"),
        };
        out.push_str(&format!(
            "parked: {} (uid {}{vmm}): {} in {} slot(s) on {} pages, allocation {}, {}{clones}{filling}\n",
            p.name,
            p.uid,
            format_size(p.bytes),
            p.slots,
            format_size(p.page_size),
            p.alloc,
            if p.copied_bytes == 0 {
                "moved from its launch".to_string()
            } else {
                format!("{} copied in", format_size(p.copied_bytes))
            },
        ));
    }
}

/// One line per parked VM a daemon start could not bring back.
fn render_lost(stats: &Stats, out: &mut String) {
    use guest_mem::size::format_size;
    use hugemem_client::stats::utc_date;
    for l in &stats.lost_parked {
        out.push_str(&format!(
            "lost: {} (uid {}): {}, parked {}, gone at the start of {}: {} (`hugemem unpark {}` clears this)\n",
            l.name,
            l.uid,
            format_size(l.bytes),
            utc_date(l.parked_at),
            utc_date(l.lost_at),
            l.reason,
            l.name,
        ));
    }
}

/// `hugemem status` without `--json`: the STATS document as a short report.
pub fn render_status(stats: &Stats) -> String {
    use guest_mem::size::format_size;
    let mut out = format!(
        "hugemem {} pid {}, up {:.0} s, socket {}\n",
        stats.version,
        stats.pid,
        stats.uptime_s,
        stats.socket.as_deref().unwrap_or("?"),
    );
    let sessions = &stats.sessions;
    let allocs = &stats.allocations;
    out.push_str(&format!(
        "sessions: {} active, {} total, {} refused; allocations: {} active ({})\n\n",
        sessions.active,
        sessions.total,
        sessions.refused,
        allocs.active,
        format_size(allocs.bytes),
    ));
    out.push_str(&format!(
        "{:<5} {:<5} {:>9} {:>9} {:>12} {:>9} {:>9} {:>9}\n",
        "node", "size", "clean", "dirty", "quarantined", "in use", "target", "limit"
    ));
    if stats.pools.is_empty() {
        out.push_str("(no regions)\n");
    }
    for p in &stats.pools {
        out.push_str(&format!(
            "{:<5} {:<5} {:>9} {:>9} {:>12} {:>9} {:>9} {:>9}\n",
            p.node,
            p.page_size,
            format_size(p.clean_bytes),
            format_size(p.dirty_bytes),
            format_size(p.quarantined_bytes),
            format_size(p.in_use_bytes),
            format_size(p.target_bytes),
            format_size(p.limit_bytes),
        ));
    }
    let scrub = &stats.scrub;
    out.push_str(&format!(
        "\nscrub ({}): {} cleared in {:.3} s of clearing, {:.2} GB/s; {} pending\n",
        if scrub.kernel.is_empty() {
            "?"
        } else {
            &scrub.kernel
        },
        format_size(scrub.bytes),
        scrub.seconds,
        scrub.gb_per_s,
        format_size(scrub.pending_bytes),
    ));
    for n in &scrub.nodes {
        out.push_str(&format!(
            "  node {}: {} thread(s), {} cleared, {:.2} GB/s, {} pending\n",
            n.node,
            n.threads,
            format_size(n.bytes),
            n.gb_per_s,
            format_size(n.pending_bytes),
        ));
    }
    render_parked(stats, &mut out);
    render_lost(stats, &mut out);
    for r in stats.quarantine.iter().flatten() {
        out.push_str(&format!(
            "quarantined: region {} ({}) for {:.1} s, held by pid {}\n",
            r.region,
            format_size(r.bytes),
            r.seconds,
            r.holder_pid
                .map_or_else(|| "-".to_string(), |p| p.to_string()),
        ));
    }
    for r in stats
        .regions
        .iter()
        .flatten()
        .filter(|r| r.state != "in_use")
    {
        out.push_str(&format!(
            "region {} ({}, {} pages, node {}): {}\n",
            r.id,
            format_size(r.bytes),
            r.page_size,
            r.node,
            r.why,
        ));
    }
    for r in stats.given_back.iter().flatten().take(5) {
        out.push_str(&format!(
            "region {} ({}, {} pages, node {}), {:.0} s ago: {}\n",
            r.region,
            format_size(r.bytes),
            r.page_size,
            r.node,
            r.seconds_ago,
            r.why,
        ));
    }
    if let Some(refill) = stats.refill.as_ref().filter(|r| r.enabled) {
        match &refill.current {
            Some(c) => out.push_str(&format!(
                "refill: making {} on {} pages for node {}: {} done\n",
                format_size(c.bytes),
                c.page_size,
                c.node,
                format_size(c.done_bytes),
            )),
            None => out.push_str(&format!(
                "refill: idle; {} regions ({}) made ahead of demand, yielded to an ALLOC {} times\n",
                refill.regions,
                format_size(refill.bytes),
                refill.yielded,
            )),
        }
    }
    out.push_str(&render_regions(stats));
    out
}

/// The in-use part of `hugemem status`: one line per region with its
/// placement (from the STATS `regions` list).
pub fn render_regions(stats: &Stats) -> String {
    use guest_mem::size::format_size;
    let regions: Vec<_> = stats
        .regions
        .iter()
        .flatten()
        .filter(|r| r.alloc_id.is_some())
        .collect();
    if regions.is_empty() {
        return String::new();
    }
    let mut out = format!(
        "\n{:<7} {:<6} {:>9} {:<5} {:<5} placement\n",
        "region", "alloc", "size", "page", "node"
    );
    for r in regions {
        let placement = match &r.placement {
            Some(Some(p)) if !p.is_empty() => p
                .iter()
                .map(|(n, c)| format!("node {n}: {c}"))
                .collect::<Vec<_>>()
                .join(", "),
            Some(Some(_)) => "no page present".to_string(),
            _ => r
                .placement_error
                .as_ref()
                .map_or_else(|| "?".to_string(), |e| format!("unknown: {e}")),
        };
        let mut extra = String::new();
        let np = r.not_present.unwrap_or(0);
        if np > 0 {
            extra.push_str(&format!(", {np} not present"));
        }
        if r.split == Some(true) {
            extra.push_str(" (split)");
        }
        if r.moving == Some(true) {
            extra.push_str(" (moving)");
        }
        out.push_str(&format!(
            "{:<7} {:<6} {:>9} {:<5} {:<5} {placement}{extra}\n",
            r.id,
            r.alloc_id.unwrap_or(0),
            format_size(r.bytes),
            r.page_size,
            r.bound_node
                .flatten()
                .map_or_else(|| "-".to_string(), |n| n.to_string()),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn typed(v: serde_json::Value) -> Stats {
        serde_json::from_value(v).expect("a partial STATS document reads")
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
        let table = render_status(&typed(stats));
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
    fn status_lists_parked_vms_with_their_vmm_when_the_daemon_names_it() {
        let stats = json!({
            "parked": [
                {"uid": 1000, "name": "web1", "alloc": 7, "bytes": 8u64 << 30, "copied_bytes": 0,
                 "slots": 2, "page_size": 1u64 << 30, "parked_at": 0, "vmm": "qemu"},
                {"uid": 0, "name": "db", "alloc": 9, "bytes": 1u64 << 30, "copied_bytes": 1u64 << 29,
                 "slots": 1, "page_size": 2u64 << 20, "parked_at": 0}
            ]
        });
        let table = render_status(&typed(stats));
        assert!(
            table.contains("parked: web1 (uid 1000, qemu): 8G in 2 slot(s) on 1G pages, allocation 7, moved from its launch"),
            "{table}"
        );
        assert!(
            table.contains(
                "parked: db (uid 0): 1G in 1 slot(s) on 2M pages, allocation 9, 512M copied in"
            ),
            "{table}"
        );
    }

    #[test]
    fn status_says_which_parked_vms_were_lost() {
        let stats = json!({
            "lost_parked": [
                {"uid": 1000, "name": "web1", "bytes": 8u64 << 30, "parked_at": 0,
                 "lost_at": 86_400, "reason": "the daemon started afresh"}
            ]
        });
        let table = render_status(&typed(stats));
        assert!(
            table.contains("lost: web1 (uid 1000): 8G, parked 1970-01-01 00:00:00 UTC, gone at the start of 1970-01-02 00:00:00 UTC: the daemon started afresh (`hugemem unpark web1` clears this)"),
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
        let text = render_regions(&typed(stats));
        assert!(text.contains("node 0: 4, node 1: 4 (split)"), "{text}");
        assert!(
            !text.contains("\n4 "),
            "pooled regions are not listed: {text}"
        );
        assert_eq!(render_regions(&typed(json!({}))), "");
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
        let table = render_status(&typed(stats));
        assert!(table.contains("2M"), "{table}");
        assert!(table.contains("4M"), "{table}");
    }
}
