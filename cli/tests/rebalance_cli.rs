//! `hugemem status` (placement) and `hugemem rebalance` run as the real
//! binary against a daemon on real hugetlb memory (`hugemem bench migrate`,
//! as the real `hugemem-bench`, is in bench/tests/bench_migrate.rs).
//!
//! This host has one NUMA node, so nothing can really move here: a move to
//! node 0 finds every page there already (0 moved), a move to node 1 is
//! `BAD_NODE`. Tests are serialized by one lock (shared huge-page pools).

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::process::{Command, Output};

use backend::stats::Stats;
use test_support::prelude::{
    alloc_2m_pages as alloc_2m, one_node, region, reserve_2m, serial, TestDaemon,
};
use test_support::tenant::NOBODY;

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
    let e = region(&stats, r.region_id).expect("region in STATS");
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
    let placement = region(&json, r.region_id)
        .expect("region in STATS")
        .placement
        .flatten();
    assert_eq!(placement.and_then(|p| p.get(&0).copied()), Some(3));
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
