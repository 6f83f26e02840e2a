use super::*;
use serde_json::json;
use serde_json::Value;

fn dir_with(files: &[(&str, Value)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    for (name, v) in files {
        std::fs::write(dir.path().join(format!("{name}.json")), v.to_string()).expect("write");
    }
    dir
}

fn clear_run() -> Value {
    json!({
        "bench": "clear",
        "size_bytes": 1u64 << 30, "page_size": "1G", "reps": 5, "cpus": 2,
        "kernel_fault_gbps": 8.0, "kernel_refault_gbps": 10.0, "memset_gbps": 11.0,
        "multipage_gbps": 12.0, "per4k_gbps": 9.0, "nt_gbps": 20.0,
        "default_kernel": "nt", "default_gbps": 20.0,
        "parallel": [{"threads": 1, "gbps": 18.0, "speedup": 1.0, "runner_gbps": 19.0, "runner_speedup": 1.0}],
        "ratios": {"multipage_vs_per4k": 1.3333, "default_vs_kernel_refault": 2.0},
        "run": {"command": "hugemem bench clear --json", "date": "2026-11-23T22:00:00Z",
                "build": "release", "version": "0.1.0",
                "machine": {"cpu_model": "Test CPU", "cores": 2, "numa_nodes": 1,
                            "memory_bytes": 1u64 << 34, "kernel": "6.18", "virtualized": true,
                            "load_at_start": 1.5}}
    })
}

#[test]
fn paths_and_formats() {
    let v = json!({"a": {"b": [1.0, {"name": "x", "y": 2.345}]}, "s": "text"});
    assert_eq!(lookup(&v, "a.b.0"), Some(&json!(1.0)));
    assert_eq!(lookup(&v, "a.b.name=x.y"), Some(&json!(2.345)));
    assert_eq!(lookup(&v, "a.b.name=z.y"), None);
    assert_eq!(lookup(&v, "a.c"), None);
    assert_eq!(lookup(&v, "s.t"), None);
    assert_eq!(format_value(&json!(2.345), ".2x").as_deref(), Some("2.35x"));
    assert_eq!(
        format_value(&json!(1234.5), ".0 ms").as_deref(),
        Some("1234 ms")
    );
    assert_eq!(format_value(&json!("text"), "s").as_deref(), Some("text"));
    assert_eq!(
        format_value(&json!(2u64 << 30), "size").as_deref(),
        Some("2G")
    );
    assert_eq!(format_value(&json!(0), "size").as_deref(), Some("0"));
    assert_eq!(format_value(&json!("text"), ".2"), None);
    assert_eq!(format_value(&json!(1.0), "x"), None);
    assert_eq!(format_value(&json!(1.25), "+.1").as_deref(), Some("+1.2"));
    assert_eq!(
        format_value(&json!(-0.44), "+.1 ms").as_deref(),
        Some("-0.4 ms")
    );
    assert_eq!(format_value(&json!(0.0), "+.1").as_deref(), Some("+0.0"));
    assert_eq!(format_value(&json!("text"), "+.1"), None);
}

#[test]
fn blocks_and_values_are_generated_and_idempotent() {
    let dir = dir_with(&[("c", clear_run())]);
    let doc = "# T\n\nProse says <!-- v:c:ratios.default_vs_kernel_refault:.2x -->9.99x<!-- /v --> and <!-- v:c:run.date:s -->old<!-- /v -->.\n\n<!-- results:c -->\nstale table\n<!-- /results -->\n\nAfter.\n";
    let out = render(doc, dir.path()).expect("render");
    assert!(out.contains("Prose says <!-- v:c:ratios.default_vs_kernel_refault:.2x -->2.00x<!-- /v --> and <!-- v:c:run.date:s -->2026-11-23T22:00:00Z<!-- /v -->."), "{out}");
    assert!(!out.contains("stale table"), "{out}");
    assert!(out.contains("`hugemem bench clear --json`, 2026-11-23T22:00:00Z, release build; Test CPU, 2 CPUs, 1 NUMA node, 16.0 GiB, Linux 6.18, a virtual machine"), "{out}");
    assert!(
        out.contains("| **default** (`nt`) | 20.00 | 2.50x | 2.00x |"),
        "{out}"
    );
    assert!(
        out.contains("| 1 | 18.00 | 1.00x | 19.00 | 1.00x |"),
        "{out}"
    );
    assert!(out.ends_with("<!-- /results -->\n\nAfter.\n"), "{out}");
    assert_eq!(render(&out, dir.path()).expect("again"), out, "idempotent");
    assert_eq!(names_in(doc), ["c"]);
}

#[test]
fn drift_is_seen_and_fixed_by_update() {
    let dir = dir_with(&[("c", clear_run())]);
    let doc_path = dir.path().join("doc.md");
    std::fs::write(&doc_path, "x <!-- v:c:memset_gbps:.1 -->1.0<!-- /v -->\n").expect("write doc");
    assert!(!update(&doc_path, dir.path(), false).expect("check"));
    assert!(!update(&doc_path, dir.path(), true).expect("write"));
    assert!(update(&doc_path, dir.path(), false).expect("check again"));
    assert_eq!(
        std::fs::read_to_string(&doc_path).expect("read"),
        "x <!-- v:c:memset_gbps:.1 -->11.0<!-- /v -->\n"
    );
}

#[test]
fn bad_markers_are_errors_with_their_line() {
    let dir = dir_with(&[("c", clear_run())]);
    let cases = [
        ("<!-- results:c -->\nno end\n", 1, "no <!-- /results -->"),
        ("a\n<!-- /results -->\n", 2, "without its opening"),
        (
            "<!-- results:missing -->\n<!-- /results -->\n",
            0,
            "cannot read",
        ),
        (
            "<!-- results:../c -->\n<!-- /results -->\n",
            1,
            "bad results name",
        ),
        (
            "<!-- results:c -->\n<!-- results:c -->\n<!-- /results -->\n",
            2,
            "cannot nest",
        ),
        ("<!-- v:c:nope:.1 -->x<!-- /v -->\n", 1, "has no nope"),
        (
            "<!-- v:c:memset_gbps -->x<!-- /v -->\n",
            1,
            "expected v:NAME:PATH:FORMAT",
        ),
        ("<!-- v:c:memset_gbps:.1 -->x\n", 1, "no <!-- /v -->"),
        (
            "<!-- v:c:page_size:.1 -->x<!-- /v -->\n",
            1,
            "cannot be shown",
        ),
    ];
    for (doc, line, why) in cases {
        let e = render(doc, dir.path()).expect_err(doc);
        let text = e.to_string();
        assert!(text.contains(why), "{doc:?}: {text}");
        if line > 0 {
            assert!(
                text.starts_with(&format!("line {line}:")),
                "{doc:?}: {text}"
            );
        }
    }
}

#[test]
fn every_kind_renders_without_its_optional_parts() {
    // Files of each kind with nothing but the kind: every figure shows as `-`
    // and nothing panics; an unknown kind gets its top-level figures.
    for kind in [
        "clear", "alloc", "mlock", "fill", "vmstart", "compare", "demo", "migrate",
    ] {
        let out = tables::block(
            "x",
            &json!({"bench": kind, "stale_reads": 0, "p50_ms": 41.25}),
        );
        assert!(out.contains("the file has no run record"), "{kind}: {out}");
        assert!(
            out.starts_with('\n') && out.ends_with('\n'),
            "{kind}: {out}"
        );
    }
    let out = tables::block(
        "x",
        &json!({"bench": "churn", "stale_reads": 0, "p50_ms": 41.25}),
    );
    assert!(
        out.contains("| `stale_reads` | 0 |") && out.contains("| `p50_ms` | 41.25 |"),
        "{out}"
    );
    let out = tables::block(
        "x",
        &json!({"bench": "churn", "a": 0.000_187_26, "b": 1676.89}),
    );
    assert!(
        out.contains("| `a` | 0.0001873 |") && out.contains("| `b` | 1677 |"),
        "{out}"
    );
}

#[test]
fn churn_runs_share_one_table_and_other_lists_follow_each_other() {
    let churn = |vmm: &str, p50: f64| {
        json!({"bench": "churn", "vmm": vmm, "vms": 10, "parallel": 1, "size_bytes": 2u64 << 30,
               "page_policy": "best", "expected_page_size": "1G", "page_sizes": {"1G": 9, "4K": 1},
               "downgrades": 1, "downgrades_source": "daemon", "stale_reads": 0, "baseline_stale_reads": 0,
               "p50_ms": p50, "p99_ms": 80.0, "max_ms": 80.0, "alloc_p50_ms": 10.0,
               "baseline_p50_ms": 200.0, "baseline_p99_ms": 210.0, "speedup_p50": 200.0 / p50,
               "p99_over_p50": 80.0 / p50})
    };
    let dir = dir_with(&[
        ("a", churn("qemu", 40.0)),
        ("b", churn("micro", 50.0)),
        ("c", clear_run()),
    ]);
    let doc = "<!-- results:a, b -->\n<!-- /results -->\n<!-- results:a,c -->\n<!-- /results -->\n";
    let out = render(doc, dir.path()).expect("render");
    // Runs from before the floor: its columns show `-`.
    assert!(out.contains("| `a` | qemu | best (1G) | 10 x 2G (1) | 9 x 1G, 1 x 4K | 1 (daemon) | 0 (0) | 40.0 / 80.0 / 80.0 | 10.0 | 200.0 / 210.0 | 5.00x | 2.00 | - / - | - |"), "{out}");
    assert!(out.contains("| `b` | micro |"), "{out}");
    assert_eq!(out.matches("| run | VMM |").count(), 1, "{out}");
    // churn and clear mixed: each file's own block.
    assert!(
        out.contains("| `vms` | 10 |") && out.contains("| **default** (`nt`)"),
        "{out}"
    );
    assert_eq!(names_in(doc), ["a", "b", "c"]);
}

#[test]
fn takeover_and_mlock_show_their_floor_and_limit_or_a_dash() {
    let spread = |m: f64| json!({"median": m, "worst": m});
    let mode = |first: f64| {
        json!({"first_alloc_ms": spread(first), "pool_served_ms": spread(first),
               "max_stall_ms": spread(first), "bytes_zeroed": spread(0.0)})
    };
    let older = json!({"bench": "takeover", "takeover": mode(12.0), "stop_start": mode(9.0),
                       "ratios": {"first_alloc_speedup": 0.75}});
    let out = tables::block("t", &older);
    assert!(out.contains("| no switch (floor) |"), "{out}");
    assert!(
        out.contains("| longest client stall, ms | 12.0 (12.0) | 9.0 (9.0) | - |"),
        "{out}"
    );
    assert!(!out.contains("Against no switch"), "{out}");
    let mut newer = older.clone();
    newer["floor"] = mode(1.5);
    newer["ratios"]["takeover_over_floor"] = json!({"first_alloc": 8.0});
    let out = tables::block("t", &newer);
    assert!(
        out.contains("| longest client stall, ms | 12.0 (12.0) | 9.0 (9.0) | 1.5 (1.5) |"),
        "{out}"
    );
    assert!(out.contains("0 (0), the limit is 0 |"), "{out}");
    assert!(
        out.contains("takeover's first ALLOC took 8.00x the floor's time, stop and start's -x"),
        "{out}"
    );

    let backing = json!({"single_lock_s": 0.5, "batched_lock_s": 0.6});
    let older = json!({"bench": "mlock", "shmem_4k": backing, "ratios": {"shmem_4k": {}}});
    let out = tables::block("m", &older);
    assert!(
        out.contains("| 4 KiB shmem | single | 1 | 0.500 | - | - / - | - | - (-) |"),
        "{out}"
    );
    let mut newer = older.clone();
    newer["shmem_4k"]["populate_limit_s"] = json!(0.4);
    newer["ratios"]["shmem_4k"] =
        json!({"single_lock_over_limit": 1.25, "single_lock_quiet_over_limit": 1.1});
    let out = tables::block("m", &newer);
    assert!(
        out.contains("| 4 KiB shmem | single | 1 | 0.500 | - | - / - | - | 1.25x (1.10x) |"),
        "{out}"
    );
    assert!(out.contains("| 4 KiB shmem | - | 0.400 |"), "{out}");
}

#[test]
fn churn_rows_show_the_floor_and_the_limit() {
    let span = |h: f64, b: f64, fl: f64| {
        json!({"hugemem": {"p50": h, "p99": h + 1.0, "max": h + 1.0},
               "baseline": {"p50": b, "p99": b + 1.0, "max": b + 1.0},
               "floor": {"p50": fl, "p99": fl + 1.0, "max": fl + 1.0},
               "speedup_p50": b / h, "speedup_p99": (b + 1.0) / (h + 1.0), "p99_over_p50": (h + 1.0) / h})
    };
    let run = json!({"bench": "churn", "vmm": "qemu", "vms": 10, "parallel": 1, "size_bytes": 2u64 << 30,
           "page_policy": "1G", "expected_page_size": "1G", "page_sizes": {"1G": 10},
           "downgrades": 0, "downgrades_source": "daemon", "stale_reads": 0, "baseline_stale_reads": 0,
           "p50_ms": 100.0, "p99_ms": 110.0, "max_ms": 110.0, "alloc_p50_ms": 1.0,
           "baseline_p50_ms": 150.0, "baseline_p99_ms": 160.0, "speedup_p50": 1.5, "p99_over_p50": 1.1,
           "host_vm_fits": 1, "ready": span(50.0, 120.0, 45.5), "touched": span(90.0, 140.0, 60.0),
           "floor": {"p50_ms": 70.0, "p99_ms": 75.0, "max_ms": 75.0},
           "over_floor": {"p50_ms": 30.0, "ready_p50_ms": 4.5, "touched_p50_ms": -1.25},
           "limits": {"kernel_zeroing_1_thread_ms": 81.25}});
    let dir = dir_with(&[("f", run)]);
    let out = render("<!-- results:f -->\n<!-- /results -->\n", dir.path()).expect("render");
    assert!(
        out.contains("| 150.0 / 160.0 | 1.50x | 1.10 | 70.0 / 75.0 | +30.0 |"),
        "{out}"
    );
    assert!(
        out.contains("| `f` | 1 | 50.0 / 51.0 | 120.0 / 121.0 | 2.40x (2.37x) | 1.02 | 45.5 | +4.5 | 90.0 / 91.0 | 81.2 | 140.0 / 141.0 | 1.56x (1.55x) | 60.0 | -1.2 |"),
        "{out}"
    );
}

fn vmm_update_run(size: u64, pause: f64, floor_pause: f64, copy_ms: f64) -> Value {
    json!({
        "bench": "vmm-update", "vmm": "cloud-hypervisor", "size": size, "page_size": "2M",
        "page_size_note": "run on 2 MiB pages; the host has 1 huge pages of 1 GiB (1 free)",
        "update": {"updates": 10, "update_median_ms": 40.0, "switch_gap_median_ms": pause,
                   "downtime_median_ms": pause, "idle_gap_ms": 0.1,
                   "ram_transferred_max_bytes": 4096, "ram_transferred_max_pct": 0.001,
                   "stale_guest": 0, "stale_host": 0, "cleared_bytes": 0,
                   "balanced": true, "released_after_exit": true},
        "floor": {"updates": 10, "update_median_ms": 38.0, "switch_gap_median_ms": floor_pause},
        "copy": {"update_ms": copy_ms, "switch_gap_ms": 9.0, "ram_transferred_bytes": size},
        "update_time_ratio": copy_ms / 40.0,
        "update_over_floor_paired_ms": 2.0, "update_over_floor_ci95_ms": [-1.0, 4.5],
        "switch_gap_over_floor_paired_ms": 0.1
    })
}

#[test]
fn vmm_update_runs_share_one_table_with_their_expectations_checked() {
    let small = vmm_update_run(1 << 30, 1.0, 0.9, 500.0);
    let large = vmm_update_run(8 << 30, 1.5, 1.0, 600.0);
    let out = tables::blocks(&[("a".into(), small), ("b".into(), large)]);
    assert!(
        out.contains("| 1G (cloud-hypervisor, 2M pages) | 8G"),
        "{out}"
    );
    assert!(out.contains("+2.0 [-1.0, +4.5]"), "{out}");
    assert!(out.contains("+0.10 (no interval: under 6 pairs)"), "{out}");
    assert!(
        out.contains("| met (1.00 ≤ 0.90 + 2) | met (1.50 ≤ 1.00 + 2) |"),
        "{out}"
    );
    assert!(
        out.contains("1.50x (1.50 over 1.00 ms): **not met**"),
        "{out}"
    );
    // The copy ratio is judged at 8 GiB only: 600 / 40 = 15x < 20x.
    assert!(out.contains("| 12.5x | 15.0x: **not met** |"), "{out}");
    assert!(out.contains("0.001000 %: met"), "{out}");
    assert!(out.contains("the host has 1 huge pages of 1 GiB"), "{out}");
}

fn offload_run(size: u64, park: f64, load_vs_disk: f64, file_ratio: f64, od_ms: f64) -> Value {
    json!({
        "bench": "offload", "size": size, "page_size": "2M", "reps": 6,
        "page_size_note": "run on 2 MiB pages; the host has 1 huge pages of 1 GiB (1 free)",
        "from_park": {"park_ms": {"median": park}, "restore_ms": {"median": 9.0},
                      "restore_launcher_ms": {"median": 8.0}, "pause_ms": {"median": 16.0},
                      "park_copied_bytes": 0, "park_written_bytes": 24, "stale_guest": 0},
        "from_disk": {"save_ms": {"median": 2000.0}, "load_ms": {"median": 700.0},
                      "load_daemon_copy_ms": {"median": 690.0}, "load_gbps": {"median": 1.5},
                      "disk_read_gbps": {"median": 1.5 / load_vs_disk},
                      "disk_to_running_ms": {"median": 710.0}, "stale_guest": 0},
        "on_demand": {"park_ms": {"median": 4.0}, "restore_ms": {"median": od_ms},
                      "disk_to_running_ms": {"median": od_ms + 4.0},
                      "all_filled_ms": {"median": 900.0}, "stale_host": 0, "stale_guest": 0},
        "ch_file": {"snapshot_ms": {"median": 1500.0}, "restore_ms": {"median": 710.0 * file_ratio},
                    "stale_guest": 0},
        "offload_daemon": null,
        "offload_daemon_note": "no offload_daemon binary given",
        "load_vs_disk": load_vs_disk, "ch_file_over_from_disk": file_ratio,
        "ch_file_minus_from_disk_paired_ms": 300.0, "ch_file_minus_from_disk_ci95_ms": [100.0, 500.0]
    })
}

#[test]
fn offload_runs_share_one_table_with_their_expectations_checked() {
    let small = offload_run(1 << 30, 8.0, 0.9, 2.5, 30.0);
    let large = offload_run(8 << 30, 12.0, 0.5, 1.5, 15.0);
    let out = tables::blocks(&[("a".into(), small), ("b".into(), large)]);
    assert!(out.contains("| 1G (2M pages) | 8G (2M pages) |"), "{out}");
    assert!(
        out.contains("1.50x (12.0 over 8.0 ms): **not met**"),
        "{out}"
    );
    assert!(out.contains("0.90x (1.50 over 1.67 GB/s): met"), "{out}");
    assert!(
        out.contains("0.50x (1.50 over 3.00 GB/s): **not met**"),
        "{out}"
    );
    assert!(out.contains("2.50x (1775.0 over 710.0 ms): met"), "{out}");
    assert!(
        out.contains("1.50x (1065.0 over 710.0 ms): **not met**"),
        "{out}"
    );
    assert!(out.contains("+300.0 [+100.0, +500.0]"), "{out}");
    assert!(out.contains("0 / 24: met"), "{out}");
    assert!(out.contains("| 2000.0 / 1500.0 / - |"), "{out}");
    // Judged at 8 GiB only: the 1 GiB column's 30 ms is shown, not judged.
    assert!(
        out.contains("| 30.0 ms (judged at 8 GiB) | 15.0 ms: met |"),
        "{out}"
    );
    assert!(
        out.contains("| 4.0 / 30.0 / 34.0 | 4.0 / 15.0 / 19.0 |"),
        "{out}"
    );
    assert!(
        out.contains("Note: no offload_daemon binary given."),
        "{out}"
    );
}

#[test]
fn offload_save_rows_appear_with_a_run_that_measured_them_and_judge_its_share() {
    let old = offload_run(1 << 30, 8.0, 0.9, 2.5, 30.0);
    let out = tables::blocks(&[("old".into(), old.clone())]);
    assert!(
        !out.contains("save ≥ 0.8x"),
        "no save rows without them: {out}"
    );
    let mut new = offload_run(2 << 30, 8.0, 0.9, 2.5, 30.0);
    new["dense"] = json!(true);
    new["from_disk"]["save_written_bytes"] = json!({"median": (2u64 << 30) as f64});
    new["from_disk"]["save_gbps"] = json!({"median": 0.4});
    new["from_disk"]["disk_write"] = json!({
        "single_before_gbps": {"median": 0.5}, "single_after_gbps": {"median": 0.6},
        "parallel_before_gbps": {"median": 0.7}, "parallel_after_gbps": {"median": 0.8},
        "buffered_gbps": {"median": 0.3}, "host_load": {"median": 1.5}
    });
    new["from_disk"]["stale_dense"] = json!(0);
    new["save_over_disk"] = json!({
        "single": {"rounds": 6, "median": 0.75, "min": 0.6, "max": 0.9, "ci95": [0.65, 0.85]},
        "parallel": {"rounds": 6, "median": 0.55, "min": 0.5, "max": 0.6, "ci95": null},
        "buffered": null, "single_drift": null, "parallel_drift": null
    });
    let out = tables::blocks(&[("old".into(), old), ("new".into(), new)]);
    assert!(
        out.contains("| 1G (2M pages) | 2G (2M pages, dense) |"),
        "{out}"
    );
    assert!(
        out.contains(
            "| - | 0.75x [0.60, 0.90] (6 rounds, 95 % interval [0.65, 0.85]): **not met** |"
        ),
        "{out}"
    );
    assert!(out.contains("| - / - | 0.50 / 0.60 |"), "{out}");
    assert!(out.contains("| - / -; - | 0.70 / 0.80; 0.30 |"), "{out}");
    assert!(
        out.contains("| - / - / 2000.0, - and - | 2G / 0.40 / 2000.0, - and - |"),
        "{out}"
    );
    assert!(out.contains("0.55x [0.50, 0.60] (6 rounds) / -"), "{out}");
    assert!(out.contains("| - / - | 0 / - |"), "{out}");
}
