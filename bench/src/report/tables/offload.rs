//! `offload` runs: one table, a column per run (one size each, the
//! smallest first as listed): hugemem's park and restore from the park,
//! its save to disk and restore from it, beside cloud-hypervisor's own
//! `file://` snapshot and restore and its reference offload daemon; and
//! the expectations checked on the figures: park and restore from the park
//! flat in guest size (each run against the first, at most 1.2x) with no
//! guest RAM copied, the load from disk at 0.8x the disk's read rate or
//! more, hugemem's restore from disk at least 2x faster than
//! cloud-hypervisor's `file://` restore, and an on-demand restore's guest
//! running within 20 ms at 8 GiB. Runs that measured the save beside the
//! disk's own write rates (`save_over_disk`) add rows for them and the
//! expectation that the save reaches 0.8x of the disk's direct write rate.

use serde_json::Value;

use super::cells::{f, note, num, row, run_line, s, size, three, verdict, Cell};
use crate::offload::SAVE_SHARE;
use crate::report::fixed;

/// Largest park or restore time of a run over the first run's.
const FLAT_RATIO: f64 = 1.2;
/// Least load rate over the disk's read rate.
const DISK_SHARE: f64 = 0.8;
/// Least `file://` restore time over hugemem's restore from disk.
const FILE_RATIO: f64 = 2.0;
/// Most time from an on-demand restore's start to the guest running, ms,
/// judged at [`ON_DEMAND_JUDGED_FROM`] bytes of guest RAM and more.
const ON_DEMAND_MS: f64 = 20.0;
/// The guest size the on-demand expectation names: 8 GiB.
const ON_DEMAND_JUDGED_FROM: f64 = (8u64 << 30) as f64;

/// A spread at `path` (`save_over_disk.*`): `median x [least, most]`, the
/// rounds and the 95 % interval where there is one.
fn spread(v: &Value, path: &str) -> String {
    let Some(median) = num(v, &format!("{path}.median")) else {
        return "-".into();
    };
    let interval = match (
        num(v, &format!("{path}.ci95.0")),
        num(v, &format!("{path}.ci95.1")),
    ) {
        (Some(lo), Some(hi)) => format!(", 95 % interval [{}, {}]", fixed(lo, 2), fixed(hi, 2)),
        _ => String::new(),
    };
    format!(
        "{}x [{}, {}] ({} rounds{interval})",
        fixed(median, 2),
        f(v, &format!("{path}.min"), 2),
        f(v, &format!("{path}.max"), 2),
        f(v, &format!("{path}.rounds"), 0),
    )
}

/// The save over the disk's direct write rate (`dd`-like), judged.
fn save_share(v: &Value) -> String {
    match num(v, "save_over_disk.single.median") {
        Some(r) => format!(
            "{}: {}",
            spread(v, "save_over_disk.single"),
            verdict(r >= SAVE_SHARE)
        ),
        None => "-".into(),
    }
}

/// A direct writer's rates (`single` or `parallel`) before / after the
/// save.
fn before_after(v: &Value, what: &str) -> String {
    format!(
        "{} / {}",
        f(
            v,
            &format!("from_disk.disk_write.{what}_before_gbps.median"),
            2
        ),
        f(
            v,
            &format!("from_disk.disk_write.{what}_after_gbps.median"),
            2
        )
    )
}

/// The rows of the save beside the disk's write rates.
fn save_rows(files: &[(String, Value)]) -> String {
    let rows: [(&str, Cell<'_>); 7] = [
        ("save: bytes written / its rate, GB/s / hugemem unpark --save's wall time, the save's own figure and the process's CPU time (user + system), ms", &|v| {
            format!(
                "{} / {} / {}, {} and {}",
                num(v, "from_disk.save_written_bytes.median").map_or_else(
                    || "-".into(),
                    // A median of byte counts: whole bytes.
                    |b| guest_mem::size::format_size(b as u64)
                ),
                f(v, "from_disk.save_gbps.median", 2),
                f(v, "from_disk.save_ms.median", 1),
                f(v, "from_disk.save_own_ms.median", 1),
                f(v, "from_disk.save_cpu_ms.median", 1)
            )
        }),
        ("the disk writing as many bytes, GB/s: one direct writer (dd bs=1M oflag=direct conv=fsync), right before / right after the save", &|v| {
            before_after(v, "single")
        }),
        ("the disk writing as many bytes, GB/s: direct writers as the saver's (its threads, 8 MiB writes), before / after the save; one writer through the page cache + fsync, after", &|v| {
            format!(
                "{}; {}",
                before_after(v, "parallel"),
                f(v, "from_disk.disk_write.buffered_gbps.median", 2)
            )
        }),
        ("**expected**: save ≥ 0.8x the disk's direct write rate (one writer, the mean of before and after), median of the rounds [least, most]", &save_share),
        ("save over the saver's direct writers (mean of before and after) / over one writer through the page cache, median [least, most]", &|v| {
            format!(
                "{} / {}",
                spread(v, "save_over_disk.parallel"),
                spread(v, "save_over_disk.buffered")
            )
        }),
        ("the disk's drift across a save (after over before): one direct writer / the saver's writers, median [least, most]", &|v| {
            format!(
                "{} / {}",
                spread(v, "save_over_disk.single_drift"),
                spread(v, "save_over_disk.parallel_drift")
            )
        }),
        ("the host's load average as the saves started (median)", &|v| {
            f(v, "from_disk.disk_write.host_load.median", 2)
        }),
    ];
    rows.iter()
        .map(|(label, cell)| row(label, files, cell))
        .collect()
}

/// This run's median at `path` over the first run's, judged flat or not.
fn flat(v: &Value, first: &Value, path: &str) -> String {
    match (num(v, path), num(first, path)) {
        (Some(x), Some(base)) if base > 0.0 => {
            let r = x / base;
            format!(
                "{}x ({} over {} ms): {}",
                fixed(r, 2),
                fixed(x, 1),
                fixed(base, 1),
                verdict(r <= FLAT_RATIO)
            )
        }
        _ => "-".into(),
    }
}

/// The load's rate over the disk's, judged.
fn disk_share(v: &Value) -> String {
    match num(v, "load_vs_disk") {
        Some(r) => format!(
            "{}x ({} over {} GB/s): {}",
            fixed(r, 2),
            f(v, "from_disk.load_gbps.median", 2),
            f(v, "from_disk.disk_read_gbps.median", 2),
            verdict(r >= DISK_SHARE)
        ),
        None => "-".into(),
    }
}

/// `file://` restore over hugemem's restore from disk, judged.
fn file_ratio(v: &Value) -> String {
    match num(v, "ch_file_over_from_disk") {
        Some(r) => format!(
            "{}x ({} over {} ms): {}",
            fixed(r, 2),
            f(v, "ch_file.restore_ms.median", 1),
            f(v, "from_disk.disk_to_running_ms.median", 1),
            verdict(r >= FILE_RATIO)
        ),
        None => "-".into(),
    }
}

/// The paired difference `file://` − hugemem from disk and its interval.
fn paired(v: &Value) -> String {
    let lo = num(v, "ch_file_minus_from_disk_ci95_ms.0");
    let hi = num(v, "ch_file_minus_from_disk_ci95_ms.1");
    let interval = match (lo, hi) {
        (Some(lo), Some(hi)) => format!(" [{lo:+.1}, {hi:+.1}]"),
        _ => " (no interval: under 6 pairs)".into(),
    };
    match num(v, "ch_file_minus_from_disk_paired_ms") {
        Some(d) => format!("{d:+.1}{interval}"),
        None => "-".into(),
    }
}

/// The on-demand restore's start to the guest counting, judged at 8 GiB.
fn on_demand(v: &Value) -> String {
    let Some(ms) = num(v, "on_demand.restore_ms.median") else {
        return "not measured".into();
    };
    if num(v, "size").is_some_and(|b| b >= ON_DEMAND_JUDGED_FROM) {
        format!("{} ms: {}", fixed(ms, 1), verdict(ms <= ON_DEMAND_MS))
    } else {
        format!("{} ms (judged at 8 GiB)", fixed(ms, 1))
    }
}

/// Guest RAM bytes the park copied, judged, and what the old process wrote.
fn copied(v: &Value) -> String {
    match num(v, "from_park.park_copied_bytes") {
        Some(c) => format!(
            "{} / {}: {}",
            fixed(c, 0),
            f(v, "from_park.park_written_bytes", 0),
            verdict(c == 0.0)
        ),
        None => "-".into(),
    }
}

/// The table's header: a column per run, its size and page size (and
/// `dense` for a `--dense` run).
fn header(files: &[(String, Value)]) -> String {
    let columns: Vec<String> = files
        .iter()
        .map(|(_, v)| {
            let dense = if v["dense"] == true { ", dense" } else { "" };
            format!("{} ({} pages{dense})", size(v, "size"), s(v, "page_size"))
        })
        .collect();
    format!(
        "| figure (medians) | {} |\n|---|{}\n",
        columns.join(" | "),
        "---|".repeat(files.len())
    )
}

/// The rows only some runs have: the save beside the disk's write rates,
/// and the host's check of a `--dense` guest's bytes.
fn extra_rows(files: &[(String, Value)]) -> String {
    let mut out = String::new();
    if files
        .iter()
        .any(|(_, v)| num(v, "save_over_disk.single.median").is_some())
    {
        out += &save_rows(files);
    }
    if files.iter().any(|(_, v)| v["dense"] == true) {
        out += &row(
            "dense: pages whose filled bytes the host found changed, after the load / on demand",
            files,
            |v| {
                format!(
                    "{} / {}",
                    f(v, "from_disk.stale_dense", 0),
                    f(v, "on_demand.stale_dense", 0)
                )
            },
        );
    }
    out
}

/// The table of the `offload` runs in `files`.
pub(super) fn offloads(files: &[(String, Value)]) -> String {
    let mut out = String::from("\n");
    for (n, v) in files {
        out += run_line(n, v).trim_end();
        out += &note(v, "page_size_note");
        out += &note(v, "ch_file_note");
        out += &note(v, "offload_daemon_note");
        out += "\n\n";
    }
    let Some((_, first)) = files.first() else {
        return out;
    };
    out += &header(files);
    let rows: [(&str, Cell<'_>); 20] = [
        ("repetitions", &|v| f(v, "reps", 0)),
        ("hugemem park, ms", &|v| f(v, "from_park.park_ms.median", 1)),
        ("**expected**: park flat in size (over the first column's, ≤ 1.2x)", &|v| {
            flat(v, first, "from_park.park_ms.median")
        }),
        ("restore from the park (command start to the guest counting) / its RESTORE exchange, ms", &|v| {
            format!(
                "{} / {}",
                f(v, "from_park.restore_ms.median", 1),
                f(v, "from_park.restore_launcher_ms.median", 1)
            )
        }),
        ("**expected**: restore from the park flat in size (≤ 1.2x)", &|v| {
            flat(v, first, "from_park.restore_ms.median")
        }),
        ("the guest's pause across park and restore, ms", &|v| {
            f(v, "from_park.pause_ms.median", 1)
        }),
        ("**expected**: guest RAM bytes the park copied (STATS) = 0 / bytes the old cloud-hypervisor wrote", &copied),
        ("save to disk, ms: hugemem unpark --save / file:// pause + snapshot / offload_daemon snapshot", &|v| {
            three(
                f(v, "from_disk.save_ms.median", 1),
                f(v, "ch_file.snapshot_ms.median", 1),
                f(v, "offload_daemon.park_ms.median", 1),
            )
        }),
        ("bytes on disk: hugemem's save / file:// / offload_daemon (a slot the guest never wrote is a hole)", &|v| {
            three(
                size(v, "from_disk.saved_bytes_on_disk"),
                size(v, "ch_file.snapshot_bytes_on_disk"),
                size(v, "offload_daemon.snapshot_bytes_on_disk"),
            )
        }),
        ("load from disk (hugemem park --from-dir, cold) / the daemon's copy in it, ms", &|v| {
            format!(
                "{} / {}",
                f(v, "from_disk.load_ms.median", 1),
                f(v, "from_disk.load_daemon_copy_ms.median", 1)
            )
        }),
        ("**expected**: load (bytes on disk over its time) ≥ 0.8x the disk's sequential read rate (cold)", &disk_share),
        ("restore from disk (cold) to the guest counting, ms: hugemem load + restore / file:// / offload_daemon", &|v| {
            three(
                f(v, "from_disk.disk_to_running_ms.median", 1),
                f(v, "ch_file.restore_ms.median", 1),
                f(v, "offload_daemon.restore_ms.median", 1),
            )
        }),
        ("**expected**: hugemem from disk ≥ 2x faster than file:// (its time over hugemem's)", &file_ratio),
        ("file:// less hugemem from disk, paired median [95 % interval], ms", &paired),
        ("offload_daemon restore over hugemem's from disk / from the park", &|v| {
            format!(
                "{}x / {}x",
                f(v, "offload_daemon_over_from_disk", 2),
                f(v, "offload_daemon_over_from_park", 1)
            )
        }),
        ("on demand from disk (cold): hugemem park --from-dir --on-demand / launch --restore --on-demand's start to the guest counting / both, ms", &|v| {
            three(
                f(v, "on_demand.park_ms.median", 1),
                f(v, "on_demand.restore_ms.median", 1),
                f(v, "on_demand.disk_to_running_ms.median", 1),
            )
        }),
        ("**expected**: an on-demand restore has the guest running in ≤ 20 ms at 8 GiB", &on_demand),
        ("file://'s restore over hugemem on demand from disk (both: files on disk to the guest counting)", &|v| {
            format!("{}x", f(v, "ch_file_over_on_demand", 1))
        }),
        ("on demand: the restore's start to every page filled (the guest running meanwhile), ms / pages the host found stale then", &|v| {
            format!(
                "{} / {}",
                f(v, "on_demand.all_filled_ms.median", 1),
                f(v, "on_demand.stale_host", 0)
            )
        }),
        ("stale pages the guest found: from the park / from disk / on demand / file:// / offload_daemon", &|v| {
            format!(
                "{} / {} / {} / {} / {}",
                f(v, "from_park.stale_guest", 0),
                f(v, "from_disk.stale_guest", 0),
                f(v, "on_demand.stale_guest", 0),
                f(v, "ch_file.stale_guest", 0),
                f(v, "offload_daemon.stale_guest", 0)
            )
        }),
    ];
    for (label, cell) in rows {
        out += &row(label, files, cell);
    }
    out += &extra_rows(files);
    out += "\n";
    out
}
