//! Faults around a parked VM, through fake peers that stop at exact
//! protocol steps (issue 43): the promise is that afterwards the VM is
//! parked or running, never gone unless its own process was running it,
//! that no fault hands out memory the VM did not hold, and that the
//! daemon's books balance.
//!
//! * A receiver that dies at each step of a RESTORE (before `Start`, after
//!   `Start`, `MemoryFd`, `Config`, `State`, with `Complete` unanswered)
//!   leaves the VM parked; one that answered `Complete` ran it, and its
//!   allocation is the restoring connection's. Moved and parked on demand
//!   (postcopy) alike; on demand, the units a dead receiver had (and its
//!   guest wrote) are read again from the files at the next restore.
//! * A VM parked on demand survives a takeover: its files travel.
//! * A takeover while an on-demand restore fills a VM waits 10 s, then is
//!   refused with the reason; the restore goes on and ends, and the next
//!   takeover carries the restored VM.
//! * The restoring connection gone (its launcher killed) while an
//!   on-demand restore runs: every page the receiver asks for is still
//!   served, the restore ends, and its memory is released and accounted.
//!
//! The tests are serialized (`serial`): they share the host's huge pages.

mod park_peer;
mod restore_peer;

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::time::Duration;

use backend::client::{Client, ClientError};
use backend::daemon::{restart::takeover, Config, Daemon, DaemonHandle};
use ch_migration::Command;
use park_peer::{
    complete_paused, config, fake_sender, identity, memfd, memory_fd, open_count, pattern, start,
    state, Answer, Step, STATE,
};
use restore_peer::{Script, Stop};
use test_support::prelude::{reserve_2m, serial, TestDaemon};

const MIB: u64 = 1 << 20;
/// The fake VM: two 2 MiB units.
const SIZE: u64 = 4 * MIB;
const PAGE: u64 = 2 * MIB;
/// How long the daemon may take to settle (a release, a scrub).
const SETTLE: Duration = Duration::from_secs(60);

/// A configuration with one slot at guest address 0 and a memory section
/// (a postcopy restore declares its zones hugetlb in it).
fn vm_config(size: u64) -> String {
    serde_json::json!({
        "cpus": {"boot_vcpus": 1},
        "vm_config": {"memory": {"size": size}},
        "memory_manager_data": {"guest_ram_mappings": [{
            "slot": 0, "gpa": 0, "size": size, "file_offset": 0,
            "zone_id": "mem0", "virtio_mem": false
        }]}
    })
    .to_string()
}

/// The fake sender's steps for `fd`, `size` bytes.
fn steps(fd: &OwnedFd, size: u64) -> Vec<Step> {
    vec![
        Step::Send(start()),
        Step::Send(memory_fd(0, &[fd])),
        Step::Send(config(&vm_config(size))),
        Step::Send(state(STATE)),
        Step::Send(complete_paused()),
    ]
}

/// PARK `name` from `fd` (memory from elsewhere), on demand or copied.
fn park(client: &mut Client, name: &str, fd: &OwnedFd, on_demand: bool) {
    let (daemon_end, sender) = fake_sender(steps(fd, SIZE));
    let parked = client.park_with(name, &daemon_end, on_demand);
    drop(daemon_end);
    let answers = sender.join().expect("the fake sender");
    let parked = parked.expect("PARK");
    assert_eq!(answers, [Answer::Ok; 5]);
    assert_eq!(parked.bytes, SIZE);
}

/// RESTORE `name` on `client` to a receiver running `script`; the reply
/// and what the receiver saw.
fn restore(
    client: &mut Client,
    name: &str,
    script: Script,
) -> (
    Result<hugemem_client::client::Allocation, ClientError>,
    restore_peer::Seen,
) {
    let postcopy = script.postcopy;
    let (main, fault, receiver) = restore_peer::spawn(script);
    let r = match &fault {
        Some(f) if postcopy => client.restore_postcopy(name, &main, f, false),
        _ => client.restore(name, &main, false),
    };
    drop((main, fault));
    (r, receiver.join().expect("the fake receiver"))
}

/// True when every page the receiver had holds the VM's bytes.
fn pages_intact(seen: &restore_peer::Seen) -> bool {
    seen.pages.iter().all(|(at, bytes)| {
        bytes
            .iter()
            .enumerate()
            .all(|(i, b)| *b == pattern(at + i as u64))
    })
}

/// The daemon's books: `active` allocations, `parked` VMs, regions and
/// allocations balanced.
fn assert_books(stats: &backend::stats::Stats, active: u64, parked: usize, case: &str) {
    assert_eq!(stats.allocations.active, active, "{case}: {stats}");
    assert_eq!(stats.parked.len(), parked, "{case}: {stats}");
    assert_eq!(
        stats.counters.allocs_ok - stats.counters.allocs_released,
        active,
        "{case}: allocations made − released: {stats}"
    );
    assert_eq!(
        stats.totals.created_bytes - stats.totals.released_bytes,
        stats.totals.held_bytes,
        "{case}: region totals: {stats}"
    );
}

/// The receiver steps a test kills it at, with what it does there.
fn deaths(postcopy: bool) -> Vec<(&'static str, Script)> {
    let at = |stop| Script::new(stop, postcopy, SIZE);
    let mut unanswered = at(Stop::Unanswered(Command::Complete));
    if postcopy {
        // Its guest ran from the first page it had and wrote there.
        unanswered.early_faults = vec![0];
        unanswered.scribble = true;
    }
    vec![
        ("before Start", at(Stop::AtOnce)),
        ("after Start", at(Stop::After(Command::Start))),
        ("after MemoryFd", at(Stop::After(Command::MemoryFd))),
        ("after Config", at(Stop::After(Command::Config))),
        ("after State", at(Stop::After(Command::State))),
        ("with Complete unanswered", unanswered),
    ]
}

fn a_receiver_dying_at_each_step(on_demand: bool, test: &str) {
    let _g = serial();
    if !reserve_2m(8, test) {
        return;
    }
    let d = TestDaemon::start(|_| {});
    let mut client = d.client();
    let vm = memfd("park-faults-vm", SIZE, false);
    park(&mut client, "vm", &vm, on_demand);
    drop(vm);
    let before = d.stats();
    assert_books(&before, 1, 1, "parked");
    for (i, (step, script)) in deaths(on_demand).into_iter().enumerate() {
        let (r, seen) = restore(&mut client, "vm", script);
        match r {
            Err(ClientError::Refused { message, .. }) => {
                assert!(message.contains("stays parked"), "{step}: {message}")
            }
            other => panic!("{step}: a RESTORE to a receiver that died: {other:?}"),
        }
        if step.contains("Complete") {
            assert!(
                seen.commands.last() == Some(&Command::Complete),
                "{step}: {:?}",
                seen.commands
            );
        }
        drop(seen);
        let s = d.stats();
        assert_books(&s, 1, 1, step);
        assert_eq!(s.counters.restores_refused, i as u64 + 1, "{step}: {s}");
        eprintln!("{test}: a receiver that died {step}: the VM stays parked");
    }
    // A receiver that takes it: every page holds the VM's bytes, the page
    // the dead receiver's guest wrote included.
    let script = Script::new(Stop::Never, on_demand, SIZE);
    let (r, seen) = restore(&mut client, "vm", script);
    let a = r.expect("RESTORE to a receiver that takes the VM");
    assert!(
        park_peer::holds_pattern(&a.fds[0], 0, SIZE, 0),
        "the restored VM's memory is what was parked"
    );
    if on_demand {
        assert_eq!(seen.faults_ok as u64, SIZE / PAGE, "every page answered");
        assert!(
            pages_intact(&seen),
            "a page the receiver had was not the VM's"
        );
    }
    drop(seen);
    let s = d.stats();
    assert_books(&s, 1, 0, "restored");
    let id = a.id;
    drop(a);
    client
        .free(id)
        .expect("the restoring connection owns the VM");
    let s = d.wait_stats(SETTLE, "the memory back in the pool", |s| {
        s.pool_sum(|p| p.quarantined_bytes) == 0
    });
    assert_books(&s, 0, 0, "freed");
    d.shutdown();
}

#[test]
fn a_receiver_dying_at_each_step_leaves_a_moved_vm_parked() {
    a_receiver_dying_at_each_step(
        false,
        "a_receiver_dying_at_each_step_leaves_a_moved_vm_parked",
    );
}

#[test]
fn a_receiver_dying_at_each_step_leaves_an_on_demand_vm_parked_and_intact() {
    a_receiver_dying_at_each_step(
        true,
        "a_receiver_dying_at_each_step_leaves_an_on_demand_vm_parked_and_intact",
    );
}

/// A postcopy receiver that answered `Complete` and died with pages still
/// to come ran the VM: the restore ends (the daemon fills the rest), the
/// restoring connection owns the allocation, and its FREE returns it.
#[test]
fn a_postcopy_receiver_dying_after_complete_ran_the_vm() {
    const TEST: &str = "a_postcopy_receiver_dying_after_complete_ran_the_vm";
    let _g = serial();
    if !reserve_2m(8, TEST) {
        return;
    }
    let d = TestDaemon::start(|_| {});
    let mut client = d.client();
    let vm = memfd("park-faults-ran", SIZE, false);
    park(&mut client, "ran", &vm, true);
    let mut script = Script::new(Stop::After(Command::Complete), true, SIZE);
    script.early_faults = vec![PAGE];
    let (r, seen) = restore(&mut client, "ran", script);
    let a = r.expect("the receiver took the VM: its allocation is the restorer's");
    assert_eq!(seen.faults_ok, 1);
    assert!(pages_intact(&seen));
    drop(seen);
    assert_books(&d.stats(), 1, 0, "ran and died");
    let id = a.id;
    drop(a);
    client.free(id).expect("FREE");
    let s = d.wait_stats(SETTLE, "the memory back in the pool", |s| {
        s.pool_sum(|p| p.quarantined_bytes) == 0
    });
    assert_books(&s, 0, 0, "freed");
    d.shutdown();
}

/// The restoring connection goes (its launcher was killed) while a
/// postcopy restore runs: the receiver's faults are still answered, the
/// restore ends when the receiver has every page, the reply that can no
/// longer be delivered releases the allocation, and once the receiver
/// lets go its memory is back in the pool.
#[test]
fn the_restoring_connection_gone_during_an_on_demand_restore() {
    const TEST: &str = "the_restoring_connection_gone_during_an_on_demand_restore";
    let _g = serial();
    if !reserve_2m(8, TEST) {
        return;
    }
    let d = TestDaemon::start(|_| {});
    let mut client = d.client();
    let vm = memfd("park-faults-orphan", SIZE, false);
    park(&mut client, "orphan", &vm, true);
    let (go, hold) = mpsc::channel();
    let (reached_tx, reached) = mpsc::channel();
    let mut script = Script::new(Stop::Never, true, SIZE);
    script.early_faults = vec![0];
    script.hold = Some((reached_tx, hold));
    let (main, fault, receiver) = restore_peer::spawn(script);
    let stream = UnixStream::connect(d.socket()).expect("connect");
    let launcher_end = stream.try_clone().expect("dup");
    let launcher = std::thread::spawn(move || {
        let mut c = Client::from_stream(stream).expect("handshake");
        let fault = fault.expect("a fault connection");
        c.restore_postcopy("orphan", &main, &fault, false)
            .map(|a| a.id)
    });
    // The receiver runs the VM (it answered Complete): the restore is
    // now the daemon's and the receiver's.
    reached.recv().expect("the receiver runs the VM");
    assert_eq!(d.stats().parked.len(), 1, "the restore is under way");
    launcher_end
        .shutdown(std::net::Shutdown::Both)
        .expect("the launcher dies");
    let gone = launcher.join().expect("the launcher thread");
    assert!(gone.is_err(), "a dead launcher got a reply: {gone:?}");
    // Its guest goes on asking for pages: every one is answered.
    go.send(()).expect("the receiver goes on");
    let seen = receiver.join().expect("the receiver");
    assert_eq!(seen.faults_ok as u64, SIZE / PAGE, "{seen:?}");
    assert!(pages_intact(&seen));
    let s = d.wait_stats(SETTLE, "the undelivered restore released", |s| {
        s.parked.is_empty() && s.allocations.active == 0
    });
    assert_books(&s, 0, 0, "the restore's reply undelivered");
    drop(seen);
    let s = d.wait_stats(SETTLE, "the memory back in the pool", |s| {
        s.pool_sum(|p| p.quarantined_bytes) == 0
    });
    assert_books(&s, 0, 0, "the receiver let go");
    d.shutdown();
}

/// A daemon for the takeover tests, and its configuration.
fn takeover_daemon(dir: &std::path::Path) -> (Config, DaemonHandle) {
    let mut cfg = Config {
        socket: dir.join("hugemem.sock"),
        ..Config::default()
    };
    cfg.pool.recheck_ms = 50;
    let d = Daemon::start(cfg.clone()).expect("daemon starts");
    (cfg, d)
}

fn connect(socket: &std::path::Path) -> Client {
    let c = Client::connect(socket).expect("connect");
    c.set_timeout(Some(SETTLE)).expect("timeout");
    c
}

/// A VM parked on demand (its files not read yet) across a takeover:
/// its files travel, and the successor restores it on demand with the
/// VM's bytes in every page.
#[test]
fn an_on_demand_vm_survives_a_takeover_and_restores() {
    const TEST: &str = "an_on_demand_vm_survives_a_takeover_and_restores";
    let _g = serial();
    if !reserve_2m(8, TEST) {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let (cfg, old) = takeover_daemon(dir.path());
    let vm = memfd("park-faults-takeover", SIZE, false);
    let file = identity(&vm);
    park(&mut connect(&cfg.socket), "lazy", &vm, true);
    drop(vm);
    assert_eq!(open_count(file), 1, "the daemon keeps the VM's file");

    let inherited = takeover::receive(&cfg.socket).expect("takeover: state received");
    let new = Daemon::start_inherited(cfg.clone(), inherited).expect("the successor starts");
    old.shutdown().expect("the old daemon exits");
    assert_eq!(open_count(file), 1, "the successor holds the VM's file");
    let s = new.stats();
    assert_books(&s, 1, 1, "after the takeover");

    let mut client = connect(&cfg.socket);
    let (r, seen) = restore(&mut client, "lazy", Script::new(Stop::Never, true, SIZE));
    let a = r.expect("RESTORE on demand from the successor");
    assert_eq!(seen.faults_ok as u64, SIZE / PAGE);
    assert!(pages_intact(&seen), "the successor filled the VM's bytes");
    assert!(park_peer::holds_pattern(&a.fds[0], 0, SIZE, 0));
    drop(seen);
    assert_eq!(open_count(file), 0, "the file closed once read");
    let id = a.id;
    drop(a);
    client.free(id).expect("FREE");
    assert_books(&new.stats(), 0, 0, "freed");
    new.shutdown().expect("the successor exits");
}

/// A takeover while an on-demand restore is filling a VM: the freeze waits
/// for the RESTORE (a request in progress), gives up after 10 s and the
/// successor is told why; the old daemon serves on, the restore ends with
/// every page, and a takeover after it carries the restored VM.
#[test]
fn a_takeover_during_an_on_demand_restore_is_refused_and_the_restore_goes_on() {
    const TEST: &str = "a_takeover_during_an_on_demand_restore_is_refused_and_the_restore_goes_on";
    let _g = serial();
    if !reserve_2m(8, TEST) {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let (cfg, old) = takeover_daemon(dir.path());
    let vm = memfd("park-faults-busy", SIZE, false);
    park(&mut connect(&cfg.socket), "busy", &vm, true);
    drop(vm);

    let (go, hold) = mpsc::channel();
    let (reached_tx, reached) = mpsc::channel();
    let mut script = Script::new(Stop::Never, true, SIZE);
    script.early_faults = vec![0];
    script.hold = Some((reached_tx, hold));
    let socket = cfg.socket.clone();
    let restorer = std::thread::spawn(move || {
        let mut client = connect(&socket);
        let (r, seen) = restore(&mut client, "busy", script);
        (client, r, seen)
    });
    reached.recv().expect("the receiver runs the VM");
    assert_eq!(old.stats().parked.len(), 1, "the restore is under way");
    let started = std::time::Instant::now();
    let refused = takeover::receive(&cfg.socket);
    let waited = started.elapsed();
    match refused {
        Err(takeover::TakeoverError::Refused(why)) => {
            assert!(why.contains("did not park within 10 s"), "{why}");
            eprintln!("{TEST}: refused after {waited:?}: {why}");
        }
        Err(other) => panic!("the takeover during a restore: {other}"),
        Ok(_) => panic!("a takeover went through during an on-demand restore"),
    }
    assert_eq!(old.stats().parked.len(), 1, "the old daemon serves on");
    go.send(()).expect("the receiver goes on");
    let (mut client, r, seen) = restorer.join().expect("the restore");
    let a = r.expect("the restore ended after the refused takeover");
    assert_eq!(seen.faults_ok as u64, SIZE / PAGE);
    assert!(pages_intact(&seen));
    drop(seen);

    let inherited = takeover::receive(&cfg.socket).expect("a takeover after the restore");
    let new = Daemon::start_inherited(cfg.clone(), inherited).expect("the successor starts");
    old.shutdown().expect("the old daemon exits");
    assert_books(
        &new.stats(),
        1,
        0,
        "the restored VM went with its connection",
    );
    assert!(park_peer::holds_pattern(&a.fds[0], 0, SIZE, 0));
    let id = a.id;
    drop(a);
    client
        .free(id)
        .expect("FREE on the connection that travelled");
    assert_books(&new.stats(), 0, 0, "freed");
    new.shutdown().expect("the successor exits");
}

/// A restart that cannot bring the parked VMs back (no fd store, no
/// takeover) says which were lost: STATS lists them, a RESTORE of the
/// name says what happened, UNPARK clears the note; a takeover loses
/// nothing.
#[test]
fn a_start_without_its_parked_vms_says_which_were_lost() {
    const TEST: &str = "a_start_without_its_parked_vms_says_which_were_lost";
    let _g = serial();
    if !reserve_2m(8, TEST) {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let (cfg, first) = takeover_daemon(dir.path());
    let vm = memfd("park-faults-lost", SIZE, false);
    park(&mut connect(&cfg.socket), "kept", &vm, false);
    park(&mut connect(&cfg.socket), "lazy", &vm, true);
    drop(vm);
    let parked_at = first.stats().parked[0].parked_at;
    // A takeover keeps both: nothing is lost.
    let inherited = takeover::receive(&cfg.socket).expect("takeover");
    let second = Daemon::start_inherited(cfg.clone(), inherited).expect("the successor starts");
    first.shutdown().expect("the old daemon exits");
    let s = second.stats();
    assert_books(&s, 2, 2, "after the takeover");
    assert!(s.lost_parked.is_empty(), "{s}");
    // A stop without the fd store drops them; the next start says so.
    second.shutdown().expect("a stop without the fd store");
    let third = Daemon::start(cfg.clone()).expect("a fresh start");
    let s = third.stats();
    assert_books(&s, 0, 0, "a fresh start");
    let mut lost: Vec<(&str, u64)> = s
        .lost_parked
        .iter()
        .map(|l| (l.name.as_str(), l.bytes))
        .collect();
    lost.sort_unstable();
    assert_eq!(lost, [("kept", SIZE), ("lazy", SIZE)], "{s}");
    assert!(s.lost_parked.iter().any(|l| l.parked_at == parked_at));
    let mut client = connect(&cfg.socket);
    let (r, _) = restore(&mut client, "kept", Script::new(Stop::Never, false, SIZE));
    match r {
        Err(ClientError::Refused { message, .. }) => {
            assert!(
                message.contains("was lost") && message.contains("started afresh"),
                "{message}"
            );
            assert!(message.contains("hugemem unpark kept"), "{message}");
        }
        other => panic!("RESTORE of a lost VM: {other:?}"),
    }
    match client.unpark("kept") {
        Err(ClientError::Refused { message, .. }) => {
            assert!(message.contains("note is now cleared"), "{message}")
        }
        other => panic!("UNPARK of a lost VM: {other:?}"),
    }
    let s = third.stats();
    assert_eq!(
        s.lost_parked.len(),
        1,
        "only the acknowledged one cleared: {s}"
    );
    // The note kept the other one: the next start still reports it.
    third.shutdown().expect("stop");
    let fourth = Daemon::start(cfg.clone()).expect("start");
    let s = fourth.stats();
    assert_eq!(
        s.lost_parked
            .iter()
            .map(|l| l.name.as_str())
            .collect::<Vec<_>>(),
        ["lazy"],
        "{s}"
    );
    fourth.shutdown().expect("stop");
}
