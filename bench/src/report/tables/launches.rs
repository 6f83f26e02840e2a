//! The tables of the benches that boot guests: `vmstart`, `compare`,
//! `demo`, and a churn run's row.

use serde_json::Value;

use super::cells::{f, note, num, s, signed, significant, size};

pub(super) fn vmstart(v: &Value) -> String {
    let mut out = format!(
        "{} on {} pages; clearing kernel `{}`, one page cleared in {} µs ({} GB/s); prefault threads {}; the kernel zeroing the whole size at fault time on one thread (the limit of a one-vCPU guest's touches of fresh or punched memory): {} ms{}.\n\n",
        size(v, "size"),
        s(v, "page_size"),
        s(v, "kernel"),
        f(v, "one_page_clear_us", 0),
        f(v, "clear_gbps", 1),
        f(v, "prefault_threads", 0),
        f(v, "kernel_zeroing_1_thread_ms", 1),
        num(v, "kernel_zeroing_all_cpus_ms").map_or_else(String::new, |_| format!(
            "; on all {} CPUs (the limit of those touches with the daemon's fault helpers faulting the same memory in beside them): {} ms",
            f(v, "cpus", 0),
            f(v, "kernel_zeroing_all_cpus_ms", 1)
        ))
    );
    out += "| scenario | served | ALLOC ms | ready ms | first instruction ms | all pages touched ms | the vCPU thread's CPU until then, ms | VM setup ms (in both) | first instruction / all touched over the floor, ms |\n|---|---|---|---|---|---|---|---|---|\n";
    let scenarios = v.get("scenarios").and_then(Value::as_array);
    let floor = scenarios
        .into_iter()
        .flatten()
        .find(|sc| sc.get("name").and_then(Value::as_str) == Some("floor"));
    for sc in scenarios.into_iter().flatten() {
        let served = match sc.get("recleared") {
            Some(Value::Bool(true)) => "dirty, cleared by the ALLOC".to_string(),
            Some(Value::Bool(false)) => "clean (scrubbed before the ALLOC)".to_string(),
            _ if s(sc, "name") == "floor" => "resident memfd, no daemon (the floor)".to_string(),
            _ if s(sc, "name") == "fresh-floor" => {
                "fresh memfd, no daemon (`lazy-fresh`'s floor)".to_string()
            }
            _ => s(sc, "flags"),
        };
        let over = |key: &str| match (num(sc, key), floor.and_then(|fl| num(fl, key))) {
            (Some(x), Some(base)) => format!("{:+.1}", x - base),
            _ => "-".into(),
        };
        out += &format!(
            "| `{}` | {served} | {} | {} | {} | {} | {} | {} | {} / {} |\n",
            s(sc, "name"),
            f(sc, "alloc_ms", 1),
            f(sc, "ready_ms", 1),
            f(sc, "first_instruction_ms", 1),
            f(sc, "all_touched_ms", 1),
            f(sc, "all_touched_vcpu_cpu_ms", 1),
            f(sc, "vm_setup_ms", 1),
            over("first_instruction_ms"),
            over("all_touched_ms"),
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

pub(super) fn compare(v: &Value) -> String {
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
    if let Some(kind) = v.get("pool_hand_out").and_then(Value::as_str) {
        let refault = match v.get("refault_ahead").and_then(Value::as_bool) {
            Some(false) => ", nothing refaulted behind the FREE (`refault_ahead`: false)",
            _ => "",
        };
        out += &format!("The pool rows' hand-out: **{kind}** (`pool_hand_out`){refault}.\n\n");
    }
    let has_floor = v.get("over_floor").is_some();
    out += "| variant | ready s (best / median) | power-off s (best / median) | ALLOC s (best) | ratio vs the baseline: ready / power-off (best) | ready over the VMM's floor, ms (best / median / paired) | power-off over the floor, ms (best / median) | all pages touched s (best / median) | touched over the floor, ms (best / median / paired) |\n|---|---|---|---|---|---|---|---|---|\n";
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
            out += &format!("| {label} | skipped: {} | | | | | | | |\n", s(var, "note"));
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
        let floor = match v.get("over_floor").and_then(|o| o.get(key.as_str())) {
            Some(o) if s(o, "floor") == key => "(the floor) | (the floor)".to_string(),
            Some(o) => {
                let ms = |k: &str| num(o, k).map_or_else(|| "-".into(), |x| format!("{x:+.1}"));
                format!(
                    "{} / {}{} | {} / {}",
                    ms("ready_ms"),
                    ms("ready_median_ms"),
                    paired(o, "ready_paired_median_ms"),
                    ms("poweroff_ms"),
                    ms("poweroff_median_ms")
                )
            }
            None if has_floor => "- | -".into(),
            None => "not measured | not measured".into(),
        };
        let touched = match v.get("over_floor").and_then(|o| o.get(key.as_str())) {
            Some(o) if s(o, "floor") == key => "(the floor)".to_string(),
            Some(o) => {
                let ms = |k: &str| num(o, k).map_or_else(|| "-".into(), |x| format!("{x:+.1}"));
                format!(
                    "{} / {}{}",
                    ms("touched_ms"),
                    ms("touched_median_ms"),
                    paired(o, "touched_paired_median_ms")
                )
            }
            None => "-".into(),
        };
        out += &format!(
            "| {label} | {} | {} | {} | {ratio} | {floor} | {} | {touched} |\n",
            pair("ready_s", 4),
            pair("poweroff_s", 4),
            f(var, "alloc_s.best", 4),
            pair("touched_s", 4),
        );
    }
    if v.get("pool_scrub_s").is_some_and(|x| !x.is_null()) {
        out += &format!(
            "\nFREE → pool clean (the background scrub behind the pool rows): {} / {} s{}.\n",
            f(v, "pool_scrub_s.best", 3),
            f(v, "pool_scrub_s.median", 3),
            if v.get("pool_resident_s").is_some_and(|x| !x.is_null()) {
                format!(
                    "; FREE → resident again (punched pages refaulted; the pool rows' ALLOCs came after it): {} / {} s",
                    f(v, "pool_resident_s.best", 3),
                    f(v, "pool_resident_s.median", 3)
                )
            } else {
                String::new()
            }
        );
    }
    out
}

pub(super) fn demo(v: &Value) -> String {
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
    if v.get("host_first_touch_s").is_some() {
        out += &format!(
            "| warm-up: the host's first touch (the size populated and freed once before timing; docs/platform.md#first-touch) | {} s |\n",
            f(v, "host_first_touch_s", 4)
        );
    }
    out += &format!(
        "| ALLOC, fresh pages{} | {} s ({} GB/s populated and zeroed by the kernel) |\n",
        if v.get("host_first_touch_s").is_some() {
            ", after the warm-up"
        } else {
            " (includes the host's first touch)"
        },
        f(v, "alloc_fresh_s", 4),
        f(v, "alloc_fresh_gbps", 1)
    );
    if num(v, "kernel_zeroing_all_cpus_s").is_some() {
        out += &format!(
            "| the fresh ALLOC's limit: the kernel zeroing the size on all {} CPUs, no daemon | {} s |\n",
            f(v, "cpus", 0),
            f(v, "kernel_zeroing_all_cpus_s", 4)
        );
    }
    let guest = |out: &mut String, key: &str, which: &str, since: &str| {
        let Some(g) = v.get(key).filter(|g| !g.is_null()) else {
            return;
        };
        *out += &format!(
            "| guest {which}: {since} → first instruction | {} ms (VM setup {} ms; vCPU start → first instruction {} ms) |\n",
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
    guest(
        &mut out,
        "guest_floor",
        "on a resident memfd, no daemon (the floor)",
        "mapping started",
    );
    guest(&mut out, "guest_fresh", "#1 (fresh)", "ALLOC sent");
    out += &format!(
        "| FREE → pool clean{} | {} s ({} scrubbed at {} GB/s) |\n",
        if v.get("host_first_touch_s").is_some() {
            " and resident (punched pages refaulted)"
        } else {
            ""
        },
        f(v, "free_to_clean_s", 4),
        size(v, "scrubbed_bytes"),
        f(v, "scrub_gbps", 1)
    );
    out += &format!(
        "| ALLOC from the clean pool | {} s (from the pool: {}; {}; {}x the fresh ALLOC's {} s) |\n",
        num(v, "alloc_pooled_s").map_or_else(|| "-".into(), significant),
        s(v, "alloc_pooled_from_pool"),
        match (
            v.get("alloc_pooled_resident_bytes"),
            v.get("alloc_pooled_hole_bytes").and_then(Value::as_u64)
        ) {
            (Some(_), Some(0)) => format!(
                "resident: {} backed, no holes",
                size(v, "alloc_pooled_resident_bytes")
            ),
            (Some(_), Some(_)) => format!(
                "with holes: {} backed, {} holes",
                size(v, "alloc_pooled_resident_bytes"),
                size(v, "alloc_pooled_hole_bytes")
            ),
            _ => "what it held not measured".into(),
        },
        f(v, "pooled_speedup", 0),
        f(v, "alloc_fresh_s", 4)
    );
    guest(&mut out, "guest_pooled", "#2 (pool)", "ALLOC sent");
    if let Some(why) = v.get("guest_skipped").and_then(Value::as_str) {
        out += &format!("| guests | skipped: {why} |\n");
    }
    out += &format!("| whole demo | {} s |\n", f(v, "total_s", 2));
    out
}

/// One churn run as a table row.
pub(super) fn churn_row(name: &str, v: &Value) -> String {
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
        "| `{name}` | {} | {} ({}) | {} x {} ({}) | {served} | {} ({}) | {} ({}) | {} / {} / {} | {} | {} / {} | {}x | {} | {} / {} | {} |\n",
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
        f(v, "floor.p50_ms", 1),
        f(v, "floor.p99_ms", 1),
        signed(v, "over_floor.p50_ms", 1),
    )
}

/// One churn run's spans (ready, all RAM touched) as a table row.
pub(super) fn churn_spans_row(name: &str, v: &Value) -> String {
    format!(
        "| `{name}` | {} | {} / {} | {} / {} | {}x ({}x) | {} | {} | {} | {} / {} | {} | {} / {} | {}x ({}x) | {} | {} |\n",
        f(v, "host_vm_fits", 0),
        f(v, "ready.hugemem.p50", 1),
        f(v, "ready.hugemem.p99", 1),
        f(v, "ready.baseline.p50", 1),
        f(v, "ready.baseline.p99", 1),
        f(v, "ready.speedup_p50", 2),
        f(v, "ready.speedup_p99", 2),
        f(v, "ready.p99_over_p50", 2),
        f(v, "ready.floor.p50", 1),
        signed(v, "over_floor.ready_p50_ms", 1),
        f(v, "touched.hugemem.p50", 1),
        f(v, "touched.hugemem.p99", 1),
        f(v, "limits.kernel_zeroing_1_thread_ms", 1),
        f(v, "touched.baseline.p50", 1),
        f(v, "touched.baseline.p99", 1),
        f(v, "touched.speedup_p50", 2),
        f(v, "touched.speedup_p99", 2),
        f(v, "touched.floor.p50", 1),
        signed(v, "over_floor.touched_p50_ms", 1),
    )
}

/// ` / +x.x` for a paired median over the floor, or nothing in runs made
/// before the field existed.
fn paired(over_floor: &Value, key: &str) -> String {
    let ci = over_floor
        .get(key.replace("_median_ms", "_ci95_ms"))
        .and_then(Value::as_array)
        .and_then(|b| Some((b.first()?.as_f64()?, b.get(1)?.as_f64()?)))
        .map_or_else(String::new, |(lo, hi)| format!(" [{lo:+.1}, {hi:+.1}]"));
    num(over_floor, key).map_or_else(String::new, |x| format!(" / {x:+.1}{ci}"))
}
