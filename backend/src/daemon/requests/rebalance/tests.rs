//! Tests of the rebalancing part.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use migrate::CpuNodes;

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use clearing::CancelToken;
use migrate::{ByteRange, Decision, Placement, PlanError, PolicyConfig, Sample, Watcher};
use numa::NodeId;

use super::moves::*;
use super::policy::*;
use super::rebalancer::*;
use crate::daemon::config::RebalanceConfig;
use crate::daemon::connections::session::Rooms;
use crate::daemon::pool::{InUseRegion, RegionId};
use crate::daemon::process::guest_check;
use crate::proto::Status;

#[test]
fn operator_model() {
    let ops = [0, 1000];
    assert_eq!(authorize(3, 3, 4242, &ops), Access::Owner);
    assert_eq!(authorize(3, 4, 0, &ops), Access::Operator);
    assert_eq!(authorize(3, 4, 1000, &ops), Access::Operator);
    assert_eq!(authorize(3, 4, 4242, &ops), Access::Denied);
    // An owner is an owner whatever its uid.
    assert_eq!(authorize(3, 3, 0, &[]), Access::Owner);
    assert_eq!(authorize(3, 4, 0, &[]), Access::Denied);
}

#[test]
fn default_operators_are_root_and_the_daemon() {
    let ops = RebalanceConfig::default().effective_operators();
    assert!(ops.contains(&0));
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    assert!(ops.contains(&me));
    let c = RebalanceConfig {
        operator_uids: vec![7],
        ..RebalanceConfig::default()
    };
    assert_eq!(
        c.effective_operators(),
        vec![0, 7],
        "root is always an operator"
    );
    assert_eq!(c.rate_limit_bytes_per_s(), None);
    let c = RebalanceConfig {
        rate_limit_mib_s: 100,
        ..RebalanceConfig::default()
    };
    assert_eq!(c.rate_limit_bytes_per_s(), Some(100 << 20));
}

#[test]
fn errors_map_to_statuses() {
    assert_eq!(RebalanceError::Unknown(1).status(), Status::NotFound);
    assert_eq!(RebalanceError::NotInUse(1).status(), Status::NotFound);
    assert_eq!(
        RebalanceError::NotYours { region: 1, uid: 5 }.status(),
        Status::NotFound
    );
    let bad = RebalanceError::Plan(PlanError::UnknownNode {
        node: 1,
        available: vec![0],
    });
    assert_eq!(bad.status(), Status::BadNode);
    assert_eq!(
        bad.to_string(),
        "NUMA node 1 does not exist (this host has nodes [0])"
    );
    assert_eq!(
        RebalanceError::Plan(PlanError::ZeroLength).status(),
        Status::Invalid
    );
    assert_eq!(
        RebalanceError::Busy {
            region: 1,
            target: 0,
            seconds: 0.0
        }
        .status(),
        Status::Invalid
    );
}

#[test]
fn range_map_overrides_and_merges() {
    let mut m = RangeMap::default();
    m.insert(0, 100, 1);
    m.insert(100, 200, 1);
    assert_eq!(m.ranges(), vec![(0, 200, 1)]);
    m.insert(50, 150, 0);
    assert_eq!(m.ranges(), vec![(0, 50, 1), (50, 150, 0), (150, 200, 1)]);
    m.insert(150, 200, 0);
    assert_eq!(m.ranges(), vec![(0, 50, 1), (50, 200, 0)]);
    m.insert(0, 300, 2);
    assert_eq!(m.ranges(), vec![(0, 300, 2)]);
    m.insert(10, 10, 1);
    assert_eq!(m.ranges(), vec![(0, 300, 2)]);
    m.insert(100, 120, 1);
    assert_eq!(m.ranges(), vec![(0, 100, 2), (100, 120, 1), (120, 300, 2)]);
}

#[test]
fn whole_node_needs_one_node() {
    let p = |per: &[(NodeId, usize)], unlocated| Placement {
        page_size: 2 << 20,
        pages: 8,
        per_node: per.iter().copied().collect(),
        not_present: 0,
        unlocated,
    };
    assert_eq!(whole_node(&p(&[(1, 8)], 0), 1, true), Some(1));
    assert_eq!(whole_node(&p(&[(0, 8)], 0), 1, false), Some(0));
    assert_eq!(whole_node(&p(&[(0, 4), (1, 4)], 0), 1, true), None);
    assert_eq!(whole_node(&p(&[(1, 7)], 1), 1, true), None);
    assert_eq!(whole_node(&p(&[], 0), 1, true), Some(1));
    assert_eq!(whole_node(&p(&[], 0), 1, false), None);
}

#[test]
fn ppid_parses_past_awkward_names() {
    assert_eq!(parse_ppid("42 (a) b (c) S 7 42 42 0"), Some(7));
    assert_eq!(parse_ppid("1 (init) S 0 1 1"), Some(0));
    assert_eq!(parse_ppid("garbage"), None);
}

#[test]
fn descendants_are_followed_with_a_limit() {
    let mut kids: HashMap<i32, Vec<i32>> = HashMap::new();
    kids.insert(10, vec![11, 12]);
    kids.insert(11, vec![13]);
    kids.insert(99, vec![100]);
    assert_eq!(with_descendants(10, &kids, 64), vec![10, 11, 12, 13]);
    assert_eq!(with_descendants(10, &kids, 2), vec![10, 11]);
    assert_eq!(with_descendants(5, &kids, 64), vec![5]);
}

#[test]
fn policy_step_moves_after_persisting_and_skips_what_it_must() {
    let cfg = PolicyConfig {
        enabled: true,
        threshold: 0.75,
        persist: 3,
        cooldown: 2,
        min_vcpus: 1,
    };
    let mut w = Watcher::new(cfg);
    let on1 = Sample::from_counts(&[(0, 0), (1, 4)]);
    let view = |node, split, moving| RegionView {
        node,
        split,
        moving,
    };
    let one = [view(0, false, false)];
    assert!(matches!(
        policy_step(&mut w, &on1, &one),
        Step::Decided(Decision::Pending {
            to: 1,
            streak: 1,
            ..
        })
    ));
    assert!(matches!(
        policy_step(&mut w, &on1, &one),
        Step::Decided(Decision::Pending { streak: 2, .. })
    ));
    assert!(matches!(
        policy_step(&mut w, &on1, &one),
        Step::Decided(Decision::Move { from: 0, to: 1, .. })
    ));
    assert!(matches!(
        policy_step(&mut w, &on1, &one),
        Step::Decided(Decision::CoolingDown { .. })
    ));
    let mut w = Watcher::new(cfg);
    assert_eq!(policy_step(&mut w, &on1, &[]), Step::Skip("no memory"));
    assert!(matches!(
        policy_step(
            &mut w,
            &on1,
            &[view(0, false, false), view(1, false, false)]
        ),
        Step::Skip(_)
    ));
    assert!(matches!(
        policy_step(&mut w, &on1, &[view(0, true, false)]),
        Step::Skip(_)
    ));
    assert!(matches!(
        policy_step(&mut w, &on1, &[view(0, false, true)]),
        Step::Skip(_)
    ));
    let local = Sample::from_counts(&[(0, 4)]);
    assert!(matches!(
        policy_step(&mut w, &local, &one),
        Step::Decided(Decision::Local { .. })
    ));
}

#[test]
fn samples_this_process_and_its_children() {
    // A thread named like a cloud-hypervisor vCPU, in this process.
    // std names a thread from inside it, when it first runs: until then
    // /proc shows the spawner's name and the sampler rightly skips it
    // (the sample was then `Sample { per_node: {}, unknown: 0 }`). So sample only
    // once the thread itself says it runs, which is after its name is
    // set; it then stays alive, blocked on `rx`, until we have sampled.
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let t = std::thread::Builder::new()
        .name("vcpu0".into())
        .spawn(move || {
            let _ = ready_tx.send(());
            let _ = rx.recv();
        })
        .expect("thread");
    ready_rx.recv().expect("vcpu0 thread runs");
    let topology = numa::Topology::detect().expect("topology");
    let cpus = CpuNodes::new(&topology);
    let pid = i32::try_from(std::process::id()).expect("pid");
    let out = sample_clients(Path::new("/proc"), &cpus, &[(1, pid)]);
    drop(tx);
    t.join().expect("join");
    let (sample, watched) = out
        .into_iter()
        .next()
        .expect("one client")
        .1
        .expect("sampled");
    assert!(watched >= 1);
    // At least our `vcpu0` thread: other lib tests in this process may run
    // vCPU-named threads at the same moment, so an exact count would be flaky.
    assert!(sample.vcpus() + sample.unknown >= 1, "{sample:?}");
    let gone = sample_clients(Path::new("/proc"), &cpus, &[(2, i32::MAX)]);
    assert!(gone[0].1.is_err());
}

/// A daemon on a temporary socket, and a 4 KiB region (no huge pages
/// needed) allocated by a client on node 0.
fn daemon_with_region(
    dir: &Path,
) -> (
    crate::daemon::DaemonHandle,
    crate::client::Client,
    crate::client::Allocation,
) {
    use crate::proto::{AllocPart, AllocRequest, ClearMode, PagePolicy};
    let mut cfg = crate::daemon::Config {
        socket: dir.join("s.sock"),
        ..crate::daemon::Config::default()
    };
    cfg.pool.recheck_ms = 20;
    let handle = crate::daemon::Daemon::start(cfg).expect("daemon");
    let mut client = crate::client::Client::connect(handle.socket_path()).expect("connect");
    let size = 8 << 20;
    let alloc = client
        .alloc(AllocRequest {
            total_size: size,
            page_policy: PagePolicy::Base4K,
            clear_mode: ClearMode::Eager,
            lock: false,
            parts: vec![AllocPart { node: 0, size }],
            want_paths: false,
        })
        .expect("alloc");
    (handle, client, alloc)
}

/// What `start` does before the move thread runs: claim and mark split.
fn pretend_moving(shared: &Rooms, id: RegionId) -> (InUseRegion, CancelToken) {
    let r = shared.pool.placement().in_use(id).expect("in use");
    let cancel = CancelToken::new();
    lock(&shared.rebalance.active).insert(
        id,
        ActiveMove {
            alloc: r.alloc,
            owner: r.session,
            target: 0,
            range: ByteRange::whole(r.region.len()),
            started: Instant::now(),
            initiator: Initiator::Policy,
            cancel: cancel.clone(),
        },
    );
    assert!(shared.pool.placement().mark_split(id, r.alloc));
    (r, cancel)
}

#[test]
fn a_4k_region_rebalances_in_place() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (handle, mut client, alloc) = daemon_with_region(dir.path());
    let id = alloc.regions[0].region_id;
    assert_eq!(client.rebalance(id, 0, 0, 0).expect("move"), (0, 0));
    assert_eq!(
        client.rebalance(id, 4096, 8192, 0).expect("4 KiB range"),
        (0, 0)
    );
    let stats = client.stats().expect("stats");
    let e = stats.region(id).expect("listed");
    assert_eq!(
        e.placement
            .clone()
            .flatten()
            .and_then(|p| p.get(&0).copied()),
        Some(2048),
        "{e:?}"
    );
    assert_eq!(e.split, Some(false), "{e:?}");
    client.free(alloc.id).expect("free");
    handle.shutdown().expect("shutdown");
}

#[test]
fn free_or_disconnect_during_a_move_cancels_it_and_the_region_is_not_pooled() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (handle, mut client, alloc) = daemon_with_region(dir.path());
    let shared = Arc::clone(&handle.rooms);
    let id = alloc.regions[0].region_id;
    let (r, cancel) = pretend_moving(&shared, id);

    // A second move of the same region is refused while one runs.
    match client.rebalance(id, 0, 0, 0) {
        Err(crate::client::ClientError::Refused { status, message }) => {
            assert_eq!(status, Status::Invalid);
            assert!(message.contains("is being moved already"), "{message}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    let stats = client.stats().expect("stats");
    assert_eq!(
        stats
            .rebalance
            .as_ref()
            .and_then(|r| r.active.first())
            .map(|m| m.region),
        Some(id),
        "{stats}"
    );
    let released = shared.metrics.bytes_released.load(Ordering::Relaxed);

    // FREE is accepted at once and cancels the move; the region goes
    // back to the kernel instead of quarantine and the pool.
    client.free(alloc.id).expect("FREE during a move");
    assert!(cancel.is_cancelled());
    assert!(
        !shared.pool.placement().contains(id),
        "a split region was pooled"
    );
    assert_eq!(
        shared.metrics.bytes_released.load(Ordering::Relaxed),
        released + r.region.len()
    );
    // The move thread's bookkeeping afterwards changes nothing in the pool.
    record(
        &shared.rebalance,
        &r,
        ByteRange::whole(r.region.len()),
        0,
        true,
        Some(0),
    );
    assert!(!shared.pool.placement().contains(id));
    assert!(!shared.rebalance.is_moving(id));
    drop(alloc);

    // Disconnect does the same.
    let mut second = crate::client::Client::connect(handle.socket_path()).expect("connect");
    let size = 4 << 20;
    let a2 = second
        .alloc(crate::proto::AllocRequest {
            total_size: size,
            page_policy: crate::proto::PagePolicy::Base4K,
            clear_mode: crate::proto::ClearMode::Eager,
            lock: false,
            parts: vec![crate::proto::AllocPart { node: 0, size }],
            want_paths: false,
        })
        .expect("alloc");
    let id2 = a2.regions[0].region_id;
    let (_, cancel2) = pretend_moving(&shared, id2);
    drop(a2);
    drop(second);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cancel2.is_cancelled() || shared.pool.placement().contains(id2) {
        assert!(
            Instant::now() < deadline,
            "disconnect did not cancel the move"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(client);
    handle.shutdown().expect("shutdown");
}

#[test]
fn the_guest_check_runs_here_without_copying() {
    let topology = numa::Topology::detect().expect("topology");
    let Some(&node) = migrate::memory_nodes(&topology).first() else {
        return;
    };
    match guest_check::check_between(node, node) {
        Ok(line) => {
            assert!(line.contains("8 2M pages"), "{line}");
            assert!(line.contains(": 0 moved, 0 failed"), "{line}");
        }
        Err(e) if e.0.contains("free 2M pages") => test_support::skip!("{e}"),
        Err(e) => panic!("{e}"),
    }
}
