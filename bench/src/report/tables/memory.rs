//! The tables of the memory benches `clear`, `mlock` and `fill` (`alloc` has its own file).

use serde_json::Value;

use super::cells::{f, note, num, s, size};
use crate::report::fixed;

pub(super) fn clear(v: &Value) -> String {
    let mut out = format!(
        "{} on {} pages, best of {} repetitions, {} CPUs. GB/s = 10^9 bytes/s.\n\n",
        size(v, "size_bytes"),
        s(v, "page_size"),
        f(v, "reps", 0),
        f(v, "cpus", 0)
    );
    out += "| method | GB/s | vs kernel fault (fresh mapping) | vs kernel re-zero (same buffer) |\n|---|---|---|---|\n";
    let fault = num(v, "kernel_fault_gbps").unwrap_or(0.0);
    let refault = num(v, "kernel_refault_gbps").unwrap_or(0.0);
    let mut row = |label: &str, key: &str| {
        let x = num(v, key);
        let r = |base: f64| {
            x.filter(|_| base > 0.0)
                .map_or_else(|| "-".into(), |x| format!("{}x", fixed(x / base, 2)))
        };
        out += &format!(
            "| {label} | {} | {} | {} |\n",
            x.map_or_else(|| "-".into(), |x| fixed(x, 2)),
            r(fault),
            r(refault)
        );
    };
    row(
        "kernel fault-time clear: `MADV_POPULATE_WRITE` of a fresh mapping",
        "kernel_fault_gbps",
    );
    row(
        "kernel re-zero of the populated buffer: `MADV_DONTNEED` + `MADV_POPULATE_WRITE`",
        "kernel_refault_gbps",
    );
    row("glibc `memset`", "memset_gbps");
    row("multi-page: one `rep stosb` per run", "multipage_gbps");
    row("per-4 KiB `rep stosb` loop", "per4k_gbps");
    if v.get("nt_gbps").is_some_and(|x| !x.is_null()) {
        row("non-temporal stores", "nt_gbps");
    }
    row(
        &format!("**default** (`{}`)", s(v, "default_kernel")),
        "default_gbps",
    );
    out += &format!(
        "\nMulti-page over per-4 KiB: {}x.\n",
        f(v, "ratios.multipage_vs_per4k", 2)
    );
    if let Some(points) = v.get("parallel").and_then(Value::as_array) {
        out += "\n| parallel runner, default kernel: workers | GB/s, call to return | speedup | GB/s, runner's own clock | speedup |\n|---|---|---|---|---|\n";
        for p in points {
            out += &format!(
                "| {} | {} | {}x | {} | {}x |\n",
                f(p, "threads", 0),
                f(p, "gbps", 2),
                f(p, "speedup", 2),
                f(p, "runner_gbps", 2),
                f(p, "runner_speedup", 2)
            );
        }
    }
    out
}

pub(super) fn mlock(v: &Value) -> String {
    let mut out = format!(
        "{} per region, best of {} repetitions (stalls: median / worst over them), {} worker(s) per node.{}\n\n",
        size(v, "size_bytes"),
        f(v, "reps", 0),
        f(v, "threads_per_node", 0),
        note(v, "hugetlb_note")
    );
    out += "| backing | path | calls | lock s | unlock s | max stall ms (median / worst) | lock s, no probe | lock s over the populate limit: with probe (no probe) |\n|---|---|---|---|---|---|---|---|\n";
    // `-` for a run from before the limit was measured.
    let times = |r: &Value, key: &str| {
        num(r, key).map_or_else(|| "-".into(), |x| format!("{}x", fixed(x, 2)))
    };
    let backings = [("shmem_4k", "4 KiB shmem"), ("hugetlb", "hugetlb")];
    for (key, label) in backings {
        let Some(b) = v.get(key).filter(|b| !b.is_null()) else {
            continue;
        };
        let label = if key == "hugetlb" {
            format!("{label} {}", s(b, "page_size"))
        } else {
            label.to_string()
        };
        let r = &v["ratios"][key];
        for (path, calls) in [
            ("single", "1".to_string()),
            ("batched", f(b, "batched_calls", 0)),
        ] {
            let chunk = if path == "batched" {
                format!(", {}", size(b, "batched_chunk_bytes"))
            } else {
                String::new()
            };
            out += &format!(
                "| {label} | {path}{chunk} | {calls} | {} | {} | {} / {} | {} | {} ({}) |\n",
                f(b, &format!("{path}_lock_s"), 3),
                f(b, &format!("{path}_unlock_s"), 4),
                f(b, &format!("{path}_max_stall_ms"), 1),
                f(b, &format!("{path}_max_stall_worst_ms"), 1),
                f(b, &format!("{path}_lock_quiet_s"), 3),
                times(r, &format!("{path}_lock_over_limit")),
                times(r, &format!("{path}_lock_quiet_over_limit")),
            );
        }
    }
    out += "\n| backing | probe alone: max stall ms | populate limit s (`MADV_POPULATE_WRITE`, 1 thread) | stall reduction | total time, batched vs single, with probe | the same, no probe | expectation (≥10x, ≤+10 %) |\n|---|---|---|---|---|---|---|\n";
    for (key, label) in backings {
        let Some(r) = v["ratios"].get(key).filter(|r| !r.is_null()) else {
            continue;
        };
        let pct =
            |p: &str| num(r, p).map_or_else(|| "-".into(), |x| format!("{:+.1} %", x * 100.0));
        out += &format!(
            "| {label} | {} | {} | {}x | {} | {} | {} |\n",
            f(&v[key], "idle_max_stall_ms", 1),
            f(&v[key], "populate_limit_s", 3),
            f(r, "stall_reduction", 1),
            pct("total_time_overhead"),
            pct("total_time_overhead_quiet"),
            if r["meets_expectation"] == true {
                "met"
            } else {
                "not met"
            }
        );
    }
    out
}

pub(super) fn fill(v: &Value) -> String {
    let mut out = format!(
        "{} file, {} % holes, under {}; medians of {} repetitions. GB/s = 10^9 bytes of the file per second, holes included.\n\n",
        size(v, "size_bytes"),
        f(v, "holes_percent", 0),
        s(v, "dir"),
        f(v, "reps", 0)
    );
    out += "| figure | GB/s | vs sequential `read(2)` | workers | read with `O_DIRECT` | limit | samples |\n|---|---|---|---|---|---|---|\n";
    let samples = |p: &Value, key: &str| {
        p.get(key).and_then(Value::as_array).map_or_else(
            || "-".into(),
            |xs| {
                xs.iter()
                    .filter_map(Value::as_f64)
                    .map(|x| fixed(x, 2))
                    .collect::<Vec<_>>()
                    .join(", ")
            },
        )
    };
    out += &format!(
        "| sequential `read(2)`, cold, one thread | {} | 1.00x | 1 | 0 % | the disk | {} |\n",
        f(v, "seq_read_gbps", 2),
        samples(v, "seq_read_samples")
    );
    out += &format!(
        "| sequential `O_DIRECT` read, one thread | {} | - | 1 | 100 % | the device | - |\n",
        f(v, "seq_read_direct_gbps", 2)
    );
    for p in v
        .get("fills")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let direct = match (num(p, "bytes_read_direct"), num(p, "bytes_read")) {
            (Some(d), Some(r)) if r > 0.0 => format!("{} %", fixed(100.0 * d / r, 0)),
            _ => "-".into(),
        };
        out += &format!(
            "| `fill_region`, {} | {} | {}x | {} | {} | {} | {} |\n",
            s(p, "mode"),
            f(p, "gbps", 2),
            f(p, "vs_seq_read", 2),
            f(p, "threads", 0),
            direct,
            s(p, "limit"),
            samples(p, "samples")
        );
    }
    out
}
