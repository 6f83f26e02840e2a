//! `hugemem bench clone`'s parts that measure nothing: its options, its
//! plan of combinations against the host's memory, and its table from a
//! fixture JSON; then a small real run (64 MiB, two clones, one
//! repetition): every kind of start ran, no clone saw a stale or foreign
//! page, the templates did not change. No timing is asserted.
//!
//! The real run is skipped (through the skip helper) without the
//! cloud-hypervisor binary that `CLOUD_HYPERVISOR` names, a usable
//! `/dev/kvm`, or enough free 2 MiB pages.

use std::process::Command;

use guest_mem::PageSize;
use hugemem_bench::clone::{parse_list, Plan};
use serde_json::{json, Value};
use test_support::prelude::serial;

const HUGEMEM_BENCH: &str = env!("CARGO_BIN_EXE_hugemem-bench");
const GIB: u64 = 1 << 30;

/// `hugemem-bench clone ARGS --plan`: its exit status, stdout and stderr.
fn plan_of(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(HUGEMEM_BENCH)
        .arg("clone")
        .args(args)
        .arg("--plan")
        .output()
        .expect("run hugemem-bench clone --plan");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_plan_leaves_out_what_memory_cannot_hold_and_says_why() {
    let plan = Plan::new(
        &[PageSize::Huge2M, PageSize::Huge1G],
        &[GIB, 4 * GIB, 8 * GIB],
        &[1, 8, 25],
        &[(PageSize::Huge2M, 20 * GIB), (PageSize::Huge1G, 2 * GIB)],
    );
    let run: Vec<(PageSize, u64, usize)> = plan
        .run
        .iter()
        .map(|c| (c.page_size, c.size, c.count))
        .collect();
    // The template and N clones each: (N + 1) x S.
    assert_eq!(
        run,
        [
            (PageSize::Huge2M, GIB, 1),
            (PageSize::Huge2M, GIB, 8),
            (PageSize::Huge2M, 4 * GIB, 1),
            (PageSize::Huge2M, 8 * GIB, 1),
            (PageSize::Huge1G, GIB, 1),
        ]
    );
    assert_eq!(plan.left_out.len(), 9 + 9 - run.len());
    let l = plan
        .left_out
        .iter()
        .find(|l| l.combination.size == GIB && l.combination.count == 25)
        .expect("25 clones of 1 GiB left out");
    assert!(l.why.starts_with("memory:"), "{}", l.why);
    assert!(l.why.contains("26G"), "{}", l.why);
    assert!(l.why.contains("20G"), "{}", l.why);
    assert_eq!(plan.peak(PageSize::Huge2M), 16 * GIB);
    assert_eq!(plan.peak(PageSize::Huge1G), 2 * GIB);
    // A size that is no multiple of the page is left out, not run.
    let odd = Plan::new(
        &[PageSize::Huge1G],
        &[GIB / 2],
        &[1],
        &[(PageSize::Huge1G, 8 * GIB)],
    );
    assert!(odd.run.is_empty());
    assert!(odd.left_out[0].why.contains("not a multiple"), "{odd:?}");
}

#[test]
fn options_parse_lists_and_refuse_bad_items() {
    assert_eq!(
        parse_list("1, 8,25", str::parse::<usize>)
            .expect("a list")
            .0,
        [1, 8, 25]
    );
    assert!(parse_list("", str::parse::<usize>).is_err());
    assert!(parse_list("1,x", str::parse::<usize>).is_err());

    let (ok, stdout, stderr) = plan_of(&[
        "--sizes",
        "1G,4G",
        "--counts",
        "1,8",
        "--page-sizes",
        "2M",
        "--memory",
        "7G",
    ]);
    assert!(ok, "{stderr}");
    let plan: Value = serde_json::from_str(&stdout).expect("the plan as JSON");
    let run = plan["run"].as_array().expect("run");
    assert_eq!(run.len(), 1, "{plan}");
    assert_eq!(run[0], json!({"page_size": "2M", "size": GIB, "count": 1}));
    let left = plan["left_out"].as_array().expect("left_out");
    assert_eq!(left.len(), 3, "{plan}");
    let eight = &left[0];
    assert_eq!(
        (&eight["size"], &eight["count"]),
        (&json!(GIB), &json!(8)),
        "{plan}"
    );
    assert!(
        eight["why"]
            .as_str()
            .is_some_and(|w| w.contains("need 9G") && w.contains("give 7G")),
        "{plan}"
    );

    let (ok, _, stderr) = plan_of(&["--sizes", "1G,lots"]);
    assert!(!ok);
    assert!(stderr.contains("lots"), "{stderr}");
    let (ok, _, stderr) = plan_of(&["--page-sizes", "3M"]);
    assert!(!ok);
    assert!(stderr.contains("3M"), "{stderr}");
}

/// One start of a fixture.
fn start(mode: &str, start: &str, count: u64, p50: f64, p95: f64) -> Value {
    json!({
        "page_size": "2M", "size": GIB, "count": count, "mode": mode, "start": start,
        "running_ms": {"samples": [p50, p95], "p50": p50, "p95": p95},
        "batch_ms": {"samples": [p95], "p50": p95, "p95": p95},
        "pool_bytes_per_vm": if mode == "copy" { GIB } else { 0 },
        "kernel_taken_bytes_per_vm": if mode == "shared" { 4u64 << 20 } else { 0 },
        "kernel_reserved_bytes_per_vm": if mode == "shared" { GIB } else { 0 },
        "private_hugetlb_bytes_per_vm": if mode == "shared" { 2u64 << 20 } else { 0 },
        "own_pages_written_max": 3, "stale_pages": 0,
        "clones_checked": if mode == "park" { 0 } else { count }, "guest_bad": 0
    })
}

#[test]
fn the_table_sets_each_figure_beside_its_limit() {
    let v = json!({
        "bench": "clone",
        "sizes": [GIB, 8 * GIB], "counts": [1, 8, 25], "page_sizes": ["2M"], "reps": 1,
        "left_out": [
            {"page_size": "2M", "size": 8 * GIB, "count": 1, "why": "memory: the template and 1 clone(s) of 8G need 16G of 2M pages, the host can give 15G"},
            {"page_size": "2M", "size": GIB, "count": 25, "why": "memory: the template and 25 clone(s) of 1G need 26G of 2M pages, the host can give 15G"}
        ],
        "starts": [
            start("shared", "one_at_a_time", 1, 30.0, 30.0),
            start("shared", "at_once", 8, 60.0, 120.0),
            start("copy", "one_at_a_time", 1, 1000.0, 1000.0),
            start("park", "one_at_a_time", 1, 10.0, 10.0),
            start("park", "at_once", 8, 40.0, 80.0)
        ],
        "notes": ["8G on 2M pages: shared clones not measured: a zone | two files"],
        "templates": [{"page_size": "2M", "size": GIB, "phase": "shared", "unchanged": true},
                      {"page_size": "2M", "size": GIB, "phase": "copy", "unchanged": true}],
        "ch_restore": [
            {"page_size": "2M", "size": GIB, "mode": "memory_restore_mode=copy",
             "running_ms": {"samples": [300.0], "p50": 300.0, "p95": 300.0}, "guest_bad": 0, "note": null},
            {"page_size": "2M", "size": GIB, "mode": "memory_restore_mode=ondemand",
             "running_ms": {"samples": [], "p50": 0.0, "p95": 0.0}, "guest_bad": 0, "note": "it | exited"}
        ]
    });
    let table = hugemem_bench::report::tables::block("clone-fixture", &v);
    eprintln!("{table}");
    // What the plan left out, with its reason.
    assert!(
        table.contains("* 25 clone(s) of 1G (2M pages): memory: the template and 25"),
        "{table}"
    );
    // A phase that failed, said so.
    assert!(
        table.contains(
            "Not measured:\n\n* 8G on 2M pages: shared clones not measured: a zone \\| two files\n"
        ),
        "{table}"
    );
    // The clone beside its floor: 30 ms against 10 ms is 20 ms over.
    assert!(table.contains("| 1G (2M pages) | 1 | one at a time | shared | 30.0 / 30.0 | 10.0 / 10.0 | +20.0 | 3.00x | - |"), "{table}");
    assert!(
        table.contains("+20.0 ms (30.0 over 10.0 ms), **not met**"),
        "{table}"
    );
    // At once: 120 ms p95 against 100 ms, 1.5x the floor's 80 ms.
    assert!(table.contains("8 clones of 1G (2M pages): p95 120.0 ms, **not met**; 1.50x the floor's 80.0 ms, **not met** (judged with 8 clones: memory:"), "{table}");
    // Shared memory: 4 MiB taken, 2 written, within the 2 MiB slack.
    assert!(
        table.contains("most over what a clone wrote: 2.0 MiB"),
        "{table}"
    );
    assert!(
        table.contains("most from the pool per clone 0.0 MiB: met"),
        "{table}"
    );
    // cloud-hypervisor: its copy restore over the slower clone mode (copy: 1000 ms).
    assert!(
        table.contains(
            "1G (2M pages): 0.3x (300.0 ms with `memory_restore_mode=copy` over 1000.0 ms)"
        ),
        "{table}"
    );
    assert!(
        table.contains("not measured at 8G: memory: the template and 1 clone(s) of 8G"),
        "{table}"
    );
    assert!(table.contains("it \\| exited"), "{table}");
    assert!(table.contains("0 stale or foreign 4 KiB pages in 10 clones compared; 0 bad pages the guests found; 2 of 2 templates unchanged: met"), "{table}");
}

#[test]
fn a_small_run_measures_every_kind_of_start() {
    let _serial = serial();
    let Some(built) = test_support::cloud_hypervisor::binaries_or_skip() else {
        return;
    };
    if let Err(reason) = microguest::kvm_available() {
        test_support::skip!("{reason}");
        return;
    }
    let dir = tempfile::tempdir_in("/var/tmp").expect("a directory under /var/tmp");
    let out = Command::new("timeout")
        .args([
            "600",
            HUGEMEM_BENCH,
            "clone",
            "--sizes",
            "64M",
            "--counts",
            "2",
            "--page-sizes",
            "2M",
            "--reps",
            "1",
        ])
        .arg("--cloud-hypervisor")
        .arg(&built.cloud_hypervisor)
        .arg("--dir")
        .arg(dir.path())
        .arg("--json")
        .output()
        .expect("run hugemem-bench clone");
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() && stderr.contains("free 2 MiB pages needed") {
        test_support::skip!("not enough 2 MiB pages: {stderr}");
        return;
    }
    assert!(out.status.success(), "bench clone failed:\n{stderr}");
    let r: Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    eprintln!("{r}");
    assert_eq!(r["bench"], "clone");
    let starts = r["starts"].as_array().expect("starts");
    for mode in ["shared", "copy", "park"] {
        for start in ["one_at_a_time", "at_once"] {
            let s = starts
                .iter()
                .find(|s| s["mode"] == mode && s["start"] == start)
                .unwrap_or_else(|| panic!("no {mode} {start}: {r}"));
            assert_eq!(
                s["running_ms"]["samples"].as_array().map(Vec::len),
                Some(2),
                "{s}"
            );
            assert_eq!(s["guest_bad"], 0, "{s}");
            assert_eq!(s["stale_pages"], 0, "{s}");
            if mode != "park" {
                assert_eq!(s["clones_checked"], 2, "the first and the last: {s}");
            }
            if mode == "shared" {
                assert_eq!(s["pool_bytes_per_vm"], 0, "{s}");
            }
            if mode == "copy" {
                assert_eq!(s["pool_bytes_per_vm"], 64u64 << 20, "{s}");
            }
        }
    }
    let templates = r["templates"].as_array().expect("templates");
    assert_eq!(templates.len(), 2, "{r}");
    assert!(templates.iter().all(|t| t["unchanged"] == true), "{r}");
    let ch = r["ch_restore"].as_array().expect("ch_restore");
    assert_eq!(ch.len(), 3, "{r}");
    let copy = &ch[0];
    assert_eq!(
        copy["running_ms"]["samples"].as_array().map(Vec::len),
        Some(1),
        "{copy}"
    );
    assert_eq!(copy["guest_bad"], 0, "{copy}");
}
