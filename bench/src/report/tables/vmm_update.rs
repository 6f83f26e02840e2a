//! `vmm-update` runs: one table, a column per run (one size each, the
//! smallest first as listed), each figure of hugemem's update beside its
//! floor and the copying migration, and the expectations checked on the
//! figures: the pause at the switch within the floor's + 2 ms and flat in
//! guest size (each run against the first, at most 1.2x), under 1 % of RAM
//! sent, and the copy at least 20x slower at 8 GiB.

use serde_json::Value;

use super::cells::{f, note, num, row, run_line, s, signed, size, three, verdict, Cell};
use crate::report::fixed;

/// Pause at the switch allowed over the floor's, ms.
const PAUSE_OVER_FLOOR_MS: f64 = 2.0;
/// Largest pause at the switch of a run over the first run's.
const FLAT_RATIO: f64 = 1.2;
/// Least copy / update time ratio at [`RATIO_SIZE`] and above.
const COPY_RATIO: f64 = 20.0;
/// The size the update time ratio is asked at.
const RATIO_SIZE: f64 = (8u64 << 30) as f64;

/// A paired median and its 95 % interval, `+1.2 [-0.3, +2.0]`.
fn paired(v: &Value, median: &str, ci: &str, digits: usize) -> String {
    let interval = match (num(v, &format!("{ci}.0")), num(v, &format!("{ci}.1"))) {
        (Some(lo), Some(hi)) => format!(" [{lo:+.digits$}, {hi:+.digits$}]"),
        _ => " (no interval: under 6 pairs)".into(),
    };
    format!("{}{interval}", signed(v, median, digits))
}

/// The pause at the switch within the floor's + 2 ms.
fn pause_within_floor(v: &Value) -> String {
    match (
        num(v, "update.switch_gap_median_ms"),
        num(v, "floor.switch_gap_median_ms"),
    ) {
        (Some(u), Some(fl)) => format!(
            "{} ({} {} {} + {})",
            verdict(u <= fl + PAUSE_OVER_FLOOR_MS),
            fixed(u, 2),
            if u <= fl + PAUSE_OVER_FLOOR_MS {
                "≤"
            } else {
                ">"
            },
            fixed(fl, 2),
            fixed(PAUSE_OVER_FLOOR_MS, 0)
        ),
        _ => "-".into(),
    }
}

/// This run's pause at the switch over the first run's.
fn flat(v: &Value, first: &Value) -> String {
    let path = "update.switch_gap_median_ms";
    match (num(v, path), num(first, path)) {
        (Some(u), Some(base)) if base > 0.0 => {
            let r = u / base;
            format!(
                "{}x ({} over {} ms): {}",
                fixed(r, 2),
                fixed(u, 2),
                fixed(base, 2),
                verdict(r <= FLAT_RATIO)
            )
        }
        _ => "-".into(),
    }
}

/// The copy's update time over hugemem's, with the verdict at 8 GiB and up.
fn copy_ratio(v: &Value) -> String {
    let Some(r) = num(v, "update_time_ratio") else {
        return "-".into();
    };
    let at_size = num(v, "size").is_some_and(|b| b >= RATIO_SIZE);
    let mut out = format!("{}x", fixed(r, 1));
    if at_size {
        out += &format!(": {}", verdict(r >= COPY_RATIO));
    }
    out
}

/// RAM sent by hugemem's update in % of RAM, with the verdict.
fn ram_sent(v: &Value) -> String {
    match num(v, "update.ram_transferred_max_pct") {
        Some(p) => format!("{} %: {}", fixed(p, 6), verdict(p < 1.0)),
        None => "-".into(),
    }
}

/// The table of the `vmm-update` runs in `files`.
pub(super) fn vmm_updates(files: &[(String, Value)]) -> String {
    let mut out = String::from("\n");
    for (n, v) in files {
        out += run_line(n, v).trim_end();
        out += &note(v, "page_size_note");
        out += "\n\n";
    }
    let Some((_, first)) = files.first() else {
        return out;
    };
    let header: Vec<String> = files
        .iter()
        .map(|(_, v)| {
            format!(
                "{} ({}, {} pages)",
                size(v, "size"),
                s(v, "vmm"),
                s(v, "page_size")
            )
        })
        .collect();
    out += &format!(
        "| figure | {} |\n|---|{}\n",
        header.join(" | "),
        "---|".repeat(files.len())
    );
    let rows: [(&str, Cell<'_>); 15] = [
        ("updates (hugemem / floor)", &|v| {
            format!("{} / {}", f(v, "update.updates", 0), f(v, "floor.updates", 0))
        }),
        ("update time, median ms: hugemem / floor / copying migration", &|v| {
            three(
                f(v, "update.update_median_ms", 1),
                f(v, "floor.update_median_ms", 1),
                f(v, "copy.update_ms", 1),
            )
        }),
        ("update time over the floor, paired median [95 % interval], ms", &|v| {
            paired(v, "update_over_floor_paired_ms", "update_over_floor_ci95_ms", 1)
        }),
        ("pause at the switch, median ms: hugemem / floor / copying migration", &|v| {
            three(
                f(v, "update.switch_gap_median_ms", 2),
                f(v, "floor.switch_gap_median_ms", 2),
                f(v, "copy.switch_gap_ms", 2),
            )
        }),
        ("pause at the switch over the floor, paired median [95 % interval], ms", &|v| {
            paired(v, "switch_gap_over_floor_paired_ms", "switch_gap_over_floor_ci95_ms", 2)
        }),
        ("**expected**: pause at the switch ≤ the floor's + 2 ms", &pause_within_floor),
        ("**expected**: pause at the switch flat in size (over the first column's, ≤ 1.2x)", &|v| {
            flat(v, first)
        }),
        ("largest gap in the update's window, median ms: hugemem / floor / copying", &|v| {
            three(
                f(v, "update.downtime_median_ms", 2),
                f(v, "floor.downtime_median_ms", 2),
                f(v, "copy.downtime_ms", 2),
            )
        }),
        ("largest gap in an idle window as long (noise), ms: hugemem / floor / copying", &|v| {
            three(
                f(v, "update.idle_gap_ms", 2),
                f(v, "floor.idle_gap_ms", 2),
                f(v, "copy.idle_gap_ms", 2),
            )
        }),
        ("bytes the old process wrote during the switch (most of the updates): hugemem / floor / copying", &|v| {
            three(
                f(v, "update.ram_transferred_max_bytes", 0),
                f(v, "floor.ram_transferred_max_bytes", 0),
                f(v, "copy.ram_transferred_bytes", 0),
            )
        }),
        ("**expected**: hugemem's in % of RAM < 1 %", &ram_sent),
        ("update time, copying / hugemem", &|v| fixed_or_dash(num(v, "update_time_ratio"), 1, "x")),
        ("**expected**: copying ≥ 20x hugemem's update time at 8 GiB", &copy_ratio),
        ("stale pages, guest + host: hugemem / floor / copying", &|v| {
            let stale = |side: &str| match (
                num(v, &format!("{side}.stale_guest")),
                num(v, &format!("{side}.stale_host")),
            ) {
                (Some(g), Some(h)) => fixed(g + h, 0),
                _ => "-".into(),
            };
            three(stale("update"), stale("floor"), stale("copy"))
        }),
        ("daemon: cleared bytes / created − released == held / released after exit", &|v| {
            format!(
                "{} / {} / {}",
                f(v, "update.cleared_bytes", 0),
                s(v, "update.balanced"),
                s(v, "update.released_after_exit")
            )
        }),
    ];
    for (label, cell) in rows {
        out += &row(label, files, cell);
    }
    out += "\n";
    out
}

fn fixed_or_dash(x: Option<f64>, digits: usize, suffix: &str) -> String {
    x.map_or_else(|| "-".into(), |x| format!("{}{suffix}", fixed(x, digits)))
}
