//! `hugemem bench migrate` on a one-node host: the moves are skipped with
//! the reason and the clearing runner's locality is still measured (the
//! in-guest form, `integration::checks::bench_migrate`, is checked by
//! `integration/tests/migrate_checks.rs`).

use guest_mem::PageSize;
use hugemem::bench::migrate::{run_bench, BenchOptions};
use numa::Topology;

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
