//! `hugemem bench migrate` on a one-node host: the moves are skipped with
//! the reason and the clearing runner's locality is still measured, called
//! in-process and run as the real binary (`hugemem-bench migrate`; the
//! in-guest form, `integration::checks::bench_migrate`, is checked by
//! `integration/tests/migrate_checks.rs`).

use std::process::{Command, Output};

use guest_mem::PageSize;
use hugemem_bench::migrate::{run_bench, BenchOptions};
use numa::Topology;
use serde_json::Value;
use test_support::prelude::{one_node, serial};

/// Runs `hugemem-bench` (what `hugemem bench` runs) with `args`.
fn hugemem_bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hugemem-bench"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run hugemem-bench")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn bench_on_one_node_skips_moves_and_measures_locality() {
    let topology = Topology::detect().expect("topology");
    if migrate::memory_nodes(&topology).len() > 1 {
        test_support::skip!("this host has several nodes; the bench would move memory");
        return;
    }
    let opts = BenchOptions {
        page_sizes: vec![PageSize::Base4K, PageSize::Huge2M, PageSize::Huge1G],
        reserve: false,
        ..BenchOptions::new(3 << 20)
    };
    let report = run_bench(&topology, &opts);
    assert_eq!(report.results.len(), 3);
    for r in &report.results {
        assert_eq!(
            r.skipped.as_deref(),
            Some("needs two nodes with memory (this host has [0])")
        );
    }
    assert_eq!(
        report.results[2].bytes,
        1 << 30,
        "rounded up to one 1 GiB page"
    );
    assert!(report.notes.iter().any(|n| n.contains("rounded up")));
    assert_eq!(report.locality.len(), 1);
    let loc = &report.locality[0];
    assert!(loc.error.is_none(), "{loc:?}");
    assert_eq!(loc.on_node, loc.pages, "{loc:?}");
    assert!((loc.share_pct - 100.0).abs() < 1e-9);
    assert!(report.failures().is_empty());
    for line in report.lines("") {
        println!("{line}");
    }
    let json = serde_json::to_string(&report).expect("json");
    assert!(json.contains("\"share_pct\":100.0"));
}

#[test]
fn bench_migrate_reports_skipped_moves_and_locality() {
    let _g = serial();
    if !one_node("bench_migrate") {
        return;
    }
    let out = hugemem_bench(&["migrate", "--size", "8M", "--json"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    let report: Value = serde_json::from_str(&stdout).expect("one JSON object");
    assert_eq!(report["bench"], "migrate", "{report}");
    assert_eq!(
        report["run"]["command"], "hugemem bench migrate --size 8M --json",
        "{report}"
    );
    let results = report["results"].as_array().expect("results");
    let sizes: Vec<&str> = results
        .iter()
        .filter_map(|r| r["page_size"].as_str())
        .collect();
    assert_eq!(sizes, ["4K", "2M", "1G"], "{report}");
    for r in results {
        let why = r["skipped"].as_str().unwrap_or_default();
        assert!(why.contains("needs two nodes with memory"), "{r}");
        assert!(r["there"].is_null() && r["error"].is_null(), "{r}");
    }
    let locality = report["locality"].as_array().expect("locality");
    assert_eq!(locality.len(), 1, "{report}");
    assert_eq!(locality[0]["node"], 0);
    assert!(locality[0]["error"].is_null(), "{report}");
    assert!(locality[0]["pages"].as_u64().unwrap_or(0) > 0, "{report}");
    assert_eq!(locality[0]["share_pct"], 100.0, "{report}");

    let out = hugemem_bench(&["migrate", "--size", "8M"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("migrate 2M 8 MiB no second node: skipped"),
        "{stdout}"
    );
    assert!(stdout.contains("(100.0%)"), "{stdout}");
}
