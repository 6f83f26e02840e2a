//! One cell of a table: a figure, a string or a size at a path of the
//! results JSON (`-` when missing), and the run's header line; the rows
//! and verdicts of the tables that check expectations (`offload`,
//! `vmm-update`).

use serde_json::Value;

use crate::report::{fixed, lookup};

/// `v[path]` as a number.
pub(super) fn num(v: &Value, path: &str) -> Option<f64> {
    lookup(v, path).and_then(Value::as_f64)
}

/// `v[path]` with `digits` decimals, or `-`.
pub(super) fn f(v: &Value, path: &str, digits: usize) -> String {
    num(v, path).map_or_else(|| "-".into(), |x| fixed(x, digits))
}

/// `v[path]` with its sign and `digits` decimals (`+1.5`), or `-`.
pub(super) fn signed(v: &Value, path: &str, digits: usize) -> String {
    num(v, path).map_or_else(|| "-".into(), |x| format!("{x:+.digits$}"))
}

/// `v[path]` as a string, or `-`.
pub(super) fn s(v: &Value, path: &str) -> String {
    match lookup(v, path) {
        Some(Value::String(x)) => x.clone(),
        Some(Value::Null) | None => "-".into(),
        Some(other) => other.to_string(),
    }
}

/// Bytes as `2G`, `512M`.
pub(super) fn size(v: &Value, path: &str) -> String {
    lookup(v, path)
        .and_then(Value::as_u64)
        .map_or_else(|| "-".into(), guest_mem::size::format_size)
}

/// The header line: which file, the command, date, build and machine.
pub(super) fn run_line(name: &str, v: &Value) -> String {
    let Some(run) = v.get("run") else {
        return format!("Run `{name}`: the file has no run record (command, date, machine).\n");
    };
    let m = &run["machine"];
    let gib =
        num(m, "memory_bytes").map_or_else(|| "-".into(), |b| fixed(b / f64::from(1u32 << 30), 1));
    let nodes = num(m, "numa_nodes").unwrap_or(0.0);
    format!(
        "Run `{name}` (`docs/results/{name}.json`): `{}`, {}, {} build; {}, {} CPUs, {} NUMA node{}, {gib} GiB, Linux {}{}, load {} at the start.\n",
        s(run, "command"),
        s(run, "date"),
        s(run, "build"),
        s(m, "cpu_model"),
        f(m, "cores", 0),
        fixed(nodes, 0),
        if (nodes - 1.0).abs() < f64::EPSILON { "" } else { "s" },
        s(m, "kernel"),
        if m["virtualized"] == true { ", a virtual machine" } else { "" },
        f(m, "load_at_start", 2),
    )
}

/// `x` as an integer when it is one, else with 4 significant digits.
pub(super) fn significant(x: f64) -> String {
    if x.fract() == 0.0 || !x.is_finite() {
        return fixed(x, 0);
    }
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // small, clamped
    let decimals = (3.0 - x.abs().log10().floor()).clamp(0.0, 12.0) as usize;
    fixed(x, decimals)
}

/// ` Note: …` for a non-empty string at `path`, else nothing.
pub(super) fn note(v: &Value, path: &str) -> String {
    match lookup(v, path) {
        Some(Value::String(n)) if !n.is_empty() => format!(" Note: {n}."),
        _ => String::new(),
    }
}

/// "met" or a bold "not met": an expectation's verdict.
pub(super) fn verdict(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "**not met**"
    }
}

/// `a / b / c` of the cells.
pub(super) fn three(a: String, b: String, c: String) -> String {
    format!("{a} / {b} / {c}")
}

/// What a row shows of one run.
pub(super) type Cell<'a> = &'a dyn Fn(&Value) -> String;

/// One row: the label, then a cell per run.
pub(super) fn row(
    label: &str,
    files: &[(String, Value)],
    cell: impl Fn(&Value) -> String,
) -> String {
    let cells: Vec<String> = files.iter().map(|(_, v)| cell(v)).collect();
    format!("| {label} | {} |\n", cells.join(" | "))
}
