//! Hostile peers against RESTORE and UNPARK, and what a park moves or
//! copies (see `hostile_park` for PARK's refusals): memory from elsewhere
//! copied exactly or refused without a trace, names per tenant, the token a
//! park rotates, the round trip of a moved VM through a fake
//! cloud-hypervisor, and a parked VM across a takeover. The daemon runs in
//! this process; forked children `setuid` where the uid matters.
//!
//! The tests are serialized (`serial`): they share the host's huge pages.

mod park_peer;

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use backend::client::{Client, ClientError};
use backend::proto::Status;
use park_peer::*;
use test_support::prelude::{reserve_2m, serial, wait_until, TestDaemon};
use test_support::tenant::{alloc_2m, in_child, root_or_skip, NOBODY};

const MIB: u64 = 1 << 20;
/// How long the daemon may take to settle (a release, a scrub).
const SETTLE: Duration = Duration::from_secs(60);

/// Memory from elsewhere is copied: exactly the bytes its mappings claim
/// (a file that grows meanwhile adds nothing), from a file sealed against
/// writes too (the daemon only reads). A file whose reads end before its
/// size says (the peer truncated it during the copy, or lied) is refused
/// with the allocation made for the copy released, and the next tenant
/// reads none of the bytes that were copied before the read came short.
#[test]
fn foreign_memory_is_copied_exactly_or_refused_without_a_trace() {
    const TEST: &str = "foreign_memory_is_copied_exactly_or_refused_without_a_trace";
    let _g = serial();
    if !reserve_2m(8, TEST) {
        return;
    }
    let d = TestDaemon::start(|_| {});
    let mut client = d.client();
    let size = 2 * MIB;

    // Grows after State: 6 MiB more of bytes that must not be copied.
    let grow = memfd("hostile-park-grow", size, false);
    let path = reopen_path(&grow);
    let steps = whole_then(&grow, size, move || {
        let f = std::fs::OpenOptions::new().write(true).open(&path);
        let f = f.expect("reopen");
        f.set_len(4 * size).expect("the sender grows its file");
        std::os::unix::fs::FileExt::write_all_at(&f, &vec![0xEE; (3 * size) as usize], size)
            .expect("write past the mapping");
    });
    let run = park_via(&mut client, "grown", steps);
    let parked = run.result.expect("a memfd that grew is parked");
    assert_eq!(run.answers, [Answer::Ok; 5]);
    assert_eq!(
        (parked.bytes, parked.copied_bytes, parked.slots),
        (size, size, 1)
    );
    assert_eq!(
        open_count(identity(&grow)),
        1,
        "the daemon keeps no fd of the copied file"
    );
    let (restored, snap) = restore_via(&mut client, "grown");
    let restored = restored.expect("RESTORE of the copy");
    let snap = snap.expect("the receiver took the VM");
    assert_eq!(restored.regions.iter().map(|r| r.size).sum::<u64>(), size);
    assert!(
        holds_pattern(&restored.fds[0], 0, size, 0),
        "the copy is the claimed bytes"
    );
    assert_eq!(snap.memory.len(), 1);
    assert_eq!(identity(&snap.memory[0].1), identity(&restored.fds[0]));
    assert_eq!(snap.config, config_json(&[(0, 0, size, 0)]).into_bytes());
    assert_eq!(snap.state, STATE);
    assert!(snap.paused);
    drop(snap);
    let id = restored.id;
    drop(restored);
    client
        .free(id)
        .expect("the restoring connection owns the copy");

    // Sealed against writes, growing and shrinking: only read, accepted.
    let sealed = memfd("hostile-park-sealed", size, true);
    let seals = libc::F_SEAL_WRITE | libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on this test's own memfd with integer arguments.
    let sealed_ok = unsafe { libc::fcntl(sealed.as_raw_fd(), libc::F_ADD_SEALS, seals) } == 0;
    assert!(
        sealed_ok,
        "F_ADD_SEALS: {}",
        std::io::Error::last_os_error()
    );
    let run = park_via(&mut client, "sealed", whole(&sealed, size));
    let parked = run.result.expect("a sealed memfd is parked");
    assert_eq!(parked.copied_bytes, size);
    let s = assert_serves_balanced(&d, 1, 1, "sealed, parked");
    assert_eq!(s.parked[0].name, "sealed");
    client.unpark("sealed").expect("UNPARK");
    assert_serves_balanced(&d, 0, 0, "sealed, unparked");

    // A regular file whose reads end long before its size (a sysfs file
    // says 4096 bytes and holds a few): the copy reads short.
    let lying: OwnedFd =
        std::fs::File::open("/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages")
            .expect("a sysfs file")
            .into();
    let claimed =
        u64::try_from(nix::sys::stat::fstat(lying.as_fd()).expect("fstat").st_size).expect("size");
    let made = d.stats().counters.allocs_ok;
    let run = park_via(&mut client, "short", whole(&lying, claimed));
    assert_refused(
        &run.result,
        Status::Invalid,
        "the file ends at",
        "a file that reads short",
    );
    assert_eq!(run.answers.last(), Some(&Answer::Refused));
    let s = assert_serves_balanced(&d, 0, 0, "a file that reads short");
    assert_eq!(
        s.counters.allocs_ok,
        made + 1,
        "the copy's allocation was made, and released"
    );
    assert_eq!(open_count(identity(&lying)), 1);
    d.wait_stats(SETTLE, "the copy's region leaves quarantine", |s| {
        s.pool_sum(|p| p.quarantined_bytes) == 0
    });
    test_support::tenant::tenant_b_sees_nothing(&d, size, false);
    d.shutdown();
}

/// A copy onto clean pool memory zeroes nothing: the pool's pages are
/// zero already, so the file's holes are skipped, not written
/// (`park_zeroed_bytes` stays 0), and the copy still holds exactly the
/// file's bytes with zeros where the file has a hole.
#[test]
fn a_copy_onto_clean_pool_memory_zeroes_nothing() {
    const TEST: &str = "a_copy_onto_clean_pool_memory_zeroes_nothing";
    let _g = serial();
    if !reserve_2m(8, TEST) {
        return;
    }
    let d = TestDaemon::start(|_| {});
    let mut client = d.client();
    let size = 4 * MIB;

    // Pool memory of the copy's size, written by a tenant, freed, scrubbed.
    let a = client.alloc(alloc_2m(size, false)).expect("ALLOC");
    fill_mapped(&a.fds[0], size);
    let id = a.id;
    drop(a);
    client.free(id).expect("FREE");
    d.wait_stats(SETTLE, "the freed region is clean in the pool", |s| {
        s.pool_sum(|p| p.clean_bytes) >= size
            && s.pool_sum(|p| p.quarantined_bytes + p.dirty_bytes) == 0
    });
    let fresh = d.stats().counters.regions_fresh;

    // The VM's file: 2 MiB of bytes, then a 2 MiB hole.
    let vm = memfd("park-clean-pool", 2 * MIB, false);
    std::fs::File::from(vm.try_clone().expect("dup"))
        .set_len(size)
        .expect("a hole after the bytes");
    let run = park_via(&mut client, "holes", whole(&vm, size));
    let parked = run.result.expect("PARK");
    assert_eq!((parked.bytes, parked.copied_bytes), (size, 2 * MIB));
    let s = d.stats();
    assert_eq!(s.counters.regions_fresh, fresh, "the copy took pool memory");
    assert_eq!(
        s.counters.park_zeroed_bytes, 0,
        "clean pool memory is zero already: the hole is not zeroed again"
    );
    let (restored, snap) = restore_via(&mut client, "holes");
    let restored = restored.expect("RESTORE of the copy");
    assert!(snap.is_some(), "the receiver took the VM");
    assert!(holds_pattern(&restored.fds[0], 0, 2 * MIB, 0), "the bytes");
    assert!(
        read_at(&restored.fds[0], 2 * MIB, 2 * MIB)
            .iter()
            .all(|&b| b == 0),
        "the hole reads zero"
    );
    drop(snap);
    let id = restored.id;
    drop(restored);
    client.free(id).expect("FREE of the restored copy");
    d.shutdown();
}

/// Names are per tenant and a park rotates the token: a second PARK under
/// a name in use is refused; another uid's RESTORE and UNPARK of the name
/// find nothing; the launcher's old token neither REATTACHes nor HANDOFFs
/// the parked allocation; the launcher's FREE learns where it went.
#[test]
fn names_and_tokens_belong_to_the_parked_vm() {
    const TEST: &str = "names_and_tokens_belong_to_the_parked_vm";
    let _g = serial();
    if !root_or_skip() || !reserve_2m(8, TEST) {
        return;
    }
    let d = daemon_for_two_uids();
    let size = 2 * MIB;
    let mut launcher = d.client();
    let a = launcher.alloc(alloc_2m(size, false)).expect("ALLOC");
    let old_token = a.token().expect("the daemon hands out tokens");
    let mut parker = d.client();
    let run = park_via(&mut parker, "vm", whole(&a.fds[0], size));
    assert_eq!(run.result.expect("PARK").alloc_id, a.id);

    let other = memfd("hostile-park-name", size, false);
    let again = park_via(&mut parker, "vm", whole(&other, size));
    assert_refused(
        &again.result,
        Status::Invalid,
        "a VM named \"vm\" is parked already",
        "a name in use",
    );
    assert_eq!(open_count(identity(&other)), 1);

    let socket = d.socket();
    let code = in_child(Some(NOBODY), move || {
        let Ok(mut c) = Client::connect(&socket) else {
            return 10;
        };
        let Ok((daemon_end, _ch_end)) = UnixStream::pair() else {
            return 11;
        };
        let restored = child_expects(
            c.restore("vm", &daemon_end, true),
            Status::NotFound,
            "no VM named \"vm\" is parked",
        );
        let unparked = child_expects(
            c.unpark("vm"),
            Status::NotFound,
            "no VM named \"vm\" is parked",
        );
        restored + unparked
    });
    assert_eq!(code, 0, "uid 65534's RESTORE and UNPARK of root's VM");

    let refused_token = |r: Result<_, ClientError>, what: &str| match r {
        Err(ClientError::Refused {
            status: Status::NotFound,
            ..
        }) => {}
        other => panic!("{what} with the launcher's old token: {other:?}"),
    };
    refused_token(d.client().reattach(a.id, old_token).map(|_| ()), "REATTACH");
    refused_token(
        d.client().handoff(a.id, old_token, false).map(|_| ()),
        "HANDOFF",
    );
    match launcher.free(a.id) {
        Err(ClientError::Refused {
            status: Status::NotFound,
            message,
        }) => {
            assert_eq!(message, format!("allocation {} was parked as vm", a.id))
        }
        other => panic!("the launcher's FREE of its parked allocation: {other:?}"),
    }
    let s = assert_serves_balanced(&d, 1, 1, "after the attempts");
    assert_eq!((s.parked[0].name.as_str(), s.parked[0].alloc), ("vm", a.id));
    assert_eq!(
        (
            s.counters.restores,
            s.counters.handoff_ok,
            s.counters.reattach_ok
        ),
        (0, 0, 0)
    );
    drop(a);
    parker.unpark("vm").expect("root's UNPARK");
    assert_serves_balanced(&d, 0, 0, "unparked");
    d.shutdown();
}

/// The happy path through a fake peer: a daemon allocation is parked by
/// moving it (nothing copied, the same inode), a receiver that hangs up
/// leaves it parked (and the daemon keeps no fd it opened for it), and a
/// fake receiver then gets the same memory, the configuration and the
/// state byte for byte, while the restoring connection owns the
/// allocation.
#[test]
fn a_moved_vm_restores_to_a_fake_receiver_with_the_same_memory() {
    const TEST: &str = "a_moved_vm_restores_to_a_fake_receiver_with_the_same_memory";
    let _g = serial();
    if !reserve_2m(8, TEST) {
        return;
    }
    let d = TestDaemon::start(|_| {});
    let size = 4 * MIB;
    let mut launcher = d.client();
    let a = launcher.alloc(alloc_2m(size, false)).expect("ALLOC");
    fill_mapped(&a.fds[0], size);
    let a_id = identity(&a.fds[0]);
    let json = config_json(&[(0, 0, size, 0)]);
    let mut parker = d.client();
    let run = park_via(&mut parker, "moved", whole(&a.fds[0], size));
    let parked = run.result.expect("PARK");
    assert_eq!(run.answers, [Answer::Ok; 5]);
    assert_eq!(
        (
            parked.alloc_id,
            parked.bytes,
            parked.copied_bytes,
            parked.slots
        ),
        (a.id, size, 0, 1)
    );
    let s = assert_serves_balanced(&d, 1, 1, "parked");
    assert_eq!(s.counters.park_copied_bytes, 0);
    drop(a); // the sender's cloud-hypervisor exits
    let daemon_holds = open_count(a_id);

    // A receiver that hangs up at once: refused, still parked.
    let (daemon_end, ch_end) = UnixStream::pair().expect("pair");
    drop(ch_end);
    let r = parker.restore("moved", &daemon_end, true);
    match r {
        Err(ClientError::Refused {
            status: Status::Invalid,
            message,
        }) => {
            assert!(message.contains("it stays parked"), "{message}")
        }
        other => panic!("RESTORE to a receiver that hung up: {other:?}"),
    }
    drop(daemon_end);
    assert_eq!(
        open_count(a_id),
        daemon_holds,
        "the daemon kept the receiver's fd of the memory"
    );
    assert_serves_balanced(&d, 1, 1, "after a failed restore");

    let mut restorer = d.client();
    let (restored, snap) = restore_via(&mut restorer, "moved");
    let restored = restored.expect("RESTORE");
    let snap = snap.expect("the fake receiver took the VM");
    assert_eq!(restored.id, parked.alloc_id);
    assert_eq!(identity(&restored.fds[0]), a_id, "the same memory");
    assert_eq!(snap.memory.len(), 1);
    assert_eq!((snap.memory[0].0, identity(&snap.memory[0].1)), (0, a_id));
    assert_eq!(snap.config, json.as_bytes());
    assert_eq!(snap.state, STATE);
    assert!(snap.paused);
    assert!(
        holds_pattern(&restored.fds[0], 0, size, 0),
        "the guest's bytes"
    );
    let s = assert_serves_balanced(&d, 1, 0, "restored");
    assert_eq!(
        (
            s.counters.parks,
            s.counters.restores,
            s.counters.restores_refused
        ),
        (1, 1, 1)
    );
    drop(snap);
    let id = restored.id;
    drop(restored);
    restorer.free(id).expect("the restoring connection owns it");
    assert_serves_balanced(&d, 0, 0, "freed");
    d.shutdown();
}

/// A parked VM across a takeover (`takeover::receive` and
/// `Daemon::start_inherited`, as `hugemem serve --takeover` does): the
/// successor lists it, keeps it past the orphan timeout (an orphaned
/// allocation beside it is released then: the timeout did fire), and
/// RESTOREs it onto the same memory.
#[test]
fn a_parked_vm_survives_a_takeover_and_the_orphan_timeout() {
    use backend::daemon::{restart::takeover, Config, Daemon};
    const TEST: &str = "a_parked_vm_survives_a_takeover_and_the_orphan_timeout";
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
    cfg.limits.reattach_timeout_secs = 1;
    let socket = cfg.socket.clone();
    let old = Daemon::start(cfg.clone()).expect("daemon starts");
    let connect = || {
        let c = Client::connect(&socket).expect("connect");
        c.set_timeout(Some(SETTLE)).expect("timeout");
        c
    };
    let size = 4 * MIB;
    let mut launcher = connect();
    let a = launcher.alloc(alloc_2m(size, false)).expect("ALLOC");
    fill_mapped(&a.fds[0], size);
    let (a_alloc, a_id) = (a.id, identity(&a.fds[0]));
    let run = park_via(&mut connect(), "kept", whole(&a.fds[0], size));
    assert_eq!(run.result.expect("PARK").copied_bytes, 0);
    drop(a);
    let orphan = launcher.alloc(alloc_2m(2 * MIB, false)).expect("ALLOC");
    let orphan_id = orphan.id;
    drop(orphan);
    assert!(
        old.orphan_for_tests(orphan_id, None),
        "an orphan beside the parked VM"
    );

    let inherited = takeover::receive(&socket).expect("takeover: state received");
    let new = Daemon::start_inherited(cfg.clone(), inherited).expect("the successor starts");
    old.shutdown().expect("the old daemon exits");
    let s = new.stats();
    assert_eq!(s.parked.len(), 1, "the successor lists the parked VM: {s}");
    assert_eq!(
        (s.parked[0].name.as_str(), s.parked[0].alloc),
        ("kept", a_alloc)
    );
    assert_eq!(s.allocations.active, 2);
    wait_until("the successor releases the orphan", SETTLE, || {
        new.stats().allocations.active == 1
    });
    let s = new.stats();
    assert_eq!(
        s.parked.len(),
        1,
        "the orphan timeout released the parked VM: {s}"
    );
    assert_eq!(
        s.totals.created_bytes - s.totals.released_bytes,
        s.totals.held_bytes
    );

    let mut restorer = connect();
    let (restored, snap) = restore_via(&mut restorer, "kept");
    let restored = restored.expect("RESTORE from the successor");
    assert!(snap.is_some(), "the fake receiver took the VM");
    assert_eq!(identity(&restored.fds[0]), a_id, "the same memory");
    assert!(
        holds_pattern(&restored.fds[0], 0, size, 0),
        "the guest's bytes"
    );
    let id = restored.id;
    drop((restored, snap));
    restorer.free(id).expect("FREE");
    let s = new.stats();
    assert_eq!((s.allocations.active, s.parked.len()), (0, 0));
    new.shutdown().expect("the successor exits");
}
