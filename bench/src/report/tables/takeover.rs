//! The table of `bench takeover`: both modes and the floor (no switch) side
//! by side. Runs from before the floor was measured show `-` in its column.

use serde_json::Value;

use super::cells::{f, num, s, size};

/// Modes in column order.
const MODES: [&str; 3] = ["takeover", "stop_start", "floor"];

pub(super) fn takeover(v: &Value) -> String {
    let has_floor = v.get("floor").is_some_and(|x| !x.is_null());
    let mut out = format!(
        "{} of clean pool ({} regions), {} running allocations of {}, {} pages, {} idle clients besides the allocations' connections; {} rounds, each both modes{}, median (worst).\n\n",
        size(v, "pool_bytes"),
        f(v, "pool_regions", 0),
        f(v, "allocations", 0),
        size(v, "alloc_bytes"),
        s(v, "page_size"),
        f(v, "idle_clients", 0),
        f(v, "rounds", 0),
        if has_floor {
            " and the floor (the same setup and clients, no switch)"
        } else {
            ""
        },
    );
    out += "| figure | `serve --takeover` | stop and start (baseline) | no switch (floor) |\n|---|---|---|---|\n";
    out += &rows(v);
    out += &ratio_lines(v);
    out += "| issue 20 expects (takeover) | expected | measured (worst round) | met |\n|---|---|---|---|\n";
    for e in v
        .get("expectations")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        out += &format!(
            "| {} | {} | {} | {} |\n",
            s(e, "what"),
            s(e, "expected"),
            s(e, "measured"),
            if e["met"] == true { "yes" } else { "**no**" }
        );
    }
    out
}

/// The figures' rows, one cell per mode in [`MODES`].
fn rows(v: &Value) -> String {
    let mut out = String::new();
    // A mode the file lacks (the floor of an older run) is `-` throughout.
    let mut row = |label: &str, cell: &dyn Fn(&str) -> String| {
        let cells: Vec<String> = MODES
            .iter()
            .map(|m| {
                if v.get(m).is_some_and(|x| !x.is_null()) {
                    cell(m)
                } else {
                    "-".into()
                }
            })
            .collect();
        out += &format!("| {label} | {} |\n", cells.join(" | "));
    };
    let spread = |mode: &str, key: &str, d: usize| {
        format!(
            "{} ({})",
            f(v, &format!("{mode}.{key}.median"), d),
            f(v, &format!("{mode}.{key}.worst"), d)
        )
    };
    let of = |mode: &str, key: &str, total: &str| {
        format!("{} / {}", f(v, &format!("{mode}.{key}"), 0), f(v, total, 0))
    };
    row(
        "switch → first ALLOC served by the new process, ms",
        &|m| spread(m, "first_alloc_ms", 1),
    );
    row("first ALLOC from the clean pool (rounds)", &|m| {
        of(m, "first_alloc_warm_rounds", "rounds")
    });
    row(
        "switch → the old pool's size served (all its regions), ms",
        &|m| spread(m, "pool_served_ms", 1),
    );
    row("... all of it from the clean pool (rounds)", &|m| {
        of(m, "pool_served_warm_rounds", "rounds")
    });
    row("switch → old process exited, ms", &|m| {
        spread(m, "old_exit_ms", 1)
    });
    row("longest client stall, ms", &|m| {
        spread(m, "max_stall_ms", 1)
    });
    row("failed requests (all rounds)", &|m| {
        f(v, &format!("{m}.failed_requests"), 0)
    });
    row("refused connections / tried (all rounds)", &|m| {
        format!(
            "{} / {}",
            f(v, &format!("{m}.refused_connections"), 0),
            f(v, &format!("{m}.connect_attempts"), 0)
        )
    });
    row("bytes zeroed again by the new process", &|m| {
        let b = |w: &str| {
            num(v, &format!("{m}.bytes_zeroed.{w}"))
                .map_or_else(|| "-".into(), |x| guest_mem::size::format_size(x as u64))
        };
        let limit = if m == "floor" { ", the limit is 0" } else { "" };
        format!("{} ({}){limit}", b("median"), b("worst"))
    });
    row("allocations still known (fewest)", &|m| {
        of(m, "allocations_known_min", "allocations")
    });
    row("allocations free-able by their tenant (fewest)", &|m| {
        of(m, "allocations_freeable_min", "allocations")
    });
    row("tenant memory intact (fewest)", &|m| {
        of(m, "tenant_memory_intact_min", "allocations")
    });
    out
}

/// The ratio sentences: takeover against the baseline, both against the
/// floor.
fn ratio_lines(v: &Value) -> String {
    let mut out = format!(
        "\nTakeover against stop and start: first ALLOC {}x sooner (worst round {}x), the old pool's size served {}x sooner, bytes zeroed again {} of the baseline's.",
        f(v, "ratios.first_alloc_speedup", 2),
        f(v, "ratios.first_alloc_worst_speedup", 2),
        f(v, "ratios.pool_served_speedup", 2),
        f(v, "ratios.bytes_zeroed_ratio", 3),
    );
    if v.get("floor").is_some_and(|x| !x.is_null()) {
        let over = |mode: &str, key: &str| f(v, &format!("ratios.{mode}_over_floor.{key}"), 2);
        out += &format!(
            " Against no switch (the floor): takeover's first ALLOC took {}x the floor's time, stop and start's {}x; the old pool's size {}x and {}x; the longest client stall (worst round) {}x and {}x.",
            over("takeover", "first_alloc"),
            over("stop_start", "first_alloc"),
            over("takeover", "pool_served"),
            over("stop_start", "pool_served"),
            over("takeover", "max_stall"),
            over("stop_start", "max_stall"),
        );
    }
    out + "\n\n"
}
