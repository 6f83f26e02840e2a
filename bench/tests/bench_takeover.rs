//! `hugemem bench takeover`, tiny, through the real binary
//! (`hugemem-bench`, which runs `hugemem serve` beside it): its `--json`
//! carries the bench's name, the run record and both modes' figures, and
//! the takeover kept every running allocation.
//!
//! Needs root and free 2 MiB pages; skips through `test_support::skip!`
//! otherwise. No time is compared with a limit: the test checks that each
//! figure was measured, not how fast.

use std::process::Command;

use serde_json::Value;

/// `hugemem-bench`, what `hugemem bench` runs.
const HUGEMEM_BENCH: &str = env!("CARGO_BIN_EXE_hugemem-bench");

#[test]
fn takeover_keeps_every_allocation_and_reports_both_modes() {
    let _g = test_support::prelude::serial();
    // 64 MiB of pool + 2 x 16 MiB running + 16 MiB of room: 56 pages.
    if !test_support::prelude::reserve_2m(56, "bench takeover") {
        return;
    }
    let args = [
        "takeover",
        "--pool-gib",
        "0.0625",
        "--allocations",
        "2",
        "--alloc-mib",
        "16",
        "--rounds",
        "1",
        "--json",
    ];
    let out = Command::new("timeout")
        .arg("240")
        .arg(HUGEMEM_BENCH)
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run hugemem-bench takeover");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(124), "no result within 240 s");
    assert!(out.status.success(), "bench takeover failed: {stderr}");
    let r: Value = serde_json::from_slice(&out.stdout).expect("one JSON object on stdout");

    assert_eq!(r["bench"], "takeover", "{r}");
    assert_eq!(
        r["run"]["command"].as_str(),
        Some(format!("hugemem bench {}", args.join(" ")).as_str())
    );
    assert!(
        r["run"]["machine"]["cores"].as_u64().unwrap_or(0) >= 1,
        "{r}"
    );
    assert_eq!(r["page_size"], "2M");
    assert_eq!(r["allocations"], 2);
    assert_eq!(r["pool_bytes"], 64u64 << 20);
    for mode in ["takeover", "stop_start"] {
        let m = &r[mode];
        let rounds = m["rounds"].as_array().expect("rounds");
        assert_eq!(rounds.len(), 1, "{m}");
        for key in [
            "first_alloc_ms",
            "pool_served_ms",
            "old_exit_ms",
            "max_stall_ms",
        ] {
            let x = rounds[0][key].as_f64().unwrap_or(-1.0);
            assert!(x.is_finite() && x > 0.0, "{mode}.{key} = {x}");
        }
        for key in [
            "failed_requests",
            "refused_connections",
            "bytes_zeroed",
            "allocations_known",
            "allocations_freeable",
        ] {
            assert!(rounds[0][key].is_u64(), "{mode}.{key}: {m}");
        }
    }
    let t = &r["takeover"];
    assert_eq!(t["allocations_known_min"], 2, "the takeover kept them: {t}");
    assert_eq!(t["allocations_freeable_min"], 2, "{t}");
    assert_eq!(t["tenant_memory_intact_min"], 2, "{t}");
    assert!(r["ratios"]["first_alloc_speedup"].is_f64(), "{r}");
    assert!(r["expectations"].as_array().is_some_and(|e| !e.is_empty()));
}
