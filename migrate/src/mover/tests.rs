//! Tests of the mover.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use guest_mem::{PageSize, PoolError};
use numa::PolicyError;

use super::*;
use crate::mm::Mm;
use crate::plan::{Capacity, PlanError};
use crate::report::{FailReason, FailedPage, StrayPage};
use test_support::fixture::SysTree;

const M2: u64 = 2 << 20;
const BASE: usize = 0x7f00_0000_0000;

/// A simulated two-node kernel: pages by index, per-node free pools,
/// busy and shared pages, and the two ways the kernel reports failure.
struct Sim {
    ps: u64,
    /// Node of each page; `None` = not present.
    pages: RefCell<Vec<Option<NodeId>>>,
    shared: BTreeSet<usize>,
    busy: BTreeSet<usize>,
    free: RefCell<BTreeMap<NodeId, u64>>,
    fresh_fallback: bool,
    /// ENOMEM for the call (hugetlb) rather than a positive count.
    whole_call_enomem: bool,
    fail_bind: bool,
    /// Fail every call after this many with EIO.
    fail_after: Option<usize>,
    calls: RefCell<Vec<usize>>,
    bound: RefCell<Option<(usize, usize, NodeId)>>,
    queries: Cell<usize>,
}

impl Sim {
    fn new(ps: u64, pages: Vec<Option<NodeId>>, free: &[(NodeId, u64)]) -> Self {
        Self {
            ps,
            pages: RefCell::new(pages),
            shared: BTreeSet::new(),
            busy: BTreeSet::new(),
            free: RefCell::new(free.iter().copied().collect()),
            fresh_fallback: false,
            whole_call_enomem: true,
            fail_bind: false,
            fail_after: None,
            calls: RefCell::new(Vec::new()),
            bound: RefCell::new(None),
            queries: Cell::new(0),
        }
    }
    fn index(&self, addr: usize) -> usize {
        (addr - BASE) / self.ps as usize
    }
    fn location(&self, i: usize) -> PageLocation {
        match self.pages.borrow().get(i).copied().flatten() {
            Some(n) => PageLocation::Node(n),
            None => PageLocation::Error(-libc::ENOENT),
        }
    }
}

impl Mm for Sim {
    fn query(&self, addrs: &[usize]) -> std::result::Result<Vec<PageLocation>, PolicyError> {
        self.queries.set(self.queries.get() + 1);
        Ok(addrs
            .iter()
            .map(|&a| self.location(self.index(a)))
            .collect())
    }

    fn move_to(
        &self,
        addrs: &[usize],
        node: NodeId,
        move_all: bool,
    ) -> std::result::Result<Vec<PageLocation>, PolicyError> {
        let call = self.calls.borrow().len();
        self.calls.borrow_mut().push(addrs.len());
        if self.fail_after.is_some_and(|n| call >= n) {
            return Err(PolicyError::Io { op: "move_pages" });
        }
        let mut status = Vec::new();
        let mut not_moved = 0;
        for &a in addrs {
            let i = self.index(a);
            let here = self.pages.borrow()[i];
            let st = match here {
                None => PageLocation::Error(-libc::ENOENT),
                Some(n) if n == node => PageLocation::Node(n),
                Some(_) if self.shared.contains(&i) && !move_all => {
                    PageLocation::Error(-libc::EACCES)
                }
                Some(_) if self.busy.contains(&i) => PageLocation::Error(-libc::EBUSY),
                Some(src) => {
                    let mut free = self.free.borrow_mut();
                    let room = free.get(&node).copied().unwrap_or(0);
                    if room > 0 {
                        free.insert(node, room - 1);
                        *free.entry(src).or_insert(0) += 1;
                        self.pages.borrow_mut()[i] = Some(node);
                        PageLocation::Node(node)
                    } else if self.fresh_fallback {
                        self.pages.borrow_mut()[i] = Some(node);
                        PageLocation::Node(node)
                    } else if self.whole_call_enomem {
                        return Err(PolicyError::OutOfMemory { op: "move_pages" });
                    } else {
                        not_moved += 1;
                        PageLocation::Node(src)
                    }
                }
            };
            status.push(st);
        }
        if not_moved > 0 {
            // What numa::move_pages does on a positive return.
            return self.query(addrs);
        }
        Ok(status)
    }

    fn bind(&self, addr: usize, len: usize, node: NodeId) -> std::result::Result<(), PolicyError> {
        if self.fail_bind {
            return Err(PolicyError::InvalidArgument { op: "mbind" });
        }
        *self.bound.borrow_mut() = Some((addr, len, node));
        Ok(())
    }

    fn capacity(
        &self,
        page_size: PageSize,
        node: NodeId,
    ) -> std::result::Result<Capacity, PoolError> {
        Ok(Capacity::Pool {
            free: self.free.borrow().get(&node).copied().unwrap_or(0),
            host_available: 1,
            fresh_fallback: page_size == PageSize::Huge2M && self.fresh_fallback,
        })
    }
}

fn two_nodes() -> (SysTree, Topology) {
    let tree = SysTree::new()
        .cpu_online("0-3")
        .node(0, "0-1", 1 << 22, &[10, 20], &[])
        .node(1, "2-3", 1 << 22, &[20, 10], &[]);
    let topo = tree.parse(numa::Topology::from_sysfs);
    (tree, topo)
}

fn span(pages: usize, ps: PageSize) -> MoveSpan<'static> {
    MoveSpan::from_raw(BASE, pages as u64 * ps.bytes(), ps).expect("span")
}

fn run_sim(
    sim: &Sim,
    span: &MoveSpan<'_>,
    range: ByteRange,
    target: NodeId,
    opts: &MoveOptions,
    cancel: Option<&CancelToken>,
    progress: Option<&dyn Fn(&Progress)>,
) -> Result<MoveReport> {
    let (_tree, topo) = two_nodes();
    run(
        sim,
        &topo,
        &Request {
            span,
            range,
            target,
            opts,
            cancel,
            progress,
        },
    )
}

#[test]
fn moves_everything_in_batches() {
    let sim = Sim::new(M2, vec![Some(0); 10], &[(1, 10)]);
    let s = span(10, PageSize::Huge2M);
    let opts = MoveOptions {
        batch_pages: 4,
        ..MoveOptions::default()
    };
    let seen = RefCell::new(Vec::new());
    let progress = |p: &Progress| seen.borrow_mut().push((p.bytes_done, p.bytes_total));
    let report = run_sim(
        &sim,
        &s,
        ByteRange::whole(s.len()),
        1,
        &opts,
        None,
        Some(&progress),
    )
    .expect("move");
    assert_eq!(report.pages_moved, 10);
    assert!(report.complete(), "{report}");
    assert_eq!(report.bytes_moved, 10 * M2);
    assert_eq!(report.batches, 3);
    assert_eq!(*sim.calls.borrow(), vec![4, 4, 2]);
    assert_eq!(*sim.bound.borrow(), Some((BASE, 10 * M2 as usize, 1)));
    assert_eq!(
        *seen.borrow(),
        vec![(4 * M2, 10 * M2), (8 * M2, 10 * M2), (10 * M2, 10 * M2)]
    );
    assert_eq!(
        report.plan,
        "10 of 10 pages can move: node 1 has 10 free 2M pages (0 already there, 0 not present)"
    );
}

#[test]
fn moves_only_the_range_and_skips_pages_already_there() {
    let mut pages = vec![Some(0); 8];
    pages[3] = Some(1);
    pages[4] = None;
    let sim = Sim::new(M2, pages, &[(1, 8)]);
    let s = span(8, PageSize::Huge2M);
    let range = ByteRange::new(2 * M2, 4 * M2); // pages 2..6
    let report = run_sim(&sim, &s, range, 1, &MoveOptions::default(), None, None).expect("move");
    assert_eq!(report.first_page, 2);
    assert_eq!(report.pages_total, 4);
    assert_eq!(
        (report.pages_moved, report.already_there, report.not_present),
        (2, 1, 1)
    );
    assert!(report.complete());
    // One call with the two pages that had to move; the rest untouched.
    assert_eq!(*sim.calls.borrow(), vec![2]);
    let after = sim.pages.borrow().clone();
    assert_eq!(
        after,
        vec![
            Some(0),
            Some(0),
            Some(1),
            Some(1),
            None,
            Some(1),
            Some(0),
            Some(0)
        ]
    );
    assert_eq!(
        *sim.bound.borrow(),
        Some((BASE + 2 * M2 as usize, 4 * M2 as usize, 1))
    );
}

#[test]
fn all_already_there_makes_no_move_call() {
    let sim = Sim::new(M2, vec![Some(1); 4], &[]);
    let s = span(4, PageSize::Huge2M);
    let report = run_sim(
        &sim,
        &s,
        ByteRange::whole(s.len()),
        1,
        &MoveOptions::default(),
        None,
        None,
    )
    .expect("move");
    assert_eq!(report.already_there, 4);
    assert_eq!(report.pages_moved, 0);
    assert!(report.complete());
    assert!(sim.calls.borrow().is_empty());
    // The policy is still set, so later faults land on the target.
    assert!(sim.bound.borrow().is_some());
}

#[test]
fn short_1g_pool_moves_what_fits_and_names_the_rest() {
    let sim = Sim::new(1 << 30, vec![Some(0); 4], &[(1, 3)]);
    let s = span(4, PageSize::Huge1G);
    let report = run_sim(
        &sim,
        &s,
        ByteRange::whole(s.len()),
        1,
        &MoveOptions::default(),
        None,
        None,
    )
    .expect("move");
    assert_eq!(
        report.plan,
        "3 of 4 pages can move: node 1 has 3 free 1G pages (0 already there, 0 not present)"
    );
    assert_eq!(report.pages_moved, 3);
    assert_eq!(
        report.failed,
        vec![FailedPage {
            page: 3,
            reason: FailReason::NoFreeTargetPage
        }]
    );
    assert_eq!(
        report.not_on_target,
        vec![StrayPage::new(3, PageLocation::Node(0))]
    );
    assert!(!report.complete());
}

#[test]
fn empty_1g_pool_stops_after_the_first_enomem() {
    let sim = Sim::new(1 << 30, vec![Some(0); 5], &[(1, 0)]);
    let s = span(5, PageSize::Huge1G);
    let last = Cell::new((0, 0));
    let progress = |p: &Progress| last.set((p.bytes_done, p.bytes_total));
    let report = run_sim(
        &sim,
        &s,
        ByteRange::whole(s.len()),
        1,
        &MoveOptions::default(),
        None,
        Some(&progress),
    )
    .expect("move");
    assert_eq!(last.get(), (5 << 30, 5 << 30));
    assert_eq!(report.pages_moved, 0);
    assert_eq!(report.failed.len(), 5);
    assert!(report
        .failed
        .iter()
        .all(|f| f.reason == FailReason::NoFreeTargetPage));
    // One page per batch for 1 GiB pages, but only one call was made,
    // and progress still ends at the total.
    assert_eq!(*sim.calls.borrow(), vec![1]);
    assert_eq!(
        report.plan,
        "0 of 5 pages can move: node 1 has 0 free 1G pages (0 already there, 0 not present)"
    );
}

#[test]
fn refuses_a_partial_move_before_changing_anything() {
    let sim = Sim::new(1 << 30, vec![Some(0); 2], &[(1, 1)]);
    let s = span(2, PageSize::Huge1G);
    let opts = MoveOptions {
        allow_partial: false,
        ..MoveOptions::default()
    };
    let err = run_sim(&sim, &s, ByteRange::whole(s.len()), 1, &opts, None, None)
        .expect_err("insufficient");
    assert_eq!(
        err.to_string(),
        "the target cannot take every page: 1 of 2 pages can move: node 1 has 1 free 1G pages \
         (0 already there, 0 not present)"
    );
    assert!(sim.bound.borrow().is_none());
    assert!(sim.calls.borrow().is_empty());
    assert_eq!(*sim.pages.borrow(), vec![Some(0), Some(0)]);
}

#[test]
fn per_page_errors_map_to_reasons() {
    let mut sim = Sim::new(M2, vec![Some(0); 4], &[(1, 4)]);
    sim.shared = BTreeSet::from([1]);
    sim.busy = BTreeSet::from([2]);
    let s = span(4, PageSize::Huge2M);
    let opts = MoveOptions {
        move_all: false,
        ..MoveOptions::default()
    };
    let report = run_sim(&sim, &s, ByteRange::whole(s.len()), 1, &opts, None, None).expect("move");
    assert_eq!(report.pages_moved, 2);
    assert_eq!(
        report.failed,
        vec![
            FailedPage {
                page: 1,
                reason: FailReason::NeedsMoveAll
            },
            FailedPage {
                page: 2,
                reason: FailReason::Busy
            },
        ]
    );
    // With MOVE_ALL the shared page moves too.
    let report = run_sim(
        &sim,
        &s,
        ByteRange::whole(s.len()),
        1,
        &MoveOptions::default(),
        None,
        None,
    )
    .expect("move");
    assert_eq!(report.pages_moved, 1);
    assert_eq!(report.already_there, 2);
    assert_eq!(
        report.failed,
        vec![FailedPage {
            page: 2,
            reason: FailReason::Busy
        }]
    );
}

#[test]
fn positive_count_failures_are_explained_by_the_pool() {
    // The kernel returned "n pages not moved" (no per-page status).
    let mut sim = Sim::new(M2, vec![Some(0); 3], &[(1, 2)]);
    sim.whole_call_enomem = false;
    let s = span(3, PageSize::Huge2M);
    let report = run_sim(
        &sim,
        &s,
        ByteRange::whole(s.len()),
        1,
        &MoveOptions::default(),
        None,
        None,
    )
    .expect("move");
    assert_eq!(report.pages_moved, 2);
    assert_eq!(
        report.failed,
        vec![FailedPage {
            page: 2,
            reason: FailReason::NoFreeTargetPage
        }]
    );
}

#[test]
fn fresh_2m_pages_move_beyond_the_pool() {
    let mut sim = Sim::new(M2, vec![Some(0); 6], &[(1, 2)]);
    sim.fresh_fallback = true;
    let s = span(6, PageSize::Huge2M);
    let report = run_sim(
        &sim,
        &s,
        ByteRange::whole(s.len()),
        1,
        &MoveOptions::default(),
        None,
        None,
    )
    .expect("move");
    assert!(report
        .plan
        .contains("the other 4 may move if the kernel can allocate fresh 2M pages on node 1"));
    assert_eq!(report.pages_moved, 6);
    assert!(report.complete());
}

#[test]
fn cancel_from_progress_stops_between_batches() {
    let sim = Sim::new(M2, vec![Some(0); 10], &[(1, 10)]);
    let s = span(10, PageSize::Huge2M);
    let opts = MoveOptions {
        batch_pages: 3,
        ..MoveOptions::default()
    };
    let cancel = CancelToken::new();
    let progress = |p: &Progress| {
        if p.bytes_done >= 6 * M2 {
            cancel.cancel();
        }
    };
    let err = run_sim(
        &sim,
        &s,
        ByteRange::whole(s.len()),
        1,
        &opts,
        Some(&cancel),
        Some(&progress),
    )
    .expect_err("cancelled");
    let MigrateError::Cancelled { report } = &err else {
        panic!("expected Cancelled, got {err:?}");
    };
    assert_eq!(report.pages_moved, 6);
    assert_eq!(report.batches, 2);
    assert!(!report.verified);
    assert_eq!(*sim.calls.borrow(), vec![3, 3]);
    assert_eq!(
        err.to_string(),
        "the move was cancelled after 6 of 10 pages"
    );
    assert_eq!(err.report().map(|r| r.pages_moved), Some(6));
}

#[test]
fn cancelled_before_start_changes_nothing() {
    let sim = Sim::new(M2, vec![Some(0); 2], &[(1, 2)]);
    let s = span(2, PageSize::Huge2M);
    let cancel = CancelToken::new();
    cancel.cancel();
    let err = run_sim(
        &sim,
        &s,
        ByteRange::whole(s.len()),
        1,
        &MoveOptions::default(),
        Some(&cancel),
        None,
    )
    .expect_err("cancelled");
    assert!(matches!(err, MigrateError::Cancelled { .. }));
    assert!(sim.bound.borrow().is_none());
    assert!(sim.calls.borrow().is_empty());
}

#[test]
fn cancel_interrupts_a_rate_limit_wait() {
    let sim = Sim::new(M2, vec![Some(0); 4], &[(1, 4)]);
    let s = span(4, PageSize::Huge2M);
    // 1 byte/s: the second batch would wait for ages.
    let opts = MoveOptions {
        batch_pages: 2,
        rate_limit_bytes_per_s: Some(1),
        ..MoveOptions::default()
    };
    let cancel = CancelToken::new();
    let progress = |_: &Progress| cancel.cancel();
    let t = Instant::now();
    let err = run_sim(
        &sim,
        &s,
        ByteRange::whole(s.len()),
        1,
        &opts,
        Some(&cancel),
        Some(&progress),
    )
    .expect_err("cancelled");
    assert!(t.elapsed() < Duration::from_secs(2));
    assert_eq!(err.report().map(|r| r.pages_moved), Some(2));
}

#[test]
fn rate_limit_paces_batches() {
    let sim = Sim::new(M2, vec![Some(0); 6], &[(1, 6)]);
    let s = span(6, PageSize::Huge2M);
    // 2 pages (4 MiB) per batch at 80 MiB/s: batches at 0, 50, 100 ms.
    let opts = MoveOptions {
        batch_pages: 2,
        rate_limit_bytes_per_s: Some(80 << 20),
        ..MoveOptions::default()
    };
    let t = Instant::now();
    let report = run_sim(&sim, &s, ByteRange::whole(s.len()), 1, &opts, None, None).expect("move");
    let elapsed = t.elapsed();
    assert!(elapsed >= Duration::from_millis(100), "{elapsed:?}");
    assert!(elapsed < Duration::from_secs(2), "{elapsed:?}");
    assert_eq!(report.pages_moved, 6);
}

#[test]
fn failed_call_keeps_the_partial_report() {
    let mut sim = Sim::new(M2, vec![Some(0); 6], &[(1, 6)]);
    sim.fail_after = Some(1);
    let s = span(6, PageSize::Huge2M);
    let opts = MoveOptions {
        batch_pages: 3,
        ..MoveOptions::default()
    };
    let err = run_sim(&sim, &s, ByteRange::whole(s.len()), 1, &opts, None, None).expect_err("EIO");
    assert!(matches!(err, MigrateError::Move { page: 3, .. }), "{err:?}");
    assert_eq!(err.report().map(|r| r.pages_moved), Some(3));
    assert_eq!(
        err.to_string(),
        "move_pages failed for the batch starting at page 3"
    );
}

#[test]
fn bind_failure_moves_nothing() {
    let mut sim = Sim::new(M2, vec![Some(0); 2], &[(1, 2)]);
    sim.fail_bind = true;
    let s = span(2, PageSize::Huge2M);
    let err = run_sim(
        &sim,
        &s,
        ByteRange::whole(s.len()),
        1,
        &MoveOptions::default(),
        None,
        None,
    )
    .expect_err("bind");
    assert!(matches!(err, MigrateError::Bind { node: 1, .. }));
    assert!(sim.calls.borrow().is_empty());
}

#[test]
fn invalid_requests_fail_before_any_call() {
    let sim = Sim::new(M2, vec![Some(0); 4], &[(1, 4)]);
    let s = span(4, PageSize::Huge2M);
    let whole = ByteRange::whole(s.len());
    let opts = MoveOptions::default();
    let cases: Vec<(ByteRange, NodeId, MoveOptions)> = vec![
        (whole, 5, opts),
        (ByteRange::new(0, 0), 1, opts),
        (ByteRange::new(4096, M2), 1, opts),
        (ByteRange::new(2 * M2, 4 * M2), 1, opts),
        (
            whole,
            1,
            MoveOptions {
                rate_limit_bytes_per_s: Some(0),
                ..opts
            },
        ),
    ];
    for (range, node, o) in cases {
        let err = run_sim(&sim, &s, range, node, &o, None, None).expect_err("invalid");
        assert!(matches!(err, MigrateError::Plan(_)), "{err:?}");
    }
    assert_eq!(sim.queries.get(), 0);
    assert!(sim.bound.borrow().is_none());
    let err = run_sim(&sim, &s, whole, 5, &opts, None, None).expect_err("node");
    assert_eq!(
        err.to_string(),
        "NUMA node 5 does not exist (this host has nodes [0, 1])"
    );
}

/// The real kernel path: a move to the node the pages are on reports
/// that node for every page, with and without MOVE_ALL.
#[test]
fn host_move_to_the_same_node() {
    let topology = Topology::detect().expect("topology");
    let node = topology.nodes()[0].id;
    let spec = guest_mem::RegionSpec::new("mover-host", 1 << 20, Some(node))
        .with_policy(guest_mem::PagePolicy::Strict(PageSize::Base4K));
    let (region, _) =
        Region::allocate(&topology, &spec, &clearing::RunOptions::default()).expect("allocate");
    let span = MoveSpan::of_region(&region);
    let addrs: Vec<usize> = (0..256).map(|p| span.page_addr(p)).collect();
    for move_all in [false, true] {
        let locs = Host.move_to(&addrs, node, move_all).expect("move_pages");
        assert!(
            locs.iter().all(|l| *l == PageLocation::Node(node)),
            "{locs:?}"
        );
    }
    assert!(matches!(
        Host.capacity(PageSize::Base4K, node),
        Ok(Capacity::Memory { free_bytes }) if free_bytes > 0
    ));
    assert!(matches!(
        Host.capacity(PageSize::Huge2M, node),
        Ok(Capacity::Pool {
            fresh_fallback: true,
            ..
        })
    ));
}

#[test]
fn spans_must_be_whole_pages() {
    assert!(MoveSpan::from_raw(BASE, M2, PageSize::Huge2M).is_ok());
    for (addr, len) in [
        (BASE + 4096, M2),
        (BASE, M2 + 1),
        (BASE, 0),
        (usize::MAX - 4095, M2),
    ] {
        assert!(
            matches!(
                MoveSpan::from_raw(addr, len, PageSize::Huge2M),
                Err(PlanError::BadSpan { .. })
            ),
            "{addr:#x}+{len:#x}"
        );
    }
}

#[test]
fn auto_batch_is_64_mib() {
    let o = MoveOptions::default();
    assert_eq!(o.batch_for(PageSize::Huge1G), 1);
    assert_eq!(o.batch_for(PageSize::Huge2M), 32);
    assert_eq!(o.batch_for(PageSize::Base4K), 16384);
    let o = MoveOptions {
        batch_pages: 7,
        ..o
    };
    assert_eq!(o.batch_for(PageSize::Huge1G), 7);
}

#[test]
fn options_round_trip_through_serde() {
    let o = MoveOptions {
        batch_pages: 8,
        rate_limit_bytes_per_s: Some(1 << 30),
        move_all: false,
        allow_partial: false,
    };
    let json = serde_json::to_string(&o).expect("serialize");
    let back: MoveOptions = serde_json::from_str(&json).expect("deserialize");
    assert_eq!(back, o);
    let defaults: MoveOptions = serde_json::from_str("{}").expect("defaults");
    assert_eq!(defaults, MoveOptions::default());
}
