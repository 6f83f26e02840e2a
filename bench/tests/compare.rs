//! `hugemem bench compare`, small: 512M (64M) on 2 MiB pages, one repetition,
//! through the real binary
//! (`hugemem-bench`).
//!
//! * Every key of the JSON report is there, for every variant, in order.
//! * cloud-hypervisor variants say `skipped` with the reason when
//!   `CLOUD_HYPERVISOR` is unset (removed from the environment here).
//! * With QEMU and KVM: every QEMU and client variant ran, the guests read
//!   only zeros, and `ratios` holds each of them against the baseline. Without
//!   QEMU (or with `--qemu` naming no binary) the QEMU variants are skipped with
//!   the reason and `ratios` is empty.
//! * `--plot` writes a PNG when `scripts/plot-compare --check` finds matplotlib
//!   (otherwise that part prints SKIP).
//!
//! Needs root for the huge-page reservation (`numa::hugepages`); prints
//! SKIP without it. Runs are serialized: each reserves and restores the host's
//! 2 MiB pool. Child processes run under coreutils `timeout`.

use std::process::Command;
use std::sync::Mutex;

use serde_json::Value;

/// `hugemem-bench`, what `hugemem bench` runs.
const HUGEMEM_BENCH: &str = env!("CARGO_BIN_EXE_hugemem-bench");
const PLOT_SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/plot-compare");

/// One benchmark run at a time: each reserves and gives back huge pages.
static RUNS: Mutex<()> = Mutex::new(());

const TOP_KEYS: &[&str] = &[
    "size_bytes",
    "page_size",
    "note",
    "reps",
    "cpus",
    "prealloc_threads",
    "stride_bytes",
    "qemu_version",
    "cloud_hypervisor_version",
    "baseline",
    "variants",
    "ratios",
    "pool_scrub_s",
    "pool_resident_s",
    "pool_hand_out",
    "refault_ahead",
    "over_floor",
    // Every bench's --json: its name and the run (command, date, machine).
    "bench",
    "run",
];

const VARIANT_KEYS: &[&str] = &[
    "key",
    "label",
    "skipped",
    "note",
    "ready_s",
    "first_instruction_s",
    "poweroff_s",
    "touched_s",
    "alloc_s",
    "gib_per_s",
    "guest_report",
    "samples",
];

const VARIANTS: &[&str] = &[
    "qemu_prealloc",
    "qemu_lazy",
    "qemu_hugemem_fresh",
    "qemu_hugemem_pool",
    "ch_prefault",
    "ch_hugemem_pool",
    "client_fresh",
    "client_pool",
    "qemu_floor",
    "ch_floor",
    "client_floor",
];

/// Runs `hugemem bench compare --json` with `args`; `None` (after printing
/// SKIP) when no huge pages can be had.
fn compare(args: &[&str]) -> Option<Value> {
    let _serial = RUNS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let out = Command::new("timeout")
        .args(["120", HUGEMEM_BENCH, "compare", "--reps", "1", "--json"])
        .args(args)
        .env_remove("CLOUD_HYPERVISOR")
        .env("RUST_LOG", "warn")
        .output()
        .expect("run hugemem-bench compare");
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() && stderr.contains("no huge pages could be had") {
        test_support::skip!("{}", stderr.trim());
        return None;
    }
    assert_ne!(out.status.code(), Some(124), "no result within 120 s");
    assert!(out.status.success(), "bench compare failed: {stderr}");
    Some(serde_json::from_slice(&out.stdout).expect("one JSON object on stdout"))
}

fn variant<'a>(report: &'a Value, key: &str) -> &'a Value {
    report["variants"]
        .as_array()
        .expect("variants array")
        .iter()
        .find(|v| v["key"] == key)
        .unwrap_or_else(|| panic!("variant {key} missing"))
}

fn check_shape(report: &Value) {
    let top = report.as_object().expect("object");
    for k in TOP_KEYS {
        assert!(top.contains_key(*k), "top-level key {k} missing: {report}");
    }
    assert_eq!(report["page_size"], "2M");
    assert_eq!(report["baseline"], "qemu_prealloc");
    assert_eq!(report["bench"], "compare");
    assert!(
        report["run"]["command"]
            .as_str()
            .is_some_and(|c| c.starts_with("hugemem bench compare ")),
        "{}",
        report["run"]
    );
    assert!(report["run"]["machine"]["cores"].as_u64().unwrap_or(0) >= 1);
    let keys: Vec<&str> = report["variants"]
        .as_array()
        .expect("variants")
        .iter()
        .map(|v| v["key"].as_str().expect("key"))
        .collect();
    assert_eq!(keys, VARIANTS);
    assert_eq!(report["pool_hand_out"], "resident");
    assert_eq!(report["refault_ahead"], true);
    // Every measured variant stands beside its own VMM's floor.
    for (key, o) in report["over_floor"].as_object().expect("over_floor") {
        let floor = o["floor"].as_str().expect("floor key");
        // One repetition: too few for a 95 % interval, said as null.
        for k in ["ready_paired_ci95_ms", "touched_paired_ci95_ms"] {
            assert!(o.get(k).is_some_and(Value::is_null), "{key}: {k} {o}");
        }
        assert!(floor.ends_with("_floor"), "{key}: {o}");
        assert_eq!(key.split('_').next(), floor.split('_').next(), "{key}: {o}");
        if key == floor {
            assert_eq!(
                (o["ready_ms"].as_f64(), o["poweroff_ms"].as_f64()),
                (Some(0.0), Some(0.0))
            );
        }
    }
    for v in report["variants"].as_array().expect("variants") {
        let o = v.as_object().expect("variant object");
        for k in VARIANT_KEYS {
            assert!(o.contains_key(*k), "{}: key {k} missing", v["key"]);
        }
        if v["skipped"] == true {
            assert!(
                v["note"].as_str().is_some_and(|n| !n.is_empty()),
                "{}: skipped without a reason",
                v["key"]
            );
            assert!(v["ready_s"].is_null() && v["poweroff_s"].is_null());
        } else {
            for f in ["ready_s", "first_instruction_s", "poweroff_s"] {
                let best = v[f]["best"].as_f64().expect("best");
                let median = v[f]["median"].as_f64().expect("median");
                assert!(best > 0.0 && median >= best, "{}: {f} {}", v["key"], v[f]);
            }
            assert!(v["gib_per_s"].as_f64().is_some_and(|g| g > 0.0));
            assert!(
                v["guest_report"]
                    .as_str()
                    .is_some_and(|g| g.contains("nonzero=0")),
                "{}: guest report {}",
                v["key"],
                v["guest_report"]
            );
            // Memory is ready no later than the guest powers off.
            assert!(v["ready_s"]["best"].as_f64() <= v["poweroff_s"]["best"].as_f64());
        }
    }
    for ch in ["ch_prefault", "ch_hugemem_pool"] {
        let v = variant(report, ch);
        assert_eq!(v["skipped"], true, "{ch} ran without CLOUD_HYPERVISOR");
        assert!(
            v["note"]
                .as_str()
                .is_some_and(|n| n.contains("CLOUD_HYPERVISOR")),
            "{ch}: {}",
            v["note"]
        );
    }
}

#[test]
fn small_run_reports_every_variant_and_ratios() {
    let dir = tempfile::tempdir().expect("tempdir");
    let png = dir.path().join("compare.png");
    let png_arg = png.to_str().expect("utf-8 path");
    let plot = Command::new(PLOT_SCRIPT)
        .arg("--check")
        .output()
        .is_ok_and(|o| o.status.success());
    let mut args = vec!["--size", "512M", "--page-size", "2M"];
    if plot {
        args.extend(["--plot", png_arg]);
    } else {
        test_support::skip!("(plot part): scripts/plot-compare finds no matplotlib");
    }
    let Some(report) = compare(&args) else {
        return;
    };
    check_shape(&report);
    assert_eq!(report["size_bytes"], 512u64 << 20, "the size never changes");
    let kvm = microguest::kvm_available();
    let baseline = variant(&report, "qemu_prealloc");
    if let Err(why) = &kvm {
        test_support::skip!("(guest part): {why}");
        assert_eq!(baseline["skipped"], true);
        return;
    }
    // The client needs only KVM.
    for key in ["client_fresh", "client_pool"] {
        assert_eq!(variant(&report, key)["skipped"], false, "{key}");
        assert!(variant(&report, key)["alloc_s"]["best"].as_f64() > Some(0.0));
    }
    if baseline["skipped"] == true {
        test_support::skip!("(QEMU part): {}", baseline["note"]);
        assert!(report["ratios"].as_object().is_some_and(|r| r.is_empty()));
        return;
    }
    let ratios = report["ratios"].as_object().expect("ratios");
    for key in [
        "qemu_prealloc",
        "qemu_lazy",
        "qemu_hugemem_fresh",
        "qemu_hugemem_pool",
        "client_fresh",
        "client_pool",
    ] {
        let r = &ratios[key];
        assert!(
            r["ready"].as_f64().is_some_and(|x| x > 0.0)
                && r["poweroff"].as_f64().is_some_and(|x| x > 0.0),
            "ratio for {key}: {r}"
        );
    }
    assert_eq!(ratios["qemu_prealloc"]["ready"], 1.0);
    assert!(!ratios.contains_key("ch_prefault"));
    assert!(report["pool_scrub_s"]["best"].as_f64() > Some(0.0));
    eprintln!(
        "compare 512M/2M: ready s prealloc {} hugemem pool {} client pool {}",
        baseline["ready_s"]["best"],
        variant(&report, "qemu_hugemem_pool")["ready_s"]["best"],
        variant(&report, "client_pool")["ready_s"]["best"]
    );
    if plot {
        let bytes = std::fs::read(&png).expect("--plot wrote the PNG");
        assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    }
}

#[test]
fn qemu_variants_are_skipped_with_the_reason_when_qemu_is_missing() {
    let Some(report) = compare(&[
        "--size",
        "64M",
        "--page-size",
        "2M",
        "--qemu",
        "/nonexistent/qemu-system-x86_64",
    ]) else {
        return;
    };
    check_shape(&report);
    assert!(report["qemu_version"].is_null());
    for key in [
        "qemu_prealloc",
        "qemu_lazy",
        "qemu_hugemem_fresh",
        "qemu_hugemem_pool",
    ] {
        let v = variant(&report, key);
        assert_eq!(v["skipped"], true, "{key}");
        let note = v["note"].as_str().expect("note");
        assert!(
            note.contains("/nonexistent/qemu-system-x86_64") || note.contains("KVM"),
            "{key}: {note}"
        );
    }
    // No baseline, no ratios.
    assert!(report["ratios"].as_object().is_some_and(|r| r.is_empty()));
}

#[test]
fn no_refault_ahead_needs_pool_holes() {
    // Without --pool-holes the pool variants wait for the refault, which
    // --no-refault-ahead turns off: refused before anything runs.
    let out = Command::new(HUGEMEM_BENCH)
        .args(["compare", "--no-refault-ahead"])
        .output()
        .expect("run hugemem-bench");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--pool-holes"), "{stderr}");
}
