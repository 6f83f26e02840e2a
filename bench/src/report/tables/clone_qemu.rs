//! A `clone --vmm qemu` run's block: `clone.rs`'s starts and memory, then
//! QEMU's own saves and restores of the same VM beside the clones, and
//! issue 46's expectation (a clone and a restore from the park within 5 ms
//! of QEMU's floor) beside the memory and bytes ones.

use serde_json::Value;

use super::cells::{f, num, s, verdict};
use super::clone::{
    bytes_expectation, clone_p50, expected, head, memory_expectation, p50_p95, starts, template,
};
use crate::report::fixed;

/// Most a start's p50 may exceed QEMU's floor's, ms (issue 46).
const OVER_QEMU_FLOOR_MS: f64 = 5.0;

fn restore_list(v: &Value) -> Vec<&Value> {
    v["qemu_restore"]
        .as_array()
        .map(|a| a.iter().collect())
        .unwrap_or_default()
}

fn kind_name(x: &Value) -> &'static str {
    if x["kind"] == "floor" {
        "its floor: `x-ignore-shared` to a file and back, on the same memory"
    } else {
        "`migrate` of all RAM to a file, `-incoming` from it (cache dropped)"
    }
}

/// Bytes as KiB: a floor's file is tens of KiB, a migrate's the guest's RAM.
fn kib(x: &Value, path: &str) -> String {
    num(x, path).map_or_else(|| "-".into(), |b| fixed(b / 1024.0, 0))
}

/// QEMU's own saves and restores, beside the clones of the same size.
fn restores(v: &Value) -> String {
    let list = restore_list(v);
    if list.is_empty() {
        return String::new();
    }
    let mut out = String::from("\n| template | QEMU's own save and restore | save p50, ms | running p50 / p95, ms | file, KiB | RAM in the stream, KiB | over a shared / copy clone (one at a time, p50) | the guest's bad pages | note |\n|---|---|---|---|---|---|---|---|---|\n");
    for x in list {
        let over = |mode: &str| {
            clone_p50(v, x, mode)
                .zip(num(x, "running_ms.p50").filter(|p| *p > 0.0))
                .map_or_else(|| "-".into(), |(c, r)| format!("{}x", fixed(r / c, 2)))
        };
        let ran = num(x, "running_ms.samples.0").is_some();
        out += &format!(
            "| {} | {} | {} | {} | {} | {} | {} / {} | {} | {} |\n",
            template(x),
            kind_name(x),
            if ran {
                f(x, "save_ms.p50", 1)
            } else {
                "-".into()
            },
            if ran { p50_p95(x) } else { "-".into() },
            kib(x, "file_bytes"),
            kib(x, "ram_transferred_bytes"),
            over("shared"),
            over("copy"),
            f(x, "guest_bad", 0),
            s(x, "note").replace('|', "\\|"),
        );
    }
    out
}

/// QEMU's floor's restore p50 at `x`'s size and page size.
fn floor_p50(v: &Value, x: &Value) -> Option<f64> {
    restore_list(v)
        .into_iter()
        .find(|y| {
            y["kind"] == "floor" && y["size"] == x["size"] && y["page_size"] == x["page_size"]
        })
        .and_then(|y| num(y, "running_ms.p50"))
        .filter(|p| *p > 0.0)
}

/// Per kind of start, one at a time with the fewest VMs: its p50 against
/// QEMU's floor + 5 ms, at every size.
fn expectations(v: &Value) -> Vec<(String, String)> {
    let mut rows = Vec::new();
    for (mode, name) in [
        ("shared", "a shared clone"),
        ("copy", "a copy clone"),
        ("park", "a restore from the park"),
    ] {
        let mut cells = Vec::new();
        let mut sizes: Vec<&Value> = starts(v)
            .into_iter()
            .filter(|x| x["mode"] == mode && x["start"] == "one_at_a_time")
            .collect();
        sizes.sort_by_key(|x| {
            (
                x["page_size"].to_string(),
                x["size"].as_u64(),
                x["count"].as_u64(),
            )
        });
        sizes.dedup_by(|b, a| a["size"] == b["size"] && a["page_size"] == b["page_size"]);
        for x in sizes {
            let (Some(p50), Some(fl)) = (num(x, "running_ms.p50"), floor_p50(v, x)) else {
                continue;
            };
            let d = p50 - fl;
            cells.push(format!(
                "{} ({} VM(s)): {} ms, {d:+.1} ms over the floor's {} ms, {}",
                template(x),
                f(x, "count", 0),
                fixed(p50, 1),
                fixed(fl, 1),
                verdict(d <= OVER_QEMU_FLOOR_MS)
            ));
        }
        rows.push((
            format!("{name} running ≤ QEMU's floor + {OVER_QEMU_FLOOR_MS} ms (its `x-ignore-shared` restore of the same size; one at a time, the fewest VMs, p50)"),
            if cells.is_empty() { "-".into() } else { cells.join("; ") },
        ));
    }
    rows
}

/// The whole block of a `clone --vmm qemu` run.
pub(super) fn clone_qemu(v: &Value) -> String {
    let mut out = head(v);
    out += &restores(v);
    let mut rows = expectations(v);
    rows.push(memory_expectation(v));
    rows.push(bytes_expectation(v));
    out += &expected(rows);
    out
}
