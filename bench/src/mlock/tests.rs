//! The mlock bench's own checks: a small run reports every figure.

use super::*;

#[test]
fn worst_of_samples() {
    assert_eq!(worst(&[3.0, 1.0, 2.0]), 3.0);
}

#[test]
fn probe_runs_around_the_call() {
    let ((), idle) = with_probe(|| thread::sleep(Duration::from_millis(5))).expect("probe");
    assert!(idle < Duration::from_secs(5));
}

#[test]
fn small_run_reports_every_figure() {
    let cfg = MlockBenchConfig {
        size: 16 << 20,
        reps: 2,
        chunk: Some(1 << 20),
        threads_per_node: 1,
        hugetlb: false,
        hugetlb_page: None,
    };
    let report = run(&cfg, &mut |_| {}).expect("bench");
    let f = &report.shmem_4k;
    assert_eq!((f.batched_calls, f.batched_chunk_bytes), (16, 1 << 20));
    assert!(f.single_lock_s > 0.0 && f.batched_lock_s > 0.0);
    assert_eq!(f.single_lock_stall_ms.len(), 2);
    let json = serde_json::to_value(&report).expect("json");
    for key in [
        "single_lock_s",
        "batched_lock_s",
        "single_unlock_s",
        "batched_unlock_s",
        "single_max_stall_ms",
        "batched_max_stall_ms",
    ] {
        assert!(json["shmem_4k"][key].is_number(), "{key}");
    }
    // The populate limit: one sample per rep, the best of them, and each
    // path's lock time over it (no timing compared).
    assert_eq!(f.populate_s.len(), cfg.reps);
    assert!(f.populate_limit_s > 0.0 && f.populate_limit_s.is_finite());
    assert!(json["shmem_4k"]["populate_limit_s"].is_number());
    for key in [
        "single_lock_over_limit",
        "batched_lock_over_limit",
        "single_lock_quiet_over_limit",
        "batched_lock_quiet_over_limit",
    ] {
        let x = json["ratios"]["shmem_4k"][key].as_f64().unwrap_or(-1.0);
        assert!(x > 0.0 && x.is_finite(), "{key} = {x}");
    }
    assert!(json["hugetlb"].is_null());
    assert!(report.to_table().contains("shmem 4K"));
}
