//! REBALANCE, placement in STATS and the policy loop, end to end on real
//! hugetlb memory (`hugemem status`, `hugemem rebalance` and `hugemem bench
//! migrate` are in `cli/tests/rebalance_cli.rs`).
//!
//! This host has one NUMA node, so nothing can really move here: a move to
//! node 0 finds every page there already (0 moved), a move to node 1 is
//! `BAD_NODE`. What moves between nodes is checked inside the multi-node
//! QEMU guest by `backend::daemon::process::guest_check::check_rebalance_through_daemon`.
//!
//! Each test starts its own daemon on a socket in a temporary directory.
//! Tests that need 2 MiB pages reserve them with `guest_mem::ensure_free`
//! and print `SKIP: reason` when the kernel cannot give them. Tests are
//! serialized by one lock (shared huge-page pools). Waits are deadline-based.

use test_support::prelude::{
    alloc_2m_pages as alloc_2m, one_node, refused, reserve_2m, serial, wait_until, TestDaemon,
};

use std::time::Duration;

use backend::daemon::Config;
use backend::proto::{Status, FEATURE_REBALANCE};
use backend::stats::{RegionStats, Stats};
use guest_mem::vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const MIB: u64 = 1 << 20;
const PAGE: u64 = 2 * MIB;
fn pattern(seed: u64, i: u64) -> u64 {
    (i ^ seed).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

fn write_pattern(mem: &GuestMemoryMmap, len: u64, seed: u64) {
    for i in 0..len / 8 {
        mem.write_obj(pattern(seed, i), GuestAddress(i * 8))
            .expect("write");
    }
}

fn pattern_intact(mem: &GuestMemoryMmap, len: u64, seed: u64) -> bool {
    (0..len / 8).all(|i| mem.read_obj::<u64>(GuestAddress(i * 8)).ok() == Some(pattern(seed, i)))
}

fn region_entry(stats: &Stats, region: u64) -> RegionStats {
    stats
        .region(region)
        .cloned()
        .unwrap_or_else(|| panic!("region {region} not in STATS: {stats}"))
}

/// Present pages on `node` by the entry's placement.
fn on_node(e: &RegionStats, node: u32) -> Option<u64> {
    e.placement.clone().flatten()?.get(&node).copied()
}

#[test]
fn handshake_advertises_rebalance() {
    let _g = serial();
    let d = TestDaemon::start(|_| {});
    let c = d.client();
    assert_ne!(
        c.features() & FEATURE_REBALANCE,
        0,
        "features {:#x}",
        c.features()
    );
    drop(c);
    d.shutdown();
}

#[test]
fn rebalance_to_its_own_node_moves_nothing_and_keeps_the_data() {
    let _g = serial();
    if !reserve_2m(4, "rebalance_to_its_own_node") || !one_node("rebalance_to_its_own_node") {
        return;
    }
    let d = TestDaemon::start(|_| {});
    let mut c = d.client();
    let a = alloc_2m(&mut c, 4);
    let r = a.regions[0];
    let mem = a.guest_memory().expect("map");
    write_pattern(&mem, r.size, 7);
    assert_eq!(
        c.rebalance(r.region_id, 0, 0, 0).expect("whole region"),
        (0, 0)
    );
    assert_eq!(
        c.rebalance(r.region_id, PAGE, 2 * PAGE, 0)
            .expect("a range"),
        (0, 0)
    );
    assert_eq!(
        c.rebalance(r.region_id, 3 * PAGE, 0, 0)
            .expect("to the end"),
        (0, 0)
    );
    assert!(pattern_intact(&mem, r.size, 7), "data changed");
    let e = region_entry(&c.stats().expect("stats"), r.region_id);
    assert_eq!(on_node(&e, 0), Some(4), "{e:?}");
    assert_eq!(e.bound_node, Some(Some(0)), "{e:?}");
    assert_eq!(e.split, Some(false), "{e:?}");
    assert_eq!(e.moving, Some(false), "{e:?}");
    let stats = c.stats().expect("stats");
    let counters = stats.rebalance.as_ref().expect("rebalance").counters;
    assert_eq!(counters.moves_ok, 3, "{stats}");
    assert_eq!(counters.pages_moved, 0, "{stats}");
    c.free(a.id).expect("free");
    drop(mem);
    d.shutdown();
}

#[test]
fn rebalance_to_a_missing_node_is_bad_node() {
    let _g = serial();
    if !reserve_2m(2, "rebalance_to_a_missing_node") || !one_node("rebalance_to_a_missing_node") {
        return;
    }
    let d = TestDaemon::start(|_| {});
    let mut c = d.client();
    let a = alloc_2m(&mut c, 2);
    let id = a.regions[0].region_id;
    for node in [1, 999, u32::MAX] {
        let (status, msg) = refused(c.rebalance(id, 0, 0, node));
        assert_eq!(status, Status::BadNode, "{msg}");
        assert!(
            msg.contains(&format!("NUMA node {node} does not exist")),
            "{msg}"
        );
        assert!(msg.contains("this host has nodes [0]"), "{msg}");
    }
    // The connection stays usable, and the region is unchanged.
    let e = region_entry(&c.stats().expect("stats"), id);
    assert_eq!(on_node(&e, 0), Some(2), "{e:?}");
    assert_eq!(e.split, Some(false), "{e:?}");
    c.free(a.id).expect("free");
    d.shutdown();
}

#[test]
fn bad_ranges_are_invalid() {
    let _g = serial();
    if !reserve_2m(2, "bad_ranges_are_invalid") {
        return;
    }
    let d = TestDaemon::start(|_| {});
    let mut c = d.client();
    let a = alloc_2m(&mut c, 2);
    let id = a.regions[0].region_id;
    let size = a.regions[0].size;
    let cases: [(u64, u64, &str); 5] = [
        (4096, 0, "not aligned to 2M pages"),
        (0, 4096, "not aligned to 2M pages"),
        (0, size + PAGE, "outside the"),
        (size, 0, "the range is empty"),
        (u64::MAX - PAGE + 1, PAGE, "outside the"),
    ];
    for (offset, len, want) in cases {
        let (status, msg) = refused(c.rebalance(id, offset, len, 0));
        assert_eq!(status, Status::Invalid, "{offset:#x}+{len:#x}: {msg}");
        assert!(msg.contains(want), "{offset:#x}+{len:#x}: {msg}");
    }
    c.free(a.id).expect("free");
    d.shutdown();
}

#[test]
fn unknown_and_pooled_regions_are_not_found() {
    let _g = serial();
    if !reserve_2m(2, "unknown_and_pooled_regions") {
        return;
    }
    let d = TestDaemon::start(|_| {});
    let mut c = d.client();
    let (status, msg) = refused(c.rebalance(999_999, 0, 0, 0));
    assert_eq!(status, Status::NotFound);
    assert!(msg.contains("does not exist"), "{msg}");
    let a = alloc_2m(&mut c, 2);
    let id = a.regions[0].region_id;
    c.free(a.id).expect("free");
    drop(a);
    // Released: quarantined, then scrubbed and pooled. Either way it is the
    // daemon's now, not the client's, even for root.
    let (status, msg) = refused(c.rebalance(id, 0, 0, 0));
    assert_eq!(status, Status::NotFound, "{msg}");
    assert!(msg.contains("not in use"), "{msg}");
    d.shutdown();
}

#[test]
fn another_connections_region_needs_an_operator_uid() {
    let _g = serial();
    if !reserve_2m(2, "another_connections_region") || !one_node("another_connections_region") {
        return;
    }
    // Operators are configured as another uid: root (this test) stays one,
    // so the second connection may move the first one's region. (A
    // non-operator's refusal runs as uid 65534 further down this file.)
    let d = TestDaemon::start(|c| c.rebalance.operator_uids = vec![4242]);
    let mut owner = d.client();
    let a = alloc_2m(&mut owner, 2);
    let id = a.regions[0].region_id;
    let mut other = d.client();
    assert_eq!(
        other
            .rebalance(id, 0, 0, 0)
            .expect("root is always an operator"),
        (0, 0)
    );
    // The owner may.
    assert_eq!(owner.rebalance(id, 0, 0, 0).expect("owner"), (0, 0));
    // Its fds go before the FREE: the next daemon needs the same two pages.
    let alloc = a.id;
    drop(a);
    owner.free(alloc).expect("free");
    drop(other);
    d.shutdown();

    // Default operators: root and the daemon's uid (this test's): allowed.
    let d = TestDaemon::start(|_| {});
    let mut owner = d.client();
    let a = alloc_2m(&mut owner, 2);
    let id = a.regions[0].region_id;
    let mut operator = d.client();
    assert_eq!(operator.rebalance(id, 0, 0, 0).expect("operator"), (0, 0));
    owner.free(a.id).expect("free");
    d.shutdown();
}

#[test]
fn policy_loop_samples_the_clients_vcpu_threads() {
    let _g = serial();
    if !reserve_2m(2, "policy_loop") || !one_node("policy_loop") {
        return;
    }
    let d = TestDaemon::start(|c| {
        c.rebalance.policy = true;
        c.rebalance.interval_ms = 20;
        c.rebalance.persist = 2;
    });
    // The client is this process: give it a thread named like a
    // cloud-hypervisor vCPU.
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let vcpu = std::thread::Builder::new()
        .name("vcpu0".into())
        .spawn(move || {
            let _ = rx.recv();
        })
        .expect("vcpu thread");
    let mut c = d.client();
    let a = alloc_2m(&mut c, 2);
    let pid = i64::from(std::process::id());
    let mut last = Stats::default();
    wait_until(
        "the policy saw the vCPU on node 0",
        Duration::from_secs(20),
        || {
            last = c.stats().expect("stats");
            last.rebalance.iter().flat_map(|r| &r.clients).any(|cl| {
                cl.pid.map(i64::from) == Some(pid)
                    && cl.vcpus.as_ref().and_then(|v| v.get(&0)) == Some(&1)
                    && cl.decision.as_ref().and_then(|d| d.get("local")).is_some()
            })
        },
    );
    assert_eq!(
        last.rebalance.as_ref().map(|r| r.counters.policy_moves),
        Some(0),
        "{last}"
    );
    drop(tx);
    vcpu.join().expect("join");
    c.free(a.id).expect("free");
    d.shutdown();
}

#[test]
fn the_guest_check_needs_two_nodes() {
    if !one_node("the_guest_check_needs_two_nodes") {
        return;
    }
    let err = backend::daemon::process::guest_check::check_rebalance_through_daemon()
        .expect_err("one node");
    assert!(
        err.to_string().contains("needs two NUMA nodes with memory"),
        "{err}"
    );
}

#[test]
fn config_section_validates() {
    let c = Config::from_toml_str(
        "[rebalance]\npolicy = true\ninterval_ms = 500\nthreshold_pct = 90\nrate_limit_mib_s = 256\noperator_uids = [0]",
    )
    .expect("parse");
    c.validate().expect("valid");
    assert_eq!(c.rebalance.rate_limit_bytes_per_s(), Some(256 * MIB));
    for bad in [
        "threshold_pct = 0",
        "threshold_pct = 101",
        "interval_ms = 0",
    ] {
        let c = Config::from_toml_str(&format!("[rebalance]\n{bad}")).expect("parse");
        assert!(c.validate().is_err(), "{bad}");
    }
    assert!(Config::from_toml_str("[rebalance]\npolicyy = true").is_err());
}
