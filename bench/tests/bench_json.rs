//! `hugemem bench clear` and `hugemem bench vmstart`, small, through the real
//! binary (`hugemem-bench`): their `--json` carries the bench's name and the run (command,
//! date, build, machine summary), `bench clear` reports the kernel re-zeroing
//! the same buffer and both clocks of the parallel runner, and `bench
//! vmstart` runs the eager-dirty scenario (a dirty pooled region cleared by
//! the daemon before it replies) with the guest reading only zeros.
//!
//! Needs root and free 2 MiB pages (and KVM for vmstart); skips through
//! `test_support::skip!` otherwise. No figure is compared with a limit: the
//! tests check that each figure was measured (finite, positive), not how fast.

use std::process::Command;

use serde_json::Value;

/// `hugemem-bench`, what `hugemem bench` runs.
const HUGEMEM_BENCH: &str = env!("CARGO_BIN_EXE_hugemem-bench");

/// Runs `hugemem-bench <args> --json` (`hugemem bench <args> --json`) under
/// coreutils `timeout`; the report.
fn bench(args: &[&str]) -> Value {
    let out = Command::new("timeout")
        .arg("240")
        .arg(HUGEMEM_BENCH)
        .args(args)
        .arg("--json")
        .env("RUST_LOG", "warn")
        .output()
        .expect("run hugemem-bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(124), "no result within 240 s");
    assert!(out.status.success(), "bench {args:?} failed: {stderr}");
    serde_json::from_slice(&out.stdout).expect("one JSON object on stdout")
}

fn positive(v: &Value, what: &str) -> f64 {
    let x = v
        .as_f64()
        .unwrap_or_else(|| panic!("{what} is not a number: {v}"));
    assert!(x.is_finite() && x > 0.0, "{what} = {x}");
    x
}

/// The run summary every bench's `--json` carries.
fn check_run(report: &Value, bench: &str, args: &[&str]) {
    assert_eq!(report["bench"], bench, "{report}");
    let run = &report["run"];
    let command = run["command"].as_str().expect("run.command");
    assert_eq!(
        command,
        format!("hugemem bench {} --json", args.join(" ")),
        "the exact command"
    );
    let date = run["date"].as_str().expect("run.date");
    assert!(date.ends_with('Z') && date.len() == 20, "{date}");
    assert!(["debug", "release"].contains(&run["build"].as_str().unwrap_or("")));
    let m = &run["machine"];
    assert!(m["cores"].as_u64().unwrap_or(0) >= 1, "{m}");
    assert!(m["numa_nodes"].as_u64().unwrap_or(0) >= 1, "{m}");
    assert!(!m["kernel"].as_str().unwrap_or("").is_empty(), "{m}");
    assert!(
        m["cpu_model"].is_string() && m["virtualized"].is_boolean(),
        "{m}"
    );
    positive(&m["memory_bytes"], "machine.memory_bytes");
}

#[test]
fn clear_reports_equal_work_and_both_runner_clocks() {
    let _g = test_support::prelude::serial();
    if !test_support::prelude::reserve_2m(32, "bench clear") {
        return;
    }
    let args = [
        "clear",
        "--size",
        "64M",
        "--page-size",
        "2M",
        "--reps",
        "1",
        "--threads",
        "1",
    ];
    let r = bench(&args);
    check_run(&r, "clear", &args);
    for key in [
        "kernel_fault_gbps",
        "kernel_refault_gbps",
        "memset_gbps",
        "per4k_gbps",
        "default_gbps",
    ] {
        positive(&r[key], key);
    }
    positive(
        &r["ratios"]["default_vs_kernel_refault"],
        "default_vs_kernel_refault",
    );
    let parallel = r["parallel"].as_array().expect("parallel");
    assert_eq!(parallel.len(), 1, "{r}");
    let p = &parallel[0];
    assert_eq!(p["threads"], 1);
    positive(&p["gbps"], "parallel gbps (call to return)");
    positive(&p["runner_gbps"], "parallel runner_gbps (runner's clock)");
    assert_eq!(p["speedup"], 1.0);
    assert_eq!(p["runner_speedup"], 1.0);
}

#[test]
fn vmstart_runs_eager_dirty_and_reads_only_zeros() {
    let _g = test_support::prelude::serial();
    if let Err(e) = microguest::kvm_available() {
        test_support::skip!("bench vmstart: KVM not usable: {e}");
        return;
    }
    if !test_support::prelude::reserve_2m(32, "bench vmstart") {
        return;
    }
    let args = ["vmstart", "--size", "64M", "--page-size", "2M"];
    let r = bench(&args);
    check_run(&r, "vmstart", &args);
    let names: Vec<&str> = r["scenarios"]
        .as_array()
        .expect("scenarios")
        .iter()
        .filter_map(|s| s["name"].as_str())
        .collect();
    assert_eq!(
        names,
        [
            "eager-fresh",
            "eager-clean",
            "lazy-dirty",
            "eager-dirty",
            "lazy-fresh",
            "prefault",
            "floor",
            "fresh-floor"
        ],
        "{r}"
    );
    // The kernel zeroing limits were measured, on one thread and on every CPU.
    positive(
        &r["kernel_zeroing_1_thread_ms"],
        "kernel_zeroing_1_thread_ms",
    );
    positive(
        &r["kernel_zeroing_all_cpus_ms"],
        "kernel_zeroing_all_cpus_ms",
    );
    assert!(r["cpus"].as_u64().is_some_and(|c| c >= 1), "{r}");
    for s in r["scenarios"].as_array().expect("scenarios") {
        assert_eq!(s["saw_nonzero"], false, "{s}");
        positive(&s["first_instruction_ms"], "first_instruction_ms");
        positive(&s["all_touched_ms"], "all_touched_ms");
        positive(&s["all_touched_vcpu_cpu_ms"], "all_touched_vcpu_cpu_ms");
        if s["name"] == "floor" {
            // The floor: no ALLOC, memory the bench populated itself.
            assert_eq!(
                (&s["flags"], &s["alloc_ms"]),
                (&"RESIDENT".into(), &0.0.into()),
                "{s}"
            );
        }
        if s["name"] == "fresh-floor" {
            // No ALLOC either: a fresh memfd nobody populated.
            assert_eq!(
                (&s["flags"], &s["alloc_ms"]),
                (&"FRESH".into(), &0.0.into()),
                "{s}"
            );
        }
        let dirty = s["name"] == "eager-dirty";
        assert_eq!(s["recleared"].is_boolean(), dirty, "{s}");
        if dirty {
            assert_eq!(s["flags"], "CLEAN", "{s}");
            // Served clean by the scrubbers instead: the report says so.
            if s["recleared"] == false {
                let notes = r["notes"].to_string();
                assert!(notes.contains("eager-dirty"), "{r}");
            }
        }
    }
}

/// `hugemem bench refault`, small: every way's rate at every thread count
/// up to the node's CPUs beside the bandwidth limit, the tenant's ratios
/// (with the helpers' progress, which may be nothing on a busy host), and
/// both daemons' responsiveness, each refault seen through to the end.
#[test]
fn refault_reports_rates_the_tenant_and_both_daemons() {
    let _g = test_support::prelude::serial();
    if !test_support::prelude::reserve_2m(32, "bench refault") {
        return;
    }
    let args = [
        "refault",
        "--size",
        "16M",
        "--reps",
        "1",
        "--chunk",
        "4M",
        "--tenant-ms",
        "50",
    ];
    let r = bench(&args);
    check_run(&r, "refault", &args);
    let cpus = r["cpus"].as_u64().expect("cpus");
    for way in ["helpers", "threads", "fallocate", "nt_clear"] {
        let points = r["rates"][way].as_array().expect(way);
        assert_eq!(
            points.last().map(|p| p["threads"].as_u64()),
            Some(Some(cpus)),
            "{way}: up to every CPU"
        );
        for p in points {
            positive(&p["gbps"], way);
        }
    }
    positive(&r["rates"]["spawn_ms"], "spawn_ms");
    let tenant = r["tenant"].as_array().expect("tenant");
    assert!(!tenant.is_empty());
    for t in tenant {
        positive(&t["alone_mips"], "alone_mips");
        positive(&t["with_helpers"], "with_helpers");
        positive(&t["with_threads"], "with_threads");
        let refaulted = t["helpers_gbps"].as_f64().expect("helpers_gbps");
        assert!(refaulted.is_finite() && refaulted >= 0.0, "{t}");
    }
    let modes: Vec<_> = r["responsiveness"]
        .as_array()
        .expect("responsiveness")
        .iter()
        .map(|d| {
            positive(&d["refault_s"], "refault_s");
            positive(&d["idle_p50_ms"], "idle_p50_ms");
            d["mode"].as_str().unwrap_or("").to_string()
        })
        .collect();
    assert_eq!(modes, ["helpers", "scrub thread"]);
}
