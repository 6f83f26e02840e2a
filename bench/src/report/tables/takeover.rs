//! The table of `bench takeover`: both modes side by side.

use serde_json::Value;

use super::cells::{f, num, s, size};

pub(super) fn takeover(v: &Value) -> String {
    let mut out = format!(
        "{} of clean pool ({} regions), {} running allocations of {}, {} pages, {} idle clients besides the allocations' connections; {} rounds, each both modes, median (worst).\n\n",
        size(v, "pool_bytes"),
        f(v, "pool_regions", 0),
        f(v, "allocations", 0),
        size(v, "alloc_bytes"),
        s(v, "page_size"),
        f(v, "idle_clients", 0),
        f(v, "rounds", 0),
    );
    out += "| figure | `serve --takeover` | stop and start (baseline) |\n|---|---|---|\n";
    let spread = |mode: &str, key: &str, d: usize| {
        format!(
            "{} ({})",
            f(v, &format!("{mode}.{key}.median"), d),
            f(v, &format!("{mode}.{key}.worst"), d)
        )
    };
    let bytes = |mode: &str, key: &str| {
        let b = |w: &str| {
            num(v, &format!("{mode}.{key}.{w}"))
                .map_or_else(|| "-".into(), |x| guest_mem::size::format_size(x as u64))
        };
        format!("{} ({})", b("median"), b("worst"))
    };
    let mut row = |label: &str, cell: &dyn Fn(&str) -> String| {
        out += &format!(
            "| {label} | {} | {} |\n",
            cell("takeover"),
            cell("stop_start")
        );
    };
    row(
        "switch → first ALLOC served by the new process, ms",
        &|m| spread(m, "first_alloc_ms", 1),
    );
    row("first ALLOC from the clean pool (rounds)", &|m| {
        format!(
            "{} / {}",
            f(v, &format!("{m}.first_alloc_warm_rounds"), 0),
            f(v, "rounds", 0)
        )
    });
    row(
        "switch → the old pool's size served (all its regions), ms",
        &|m| spread(m, "pool_served_ms", 1),
    );
    row("... all of it from the clean pool (rounds)", &|m| {
        format!(
            "{} / {}",
            f(v, &format!("{m}.pool_served_warm_rounds"), 0),
            f(v, "rounds", 0)
        )
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
        bytes(m, "bytes_zeroed")
    });
    row("allocations still known (fewest)", &|m| {
        format!(
            "{} / {}",
            f(v, &format!("{m}.allocations_known_min"), 0),
            f(v, "allocations", 0)
        )
    });
    row("allocations free-able by their tenant (fewest)", &|m| {
        format!(
            "{} / {}",
            f(v, &format!("{m}.allocations_freeable_min"), 0),
            f(v, "allocations", 0)
        )
    });
    row("tenant memory intact (fewest)", &|m| {
        format!(
            "{} / {}",
            f(v, &format!("{m}.tenant_memory_intact_min"), 0),
            f(v, "allocations", 0)
        )
    });
    out += &format!(
        "\nTakeover against stop and start: first ALLOC {}x sooner (worst round {}x), the old pool's size served {}x sooner, bytes zeroed again {} of the baseline's.\n\n",
        f(v, "ratios.first_alloc_speedup", 2),
        f(v, "ratios.first_alloc_worst_speedup", 2),
        f(v, "ratios.pool_served_speedup", 2),
        f(v, "ratios.bytes_zeroed_ratio", 3),
    );
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
