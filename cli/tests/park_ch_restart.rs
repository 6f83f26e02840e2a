//! Parked VMs across the daemon's restarts, with the real binary, the real
//! cloud-hypervisor and the project's counting guest (issue 43): the
//! daemon runs as a process of its own.
//!
//! * A VM parked (moved) and one parked on demand (its files not read
//!   yet) across a takeover: both restore afterwards and count on.
//! * A takeover while an on-demand restore fills a VM (its page faults
//!   held by the test): the old daemon waits 10 s for the RESTORE, then
//!   refuses the takeover and says why; it serves on, the guest runs once
//!   its faults pass, the restore ends, and the next takeover carries the
//!   restored VM.
//! * The daemon SIGKILLed in the middle of a park (after the memory fds
//!   came, before it answered the last step): the guest runs on in its
//!   cloud-hypervisor. Killed right after it answered, the VM was parked
//!   in the dead daemon: the next start says it was lost.
//! * Under systemd's fd store, a crash (SIGKILL) with a VM parked and one
//!   parked on demand: both come back parked and restore; without the
//!   store the next start says which were lost.
//!
//! Skipped (through the skip helper) without the cloud-hypervisor binary
//! that `CLOUD_HYPERVISOR` names, a usable `/dev/kvm` or the huge pages.

mod common;
mod park_rig;

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use backend::client::Client;
use ch_migration::Command as Step;
use hugemem::launch::vmm::cloud_hypervisor::api::ChApi;
use park_rig::{fault_relay, memory_file, relay, Cut, Gate, Receiver, Setup, HUGEMEM, STEP};
use test_support::fake_systemd::FakeSystemd;
use test_support::hugepages::hugepages_2m;
use test_support::prelude::wait_until;

use common::{counting_past, spin_state};

fn config(setup: &Setup) -> (PathBuf, PathBuf) {
    let socket = setup.dir.path().join("hugemem.sock");
    let config = setup.dir.path().join("hugemem.toml");
    std::fs::write(&config, "[pool]\nrecheck_ms = 20\n").expect("config");
    (socket, config)
}

/// Waits until the daemon on `socket` holds no allocation and nothing in
/// quarantine, its books balanced.
fn settled(socket: &Path, what: &str) {
    let mut last = None;
    wait_until(what, STEP, || {
        let s = park_rig::stats(socket);
        let done = s.allocations.active == 0 && s.pool_sum(|p| p.quarantined_bytes) == 0;
        last = Some(s);
        done
    });
    common::assert_balanced(&last.expect("stats"), what);
}

#[test]
fn a_parked_and_an_on_demand_vm_survive_a_takeover() {
    let Some(setup) = park_rig::set_up(2) else {
        return;
    };
    let (socket, config) = config(&setup);
    let mut old = park_rig::serving(&socket, &config);
    let moved_at = park_rig::launch_and_park(&socket, &setup, "vm");
    let lazy_at = park_rig::park_from_disk(&socket, &setup, "lazy", true);
    assert_eq!(park_rig::stats(&socket).parked.len(), 2);

    let mut new = park_rig::serve(&socket, &config, true);
    assert!(old.wait("the old daemon").success(), "the takeover");
    let s = park_rig::stats(&socket);
    assert_eq!(s.pid, new.0.id(), "served by the successor");
    assert_eq!(s.parked.len(), 2, "{s}");
    park_rig::restore_and_check(&socket, &setup, "vm", moved_at, false);
    park_rig::restore_and_check(&socket, &setup, "lazy", lazy_at, true);
    settled(&socket, "both restored and stopped");
    new.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(new.wait("the successor").success());
}

#[test]
fn a_takeover_during_an_on_demand_restore_is_refused_and_the_restore_goes_on() {
    let Some(setup) = park_rig::set_up(1) else {
        return;
    };
    let (socket, config) = config(&setup);
    let mut old = park_rig::serving(&socket, &config);
    let parked_at = park_rig::park_from_disk(&socket, &setup, "lazy", true);

    // The test is the launcher; the guest's page faults wait at the gate.
    let rx = Receiver::start(&setup.ch, setup.dir.path(), "busy", true);
    let main = rx.connect();
    let gate = Gate::closed();
    let fault = fault_relay(rx.connect(), &gate);
    let (daemon_end, ours) = UnixStream::pair().expect("socketpair");
    let (tx, memory) = mpsc::channel();
    let passed = relay(ours, main, Cut::Never, || {}, Some(tx));
    let at = socket.clone();
    let restorer = std::thread::spawn(move || {
        let mut client = Client::connect(&at).expect("connect");
        client
            .set_timeout(Some(Duration::from_secs(120)))
            .expect("timeout");
        let r = client.restore_postcopy("lazy", &daemon_end, &fault, false);
        (client, r)
    });
    // Running (it took Complete), its first faults held: the restore is on.
    wait_until("the receiver runs the VM", STEP, || {
        rx.api
            .vm_state(Duration::from_secs(5))
            .is_ok_and(|s| s == "Running")
    });
    let started = Instant::now();
    let out = Command::new("timeout")
        .args(["120", HUGEMEM, "serve", "--takeover", "--config"])
        .arg(&config)
        .arg("--socket")
        .arg(&socket)
        .output()
        .expect("run hugemem serve --takeover");
    let said = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "a takeover went through during a restore: {said}"
    );
    assert!(said.contains("did not park within 10 s"), "{said}");
    eprintln!(
        "takeover refused after {:.1} s: {}",
        started.elapsed().as_secs_f64(),
        said.lines().last().unwrap_or_default()
    );
    assert_eq!(
        park_rig::stats(&socket).parked.len(),
        1,
        "the old daemon serves on"
    );

    gate.open();
    let ram = memory_file(&memory);
    let state = counting_past(&ram, parked_at, "the guest to run once its faults pass");
    assert_eq!(state.bad, 0, "the guest found a page changed");
    let (mut client, restored) = restorer.join().expect("the restore");
    let a = restored.expect("the restore ended after the refused takeover");
    assert_eq!(
        passed.join().expect("relay").commands.last(),
        Some(&Step::Complete)
    );

    let mut new = park_rig::serve(&socket, &config, true);
    assert!(
        old.wait("the old daemon").success(),
        "a takeover after the restore"
    );
    let s = client
        .stats()
        .expect("STATS on the connection that travelled");
    assert_eq!(s.pid, new.0.id(), "{s}");
    assert_eq!((s.parked.len(), s.allocations.active), (0, 1), "{s}");
    rx.kill();
    drop(ram);
    let id = a.id;
    drop(a);
    client.free(id).expect("FREE on the successor");
    settled(&socket, "the restored VM freed");
    new.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(new.wait("the successor").success());
}

/// Parks the VM of the cloud-hypervisor whose API is `api` into the daemon
/// on `socket` through a relay that SIGKILLs the daemon (`daemon_pid`) at
/// `cut`.
fn park_through(socket: &Path, dir: &Path, api: &Path, daemon_pid: u32, cut: Cut, tag: &str) {
    let path = dir.join(format!("{tag}.park"));
    let listener = UnixListener::bind(&path).expect("bind");
    let ch = ChApi::new(api);
    ch.send_migration(&path, true, STEP)
        .expect("send-migration");
    let (from_ch, _) = listener.accept().expect("cloud-hypervisor connects");
    let (daemon_end, ours) = UnixStream::pair().expect("socketpair");
    let passed = relay(
        from_ch,
        ours,
        cut,
        move || park_rig::kill_9(daemon_pid),
        None,
    );
    // Its reply races with the kill: either way the daemon is gone.
    let _ = Client::connect(socket).and_then(|mut c| c.park("vm", &daemon_end));
    drop(daemon_end);
    assert!(
        passed.join().expect("relay").cut,
        "{cut:?}: never got there"
    );
}

#[test]
fn a_daemon_killed_while_parking_leaves_the_guest_running() {
    // Two guests' pages: after the first daemon dies, its successors park
    // the guest's memory (a memfd of the dead daemon) by copying it.
    let Some(setup) = park_rig::set_up(2) else {
        return;
    };
    let free_before = hugepages_2m("free_hugepages");
    let (socket, config) = config(&setup);
    let mut daemon = park_rig::serving(&socket, &config);
    let api = setup.dir.path().join("guest.api");
    let mut launch = common::park::launch_counting_on(&socket, &setup.ch, &api, &setup.elf);
    let launcher = common::child_of(launch.id());
    let vmm = common::child_of(launcher);
    let ram = common::launched_guest_ram(launcher, vmm);
    counting_past(&ram, 0, "the guest to spin");
    let cuts = [Cut::After(Step::MemoryFd), Cut::Before(Step::Complete)];
    for (i, cut) in cuts.into_iter().enumerate() {
        let pid = daemon.0.id();
        park_through(&socket, setup.dir.path(), &api, pid, cut, &format!("p{i}"));
        let _ = daemon.wait("the killed daemon");
        let now = spin_state(&ram).count;
        counting_past(&ram, now, "the guest to run on in its cloud-hypervisor");
        eprintln!("daemon killed {cut:?}: the guest runs on ({now})");
        daemon = park_rig::serving(&socket, &config);
    }
    // Killed right after it answered the last step: the VM was parked in
    // the dead daemon (no fd store here), its cloud-hypervisor retired it.
    let pid = daemon.0.id();
    park_through(
        &socket,
        setup.dir.path(),
        &api,
        pid,
        Cut::After(Step::Complete),
        "p9",
    );
    let _ = daemon.wait("the killed daemon");
    assert!(launch.wait().expect("the launcher").code() != Some(124));
    drop(ram);
    let daemon = park_rig::serving(&socket, &config);
    let s = park_rig::stats(&socket);
    assert_eq!(s.lost_parked.len(), 1, "{s}");
    assert_eq!(s.lost_parked[0].name, "vm");
    let status = park_rig::run_ok(&socket, &["status".as_ref()]);
    assert!(status.contains("lost: vm (uid 0)"), "{status}");
    eprintln!(
        "{}",
        status
            .lines()
            .find(|l| l.starts_with("lost:"))
            .unwrap_or_default()
    );
    drop(daemon);
    wait_until("every page back", STEP, || {
        hugepages_2m("free_hugepages") == free_before
    });
}

#[test]
fn parked_vms_survive_kill_9_under_the_fd_store_and_without_it_are_reported_lost() {
    let Some(setup) = park_rig::set_up(2) else {
        return;
    };
    let (socket, config) = config(&setup);
    let systemd = FakeSystemd::new(setup.dir.path());
    let bin = Path::new(HUGEMEM);
    let mut daemon = systemd.start(bin, &socket, &config);
    wait_until("READY=1", STEP, || systemd.ready_count() == 1);
    let moved_at = park_rig::launch_and_park(&socket, &setup, "vm");
    let lazy_at = park_rig::park_from_disk(&socket, &setup, "lazy", true);
    // A park answers only once the store holds it: nothing to wait for.
    let names = systemd.names();
    assert!(
        names.iter().any(|n| n.starts_with("hugemem-f")),
        "the files of the on-demand VM: {names:?}"
    );
    daemon.signal(nix::sys::signal::Signal::SIGKILL);
    let _ = daemon.wait("the daemon");

    let mut daemon = systemd.start(bin, &socket, &config);
    wait_until("READY=1 again", STEP, || systemd.ready_count() == 2);
    let s = park_rig::stats(&socket);
    assert_eq!(s.parked.len(), 2, "both came back parked: {s}");
    assert!(s.lost_parked.is_empty(), "{s}");
    park_rig::restore_and_check(&socket, &setup, "vm", moved_at, false);
    park_rig::restore_and_check(&socket, &setup, "lazy", lazy_at, true);
    settled(&socket, "both restored and stopped");

    // Without the store (a crash, then a start that gets none: the store
    // dropped, as `systemctl stop` does) a parked VM is lost: the next
    // start says so.
    park_rig::launch_and_park(&socket, &setup, "again");
    daemon.signal(nix::sys::signal::Signal::SIGKILL);
    let _ = daemon.wait("the daemon");
    systemd.drop_store();
    let mut plain = park_rig::serving(&socket, &config);
    let status = park_rig::run_ok(&socket, &["status".as_ref()]);
    assert!(status.contains("lost: again (uid 0)"), "{status}");
    assert!(!status.contains("lost: vm"), "{status}");
    plain.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(plain.wait("the daemon").success());
}
