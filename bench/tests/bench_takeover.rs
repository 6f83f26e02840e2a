//! `hugemem bench takeover`, tiny, through the real binary
//! (`hugemem-bench`, which runs `hugemem serve` beside it): its `--json`
//! carries the bench's name, the run record, both modes' figures and the
//! floor's (the same setup with no switch), and the takeover kept every
//! running allocation.
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
    for mode in ["takeover", "stop_start", "floor"] {
        let m = &r[mode];
        let rounds = m["rounds"].as_array().expect("rounds");
        assert_eq!(rounds.len(), 1, "{m}");
        for key in [
            "first_alloc_ms",
            "first_alloc_call_ms",
            "pool_served_ms",
            "max_stall_ms",
            "window_ms",
        ] {
            let x = rounds[0][key].as_f64().unwrap_or(-1.0);
            assert!(x.is_finite() && x > 0.0, "{mode}.{key} = {x}");
        }
        // Only a switch has an old process that exits.
        let exit = rounds[0]["old_exit_ms"].as_f64();
        if mode == "floor" {
            assert!(rounds[0]["old_exit_ms"].is_null(), "{m}");
            assert!(m["old_exit_ms"].is_null(), "{m}");
        } else {
            assert!(exit.is_some_and(|x| x > 0.0), "{mode}: {m}");
        }
        for key in ["first_alloc_ms", "pool_served_ms", "max_stall_ms"] {
            assert!(
                m[key]["median"].is_f64() && m[key]["worst"].is_f64(),
                "{mode}.{key}: {m}"
            );
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

    // The floor: the steady daemon served the first ALLOC and the old
    // pool's size from its clean pool, zeroed nothing, lost nothing, and
    // its clients ran at least as long as the longer switch kept them.
    let floor = &r["floor"];
    assert_eq!(floor["mode"], "floor", "{floor}");
    assert_eq!(floor["first_alloc_warm_rounds"], 1, "{floor}");
    assert_eq!(floor["pool_served_warm_rounds"], 1, "{floor}");
    assert_eq!(floor["bytes_zeroed"]["worst"], 0.0, "{floor}");
    assert_eq!(floor["failed_requests"], 0, "{floor}");
    assert_eq!(floor["refused_connections"], 0, "{floor}");
    assert_eq!(floor["allocations_known_min"], 2, "{floor}");
    let window = |m: &str| r[m]["rounds"][0]["window_ms"].as_f64().unwrap_or(-1.0);
    assert!(
        window("floor") >= window("takeover").max(window("stop_start")),
        "the floor's window is shorter than a switch's: {r}"
    );
    for mode in ["takeover_over_floor", "stop_start_over_floor"] {
        for key in ["first_alloc", "pool_served", "max_stall"] {
            let x = r["ratios"][mode][key].as_f64().unwrap_or(-1.0);
            assert!(x.is_finite() && x > 0.0, "ratios.{mode}.{key} = {x}");
        }
    }
    assert!(r["expectations"].as_array().is_some_and(|e| !e.is_empty()));
}
