//! The tables `hugemem bench report` generates for one results file, by its
//! `"bench"`: `clear`, `alloc`, `mlock`, `vmstart`, `compare`, `demo`, `takeover`; any other
//! kind (or none) gets its top-level figures as a key/value table. The
//! tables read the JSON as `--json` prints it; a missing figure shows as `-`.

use serde_json::Value;

use super::fixed;

/// The generated lines between `<!-- results:NAME,… -->` and
/// `<!-- /results -->` for the files named: one table of rows for runs of a
/// kind that has rows (`churn`), else each file's block in turn.
pub fn blocks(files: &[(String, Value)]) -> String {
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
    out += "| run | VMM | pages asked (expected) | launches x size (at once) | pages served | downgrades (counted from) | stale reads (baseline) | p50 / p99 / max ms | ALLOC p50 ms | baseline p50 / p99 ms | speedup p50 | p99 / p50 |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n";
    for (n, v) in files {
        out += &churn_row(n, v);
    }
    out += "\n";
    let spans: Vec<&(String, Value)> = files
        .iter()
        .filter(|(_, v)| v.get("ready").is_some())
        .collect();
    if !spans.is_empty() {
        out += "| run | host fits (VMs) | ready p50 / p99 ms | baseline ready p50 / p99 ms | ready speedup p50 (p99) | ready p99 / p50 | all RAM touched p50 / p99 ms | baseline touched p50 / p99 ms | touched speedup p50 (p99) |\n|---|---|---|---|---|---|---|---|---|\n";
        for (n, v) in spans {
            out += &format!(
                "| `{n}` | {} | {} / {} | {} / {} | {}x ({}x) | {} | {} / {} | {} / {} | {}x ({}x) |\n",
                f(v, "host_vm_fits", 0),
                f(v, "ready.hugemem.p50", 1),
                f(v, "ready.hugemem.p99", 1),
                f(v, "ready.baseline.p50", 1),
                f(v, "ready.baseline.p99", 1),
                f(v, "ready.speedup_p50", 2),
                f(v, "ready.speedup_p99", 2),
                f(v, "ready.p99_over_p50", 2),
                f(v, "touched.hugemem.p50", 1),
                f(v, "touched.hugemem.p99", 1),
                f(v, "touched.baseline.p50", 1),
                f(v, "touched.baseline.p99", 1),
                f(v, "touched.speedup_p50", 2),
                f(v, "touched.speedup_p99", 2),
            );
        }
        out += "\n";
    }
    out
}

/// One churn run as a table row.
fn churn_row(name: &str, v: &Value) -> String {
    let served = v
        .get("page_sizes")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(page, n)| format!("{n} x {page}"))
                .collect::<Vec<_>>()
                .join(", ")
        })
        .unwrap_or_else(|| "-".into());
    format!(
        "| `{name}` | {} | {} ({}) | {} x {} ({}) | {served} | {} ({}) | {} ({}) | {} / {} / {} | {} | {} / {} | {}x | {} |\n",
        s(v, "vmm"),
        s(v, "page_policy"),
        s(v, "expected_page_size"),
        f(v, "vms", 0),
        size(v, "size_bytes"),
        f(v, "parallel", 0),
        f(v, "downgrades", 0),
        s(v, "downgrades_source"),
        f(v, "stale_reads", 0),
        f(v, "baseline_stale_reads", 0),
        f(v, "p50_ms", 1),
        f(v, "p99_ms", 1),
        f(v, "max_ms", 1),
        f(v, "alloc_p50_ms", 1),
        f(v, "baseline_p50_ms", 1),
        f(v, "baseline_p99_ms", 1),
        f(v, "speedup_p50", 2),
        f(v, "p99_over_p50", 2),
    )
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
        Some("vmstart") => vmstart(v),
        Some("compare") => compare(v),
        Some("demo") => demo(v),
        Some("takeover") => takeover(v),
        _ => generic(v),
    };
    out += &body;
    out += "\n";
    out
}

/// `v[path]` as a number.
fn num(v: &Value, path: &str) -> Option<f64> {
    super::lookup(v, path).and_then(Value::as_f64)
}

/// `v[path]` with `digits` decimals, or `-`.
fn f(v: &Value, path: &str, digits: usize) -> String {
    num(v, path).map_or_else(|| "-".into(), |x| fixed(x, digits))
}

/// `v[path]` as a string, or `-`.
fn s(v: &Value, path: &str) -> String {
    match super::lookup(v, path) {
        Some(Value::String(x)) => x.clone(),
        Some(Value::Null) | None => "-".into(),
        Some(other) => other.to_string(),
    }
}

/// Bytes as `2G`, `512M`.
fn size(v: &Value, path: &str) -> String {
    super::lookup(v, path)
        .and_then(Value::as_u64)
        .map_or_else(|| "-".into(), guest_mem::size::format_size)
}

/// The header line: which file, the command, date, build and machine.
fn run_line(name: &str, v: &Value) -> String {
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

fn clear(v: &Value) -> String {
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

fn alloc(v: &Value) -> String {
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
    out += "| variant (clock stops with the memory mapped and ready for the VMM) | best s | median s | GB/s (best) |\n|---|---|---|---|\n";
    let mut row = |label: String, key: &str| {
        let best = num(v, key);
        let rate = if key == "pooled_eager_s" {
            "(a hand-out)".to_string()
        } else {
            best.filter(|b| *b > 0.0)
                .map_or_else(|| "-".into(), |b| fixed(gb / b, 1))
        };
        out += &format!(
            "| {label} | {} | {} | {rate} |\n",
            f(v, key, 5),
            f(v, &format!("medians.{key}"), 5),
        );
    };
    row(
        "fresh, daemon-less (`Region::allocate`)".into(),
        "fresh_eager_s",
    );
    row("fresh, through the daemon".into(), "fresh_eager_daemon_s");
    row(
        "**from the clean pool**, through the daemon".into(),
        "pooled_eager_s",
    );
    row(
        format!(
            "the pool's price, after the FREE: FREE → clean (background scrub; {} CPU-s per GiB)",
            f(v, "scrub_cpu_s_per_gib", 3)
        ),
        "free_to_clean_s",
    );
    row(
        format!(
            "cloud-hypervisor-style prefault (threads: {})",
            f(v, "cloud_hypervisor_style_threads", 0)
        ),
        "cloud_hypervisor_style_s",
    );
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
            "fresh via the daemon / clean pool",
            "fresh_eager_daemon_over_pooled_eager",
        ),
        (
            "cloud-hypervisor style / clean pool",
            "cloud_hypervisor_style_over_pooled_eager",
        ),
    ] {
        out += &format!("| {label} | {} |\n", f(v, &format!("ratios.{key}"), 2));
    }
    if let Some(points) = v
        .get("scaling")
        .and_then(Value::as_array)
        .filter(|p| !p.is_empty())
    {
        out += "\n| fresh populate, node-local workers | best s | median s | GB/s | speedup |\n|---|---|---|---|---|\n";
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
    }
    out
}

fn mlock(v: &Value) -> String {
    let mut out = format!(
        "{} per region, best of {} repetitions (stalls: median / worst over them), {} worker(s) per node.{}\n\n",
        size(v, "size_bytes"),
        f(v, "reps", 0),
        f(v, "threads_per_node", 0),
        note(v, "hugetlb_note")
    );
    out += "| backing | path | calls | lock s | unlock s | max stall ms (median / worst) | lock s, no probe |\n|---|---|---|---|---|---|---|\n";
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
                "| {label} | {path}{chunk} | {calls} | {} | {} | {} / {} | {} |\n",
                f(b, &format!("{path}_lock_s"), 3),
                f(b, &format!("{path}_unlock_s"), 4),
                f(b, &format!("{path}_max_stall_ms"), 1),
                f(b, &format!("{path}_max_stall_worst_ms"), 1),
                f(b, &format!("{path}_lock_quiet_s"), 3),
            );
        }
    }
    out += "\n| backing | probe alone: max stall ms | stall reduction | total time, batched vs single, with probe | the same, no probe | expectation (≥10x, ≤+10 %) |\n|---|---|---|---|---|---|\n";
    for (key, label) in backings {
        let Some(r) = v["ratios"].get(key).filter(|r| !r.is_null()) else {
            continue;
        };
        let pct =
            |p: &str| num(r, p).map_or_else(|| "-".into(), |x| format!("{:+.1} %", x * 100.0));
        out += &format!(
            "| {label} | {} | {}x | {} | {} | {} |\n",
            f(&v[key], "idle_max_stall_ms", 1),
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

fn vmstart(v: &Value) -> String {
    let mut out = format!(
        "{} on {} pages; clearing kernel `{}`, one page cleared in {} µs ({} GB/s); prefault threads {}.\n\n",
        size(v, "size"),
        s(v, "page_size"),
        s(v, "kernel"),
        f(v, "one_page_clear_us", 0),
        f(v, "clear_gbps", 1),
        f(v, "prefault_threads", 0)
    );
    out += "| scenario | served | ALLOC ms | ready ms | first instruction ms | all pages touched ms | VM setup ms (in both) |\n|---|---|---|---|---|---|---|\n";
    let scenarios = v.get("scenarios").and_then(Value::as_array);
    for sc in scenarios.into_iter().flatten() {
        let served = match sc.get("recleared") {
            Some(Value::Bool(true)) => "dirty, cleared by the ALLOC".to_string(),
            Some(Value::Bool(false)) => "clean (scrubbed before the ALLOC)".to_string(),
            _ => s(sc, "flags"),
        };
        out += &format!(
            "| `{}` | {served} | {} | {} | {} | {} | {} |\n",
            s(sc, "name"),
            f(sc, "alloc_ms", 1),
            f(sc, "ready_ms", 1),
            f(sc, "first_instruction_ms", 1),
            f(sc, "all_touched_ms", 1),
            f(sc, "vm_setup_ms", 1),
        );
    }
    let lazy: Vec<&Value> = scenarios
        .into_iter()
        .flatten()
        .filter(|sc| sc.get("faults").is_some_and(|x| !x.is_null()))
        .collect();
    if !lazy.is_empty() {
        out += "\n| lazy scenario | faults | cleared by the faulting handler | already clean | waited for another clear | pages scrubbed ahead | fault latency p50 / p99 / max µs |\n|---|---|---|---|---|---|---|\n";
        for sc in lazy {
            let fl = &sc["faults"];
            out += &format!(
                "| `{}` | {} | {} | {} | {} | {} | {} / {} / {} |\n",
                s(sc, "name"),
                f(fl, "faults", 0),
                f(fl, "cleared_on_fault", 0),
                f(fl, "already_clean", 0),
                f(fl, "coalesced", 0),
                f(fl, "scrubbed_ahead", 0),
                f(fl, "p50_us", 0),
                f(fl, "p99_us", 0),
                f(fl, "max_us", 0),
            );
        }
    }
    let notes = v.get("notes").and_then(Value::as_array);
    let notes: Vec<String> = notes
        .into_iter()
        .flatten()
        .filter_map(|n| n.as_str().map(str::to_string))
        .collect();
    if !notes.is_empty() {
        out += "\n";
        for n in notes {
            out += &format!("* {n}\n");
        }
    }
    out
}

fn compare(v: &Value) -> String {
    let mut out = format!(
        "{} on {} pages, best / median of {} repetitions, {} CPUs, QEMU prealloc-threads {}; QEMU: {}; cloud-hypervisor: {}.{}\n\n",
        size(v, "size_bytes"),
        s(v, "page_size"),
        f(v, "reps", 0),
        f(v, "cpus", 0),
        f(v, "prealloc_threads", 0),
        s(v, "qemu_version"),
        s(v, "cloud_hypervisor_version"),
        note(v, "note")
    );
    out += "| variant | ready s (best / median) | power-off s (best / median) | ALLOC s (best) | ratio vs the baseline: ready / power-off (best) |\n|---|---|---|---|---|\n";
    let baseline = s(v, "baseline");
    for var in v
        .get("variants")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let key = s(var, "key");
        let label = s(var, "label");
        let label = if key == baseline && !label.contains("baseline") {
            format!("{label} (baseline)")
        } else {
            label
        };
        if var["skipped"] == true {
            out += &format!("| {label} | skipped: {} | | | |\n", s(var, "note"));
            continue;
        }
        let pair = |p: &str, d: usize| {
            format!(
                "{} / {}",
                f(var, &format!("{p}.best"), d),
                f(var, &format!("{p}.median"), d)
            )
        };
        let ratio = v["ratios"].get(key.as_str()).map_or_else(
            || {
                if key == baseline {
                    "1 / 1".to_string()
                } else {
                    "-".to_string()
                }
            },
            |r| format!("{} / {}", f(r, "ready", 2), f(r, "poweroff", 2)),
        );
        out += &format!(
            "| {label} | {} | {} | {} | {ratio} |\n",
            pair("ready_s", 3),
            pair("poweroff_s", 3),
            f(var, "alloc_s.best", 4),
        );
    }
    if v.get("pool_scrub_s").is_some_and(|x| !x.is_null()) {
        out += &format!(
            "\nFREE → pool clean (the background scrub behind the pool rows): {} / {} s.\n",
            f(v, "pool_scrub_s.best", 3),
            f(v, "pool_scrub_s.median", 3)
        );
    }
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

/// `x` as an integer when it is one, else with 4 significant digits.
fn significant(x: f64) -> String {
    if x.fract() == 0.0 || !x.is_finite() {
        return fixed(x, 0);
    }
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // small, clamped
    let decimals = (3.0 - x.abs().log10().floor()).clamp(0.0, 12.0) as usize;
    fixed(x, decimals)
}

fn takeover(v: &Value) -> String {
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

fn demo(v: &Value) -> String {
    let notes: String = v
        .get("notes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(|x| format!(" Note: {x}."))
        .collect();
    let mut out = format!(
        "{} on {} pages.{notes}\n\n",
        size(v, "size_bytes"),
        s(v, "page_size"),
    );
    out += "| step | figure |\n|---|---|\n";
    out += &format!("| daemon start | {} s |\n", f(v, "daemon_start_s", 4));
    out += &format!(
        "| ALLOC, fresh pages | {} s ({} GB/s populated and zeroed by the kernel) |\n",
        f(v, "alloc_fresh_s", 4),
        f(v, "alloc_fresh_gbps", 1)
    );
    let guest = |out: &mut String, key: &str, which: &str| {
        let Some(g) = v.get(key).filter(|g| !g.is_null()) else {
            return;
        };
        *out += &format!(
            "| guest {which}: ALLOC sent → first instruction | {} ms (VM setup {} ms; vCPU start → first instruction {} ms) |\n",
            f(g, "alloc_to_first_instruction_ms", 2),
            f(g, "vm_setup_ms", 2),
            f(g, "first_instruction_ms", 2),
        );
        *out += &format!(
            "| guest {which}: pages touched | {} in {} ms after vCPU start; read non-zero: {} |\n",
            f(g, "pages_touched", 0),
            f(g, "all_touched_ms", 2),
            s(g, "saw_nonzero"),
        );
    };
    guest(&mut out, "guest_fresh", "#1 (fresh)");
    out += &format!(
        "| FREE → pool clean | {} s ({} scrubbed at {} GB/s) |\n",
        f(v, "free_to_clean_s", 4),
        size(v, "scrubbed_bytes"),
        f(v, "scrub_gbps", 1)
    );
    out += &format!(
        "| ALLOC from the clean pool | {} s (from the pool: {}; {}x faster than fresh) |\n",
        num(v, "alloc_pooled_s").map_or_else(|| "-".into(), significant),
        s(v, "alloc_pooled_from_pool"),
        f(v, "pooled_speedup", 0)
    );
    guest(&mut out, "guest_pooled", "#2 (pool)");
    if let Some(why) = v.get("guest_skipped").and_then(Value::as_str) {
        out += &format!("| guests | skipped: {why} |\n");
    }
    out += &format!("| whole demo | {} s |\n", f(v, "total_s", 2));
    out
}

/// ` Note: …` for a non-empty string at `path`, else nothing.
fn note(v: &Value, path: &str) -> String {
    match super::lookup(v, path) {
        Some(Value::String(n)) if !n.is_empty() => format!(" Note: {n}."),
        _ => String::new(),
    }
}
