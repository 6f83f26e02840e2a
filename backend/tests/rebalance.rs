//! REBALANCE, placement in STATS/`hugemem status`, `hugemem rebalance`,
//! `hugemem bench migrate` and the policy loop, end to end on real hugetlb
//! memory.
//!
//! This host has one NUMA node, so nothing can really move here: a move to
//! node 0 finds every page there already (0 moved), a move to node 1 is
//! `BAD_NODE`. What moves between nodes is checked inside the multi-node
//! QEMU guest by `backend::daemon::rebalance::testing::check_rebalance_through_daemon`.
//!
//! Each test starts its own daemon on a socket in a temporary directory.
//! Tests that need 2 MiB pages reserve them with `guest_mem::ensure_free`
//! and print `SKIP: reason` when the kernel cannot give them. Tests are
//! serialized by one lock (shared huge-page pools). Waits are deadline-based.

mod common;
use common::{refused, reserve_2m, serial, wait_until, TestDaemon};

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::process::{Command, Output};
use std::time::Duration;

use backend::client::{Allocation, Client};
use backend::daemon::Config;
use backend::proto::{AllocPart, AllocRequest, ClearMode, PagePolicy, Status, FEATURE_REBALANCE};
use backend::stats::{RegionStats, Stats};
use guest_mem::vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use serde_json::Value;

const MIB: u64 = 1 << 20;
const PAGE: u64 = 2 * MIB;
const NOBODY: u32 = 65534;

fn one_node(test: &str) -> bool {
    let topology = numa::Topology::detect().expect("topology");
    let nodes = migrate::memory_nodes(&topology);
    if nodes != [0] {
        test_support::skip!("{test}: written for a host with node 0 only; this one has {nodes:?}");
        return false;
    }
    true
}

fn alloc_2m(client: &mut Client, pages: u64) -> Allocation {
    let size = pages * PAGE;
    client
        .alloc(AllocRequest {
            total_size: size,
            page_policy: PagePolicy::Huge2M,
            clear_mode: ClearMode::Eager,
            lock: false,
            parts: vec![AllocPart { node: 0, size }],
            want_paths: false,
        })
        .expect("ALLOC of 2 MiB pages on node 0")
}

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

fn hugemem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hugemem"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run hugemem")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
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
    owner.free(a.id).expect("free");
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

/// Opens the daemon's directory and socket to other uids (the daemon's own
/// uid check still applies).
fn open_socket_to_all(d: &TestDaemon) {
    std::fs::set_permissions(d.dir(), std::fs::Permissions::from_mode(0o755)).expect("chmod dir");
    std::fs::set_permissions(d.socket(), std::fs::Permissions::from_mode(0o666))
        .expect("chmod socket");
}

fn hugemem_as_nobody(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hugemem"))
        .args(args)
        .env("RUST_LOG", "warn")
        .current_dir("/")
        .uid(NOBODY)
        .gid(NOBODY)
        .output()
        .expect("run hugemem as nobody")
}

#[test]
fn a_non_root_peer_gets_not_found_unless_it_is_an_operator() {
    let _g = serial();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        test_support::skip!("needs root to run a child as uid {NOBODY}");
        return;
    }
    if !reserve_2m(2, "a_non_root_peer") {
        return;
    }
    for (operators, allowed) in [(vec![], false), (vec![NOBODY], true)] {
        let d = TestDaemon::start(|c| {
            c.allowed_uids = vec![0, NOBODY];
            c.rebalance.operator_uids = operators;
        });
        open_socket_to_all(&d);
        let mut owner = d.client();
        let a = alloc_2m(&mut owner, 2);
        let id = a.regions[0].region_id.to_string();
        let socket = d.socket();
        let out = hugemem_as_nobody(&[
            "rebalance",
            "--socket",
            socket.to_str().expect("utf-8"),
            "--region",
            &id,
            "--to-node",
            "0",
        ]);
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        if allowed {
            assert!(out.status.success(), "operator nobody: {stdout}{stderr}");
            assert!(stdout.contains("0 pages moved, 0 failed"), "{stdout}");
        } else {
            assert!(!out.status.success(), "nobody must be refused: {stdout}");
            assert!(stderr.contains("NotFound"), "{stderr}");
            assert!(
                stderr.contains(&format!(
                    "does not belong to this connection (uid {NOBODY} is not an operator)"
                )),
                "{stderr}"
            );
        }
        owner.free(a.id).expect("free");
        d.shutdown();
    }
}

#[test]
fn stats_and_status_show_placement() {
    let _g = serial();
    if !reserve_2m(3, "stats_and_status_show_placement") {
        return;
    }
    let d = TestDaemon::start(|_| {});
    let mut c = d.client();
    let a = alloc_2m(&mut c, 3);
    let r = a.regions[0];
    let stats = c.stats().expect("stats");
    let e = region_entry(&stats, r.region_id);
    assert_eq!(e.alloc_id, Some(a.id), "{e:?}");
    assert_eq!(e.size, Some(r.size), "{e:?}");
    assert_eq!(e.page_size, "2M", "{e:?}");
    assert_eq!(e.node, 0, "{e:?}");
    assert_eq!(e.bound_node, Some(Some(0)), "{e:?}");
    assert_eq!(
        e.placement,
        Some(Some([(0, 3)].into_iter().collect())),
        "{e:?}"
    );
    assert_eq!(e.not_present, Some(0), "{e:?}");
    assert_eq!(e.rebalanced, Some(Vec::new()), "{e:?}");
    assert_eq!(
        stats.rebalance.as_ref().map(|r| r.policy),
        Some(false),
        "{stats}"
    );

    let socket = d.socket();
    let s = socket.to_str().expect("utf-8");
    let out = hugemem(&["status", "--socket", s]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    let line = stdout
        .lines()
        .find(|l| l.starts_with(&format!("{:<7} {:<6}", r.region_id, a.id)))
        .unwrap_or_else(|| panic!("no line for region {}: {stdout}", r.region_id));
    assert!(line.contains(" 6M 2M "), "{line}");
    assert!(line.ends_with("node 0: 3"), "{line}");
    let out = hugemem(&["status", "--socket", s, "--json"]);
    assert!(out.status.success());
    let json: Stats = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(on_node(&region_entry(&json, r.region_id), 0), Some(3));
    c.free(a.id).expect("free");
    d.shutdown();
}

#[test]
fn cli_rebalance_moves_a_range_and_reports_refusals() {
    let _g = serial();
    if !reserve_2m(4, "cli_rebalance") || !one_node("cli_rebalance") {
        return;
    }
    let d = TestDaemon::start(|_| {});
    let mut c = d.client();
    let a = alloc_2m(&mut c, 4);
    let id = a.regions[0].region_id.to_string();
    let socket = d.socket();
    let s = socket.to_str().expect("utf-8");
    for range in ["2M..6M", "4M..", "..2M"] {
        let out = hugemem(&[
            "rebalance",
            "--socket",
            s,
            "--region",
            &id,
            "--to-node",
            "0",
            "--range",
            range,
        ]);
        let stdout = text(&out.stdout);
        assert!(
            out.status.success(),
            "{range}: {stdout}{}",
            text(&out.stderr)
        );
        assert_eq!(
            stdout.trim(),
            format!("region {id} -> node 0: 0 pages moved, 0 failed; placement now node 0: 4"),
            "{range}"
        );
    }
    let refusals: [(&[&str], &str); 4] = [
        (&["--to-node", "1"], "BadNode"),
        (
            &["--to-node", "0", "--range", "1M..2M"],
            "not aligned to 2M pages",
        ),
        (&["--to-node", "0", "--range", "2M..2M"], "is empty"),
        (&["--to-node", "0", "--range", "0..1T"], "outside the"),
    ];
    for (extra, want) in refusals {
        let mut args = vec!["rebalance", "--socket", s, "--region", &id];
        args.extend_from_slice(extra);
        let out = hugemem(&args);
        let stderr = text(&out.stderr);
        assert!(!out.status.success(), "{extra:?} must fail");
        assert!(stderr.contains(want), "{extra:?}: {stderr}");
    }
    c.free(a.id).expect("free");
    d.shutdown();
}

#[test]
fn bench_migrate_reports_skipped_moves_and_locality() {
    let _g = serial();
    if !one_node("bench_migrate") {
        return;
    }
    let out = hugemem(&["bench", "migrate", "--size", "8M", "--json"]);
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

    let out = hugemem(&["bench", "migrate", "--size", "8M"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("migrate 2M 8 MiB no second node: skipped"),
        "{stdout}"
    );
    assert!(stdout.contains("(100.0%)"), "{stdout}");
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
    let err = backend::daemon::rebalance::testing::check_rebalance_through_daemon()
        .expect_err("one node");
    assert!(err.contains("needs two NUMA nodes with memory"), "{err}");
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
