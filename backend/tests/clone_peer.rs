//! CLONE in shared mode against the real daemon in this process, with a
//! fake clone launcher (`ch_migration::peer::receive_snapshot` on a socket
//! pair) and a template parked by a fake cloud-hypervisor (`park_peer`):
//!
//! * the launcher gets the template's memory as read-only fds holding its
//!   bytes, its configuration and state, and `CompletePaused`; the
//!   template stays parked;
//! * while a clone counts (its connection is open), UNPARK and RESTORE of
//!   the template are refused, naming the running clones; more clones are
//!   served; once the connection ends, UNPARK drops the template;
//! * refused: COPY mode (not built yet), another uid's CLONE (names are
//!   per uid), a clone one page short of the headroom (naming the
//!   shortfall), a VM with a VFIO device, a VM on net fds passed to its
//!   process, a copy clone of a VM on a named tap (a shared clone's
//!   launcher replaces the tap);
//! * several CLONEs at once against a headroom that admits exactly k of
//!   them: k admitted, the rest refused naming the shortfall (each
//!   admitted clone's pages are promised until its launcher says it
//!   mapped them, by closing its end of the socket).
//!
//! The tests are serialized (`serial`): they share the host's huge pages.

mod park_peer;

use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use backend::client::Client;
use backend::daemon::ByteSize;
use backend::proto::{CloneMode, Status};
use ch_migration::peer::receive_snapshot;
use hugemem_client::park::RestoreOptions;
use park_peer::clones::*;
use park_peer::*;
use test_support::hugepages::hold_all_but_2m;
use test_support::hugepages::hugepages_2m;
use test_support::prelude::{reserve_2m, serial, wait_until, TestDaemon};
use test_support::tenant::{in_child, root_or_skip, NOBODY};

const MIB: u64 = 1 << 20;
const SIZE: u64 = 4 * MIB;
/// `clones.headroom`: four 2 MiB pages.
const HEADROOM: u64 = 4 * PAGE;

/// RESTORE with COPY, without postcopy, ending paused.
fn eager_copy() -> RestoreOptions<'static> {
    RestoreOptions {
        paused: true,
        fault: None,
        copy: true,
    }
}

fn daemon() -> TestDaemon {
    let d = TestDaemon::start(|c| {
        c.allowed_uids = vec![0, NOBODY];
        c.clones.headroom = ByteSize(HEADROOM);
    });
    for (path, mode) in [(d.dir(), 0o755), (d.socket().as_path(), 0o777)] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }
    d
}

#[test]
fn a_shared_clone_gets_the_template_read_only_and_keeps_it_parked() {
    const TEST: &str = "a_shared_clone_gets_the_template_read_only_and_keeps_it_parked";
    let _g = serial();
    if !root_or_skip() || !reserve_2m(16, TEST) {
        return;
    }
    let d = daemon();
    let mut owner = d.client();
    let mem = memfd("clone-template", SIZE, false);
    park_via(&mut owner, "tmpl", whole(&mem, SIZE))
        .result
        .expect("parked");

    let mut cloner = d.client();
    let (r, snap) = clone_via(&mut cloner, "tmpl", CloneMode::Shared);
    let sent = r.expect("cloned");
    assert_eq!((sent.bytes, sent.page_size, sent.slots), (SIZE, PAGE, 1));
    let snap = snap.expect("the template arrived whole");
    assert!(snap.paused, "sent as EXPORT sends it: CompletePaused");
    assert_eq!(snap.state, STATE);
    assert_eq!(snap.memory.len(), 1);
    let fd = &snap.memory[0].1;
    let flags = nix::fcntl::fcntl(fd.as_fd(), nix::fcntl::FcntlArg::F_GETFL).expect("F_GETFL");
    assert_eq!(flags & libc::O_ACCMODE, libc::O_RDONLY, "a read-only fd");
    assert!(nix::sys::uio::pwrite(fd, b"x", 0).is_err(), "the fd writes");
    assert!(holds_pattern(fd, 0, SIZE, 0), "the template's bytes");

    // While it counts: UNPARK and RESTORE refused; more clones served.
    expect_refused(
        owner.unpark("tmpl"),
        Status::Invalid,
        "1 running shared clone",
    );
    let (r, got) = restore_via(&mut owner, "tmpl");
    expect_refused(r, Status::Invalid, "running shared clone");
    assert!(got.is_none(), "nothing sent to a RESTORE of a template");
    let (r, second) = clone_via(&mut owner, "tmpl", CloneMode::Shared);
    r.expect("a second clone");
    drop(second);
    expect_refused(
        owner.unpark("tmpl"),
        Status::Invalid,
        "2 running shared clone",
    );
    let s = d.stats();
    assert_eq!(s.parked.len(), 1, "the template stays parked: {s}");
    assert_eq!(s.parked[0].shared_clones, 2, "{s}");

    // Refused: COPY (not built), another uid, one page short of the headroom.
    let (r, got) = clone_via(&mut cloner, "tmpl", CloneMode::Copy);
    expect_refused(r, Status::Unsupported, "RESTORE with COPY");
    assert!(got.is_none());
    let socket = d.socket();
    let code = in_child(Some(NOBODY), move || {
        let Ok(mut c) = Client::connect(&socket) else {
            return 11;
        };
        let Ok((daemon_end, _ours)) = UnixStream::pair() else {
            return 12;
        };
        child_expects(
            c.clone_parked("tmpl", CloneMode::Shared, &daemon_end),
            Status::NotFound,
            "no VM named",
        )
    });
    assert_eq!(code, 0, "uid {NOBODY} cloning root's template");
    let hog = hold_all_but_2m(SIZE / PAGE + HEADROOM / PAGE - 1);
    let (r, got) = clone_via(&mut cloner, "tmpl", CloneMode::Shared);
    drop(hog);
    expect_refused(r, Status::NoMemory, "short by 1");
    assert!(got.is_none());

    // The template's bytes never changed; once the clones' connections
    // end, UNPARK drops it.
    assert!(holds_pattern(fd, 0, SIZE, 0), "the template changed");
    drop(snap);
    drop(cloner);
    // The owner's connection counts the second clone.
    drop(owner);
    let mut last = d.client();
    wait_until(
        "UNPARK once the clones' connections ended",
        Duration::from_secs(10),
        || last.unpark("tmpl").is_ok(),
    );
    let s = assert_serves_balanced(&d, 0, 0, "the template dropped");
    assert_eq!(
        (s.counters.clones, s.counters.clones_refused),
        (2, 3),
        "{s}"
    );
}

/// Parks, on `owner`, a VM on `mem` whose `vm_config` is `vm_config`.
fn park_with(
    owner: &mut Client,
    name: &str,
    mem: &std::os::fd::OwnedFd,
    vm_config: serde_json::Value,
) {
    let mut json: serde_json::Value =
        serde_json::from_str(&config_json(&[(0, 0, SIZE, 0)])).expect("json");
    json["vm_config"] = vm_config;
    let steps = vec![
        Step::Send(start()),
        Step::Send(memory_fd(0, &[mem])),
        Step::Send(config(&json.to_string())),
        Step::Send(state(STATE)),
        Step::Send(complete_paused()),
    ];
    park_via(owner, name, steps).result.expect("parked");
}

#[test]
fn a_vm_with_a_vfio_device_or_passed_net_fds_is_not_cloned_and_a_tap_is_replaced() {
    const TEST: &str =
        "a_vm_with_a_vfio_device_or_passed_net_fds_is_not_cloned_and_a_tap_is_replaced";
    let _g = serial();
    if !reserve_2m(12, TEST) {
        return;
    }
    let d = TestDaemon::start(|_| {});
    let mut owner = d.client();
    let mem = memfd("clone-vfio", SIZE, false);
    let vfio = serde_json::json!({"devices": [{"path": "/sys/bus/pci/devices/0000:01:00.0"}]});
    park_with(&mut owner, "vfio", &mem, vfio);
    let (r, got) = clone_via(&mut owner, "vfio", CloneMode::Shared);
    expect_refused(r, Status::Invalid, "VFIO");
    assert!(got.is_none());
    // Net fds passed to the template's process: no clone can have them.
    park_with(
        &mut owner,
        "fds",
        &mem,
        serde_json::json!({"net": [{"id": "net5", "fds": [7]}]}),
    );
    let (r, got) = clone_via(&mut owner, "fds", CloneMode::Shared);
    expect_refused(r, Status::Invalid, "net5 on fds passed to its process");
    assert!(got.is_none());
    // A named tap and a vsock: the shared clone's launcher replaces them
    // (the daemon sends the template as it is); for a copy clone the
    // daemon does, tagged with the requesting launcher's pid (this
    // process), and its reply says each replacement.
    let vsock = std::env::temp_dir().join(format!("hm-clone-peer-{}.vsock", std::process::id()));
    let vsock = vsock.to_str().expect("utf-8 path");
    park_with(
        &mut owner,
        "tap",
        &mem,
        serde_json::json!({
            "net": [{"id": "net0", "tap": "tap9", "ip": "192.168.249.1"}],
            "vsock": {"id": "vsock0", "cid": 3, "socket": vsock},
        }),
    );
    let mut cloner = d.client();
    let (r, got) = clone_via(&mut cloner, "tap", CloneMode::Shared);
    r.expect("a tap is the launcher's to replace");
    let config: serde_json::Value =
        serde_json::from_slice(&got.expect("the template").config).expect("json");
    assert_eq!(
        config["vm_config"]["net"][0]["tap"], "tap9",
        "sent as parked"
    );
    let (daemon_end, ch_end) = UnixStream::pair().expect("socketpair");
    let receiver =
        std::thread::spawn(move || receive_snapshot(&ch_end, ch_migration::Limits::default()).ok());
    let copy = owner
        .restore_with("tap", &daemon_end, eager_copy())
        .expect("a copy clone with its own tap and vsock socket");
    drop(daemon_end);
    let sent = receiver
        .join()
        .expect("the fake receiver")
        .expect("the copy arrived");
    let config: serde_json::Value = serde_json::from_slice(&sent.config).expect("json");
    let tap = format!("hmc{}n0", std::process::id());
    let net = &config["vm_config"]["net"][0];
    assert_eq!(net["tap"], tap.as_str(), "a new tap: {net}");
    assert!(
        net["ip"].is_null(),
        "the template's host IP not copied: {net}"
    );
    let socket = format!("{vsock}.clone-{}", std::process::id());
    assert_eq!(config["vm_config"]["vsock"]["socket"], socket.as_str());
    assert_eq!(config["vm_config"]["vsock"]["cid"], 3, "the CID stays");
    assert!(
        copy.note.contains(&tap) && copy.note.contains(&socket) && copy.note.contains("tap9"),
        "each replacement said: {}",
        copy.note
    );
    drop(sent);
    owner.free(copy.id).expect("FREE the copy");
    drop(cloner);
    wait_until(
        "UNPARK once the clone's connection ended",
        Duration::from_secs(10),
        || owner.unpark("tap").is_ok(),
    );
    owner.unpark("fds").expect("no clone counts");
    owner.unpark("vfio").expect("no clone counts");
    assert_serves_balanced(&d, 0, 0, "the VMs dropped");
}

#[test]
fn a_clone_that_writes_every_page_changes_neither_the_template_nor_a_sibling() {
    const TEST: &str = "a_clone_that_writes_every_page_changes_neither_the_template_nor_a_sibling";
    let _g = serial();
    if !reserve_2m(16, TEST) {
        return;
    }
    let d = TestDaemon::start(|_| {});
    let mut owner = d.client();
    let mem = memfd("clone-writer", SIZE, false);
    park_via(&mut owner, "tmpl", whole(&mem, SIZE))
        .result
        .expect("parked");
    let (mut one, mut two) = (d.client(), d.client());
    let a = clone_via(&mut one, "tmpl", CloneMode::Shared)
        .1
        .expect("clone A");
    let b = clone_via(&mut two, "tmpl", CloneMode::Shared)
        .1
        .expect("clone B");
    let resv = hugepages_2m("resv_hugepages");
    let mut writer = Private::of(&a.memory[0].1, SIZE);
    assert_eq!(
        hugepages_2m("resv_hugepages") - resv,
        SIZE / PAGE,
        "the private mapping reserved every page it may write"
    );
    writer.bytes().fill(0xa5);
    assert!(writer.bytes().iter().all(|&b| b == 0xa5));
    let mut sibling = Private::of(&b.memory[0].1, SIZE);
    let seen = sibling.bytes();
    assert!(
        seen.iter()
            .enumerate()
            .all(|(i, &b)| b == pattern(i as u64)),
        "the sibling sees the template's bytes"
    );
    assert!(
        holds_pattern(&a.memory[0].1, 0, SIZE, 0),
        "the template is unchanged, byte for byte"
    );
    drop((writer, sibling));
    assert_eq!(
        hugepages_2m("resv_hugepages"),
        resv,
        "reservations returned"
    );
    drop((a, b, one, two));
    let mut last = d.client();
    wait_until(
        "UNPARK once the clones ended",
        Duration::from_secs(10),
        || last.unpark("tmpl").is_ok(),
    );
    drop(owner);
    assert_serves_balanced(&d, 0, 0, "the template dropped");
}

#[test]
fn a_copy_clone_gets_fresh_memory_filled_from_the_template_which_stays_parked() {
    const TEST: &str = "a_copy_clone_gets_fresh_memory_filled_from_the_template_which_stays_parked";
    let _g = serial();
    if !reserve_2m(16, TEST) {
        return;
    }
    let d = TestDaemon::start(|_| {});
    let mut owner = d.client();
    let mem = memfd("clone-copy", SIZE, false);
    park_via(&mut owner, "tmpl", whole(&mem, SIZE))
        .result
        .expect("parked");
    let template_id = identity(
        &clone_via(&mut owner, "tmpl", CloneMode::Shared)
            .1
            .expect("read-only")
            .memory[0]
            .1,
    );
    let (daemon_end, ch_end) = UnixStream::pair().expect("socketpair");
    let receiver =
        std::thread::spawn(move || receive_snapshot(&ch_end, ch_migration::Limits::default()).ok());
    let mut cloner = d.client();
    let copy = cloner
        .restore_with("tmpl", &daemon_end, eager_copy())
        .expect("a copy clone");
    drop(daemon_end);
    let got = receiver
        .join()
        .expect("the fake receiver")
        .expect("the copy arrived");
    assert_eq!(got.memory.len(), 1);
    let fd = &got.memory[0].1;
    assert_ne!(
        identity(fd),
        template_id,
        "fresh memory, not the template's"
    );
    assert_eq!(
        identity(fd),
        identity(&copy.fds[0]),
        "the memory handed out"
    );
    assert!(holds_pattern(fd, 0, SIZE, 0), "filled from the template");
    let flags = nix::fcntl::fcntl(fd.as_fd(), nix::fcntl::FcntlArg::F_GETFL).expect("F_GETFL");
    assert_eq!(
        flags & libc::O_ACCMODE,
        libc::O_RDWR,
        "the copy is the receiver's to write"
    );
    let s = d.stats();
    assert_eq!(s.parked.len(), 1, "the template stays parked: {s}");
    assert_eq!(s.counters.clones, 2, "{s}");
    let check = clone_via(&mut cloner, "tmpl", CloneMode::Shared)
        .1
        .expect("read-only");
    assert!(
        holds_pattern(&check.memory[0].1, 0, SIZE, 0),
        "the template is unchanged"
    );
    drop((got, check));
    cloner.free(copy.id).expect("FREE the copy");
    drop(cloner);
    drop(owner);
    let mut last = d.client();
    wait_until(
        "UNPARK once the clones ended",
        Duration::from_secs(10),
        || last.unpark("tmpl").is_ok(),
    );
    assert_serves_balanced(&d, 0, 0, "the copy freed, the template dropped");
}

/// A template and a connection's shared clone across a takeover
/// (`takeover::receive` and `Daemon::start_inherited`, as `hugemem serve
/// --takeover` does): the successor lists the template with its clone,
/// refuses its UNPARK while the clone's connection lasts, and drops it
/// once that connection ends.
#[test]
fn a_template_and_its_clone_count_survive_a_takeover() {
    use backend::daemon::{restart::takeover, Config, Daemon};
    const TEST: &str = "a_template_and_its_clone_count_survive_a_takeover";
    let _g = serial();
    if !reserve_2m(8, TEST) {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = Config {
        socket: dir.path().join("hugemem.sock"),
        ..Config::default()
    };
    cfg.pool.recheck_ms = 50;
    let socket = cfg.socket.clone();
    let old = Daemon::start(cfg.clone()).expect("daemon starts");
    let mut owner = Client::connect(&socket).expect("connect");
    let mem = memfd("clone-takeover", SIZE, false);
    park_via(&mut owner, "tmpl", whole(&mem, SIZE))
        .result
        .expect("parked");
    let mut cloner = Client::connect(&socket).expect("connect");
    let snap = clone_via(&mut cloner, "tmpl", CloneMode::Shared)
        .1
        .expect("cloned");

    let inherited = takeover::receive(&socket).expect("takeover: state received");
    let new = Daemon::start_inherited(cfg.clone(), inherited).expect("the successor starts");
    old.shutdown().expect("the old daemon exits");
    let s = new.stats();
    assert_eq!(s.parked.len(), 1, "the successor lists the template: {s}");
    assert_eq!(s.parked[0].shared_clones, 1, "and its clone: {s}");
    expect_refused(
        owner.unpark("tmpl"),
        Status::Invalid,
        "1 running shared clone",
    );
    assert!(
        holds_pattern(&snap.memory[0].1, 0, SIZE, 0),
        "the template's bytes"
    );
    drop(snap);
    drop(cloner);
    wait_until(
        "UNPARK once the clone's connection ended",
        Duration::from_secs(10),
        || owner.unpark("tmpl").is_ok(),
    );
    let s = new.stats();
    assert_eq!((s.allocations.active, s.parked.len()), (0, 0), "{s}");
    new.shutdown().expect("the successor exits");
}

/// `N` CLONEs at once, on `N` connections, against a headroom that admits
/// exactly `K` of them: exactly `K` are admitted and the rest refused
/// naming the shortfall, though no launcher has mapped anything yet (the
/// kernel's counts are the same for all of them: the admitted clones'
/// pages are promised). A launcher that closes its end without mapping
/// gives its pages back; one that mapped (its reservation shows in
/// `HugePages_Rsvd`) keeps them.
#[test]
fn clones_at_once_are_admitted_exactly_as_far_as_the_headroom_allows() {
    const TEST: &str = "clones_at_once_are_admitted_exactly_as_far_as_the_headroom_allows";
    const N: usize = 5;
    const K: usize = 2;
    let _g = serial();
    let need = SIZE / PAGE;
    if !reserve_2m(
        SIZE / PAGE + (K as u64 + 1) * need + HEADROOM / PAGE + 4,
        TEST,
    ) {
        return;
    }
    let d = daemon();
    let mut owner = d.client();
    let mem = memfd("clone-race", SIZE, false);
    park_via(&mut owner, "tmpl", whole(&mem, SIZE))
        .result
        .expect("parked");
    let hog = hold_all_but_2m(K as u64 * need + HEADROOM / PAGE);
    let start = std::sync::Barrier::new(N);
    let runs: Vec<_> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..N)
            .map(|_| {
                s.spawn(|| {
                    let mut c = d.client();
                    start.wait();
                    let (r, snap, ours) = clone_keeping(&mut c, "tmpl", CloneMode::Shared);
                    (r, snap, ours, c)
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("a cloner"))
            .collect()
    });
    let (admitted, refused): (Vec<_>, Vec<_>) = runs.into_iter().partition(|r| r.0.is_ok());
    assert_eq!(admitted.len(), K, "admitted of {N} at once");
    for (r, snap, _, _) in refused {
        assert!(snap.is_none(), "a refused clone got the template");
        expect_refused(
            r,
            Status::NoMemory,
            &format!(
                "({} of them promised to clones still starting)",
                K as u64 * need
            ),
        );
    }
    assert_eq!(d.stats().parked[0].shared_clones, K as u64);

    // One launcher goes without mapping: its pages are free again.
    let mut admitted = admitted.into_iter();
    let (_, gone_snap, gone_end, gone_client) = admitted.next().expect("one");
    drop((gone_end, gone_snap));
    let mut late = d.client();
    let (mut kept, mut tries) = (None, 0);
    wait_until(
        "a CLONE admitted on the pages of a launcher that went",
        Duration::from_secs(10),
        || {
            tries += 1;
            let (r, snap, ours) = clone_keeping(&mut late, "tmpl", CloneMode::Shared);
            let ok = r.is_ok();
            kept = ok.then(|| (snap.expect("the template"), ours));
            ok
        },
    );
    // The late clone maps (its pages reserved), then says so: its pages
    // stay taken, as reserved rather than promised.
    let (snap, ours) = kept.expect("admitted");
    let mapping = Private::of(&snap.memory[0].1, SIZE);
    drop(ours);
    let (r, _) = clone_via(&mut owner, "tmpl", CloneMode::Shared);
    expect_refused(r, Status::NoMemory, "short by");
    drop((mapping, snap, hog, admitted, gone_client, late));
    wait_until(
        "UNPARK once the clones ended",
        Duration::from_secs(10),
        || owner.unpark("tmpl").is_ok(),
    );
    let s = assert_serves_balanced(&d, 0, 0, "the template dropped");
    assert_eq!(
        (s.counters.clones, s.counters.clones_refused),
        (K as u64 + 1, (N - K) as u64 + tries),
        "{s}"
    );
}
