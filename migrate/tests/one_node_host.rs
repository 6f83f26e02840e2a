//! Real-memory tests that run on a one-node host: moves to the node the pages
//! are on (nothing is copied, everything else runs) and refused moves. The
//! in-guest checks' one-node form is `integration/tests/migrate_checks.rs`,
//! the bench's skip path `cli/tests/bench_migrate.rs`.
//!
//! 2 MiB pages are reserved with `test_support::hugepages::reserve_2m`; a
//! test that cannot get them skips with the reason.

use std::cell::RefCell;

use clearing::{CancelToken, Progress, RunOptions};
use guest_mem::{PagePolicy, PageSize, Region, RegionSpec};
use migrate::{
    move_range, move_region, placement, plan_move, ByteRange, MigrateError, MoveOptions, MoveSpan,
    PlanError,
};
use numa::Topology;
use test_support::fixture::SysTree;
use test_support::hugepages::reserve_2m;

const M2: u64 = 2 << 20;

/// Held by every test of this file that uses huge pages: each sets the
/// host's 2 MiB pool to exactly the pages it needs
/// (`test_support::hugepages`), so two at once would take each other's.
static HUGE: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn huge_lock() -> std::sync::MutexGuard<'static, ()> {
    HUGE.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn region(topology: &Topology, name: &str, page: PageSize, size: u64) -> Region {
    let spec = RegionSpec::new(name, size, Some(0)).with_policy(PagePolicy::Strict(page));
    Region::allocate(topology, &spec, &RunOptions::default())
        .expect("allocate region on node 0")
        .0
}

/// Writes a byte pattern over the whole region (every byte, not stamps).
fn fill(region: &Region, seed: u8) {
    // SAFETY: the region belongs to this test alone: no other mapping, no
    // guest, no preparer or scrubber, and no other slice of it exists.
    let bytes = unsafe { region.as_mut_slice() };
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31) ^ seed ^ ((i >> 12) as u8);
    }
}

fn intact(region: &Region, seed: u8) -> bool {
    // SAFETY: as in `fill`; nothing writes the region during the check.
    let bytes = unsafe { region.as_slice() };
    bytes
        .iter()
        .enumerate()
        .all(|(i, &b)| b == (i as u8).wrapping_mul(31) ^ seed ^ ((i >> 12) as u8))
}

#[test]
fn region_already_on_the_target_stays_put_and_intact() {
    let _huge = huge_lock();

    if !reserve_2m(8, "one_node_host") {
        return;
    }
    let topology = Topology::detect().expect("topology");
    let region = region(&topology, "mig-there", PageSize::Huge2M, 8 * M2);
    fill(&region, 0x5a);
    let calls = RefCell::new(0);
    let progress = |_: &Progress| *calls.borrow_mut() += 1;
    let report = move_region(
        &topology,
        &region,
        0,
        &MoveOptions::default(),
        None,
        Some(&progress),
    )
    .expect("move to node 0");
    assert_eq!(report.pages_total, 8);
    assert_eq!(report.already_there, 8);
    assert_eq!(report.pages_moved, 0);
    assert_eq!(report.batches, 0, "nothing to move, no move_pages call");
    assert_eq!(*calls.borrow(), 0);
    assert!(report.complete(), "{report}");
    assert_eq!(
        report.plan,
        "nothing to move: 8 of 8 pages already on node 0 (0 not present)"
    );
    assert!(intact(&region, 0x5a), "data changed");
    // The region's own check agrees.
    assert!(region
        .verify_placement()
        .expect("verify")
        .misplaced
        .is_empty());
}

#[test]
fn a_range_of_the_region_and_the_dry_run() {
    let _huge = huge_lock();

    if !reserve_2m(8, "one_node_host") {
        return;
    }
    let topology = Topology::detect().expect("topology");
    let region = region(&topology, "mig-range", PageSize::Huge2M, 8 * M2);
    fill(&region, 3);
    let span = MoveSpan::of_region(&region);
    let range = ByteRange::parse("4M..12M", region.len()).expect("range");
    let plan = plan_move(&topology, &span, range, 0).expect("plan");
    assert_eq!(
        (plan.first_page, plan.pages_total, plan.already_there),
        (2, 4, 4)
    );
    assert!(plan.fits());
    let report = move_range(
        &topology,
        &span,
        range,
        0,
        &MoveOptions::default(),
        None,
        None,
    )
    .expect("move range");
    assert_eq!(
        (report.first_page, report.pages_total, report.already_there),
        (2, 4, 4)
    );
    assert!(report.complete());
    assert!(intact(&region, 3));
    let p = placement(&span).expect("placement");
    assert_eq!(p.per_node.get(&0), Some(&8));
    assert_eq!(p.to_string(), "node 0: 8 pages, 0 not present");
}

#[test]
fn unknown_node_is_refused_naming_the_nodes() {
    let _huge = huge_lock();

    if !reserve_2m(4, "one_node_host") {
        return;
    }
    let topology = Topology::detect().expect("topology");
    let region = region(&topology, "mig-node1", PageSize::Huge2M, 4 * M2);
    fill(&region, 9);
    let err = move_region(&topology, &region, 1, &MoveOptions::default(), None, None)
        .expect_err("node 1 does not exist here");
    let available: Vec<u32> = topology.nodes().iter().map(|n| n.id).collect();
    match &err {
        MigrateError::Plan(PlanError::UnknownNode {
            node: 1,
            available: a,
        }) => assert_eq!(a, &available),
        other => panic!("expected UnknownNode, got {other:?}"),
    }
    assert_eq!(
        err.to_string(),
        format!("NUMA node 1 does not exist (this host has nodes {available:?})")
    );
    assert!(err.report().is_none(), "refused before anything was done");
    assert!(intact(&region, 9));
    assert_eq!(
        placement(&MoveSpan::of_region(&region))
            .expect("placement")
            .per_node
            .get(&0),
        Some(&4)
    );
}

#[test]
fn bad_ranges_are_refused() {
    let _huge = huge_lock();

    if !reserve_2m(4, "one_node_host") {
        return;
    }
    let topology = Topology::detect().expect("topology");
    let region = region(&topology, "mig-ranges", PageSize::Huge2M, 4 * M2);
    let span = MoveSpan::of_region(&region);
    let opts = MoveOptions::default();
    for (range, want) in [
        (ByteRange::new(0, 0), "the range is empty"),
        (
            ByteRange::new(M2 / 2, M2),
            "range 0x100000+0x200000 is not aligned to 2M pages",
        ),
        (
            ByteRange::new(2 * M2, 4 * M2),
            "range 0x400000+0x800000 is outside the 0x800000-byte region",
        ),
    ] {
        let err = move_range(&topology, &span, range, 0, &opts, None, None).expect_err("bad range");
        assert_eq!(err.to_string(), want);
    }
    let zero_rate = MoveOptions {
        rate_limit_bytes_per_s: Some(0),
        ..opts
    };
    let err = move_region(&topology, &region, 0, &zero_rate, None, None).expect_err("zero rate");
    assert!(matches!(err, MigrateError::Plan(PlanError::ZeroRate)));
}

#[test]
fn base_page_region_already_there() {
    let topology = Topology::detect().expect("topology");
    let region = region(&topology, "mig-4k", PageSize::Base4K, 8 << 20);
    fill(&region, 77);
    let report = move_region(&topology, &region, 0, &MoveOptions::default(), None, None)
        .expect("move 4K region");
    assert_eq!(report.pages_total, 2048);
    assert_eq!(report.already_there, 2048);
    assert!(report.complete());
    assert!(intact(&region, 77));
}

#[test]
fn pages_never_touched_are_not_present_and_then_land_on_the_target() {
    let _huge = huge_lock();

    if !reserve_2m(4, "one_node_host") {
        return;
    }
    let topology = Topology::detect().expect("topology");
    let spec = RegionSpec::new("mig-fresh", 4 * M2, Some(0))
        .with_policy(PagePolicy::Strict(PageSize::Huge2M));
    let region = Region::create(&topology, &spec).expect("create (not populated)");
    let report = move_region(&topology, &region, 0, &MoveOptions::default(), None, None)
        .expect("move unpopulated region");
    assert_eq!(report.not_present, 4);
    assert!(report.complete(), "{report}");
    // First touch after the move: the bound policy places the page.
    fill(&region, 1);
    let p = placement(&MoveSpan::of_region(&region)).expect("placement");
    assert_eq!(p.per_node.get(&0), Some(&4));
}

#[test]
fn cancelled_token_refuses_before_binding() {
    let _huge = huge_lock();

    if !reserve_2m(2, "one_node_host") {
        return;
    }
    let topology = Topology::detect().expect("topology");
    let region = region(&topology, "mig-cancel", PageSize::Huge2M, 2 * M2);
    let cancel = CancelToken::new();
    cancel.cancel();
    let err = move_region(
        &topology,
        &region,
        0,
        &MoveOptions::default(),
        Some(&cancel),
        None,
    )
    .expect_err("cancelled");
    let report = err.report().expect("partial report");
    assert_eq!((report.pages_moved, report.already_there), (0, 2));
    assert!(!report.verified);
}

/// A sysfs tree claiming a node 1 the kernel does not have: the planner
/// finds no pool there, a strict move is refused, and a partial one fails at
/// `mbind` with an error, never a panic, with the data untouched.
#[test]
fn a_node_the_kernel_lacks_fails_cleanly() {
    let _huge = huge_lock();

    if !reserve_2m(2, "one_node_host") {
        return;
    }
    let real = Topology::detect().expect("topology");
    if real.nodes().iter().any(|n| n.id == 1) {
        test_support::skip!("this host has a node 1");
        return;
    }
    let tree = SysTree::new()
        .cpu_online("0-1")
        .node(0, "0", 1 << 20, &[10, 20], &[])
        .node(1, "1", 1 << 20, &[20, 10], &[]);
    let fake = tree.parse(Topology::from_sysfs);
    let region = region(&real, "mig-fake", PageSize::Huge2M, 2 * M2);
    fill(&region, 42);

    let strict = MoveOptions {
        allow_partial: false,
        ..MoveOptions::default()
    };
    let err = move_region(&fake, &region, 1, &strict, None, None).expect_err("no pool on node 1");
    match &err {
        MigrateError::Insufficient { plan } => {
            assert_eq!((plan.guaranteed, plan.uncovered), (0, 2));
            assert!(
                plan.summary()
                    .starts_with("0 of 2 pages can move: node 1 has 0 free 2M pages"),
                "{}",
                plan.summary()
            );
        }
        other => panic!("expected Insufficient, got {other:?}"),
    }
    let err = move_region(&fake, &region, 1, &MoveOptions::default(), None, None)
        .expect_err("kernel has no node 1");
    assert!(matches!(err, MigrateError::Bind { node: 1, .. }), "{err:?}");
    assert!(intact(&region, 42));
    assert_eq!(
        placement(&MoveSpan::of_region(&region))
            .expect("placement")
            .per_node
            .get(&0),
        Some(&2)
    );
}
