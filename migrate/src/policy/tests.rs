//! Tests of the migration policy, on fixture `/sys` and `/proc` trees.

use super::*;
use test_support::fixture::{stat_line, ProcTree, SysTree};

#[test]
fn parses_stat_with_awkward_names() {
    let t = parse_stat(&stat_line(42, "(a) b (c)", 3)).expect("parse");
    assert_eq!(
        t,
        TaskStat {
            tid: 42,
            comm: "(a) b (c)".into(),
            state: 'S',
            last_cpu: 3
        }
    );
    let t = parse_stat(&stat_line(7, "CPU 0/KVM", 1)).expect("parse");
    assert_eq!((t.comm.as_str(), t.last_cpu), ("CPU 0/KVM", 1));
    // A name that is only a closing parenthesis and spaces.
    let t = parse_stat(&stat_line(8, ") ) ", 5)).expect("parse");
    assert_eq!((t.comm.as_str(), t.last_cpu), (") ) ", 5));
    // An empty name.
    assert_eq!(parse_stat(&stat_line(9, "", 0)).expect("parse").comm, "");
}

#[test]
fn parses_a_real_stat_line() {
    let text = fs::read_to_string("/proc/thread-self/stat").expect("read own stat");
    let t = parse_stat(text.trim_end()).expect("parse own stat");
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    assert!(t.last_cpu < cpus.max(1024));
    assert_eq!(t.state, 'R');
}

#[test]
fn refuses_malformed_lines() {
    for bad in [
        "",
        "12 comm S 1 2",
        "x (comm) S 1",
        "12 (comm) S 1 2 3",
        "12 )comm( S",
        "12 (comm) ",
    ] {
        assert!(parse_stat(bad).is_err(), "{bad:?} parsed");
    }
    // Field 39 present but not a number.
    let mut line = stat_line(1, "x", 0);
    line = line.replacen(" 0 ", " zz ", 1);
    let fields: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(fields[38], "zz");
    assert!(parse_stat(&line)
        .expect_err("bad cpu")
        .to_string()
        .contains("processor"));
}

#[test]
fn vcpu_names() {
    for yes in [
        "CPU 0/KVM",
        "CPU 12/TCG",
        "CPU 3",
        "vcpu0",
        "vcpu17",
        "fc_vcpu 3",
        "crosvm_vcpu2",
    ] {
        assert!(is_vcpu_name(yes), "{yes}");
    }
    for no in [
        "CPU /KVM",
        "CPU x/KVM",
        "vcpu",
        "vcpu_x",
        "qemu-system-x86",
        "IO mon_iothread",
        "vhost-123",
        "(a) b (c)",
    ] {
        assert!(!is_vcpu_name(no), "{no}");
    }
}

#[test]
fn reads_a_fixture_proc_tree() {
    let tree = ProcTree::new()
        .thread(100, 100, "qemu-system-x86", 0)
        .thread(100, 101, "CPU 0/KVM", 2)
        .thread(100, 102, "CPU 1/KVM", 3)
        .thread(100, 103, "(a) b (c)", 1)
        .thread(100, 104, "CPU 2/KVM", 0);
    let threads = read_threads(tree.path(), 100).expect("read");
    assert_eq!(threads.len(), 5);
    assert_eq!(threads[3].comm, "(a) b (c)");

    let sys = SysTree::new()
        .cpu_online("0-3")
        .node(0, "0-1", 1 << 20, &[10, 20], &[])
        .node(1, "2-3", 1 << 20, &[20, 10], &[]);
    let cpus = CpuNodes::new(&sys.parse(numa::Topology::from_sysfs));
    let s = sample(tree.path(), 100, &VcpuFilter::default(), &cpus).expect("sample");
    assert_eq!(s.per_node, BTreeMap::from([(0, 1), (1, 2)]));
    let all = sample(tree.path(), 100, &VcpuFilter::All, &cpus).expect("sample");
    assert_eq!(all.vcpus(), 5);
    let tids = sample(tree.path(), 100, &VcpuFilter::Tids(vec![103]), &cpus).expect("sample");
    assert_eq!(tids.per_node, BTreeMap::from([(0, 1)]));
    let pre = sample(
        tree.path(),
        100,
        &VcpuFilter::Prefixes(vec!["(a)".into()]),
        &cpus,
    )
    .expect("sample");
    assert_eq!(pre.vcpus(), 1);
}

#[test]
fn proc_tree_errors() {
    let tree = ProcTree::new()
        .raw(5, 5, "5 (bad line")
        .thread(6, 6, "vcpu0", 9);
    assert!(matches!(
        read_threads(tree.path(), 4),
        Err(WatchError::Tasks { pid: 4, .. })
    ));
    let err = read_threads(tree.path(), 5).expect_err("malformed");
    assert!(err.to_string().contains("5/task/5/stat"), "{err}");
    // A CPU no node lists is counted as unknown.
    let sys = SysTree::new()
        .cpu_online("0-1")
        .node(0, "0-1", 1 << 20, &[10], &[]);
    let s = sample(
        tree.path(),
        6,
        &VcpuFilter::default(),
        &CpuNodes::new(&sys.parse(numa::Topology::from_sysfs)),
    )
    .expect("sample");
    assert_eq!((s.vcpus(), s.unknown), (0, 1));
}

#[test]
fn reads_a_live_process() {
    // A child that sleeps has one thread for as long as it lives; this test
    // process does not: the harness starts and ends test threads beside it.
    let mut child = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .expect("spawn sleep");
    let pid = child.id() as i32;
    let threads = read_threads(Path::new("/proc"), pid);
    let topo = Topology::detect().expect("topology");
    let s = sample(
        Path::new("/proc"),
        pid,
        &VcpuFilter::All,
        &CpuNodes::new(&topo),
    );
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(threads.expect("read the child").len(), 1);
    let s = s.expect("sample the child");
    assert_eq!(s.vcpus() + s.unknown, 1);
}

#[test]
fn memoryless_cpus_count_for_the_nearest_memory_node() {
    let sys = SysTree::new()
        .cpu_online("0-5")
        .node(0, "0-1", 1 << 20, &[10, 20, 30], &[])
        .node(1, "2-3", 0, &[20, 10, 12], &[])
        .node(2, "4-5", 1 << 20, &[30, 12, 10], &[]);
    let cpus = CpuNodes::new(&sys.parse(numa::Topology::from_sysfs));
    assert_eq!(cpus.node_of(0), Some(0));
    assert_eq!(
        cpus.node_of(2),
        Some(2),
        "node 1 is nearer to 2 (12) than 0 (20)"
    );
    assert_eq!(cpus.node_of(5), Some(2));
    assert_eq!(cpus.node_of(6), None);
    let only = SysTree::two_nodes_one_memoryless();
    assert_eq!(
        CpuNodes::new(&only.parse(numa::Topology::from_sysfs)).node_of(3),
        Some(0)
    );
}

fn on() -> PolicyConfig {
    PolicyConfig {
        enabled: true,
        threshold: 0.75,
        persist: 3,
        cooldown: 2,
        min_vcpus: 1,
    }
}

#[test]
fn off_by_default() {
    assert!(!PolicyConfig::default().enabled);
    let mut w = Watcher::new(PolicyConfig::default());
    for _ in 0..100 {
        assert_eq!(
            w.observe(&Sample::from_counts(&[(1, 4)]), 0),
            Decision::Disabled
        );
    }
}

#[test]
fn persistent_mismatch_recommends_once_then_cools_down() {
    let mut w = Watcher::new(on());
    let away = Sample::from_counts(&[(0, 1), (1, 3)]);
    assert_eq!(
        w.observe(&away, 0),
        Decision::Pending {
            to: 1,
            streak: 1,
            needed: 3
        }
    );
    assert_eq!(
        w.observe(&away, 0),
        Decision::Pending {
            to: 1,
            streak: 2,
            needed: 3
        }
    );
    assert_eq!(
        w.observe(&away, 0),
        Decision::Move {
            from: 0,
            to: 1,
            share: 0.75
        }
    );
    // Cool-down: the same samples are ignored.
    assert_eq!(w.observe(&away, 0), Decision::CoolingDown { remaining: 1 });
    assert_eq!(w.observe(&away, 0), Decision::CoolingDown { remaining: 0 });
    // Then the streak starts from zero.
    assert_eq!(
        w.observe(&away, 0),
        Decision::Pending {
            to: 1,
            streak: 1,
            needed: 3
        }
    );
}

#[test]
fn a_break_in_the_streak_resets_it() {
    let mut w = Watcher::new(on());
    let away = Sample::from_counts(&[(1, 4)]);
    let home = Sample::from_counts(&[(0, 4)]);
    let spread = Sample::from_counts(&[(0, 2), (1, 2)]);
    w.observe(&away, 0);
    w.observe(&away, 0);
    assert_eq!(w.observe(&home, 0), Decision::Local { share: 1.0 });
    assert_eq!(
        w.observe(&away, 0),
        Decision::Pending {
            to: 1,
            streak: 1,
            needed: 3
        }
    );
    w.observe(&away, 0);
    // Half and half: spread, no move (ties prefer the memory's node).
    assert_eq!(w.observe(&spread, 0), Decision::Local { share: 0.5 });
    assert_eq!(
        w.observe(&Sample::from_counts(&[(0, 1), (1, 2), (2, 1)]), 0),
        Decision::Spread {
            busiest: 1,
            share: 0.5
        }
    );
    assert_eq!(
        w.observe(&away, 0),
        Decision::Pending {
            to: 1,
            streak: 1,
            needed: 3
        }
    );
}

#[test]
fn a_change_of_candidate_restarts_the_streak() {
    let mut w = Watcher::new(on());
    let to1 = Sample::from_counts(&[(1, 4)]);
    let to2 = Sample::from_counts(&[(2, 4)]);
    w.observe(&to1, 0);
    w.observe(&to1, 0);
    assert_eq!(
        w.observe(&to2, 0),
        Decision::Pending {
            to: 2,
            streak: 1,
            needed: 3
        }
    );
}

#[test]
fn too_few_vcpus_is_no_evidence() {
    let mut w = Watcher::new(PolicyConfig {
        min_vcpus: 2,
        ..on()
    });
    assert_eq!(
        w.observe(&Sample::from_counts(&[(1, 1)]), 0),
        Decision::NoVcpus
    );
    assert_eq!(w.observe(&Sample::default(), 0), Decision::NoVcpus);
}

#[test]
fn manual_move_starts_the_cool_down() {
    let mut w = Watcher::new(on());
    w.observe(&Sample::from_counts(&[(1, 4)]), 0);
    w.moved();
    assert_eq!(
        w.observe(&Sample::from_counts(&[(1, 4)]), 0),
        Decision::CoolingDown { remaining: 1 }
    );
}

#[test]
fn config_defaults_through_serde() {
    let c: PolicyConfig = serde_json::from_str(r#"{"enabled": true}"#).expect("parse");
    assert_eq!(
        c,
        PolicyConfig {
            enabled: true,
            ..PolicyConfig::default()
        }
    );
}
