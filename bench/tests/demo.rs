//! `hugemem demo` end to end, through the built binary (`hugemem-bench demo`,
//! which `hugemem demo` runs): a private daemon, a
//! fresh ALLOC, the micro-guest under KVM (when there is one), FREE, scrub,
//! a pooled ALLOC, and the guest again.
//!
//! The demo reserves huge pages itself through `numa::hugepages` and says
//! what it got; without root (or without any huge page) it falls back to
//! 4 KiB pages, which these tests accept and print. A missing KVM skips the
//! guest (the report says why), which the tests print as well.

use std::process::Command;

use serde_json::Value;

/// Runs `hugemem-bench demo --json ARGS` and returns its report.
fn demo(args: &[&str]) -> Value {
    let out = Command::new("timeout")
        .arg("120")
        .arg(env!("CARGO_BIN_EXE_hugemem-bench"))
        .args(["demo", "--json"])
        .args(args)
        .output()
        .expect("run hugemem demo");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_ne!(
        out.status.code(),
        Some(124),
        "hugemem demo did not finish within 120 s; stderr:\n{stderr}"
    );
    assert!(
        out.status.success(),
        "hugemem demo failed ({}); stderr:\n{stderr}",
        out.status
    );
    eprintln!("{stderr}");
    serde_json::from_slice(&out.stdout).expect("demo --json prints one JSON object")
}

fn f(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} missing in {v}"))
}

/// What every demo run must show, whatever page size it got.
fn check(report: &Value) {
    let size = report["size_bytes"].as_u64().expect("size_bytes");
    assert!(size > 0);
    assert!(f(report, "alloc_fresh_s") > 0.0);
    assert!(f(report, "alloc_pooled_s") > 0.0);
    // The warm-up (the host's first touch) ran and is reported apart, and
    // the fresh ALLOC's limit beside it.
    assert!(f(report, "host_first_touch_s") > 0.0, "{report}");
    assert!(f(report, "kernel_zeroing_all_cpus_s") > 0.0, "{report}");
    assert!(report["cpus"].as_u64().is_some_and(|c| c >= 1), "{report}");
    // What the pooled ALLOC handed out adds up to its size; on huge pages
    // the demo waits for the refault, so it is resident (4 KiB shmem keeps
    // the holes of pages no guest touched).
    let (resident, holes) = (
        report["alloc_pooled_resident_bytes"]
            .as_u64()
            .expect("resident bytes"),
        report["alloc_pooled_hole_bytes"]
            .as_u64()
            .expect("hole bytes"),
    );
    assert_eq!(resident + holes, size, "{report}");
    if report["page_size"] != "4K" {
        assert_eq!(holes, 0, "{report}");
    }
    assert_eq!(
        report["alloc_pooled_from_pool"],
        Value::Bool(true),
        "second ALLOC not from the pool: {report}"
    );
    // Zeroed by the scrubbers, or detached (punched and refaulted
    // kernel-zeroed, `pool.detach_pages`, the default).
    assert!(
        report["scrubbed_bytes"].as_u64().expect("scrubbed_bytes")
            + report["detached_bytes"].as_u64().expect("detached_bytes")
            >= size,
        "{report}"
    );
    // Everything went back to the pool, clean.
    let pool = report["pool_end"].as_array().expect("pool_end");
    let clean: u64 = pool
        .iter()
        .map(|p| p["clean_bytes"].as_u64().unwrap_or(0))
        .sum();
    let busy: u64 = pool
        .iter()
        .map(|p| {
            ["dirty_bytes", "quarantined_bytes", "in_use_bytes"]
                .iter()
                .map(|k| p[*k].as_u64().unwrap_or(0))
                .sum::<u64>()
        })
        .sum();
    assert_eq!((clean, busy), (size, 0), "{report}");
    match (
        &report["guest_fresh"],
        &report["guest_pooled"],
        &report["guest_floor"],
    ) {
        (Value::Null, Value::Null, Value::Null) => {
            test_support::skip!("(guest part): {}", report["guest_skipped"])
        }
        (g1, g2, floor) => {
            let pages = size / (2 << 20);
            for g in [g1, g2, floor] {
                assert_eq!(g["pages_touched"].as_u64(), Some(pages), "{report}");
                assert_eq!(g["saw_nonzero"], Value::Bool(false), "{report}");
                assert!(f(g, "first_instruction_ms") > 0.0);
            }
        }
    }
    eprintln!(
        "demo: {} on {} pages: fresh {:.1} ms, pooled {:.3} ms ({:.0}x), free->clean {:.1} ms",
        size,
        report["page_size"],
        f(report, "alloc_fresh_s") * 1e3,
        f(report, "alloc_pooled_s") * 1e3,
        f(report, "pooled_speedup"),
        f(report, "free_to_clean_s") * 1e3
    );
}

#[test]
fn demo_with_defaults() {
    let report = demo(&[]);
    check(&report);
    let notes = report["notes"].as_array().expect("notes");
    assert!(
        !notes.is_empty(),
        "the demo must say what it reserved: {report}"
    );
    if report["page_size"] != "1G" {
        eprintln!(
            "NOTE: the demo ran on {} pages: {notes:?}",
            report["page_size"]
        );
    }
}

#[test]
fn demo_on_2m_pages() {
    // Forcing a huge page size needs the pages: skip (said out loud) without them.
    let _pages = match test_support::hugepages::hold(guest_mem::PageSize::Huge2M, 32) {
        Ok(held) => held,
        Err(why) => return test_support::skip!("demo_on_2m_pages: {why}"),
    };
    let report = demo(&["--page-size", "2M", "--size", "64M"]);
    if report["page_size"] != "2M" {
        panic!("asked for 2M pages, got {}", report["page_size"]);
    }
    check(&report);
}

#[test]
fn demo_on_4k_pages() {
    let report = demo(&["--page-size", "4K", "--size", "32M"]);
    assert_eq!(report["page_size"], "4K");
    check(&report);
}

#[test]
fn demo_timeline_is_printed_and_the_guest_can_be_skipped() {
    let out = Command::new("timeout")
        .arg("120")
        .arg(env!("CARGO_BIN_EXE_hugemem-bench"))
        .args(["demo", "--page-size", "4K", "--size", "16M", "--no-guest"])
        .output()
        .expect("run hugemem demo");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8_lossy(&out.stdout);
    for row in [
        "ALLOC, fresh pages",
        "guest #1",
        "--no-guest given",
        "FREE -> pool clean",
        "ALLOC, from the clean pool",
        "pool at the end",
    ] {
        assert!(table.contains(row), "missing {row:?} in\n{table}");
    }
}
