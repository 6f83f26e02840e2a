//! What goes between a `<!-- results:… -->` marker and its end: each file's
//! block, picked by its `"bench"`, or one table of rows for churn runs.

use serde_json::Value;

use super::alloc::alloc;
use super::cells::{run_line, significant};
use super::clone::clone;
use super::clone_qemu::clone_qemu;
use super::launches::{churn_row, churn_spans_row, compare, demo, vmstart};
use super::memory::{clear, fill, mlock};
use super::offload::offloads;
use super::takeover::takeover;
use super::vmm_update::vmm_updates;

/// The generated lines between `<!-- results:NAME,… -->` and
/// `<!-- /results -->` for the files named: one table of rows for runs of a
/// kind that has rows (`churn`), one with a column per run (`vmm-update`, `offload`),
/// else each file's block in turn.
pub fn blocks(files: &[(String, Value)]) -> String {
    let all_of = |kind: &str| {
        !files.is_empty()
            && files
                .iter()
                .all(|(_, v)| v.get("bench").and_then(Value::as_str) == Some(kind))
    };
    if all_of("vmm-update") {
        return vmm_updates(files);
    }
    if all_of("offload") {
        return offloads(files);
    }
    let all_churn = !files.is_empty()
        && files
            .iter()
            .all(|(_, v)| v.get("bench").and_then(Value::as_str) == Some("churn"));
    if !all_churn {
        return files.iter().map(|(n, v)| block(n, v)).collect();
    }
    let mut out = String::from("\n");
    for (n, v) in files {
        out += &run_line(n, v);
        out += "\n";
    }
    out += "| run | VMM | pages asked (expected) | launches x size (at once) | pages served | downgrades (counted from) | stale reads (baseline) | p50 / p99 / max ms | ALLOC p50 ms | baseline p50 / p99 ms | speedup p50 | p99 / p50 | floor p50 / p99 ms | p50 over the floor ms |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
    for (n, v) in files {
        out += &churn_row(n, v);
    }
    out += "\n";
    let spans: Vec<&(String, Value)> = files
        .iter()
        .filter(|(_, v)| v.get("ready").is_some())
        .collect();
    if !spans.is_empty() {
        out += "| run | host fits (VMs) | ready p50 / p99 ms | baseline ready p50 / p99 ms | ready speedup p50 (p99) | ready p99 / p50 | floor ready p50 ms | ready p50 over the floor ms | all RAM touched p50 / p99 ms | limit: the kernel zeroing the size on 1 thread, ms | baseline touched p50 / p99 ms | touched speedup p50 (p99) | floor touched p50 ms | touched p50 over the floor ms |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
        for (n, v) in spans {
            out += &churn_spans_row(n, v);
        }
        out += "\n";
    }
    out
}

/// The generated lines between `<!-- results:NAME -->` and `<!-- /results -->`.
pub fn block(name: &str, v: &Value) -> String {
    let mut out = String::from("\n");
    out += &run_line(name, v);
    out += "\n";
    let body = match v.get("bench").and_then(Value::as_str) {
        Some("clear") => clear(v),
        Some("alloc") => alloc(v),
        Some("mlock") => mlock(v),
        Some("fill") => fill(v),
        Some("vmstart") => vmstart(v),
        Some("compare") => compare(v),
        Some("demo") => demo(v),
        Some("takeover") => takeover(v),
        Some("clone") if v["vmm"] == "qemu" => clone_qemu(v),
        Some("clone") => clone(v),
        _ => generic(v),
    };
    out += &body;
    out += "\n";
    out
}

/// Top-level numbers, strings and booleans of a file of another kind.
fn generic(v: &Value) -> String {
    let mut out = String::from("| figure | value |\n|---|---|\n");
    if let Some(m) = v.as_object() {
        for (k, x) in m {
            let shown = match x {
                Value::Number(n) => n.as_f64().map_or_else(|| n.to_string(), significant),
                Value::String(t) => t.replace('|', "\\|").replace('\n', " "),
                Value::Bool(b) => b.to_string(),
                _ => continue,
            };
            out += &format!("| `{k}` | {shown} |\n");
        }
    }
    out
}
