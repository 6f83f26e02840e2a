//! The table of `hugemem bench alloc`: every way to get a VM's RAM ready,
//! what each pooled hand-out held, and the limits measured in the same run.

use serde_json::Value;

use super::cells::{f, note, num, s, size};
use crate::report::fixed;

/// "resident 2G, holes 0" of a hand-out object at `path`, or "-".
fn held(v: &Value, path: &str) -> String {
    match v.get(path) {
        Some(h) if h.get("hole_bytes").is_some() => format!(
            "resident {}, holes {}",
            size(h, "resident_bytes"),
            size(h, "hole_bytes")
        ),
        _ => "-".into(),
    }
}

pub(super) fn alloc(v: &Value) -> String {
    let mut out = format!(
        "{} on {} pages ({} asked), best / median of {} repetitions, {} CPUs, {} node(s).{}\n\n",
        size(v, "size_bytes"),
        s(v, "page_size"),
        size(v, "requested_size_bytes"),
        f(v, "reps", 0),
        f(v, "cpus", 0),
        f(v, "nodes", 0),
        note(v, "note")
    );
    let gb = num(v, "size_bytes").unwrap_or(0.0) / 1e9;
    let rate = |key: &str| {
        num(v, key)
            .filter(|b| *b > 0.0)
            .map_or_else(|| "-".into(), |b| fixed(gb / b, 1))
    };
    out += "| variant (clock stops with the memory mapped and ready for the VMM; \"touched\": every page written once, 1 thread) | best s | median s | GB/s (best) | handed out |\n|---|---|---|---|---|\n";
    let mut row = |label: String, key: &str, rate: String, held: String| {
        out += &format!(
            "| {label} | {} | {} | {rate} | {held} |\n",
            f(v, key, 5),
            f(v, &format!("medians.{key}"), 5),
        );
    };
    let hand_out = "(a hand-out)".to_string();
    let fresh = "fresh pages".to_string();
    row(
        "fresh, daemon-less (`Region::allocate`)".into(),
        "fresh_eager_s",
        rate("fresh_eager_s"),
        fresh.clone(),
    );
    row(
        "fresh, through the daemon".into(),
        "fresh_eager_daemon_s",
        rate("fresh_eager_daemon_s"),
        fresh.clone(),
    );
    row(
        format!(
            "cloud-hypervisor-style prefault (threads: {})",
            f(v, "cloud_hypervisor_style_threads", 0)
        ),
        "cloud_hypervisor_style_s",
        rate("cloud_hypervisor_style_s"),
        fresh,
    );
    row(
        "from the pool, the ALLOC right after clean (daemon defaults)".into(),
        "pooled_eager_s",
        hand_out.clone(),
        held(v, "pooled_eager"),
    );
    row(
        "**from the pool, resident** (refaulted before the ALLOC)".into(),
        "pooled_resident_s",
        hand_out.clone(),
        held(v, "pooled_resident"),
    );
    row(
        "… resident, every page touched".into(),
        "pooled_resident_touched_s",
        "(nothing zeroed)".into(),
        String::new(),
    );
    row(
        "from the pool, with holes (`pool.refault_ahead = false`)".into(),
        "pooled_holes_s",
        hand_out,
        held(v, "pooled_holes"),
    );
    row(
        "… with holes, every page touched (the kernel zeroes each hole)".into(),
        "pooled_holes_touched_s",
        rate("pooled_holes_touched_s"),
        String::new(),
    );
    row(
        format!(
            "the pool's price, after the FREE: FREE → clean (background; {} CPU-s per GiB; with `pool.detach_pages`, clean = punched holes, refaulted after)",
            f(v, "scrub_cpu_s_per_gib", 3)
        ),
        "free_to_clean_s",
        "-".into(),
        String::new(),
    );
    out += &limits(v);
    out += &ratios(v);
    out += &scaling(v);
    out
}

/// The limits table, where the run measured them.
fn limits(v: &Value) -> String {
    if v.get("limits").is_none() {
        return String::new();
    }
    format!(
        "\n| limit, same run | s | GB/s |\n|---|---|---|\n\
         | the kernel's fault-time zeroing, {} thread (fresh populate, node-local worker) | {} | {} |\n\
         | the kernel's fault-time zeroing, {} CPUs | {} | {} |\n\
         | memory bandwidth: populated pages cleared with `{}` stores, all CPUs | - | {} |\n",
        f(v, "limits.touch_threads", 0),
        f(v, "limits.kernel_zeroing_touch_threads_s", 5),
        f(v, "limits.kernel_zeroing_touch_threads_gbps", 2),
        f(v, "limits.all_cpus", 0),
        f(v, "limits.kernel_zeroing_all_cpus_s", 5),
        f(v, "limits.kernel_zeroing_all_cpus_gbps", 2),
        s(v, "limits.memory_bandwidth_kernel"),
        f(v, "limits.memory_bandwidth_gbps", 2),
    )
}

/// The scaling run's table, where there is one.
fn scaling(v: &Value) -> String {
    let Some(points) = v
        .get("scaling")
        .and_then(Value::as_array)
        .filter(|p| !p.is_empty())
    else {
        return String::new();
    };
    let mut out = "\n| fresh populate, node-local workers | best s | median s | GB/s | speedup |\n|---|---|---|---|---|\n".to_string();
    for p in points {
        out += &format!(
            "| {} | {} | {} | {} | {}x |\n",
            f(p, "threads", 0),
            f(p, "best_s", 3),
            f(p, "median_s", 3),
            f(p, "gbps", 2),
            f(p, "speedup", 2)
        );
    }
    out
}

/// The ratios table.
fn ratios(v: &Value) -> String {
    let mut out = String::new();
    out += "\n| ratio of best times (same run) | value |\n|---|---|\n";
    for (label, key) in [
        (
            "cloud-hypervisor style / fresh daemon-less",
            "cloud_hypervisor_style_over_fresh_eager",
        ),
        (
            "fresh via the daemon / fresh daemon-less",
            "fresh_eager_daemon_over_fresh_eager",
        ),
        (
            "fresh daemon-less / kernel zeroing, all CPUs (limit 1.00)",
            "fresh_eager_over_kernel_zeroing",
        ),
        (
            "cloud-hypervisor style / kernel zeroing with its threads (limit 1.00)",
            "cloud_hypervisor_style_over_kernel_zeroing",
        ),
        (
            "fresh via the daemon / pooled resident",
            "fresh_eager_daemon_over_pooled_resident",
        ),
        (
            "fresh via the daemon / pooled right after clean",
            "fresh_eager_daemon_over_pooled_eager",
        ),
        (
            "cloud-hypervisor style / pooled resident, touched",
            "cloud_hypervisor_style_over_pooled_resident_touched",
        ),
        (
            "cloud-hypervisor style / pooled with holes, touched",
            "cloud_hypervisor_style_over_pooled_holes_touched",
        ),
        (
            "pooled with holes, touched / kernel zeroing, 1 thread (limit 1.00)",
            "pooled_holes_touched_over_kernel_zeroing",
        ),
    ] {
        out += &format!("| {label} | {} |\n", f(v, &format!("ratios.{key}"), 2));
    }
    out
}
