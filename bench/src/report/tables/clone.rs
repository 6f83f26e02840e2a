//! `clone` runs: what the plan left out, every kind of start beside the
//! floor of the same size, count and start (restores from the park), the
//! memory each VM took, cloud-hypervisor's own restores, and the issue's
//! expectations checked on the figures, each beside its limit. A `--vmm
//! qemu` run's block is `clone_qemu.rs`'s, on this file's parts.

use serde_json::Value;

use super::cells::{f, num, s, size, verdict};
use crate::report::fixed;

/// Most time to a clone running, ms, judged at [`JUDGED_SIZE`].
const CLONE_MS: f64 = 20.0;
/// Most a clone's p50 may exceed the floor's, ms.
const OVER_FLOOR_MS: f64 = 2.0;
/// Most p95 of shared clones started at once, ms.
const AT_ONCE_P95_MS: f64 = 100.0;
/// Most a batch's p95 over the floor's at once.
const AT_ONCE_RATIO: f64 = 1.3;
/// What a shared clone may take beyond what it wrote, bytes.
const SHARED_SLACK: f64 = (2u64 << 20) as f64;
/// Least cloud-hypervisor's own restore over a clone, at [`JUDGED_SIZE`].
const CH_RATIO: f64 = 10.0;
/// The size the latency expectations name: 8 GiB.
const JUDGED_SIZE: u64 = 8 << 30;
/// The count and size the at-once expectation names.
const AT_ONCE_COUNT: u64 = 25;
const AT_ONCE_SIZE: u64 = 1 << 30;

pub(super) fn starts(v: &Value) -> Vec<&Value> {
    v["starts"]
        .as_array()
        .map(|a| a.iter().collect())
        .unwrap_or_default()
}

/// The start of the same page size, size, count and start in `mode`.
fn same<'a>(v: &'a Value, x: &Value, mode: &str) -> Option<&'a Value> {
    starts(v).into_iter().find(|y| {
        ["page_size", "size", "count", "start"]
            .iter()
            .all(|k| y[*k] == x[*k])
            && y["mode"] == mode
    })
}

pub(super) fn template(x: &Value) -> String {
    format!("{} ({} pages)", size(x, "size"), s(x, "page_size"))
}

pub(super) fn p50_p95(x: &Value) -> String {
    format!(
        "{} / {}",
        f(x, "running_ms.p50", 1),
        f(x, "running_ms.p95", 1)
    )
}

fn start_name(x: &Value) -> &'static str {
    if x["start"] == "at_once" {
        "at once"
    } else {
        "one at a time"
    }
}

/// One row per kind of clone start, beside its floor.
fn latency(v: &Value) -> String {
    let mut out = String::from("| template | N | start | clones | running p50 / p95, ms | restores from the park (the floor) p50 / p95, ms | p50 over the floor, ms | p95 over the floor | at once: first request to last running, p50 ms |\n|---|---|---|---|---|---|---|---|---|\n");
    for x in starts(v).into_iter().filter(|x| x["mode"] != "park") {
        let floor = same(v, x, "park");
        let diff = floor
            .and_then(|fl| Some(num(x, "running_ms.p50")? - num(fl, "running_ms.p50")?))
            .map_or_else(|| "-".into(), |d| format!("{d:+.1}"));
        let ratio = floor
            .and_then(|fl| Some(num(x, "running_ms.p95")? / num(fl, "running_ms.p95")?))
            .map_or_else(|| "-".into(), |r| format!("{}x", fixed(r, 2)));
        let batch = if x["start"] == "at_once" {
            f(x, "batch_ms.p50", 1)
        } else {
            "-".into()
        };
        out += &format!(
            "| {} | {} | {} | {} | {} | {} | {diff} | {ratio} | {batch} |\n",
            template(x),
            f(x, "count", 0),
            start_name(x),
            s(x, "mode"),
            p50_p95(x),
            floor.map_or_else(|| "-".into(), p50_p95),
        );
    }
    out
}

/// Bytes as MiB with one decimal.
fn mib(x: &Value, path: &str) -> String {
    num(x, path).map_or_else(|| "-".into(), |b| fixed(b / f64::from(1u32 << 20), 1))
}

/// One row per kind of start: memory and pages.
fn memory(v: &Value) -> String {
    let mut out = String::from("| template | N | start | VMs | from the pool per VM, MiB | kernel huge pages taken / reserved per VM, MiB | private huge pages per VM (written), MiB | 4 KiB pages written in the guest's own area (most of one clone) | stale or foreign 4 KiB pages (clones compared with the template) | the guests' bad pages |\n|---|---|---|---|---|---|---|---|---|---|\n");
    for x in starts(v) {
        let mode = if x["mode"] == "park" {
            "restores from the park".to_string()
        } else {
            format!("{} clones", s(x, "mode"))
        };
        let compared = if x["mode"] == "park" {
            ("-".to_string(), "-".to_string())
        } else {
            (
                f(x, "own_pages_written_max", 0),
                format!("{} ({})", f(x, "stale_pages", 0), f(x, "clones_checked", 0)),
            )
        };
        out += &format!(
            "| {} | {} | {} | {mode} | {} | {} / {} | {} | {} | {} | {} |\n",
            template(x),
            f(x, "count", 0),
            start_name(x),
            mib(x, "pool_bytes_per_vm"),
            mib(x, "kernel_taken_bytes_per_vm"),
            mib(x, "kernel_reserved_bytes_per_vm"),
            mib(x, "private_hugetlb_bytes_per_vm"),
            compared.0,
            compared.1,
            f(x, "guest_bad", 0),
        );
    }
    out
}

/// cloud-hypervisor's restores, beside the clones of the same size.
fn ch_restores(v: &Value) -> String {
    let Some(list) = v["ch_restore"].as_array().filter(|a| !a.is_empty()) else {
        return String::new();
    };
    let mut out = String::from("\n| template | cloud-hypervisor's own restore from its `file://` snapshot | running p50 / p95, ms | over a shared / copy clone (one at a time, p50) | the guest's bad pages | note |\n|---|---|---|---|---|---|\n");
    for x in list {
        let over = |mode: &str| {
            clone_p50(v, x, mode)
                .zip(num(x, "running_ms.p50").filter(|p| *p > 0.0))
                .map_or_else(|| "-".into(), |(c, r)| format!("{}x", fixed(r / c, 1)))
        };
        out += &format!(
            "| {} | `{}` | {} | {} / {} | {} | {} |\n",
            template(x),
            s(x, "mode"),
            if num(x, "running_ms.samples.0").is_some() {
                p50_p95(x)
            } else {
                "-".into()
            },
            over("shared"),
            over("copy"),
            f(x, "guest_bad", 0),
            s(x, "note").replace('|', "\\|"),
        );
    }
    out
}

/// The p50 of `mode` clones one at a time with the least count at `x`'s
/// size and page size.
pub(super) fn clone_p50(v: &Value, x: &Value, mode: &str) -> Option<f64> {
    starts(v)
        .into_iter()
        .filter(|y| {
            y["mode"] == mode
                && y["start"] == "one_at_a_time"
                && y["size"] == x["size"]
                && y["page_size"] == x["page_size"]
        })
        .min_by_key(|y| y["count"].as_u64().unwrap_or(u64::MAX))
        .and_then(|y| num(y, "running_ms.p50"))
}

/// Why `size` was not measured, from the plan's left-out list.
fn not_measured(v: &Value, size: u64) -> String {
    let why = v["left_out"].as_array().and_then(|a| {
        a.iter()
            .find(|l| l["size"].as_u64() == Some(size))
            .and_then(|l| l["why"].as_str())
    });
    format!(
        "not measured at {}: {}",
        guest_mem::size::format_size(size),
        why.unwrap_or("not asked for")
    )
}

/// The latency expectations for each clone mode, one at a time.
fn latency_expectations(v: &Value) -> Vec<(String, String)> {
    let mut rows = Vec::new();
    for mode in ["shared", "copy"] {
        // Per size, the batch with the fewest clones, one at a time.
        let mut ones: Vec<&Value> = Vec::new();
        for x in starts(v)
            .into_iter()
            .filter(|x| x["mode"] == mode && x["start"] == "one_at_a_time")
        {
            let same_size = |y: &Value| y["size"] == x["size"] && y["page_size"] == x["page_size"];
            match ones.iter().position(|y| same_size(y)) {
                Some(i) if ones[i]["count"].as_u64() > x["count"].as_u64() => ones[i] = x,
                Some(_) => {}
                None => ones.push(x),
            }
        }
        let mut ms = Vec::new();
        let mut floor = Vec::new();
        for x in &ones {
            let p50 = num(x, "running_ms.p50").unwrap_or(f64::INFINITY);
            let judged = x["size"].as_u64() == Some(JUDGED_SIZE);
            ms.push(format!(
                "{} ({} clone(s)): {} ms{}",
                template(x),
                f(x, "count", 0),
                fixed(p50, 1),
                if judged {
                    format!(", {}", verdict(p50 <= CLONE_MS))
                } else {
                    String::new()
                }
            ));
            if let Some(fl) = same(v, x, "park").and_then(|fl| num(fl, "running_ms.p50")) {
                let d = p50 - fl;
                floor.push(format!(
                    "{} ({} clone(s)): {d:+.1} ms ({} over {} ms), {}",
                    template(x),
                    f(x, "count", 0),
                    fixed(p50, 1),
                    fixed(fl, 1),
                    verdict(d <= OVER_FLOOR_MS)
                ));
            }
        }
        if !ones.iter().any(|x| x["size"].as_u64() == Some(JUDGED_SIZE)) {
            ms.push(not_measured(v, JUDGED_SIZE));
        }
        rows.push((
            format!("a {mode} clone running in ≤ {CLONE_MS} ms (one at a time, the fewest clones, p50; judged at 8 GiB)"),
            ms.join("; "),
        ));
        rows.push((
            format!("a {mode} clone within {OVER_FLOOR_MS} ms of a restore from the park of the same VM (p50)"),
            if floor.is_empty() { "-".into() } else { floor.join("; ") },
        ));
    }
    rows
}

/// The at-once expectation on the shared batch with the most clones.
fn at_once_expectation(v: &Value) -> (String, String) {
    let label = format!("{AT_ONCE_COUNT} shared clones of 1 GiB at once: p95 ≤ {AT_ONCE_P95_MS} ms and ≤ {AT_ONCE_RATIO}x as many restores from the park at once (on smaller VMs or fewer clones where memory runs short)");
    let best = starts(v)
        .into_iter()
        .filter(|x| {
            x["mode"] == "shared"
                && x["start"] == "at_once"
                && x["size"].as_u64().is_some_and(|s| s <= AT_ONCE_SIZE)
        })
        .max_by_key(|x| (x["count"].as_u64(), x["size"].as_u64()));
    let Some(x) = best else {
        return (label, "-".into());
    };
    let p95 = num(x, "running_ms.p95").unwrap_or(f64::INFINITY);
    let floor = same(v, x, "park").and_then(|fl| num(fl, "running_ms.p95"));
    let mut text = format!(
        "{} clones of {}: p95 {} ms, {}",
        f(x, "count", 0),
        template(x),
        fixed(p95, 1),
        verdict(p95 <= AT_ONCE_P95_MS)
    );
    if let Some(fl) = floor {
        text += &format!(
            "; {}x the floor's {} ms, {}",
            fixed(p95 / fl, 2),
            fixed(fl, 1),
            verdict(p95 / fl <= AT_ONCE_RATIO)
        );
        if fl > AT_ONCE_P95_MS {
            text += " (the floor alone is over 100 ms on this host)";
        }
    }
    if x["count"].as_u64() != Some(AT_ONCE_COUNT) {
        text += &format!(
            " (judged with {} clones: {})",
            f(x, "count", 0),
            v["left_out"]
                .as_array()
                .and_then(|a| a
                    .iter()
                    .find(|l| l["count"].as_u64() == Some(AT_ONCE_COUNT)))
                .and_then(|l| l["why"].as_str())
                .unwrap_or("not asked for")
        );
    }
    (label, text)
}

/// Shared clones' memory: the kernel's pages taken per clone against what
/// it wrote plus 2 MiB, and nothing from the pool.
pub(super) fn memory_expectation(v: &Value) -> (String, String) {
    let label = "shared clones take ≤ the template + the pages they write + 2 MiB each (kernel pages taken per clone ≤ its private huge pages + 2 MiB; nothing from the pool)".to_string();
    let shared: Vec<&Value> = starts(v)
        .into_iter()
        .filter(|x| x["mode"] == "shared")
        .collect();
    if shared.is_empty() {
        return (label, "-".into());
    }
    let over = |x: &Value| {
        num(x, "kernel_taken_bytes_per_vm").unwrap_or(0.0)
            - num(x, "private_hugetlb_bytes_per_vm").unwrap_or(0.0)
    };
    let worst = shared
        .iter()
        .copied()
        .max_by(|a, b| over(a).total_cmp(&over(b)))
        .unwrap_or(shared[0]);
    let pool: f64 = shared
        .iter()
        .map(|x| num(x, "pool_bytes_per_vm").unwrap_or(0.0))
        .fold(0.0, f64::max);
    let ok = over(worst) <= SHARED_SLACK && pool == 0.0;
    (
        label,
        format!(
            "most over what a clone wrote: {} MiB ({} clones of {}, started {}: {} MiB taken, {} MiB written, {} MiB reserved per clone); most from the pool per clone {} MiB: {}",
            fixed(over(worst) / f64::from(1u32 << 20), 1),
            f(worst, "count", 0),
            template(worst),
            start_name(worst),
            mib(worst, "kernel_taken_bytes_per_vm"),
            mib(worst, "private_hugetlb_bytes_per_vm"),
            mib(worst, "kernel_reserved_bytes_per_vm"),
            fixed(pool / f64::from(1u32 << 20), 1),
            verdict(ok)
        ),
    )
}

/// Clones against cloud-hypervisor's fastest restore, per size.
fn ch_expectation(v: &Value) -> (String, String) {
    let label = format!("≥ {CH_RATIO}x sooner to running than cloud-hypervisor's own restore of the same snapshot (its fastest mode over the slower clone mode, one at a time, p50; judged at 8 GiB)");
    let mut cells = Vec::new();
    let list = v["ch_restore"].as_array().cloned().unwrap_or_default();
    let mut sizes: Vec<(u64, String)> = list
        .iter()
        .filter_map(|x| Some((x["size"].as_u64()?, s(x, "page_size"))))
        .collect();
    sizes.dedup();
    for (sz, page) in &sizes {
        let of_size: Vec<&Value> = list
            .iter()
            .filter(|x| x["size"].as_u64() == Some(*sz) && &s(x, "page_size") == page)
            .collect();
        let fastest = of_size
            .iter()
            .filter(|x| num(x, "running_ms.samples.0").is_some())
            .min_by(|a, b| {
                let p = |x: &Value| num(x, "running_ms.p50").unwrap_or(f64::INFINITY);
                p(a).total_cmp(&p(b))
            });
        let (Some(fastest), Some(x)) = (fastest, of_size.first()) else {
            continue;
        };
        let clone = ["shared", "copy"]
            .iter()
            .filter_map(|m| clone_p50(v, x, m))
            .fold(0.0, f64::max);
        let ch = num(fastest, "running_ms.p50").unwrap_or(0.0);
        if clone <= 0.0 {
            continue;
        }
        let r = ch / clone;
        cells.push(format!(
            "{}: {}x ({} ms with `{}` over {} ms){}",
            template(x),
            fixed(r, 1),
            fixed(ch, 1),
            s(fastest, "mode"),
            fixed(clone, 1),
            if *sz == JUDGED_SIZE {
                format!(", {}", verdict(r >= CH_RATIO))
            } else {
                String::new()
            }
        ));
    }
    if !sizes.iter().any(|(sz, _)| *sz == JUDGED_SIZE) {
        cells.push(not_measured(v, JUDGED_SIZE));
    }
    (
        label,
        if cells.is_empty() {
            "-".into()
        } else {
            cells.join("; ")
        },
    )
}

/// No stale or foreign byte anywhere; the templates unchanged.
pub(super) fn bytes_expectation(v: &Value) -> (String, String) {
    let all = starts(v);
    let stale: f64 = all
        .iter()
        .map(|x| num(x, "stale_pages").unwrap_or(0.0))
        .sum();
    let checked: f64 = all
        .iter()
        .map(|x| num(x, "clones_checked").unwrap_or(0.0))
        .sum();
    let restores = ["ch_restore", "qemu_restore"]
        .iter()
        .filter_map(|k| v[*k].as_array())
        .flatten();
    let bad: f64 = all
        .iter()
        .copied()
        .chain(restores)
        .map(|x| num(x, "guest_bad").unwrap_or(0.0))
        .sum();
    let templates = v["templates"].as_array().cloned().unwrap_or_default();
    let unchanged = templates.iter().filter(|t| t["unchanged"] == true).count();
    (
        "0 stale or foreign bytes: clones' pages outside the guest's own area equal the template's, the guests find every page, the templates unchanged (digest before and after)".into(),
        format!(
            "{} stale or foreign 4 KiB pages in {} clones compared; {} bad pages the guests found; {unchanged} of {} templates unchanged: {}",
            fixed(stale, 0),
            fixed(checked, 0),
            fixed(bad, 0),
            templates.len(),
            verdict(stale == 0.0 && bad == 0.0 && unchanged == templates.len() && checked > 0.0)
        ),
    )
}

/// What every `clone` run's block starts with: the options, what was left
/// out or not measured, the starts beside the floor, the memory.
pub(super) fn head(v: &Value) -> String {
    let mut out = String::new();
    out += &format!(
        "{}Sizes {}; counts {}; page sizes {}; {} repetition(s) of each.",
        if v["vmm"] == "qemu" { "QEMU VMs. " } else { "" },
        v["sizes"]
            .as_array()
            .map(|a| a
                .iter()
                .filter_map(Value::as_u64)
                .map(guest_mem::size::format_size)
                .collect::<Vec<_>>()
                .join(", "))
            .unwrap_or_default(),
        v["counts"]
            .as_array()
            .map(|a| a
                .iter()
                .map(Value::to_string)
                .collect::<Vec<_>>()
                .join(", "))
            .unwrap_or_default(),
        v["page_sizes"]
            .as_array()
            .map(|a| a
                .iter()
                .filter_map(Value::as_str)
                .collect::<Vec<_>>()
                .join(", "))
            .unwrap_or_default(),
        f(v, "reps", 0),
    );
    if let Some(left) = v["left_out"].as_array().filter(|a| !a.is_empty()) {
        out += " Left out:\n\n";
        for l in left {
            out += &format!(
                "* {} clone(s) of {}: {}\n",
                f(l, "count", 0),
                template(l),
                s(l, "why")
            );
        }
    } else {
        out += "\n";
    }
    if let Some(notes) = v["notes"].as_array().filter(|a| !a.is_empty()) {
        out += "\nNot measured:\n\n";
        for n in notes.iter().filter_map(Value::as_str) {
            out += &format!("* {}\n", n.replace('|', "\\|"));
        }
    }
    out += "\n";
    out += &latency(v);
    out += "\n";
    out += &memory(v);
    out
}

/// The expectations' table of `rows` (label, measured: verdict).
pub(super) fn expected(rows: Vec<(String, String)>) -> String {
    let mut out = String::from("\n| **expected** | measured: verdict |\n|---|---|\n");
    for (label, text) in rows {
        out += &format!("| {label} | {text} |\n");
    }
    out
}

/// The whole block of a cloud-hypervisor `clone` run.
pub(super) fn clone(v: &Value) -> String {
    let mut out = head(v);
    out += &ch_restores(v);
    let mut rows = latency_expectations(v);
    rows.push(at_once_expectation(v));
    rows.push(memory_expectation(v));
    rows.push(ch_expectation(v));
    rows.push(bytes_expectation(v));
    out += &expected(rows);
    out
}
