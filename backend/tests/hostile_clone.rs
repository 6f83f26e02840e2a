//! A hostile clone launcher against the real daemon in this process: CLONE
//! of a template parked by a fake cloud-hypervisor (`park_peer`), the
//! launcher's end of the socket pair played by the test. Each case must be
//! refused or harmless: the template stays parked with its bytes, no clone
//! stays counted for a launcher that did not take the template, the pool's
//! books balance, the daemon closes every fd of the template it opened,
//! and another tenant's CLONE is served afterwards.
//!
//! * the launcher's end closed before the daemon sends, after `Start`,
//!   inside the memory fds; garbage instead of a response; a refusal;
//! * a launcher that got the read-only fds and writes, truncates,
//!   allocates, punches or maps them writable;
//! * a flood of CLONEs on one connection, some of them kept, which the
//!   budget stops, and whose promises end with the connection even while
//!   the launcher keeps its ends of the sockets open (the daemon closes
//!   its ends then).
//!
//! The tests are serialized (`serial`): they share the host's huge pages.

mod park_peer;

use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use backend::client::Client;
use backend::daemon::ByteSize;
use backend::proto::{CloneMode, Status};
use ch_migration::{Response, HEADER_SIZE};
use park_peer::clones::*;
use park_peer::*;
use test_support::hugepages::hold_all_but_2m;
use test_support::prelude::{reserve_2m, serial, wait_until, TestDaemon};

const SIZE: u64 = 4 << 20;

/// What the hostile launcher does on its end of the socket.
#[derive(Debug, Clone, Copy)]
enum Launcher {
    /// Closes it before the daemon sends anything.
    GoneAtOnce,
    /// Reads `Start` and closes.
    GoneAfterStart,
    /// Answers `Start`, reads the first memory fd's request, closes.
    GoneInsideTheMemory,
    /// Answers `Start` with 16 bytes of garbage.
    Garbage,
    /// Answers `Start` with a refusal.
    Refuses,
}

/// CLONE of `name` on `client` with `launcher` playing its end.
fn hostile_clone(
    client: &mut Client,
    name: &str,
    launcher: Launcher,
) -> backend::client::ClientError {
    let (daemon_end, mut ours) = UnixStream::pair().expect("socketpair");
    let player = std::thread::spawn(move || {
        let mut head = [0u8; HEADER_SIZE];
        match launcher {
            Launcher::GoneAtOnce => {}
            Launcher::GoneAfterStart => {
                let _ = ours.read_exact(&mut head);
            }
            Launcher::GoneInsideTheMemory => {
                let _ = ours.read_exact(&mut head);
                let _ = ours.write_all(&Response { ok: true }.encode());
                let _ = ours.read_exact(&mut head);
            }
            Launcher::Garbage => {
                let _ = ours.read_exact(&mut head);
                let _ = ours.write_all(&[0xff; HEADER_SIZE]);
            }
            Launcher::Refuses => {
                let _ = ours.read_exact(&mut head);
                let _ = ours.write_all(&Response { ok: false }.encode());
            }
        }
    });
    let player = if matches!(launcher, Launcher::GoneAtOnce) {
        player.join().expect("the launcher");
        None
    } else {
        Some(player)
    };
    let r = client.clone_parked(name, CloneMode::Shared, &daemon_end);
    drop(daemon_end);
    if let Some(p) = player {
        p.join().expect("the launcher");
    }
    r.expect_err(&format!(
        "{launcher:?}: the clone was not taken, yet admitted"
    ))
}

fn daemon(headroom: u64) -> TestDaemon {
    TestDaemon::start(|c| c.clones.headroom = ByteSize(headroom))
}

#[test]
fn a_launcher_that_goes_or_answers_garbage_mid_clone_harms_nothing() {
    const TEST: &str = "a_launcher_that_goes_or_answers_garbage_mid_clone_harms_nothing";
    let _g = serial();
    if !reserve_2m(12, TEST) {
        return;
    }
    let d = daemon(0);
    let mut owner = d.client();
    let mem = memfd("hostile-clone", SIZE, false);
    park_via(&mut owner, "tmpl", whole(&mem, SIZE))
        .result
        .expect("parked");
    let mut prober = d.client();
    let (r, probe) = clone_via(&mut prober, "tmpl", CloneMode::Shared);
    r.expect("a well-behaved clone");
    let probe = probe.expect("the template");
    let template = identity(&probe.memory[0].1);
    let mut hostile = d.client();
    let mut served = vec![prober];
    for launcher in [
        Launcher::GoneAtOnce,
        Launcher::GoneAfterStart,
        Launcher::GoneInsideTheMemory,
        Launcher::Garbage,
        Launcher::Refuses,
    ] {
        let open = open_count(template);
        let err = hostile_clone(&mut hostile, "tmpl", launcher);
        let text = err.to_string();
        assert!(
            text.contains("did not take the template"),
            "{launcher:?}: {text}"
        );
        let s = d.stats();
        assert_eq!(
            (s.parked.len(), s.parked[0].shared_clones),
            (1, served.len() as u64),
            "{launcher:?}: no clone counts for it: {s}"
        );
        assert_eq!(
            open_count(template),
            open,
            "{launcher:?}: the daemon's fds of the template closed"
        );
        assert!(
            holds_pattern(&probe.memory[0].1, 0, SIZE, 0),
            "{launcher:?}: the template changed"
        );
        // Another tenant is served.
        let mut next = d.client();
        let (r, _) = clone_via(&mut next, "tmpl", CloneMode::Shared);
        r.unwrap_or_else(|e| panic!("{launcher:?}: the next CLONE: {e}"));
        served.push(next);
    }
    drop((probe, hostile, served));
    wait_until(
        "UNPARK once the clones ended",
        Duration::from_secs(10),
        || owner.unpark("tmpl").is_ok(),
    );
    let s = assert_serves_balanced(&d, 0, 0, "the template dropped");
    assert_eq!(s.counters.clones_refused, 5, "{s}");
}

#[test]
fn a_launcher_cannot_write_truncate_allocate_or_map_the_template_writable() {
    const TEST: &str = "a_launcher_cannot_write_truncate_allocate_or_map_the_template_writable";
    let _g = serial();
    if !reserve_2m(8, TEST) {
        return;
    }
    let d = daemon(0);
    let mut owner = d.client();
    let mem = memfd("hostile-clone-fds", SIZE, false);
    park_via(&mut owner, "tmpl", whole(&mem, SIZE))
        .result
        .expect("parked");
    let mut hostile = d.client();
    let (r, snap) = clone_via(&mut hostile, "tmpl", CloneMode::Shared);
    r.expect("cloned");
    let snap = snap.expect("the template");
    let fd = &snap.memory[0].1;
    assert!(nix::sys::uio::pwrite(fd, b"x", 0).is_err(), "pwrite");
    assert!(nix::unistd::ftruncate(fd, 0).is_err(), "ftruncate to 0");
    assert!(
        nix::unistd::ftruncate(fd, i64::try_from(2 * SIZE).expect("size")).is_err(),
        "ftruncate up"
    );
    for mode in [
        nix::fcntl::FallocateFlags::empty(),
        nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE
            | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE,
    ] {
        assert!(
            nix::fcntl::fallocate(fd, mode, 0, i64::try_from(PAGE).expect("page")).is_err(),
            "fallocate {mode:?}"
        );
    }
    // SAFETY: a mapping attempt that must fail; nothing is mapped when
    // it does, and a success is unmapped at once.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            usize::try_from(SIZE).expect("size"),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_fd().as_raw_fd(),
            0,
        )
    };
    if p != libc::MAP_FAILED {
        // SAFETY: the mapping just made.
        unsafe { libc::munmap(p, usize::try_from(SIZE).expect("size")) };
    }
    assert_eq!(p, libc::MAP_FAILED, "a shared writable mapping");
    assert_eq!(
        nix::sys::stat::fstat(fd.as_fd()).expect("fstat").st_size,
        i64::try_from(SIZE).expect("size"),
        "the template's size"
    );
    assert!(holds_pattern(fd, 0, SIZE, 0), "the template changed");
    drop((snap, hostile));
    wait_until(
        "UNPARK once the clone ended",
        Duration::from_secs(10),
        || owner.unpark("tmpl").is_ok(),
    );
    assert_serves_balanced(&d, 0, 0, "the template dropped");
}

#[test]
fn a_flood_of_clones_is_stopped_by_the_budget_and_ends_with_its_connection() {
    const TEST: &str = "a_flood_of_clones_is_stopped_by_the_budget_and_ends_with_its_connection";
    const FLOOD: usize = 64;
    const KEPT: u64 = 2;
    let _g = serial();
    let need = SIZE / PAGE;
    if !reserve_2m(need * (KEPT + 2) + 4, TEST) {
        return;
    }
    let d = daemon(0);
    let mut owner = d.client();
    let mem = memfd("hostile-clone-flood", SIZE, false);
    park_via(&mut owner, "tmpl", whole(&mem, SIZE))
        .result
        .expect("parked");
    let hog = hold_all_but_2m(KEPT * need);
    // The flood: every launcher keeps its end (nothing ever maps).
    let mut flooder = d.client();
    let mut ends = Vec::new();
    let (mut admitted, mut refused) = (0, 0);
    for _ in 0..FLOOD {
        let (r, snap, ours) = clone_keeping(&mut flooder, "tmpl", CloneMode::Shared);
        match r {
            Ok(_) => admitted += 1,
            Err(e) => {
                assert!(e.to_string().contains("short by"), "{e}");
                refused += 1;
            }
        }
        ends.push((snap, ours));
    }
    assert_eq!((admitted, refused), (KEPT, FLOOD as u64 - KEPT));
    // Another tenant is refused by the same budget, then served once the
    // flooder's connection ends, though it keeps every socket end open.
    let mut other = d.client();
    let (r, _) = clone_via(&mut other, "tmpl", CloneMode::Shared);
    expect_refused(
        r,
        Status::NoMemory,
        &format!(
            "({} of them promised to clones still starting)",
            KEPT * need
        ),
    );
    drop(flooder);
    wait_until(
        "the flooder's promises ended with its connection",
        Duration::from_secs(10),
        || d.stats().parked[0].shared_clones == 0,
    );
    // The daemon keeps none of the flood's sockets: each end the flooder
    // kept sees its peer gone.
    for (_, ours) in &ends {
        ours.set_nonblocking(true).expect("nonblocking");
    }
    wait_until(
        "the daemon closed its end of every flooded CLONE's socket",
        Duration::from_secs(10),
        || {
            ends.iter()
                .all(|(_, ours)| matches!((&*ours).read(&mut [0u8; 1]), Ok(0)))
        },
    );
    let (r, _) = clone_via(&mut other, "tmpl", CloneMode::Shared);
    r.expect("served once the flood's connection ended");
    drop((ends, hog, other));
    wait_until(
        "UNPARK once the clones ended",
        Duration::from_secs(10),
        || owner.unpark("tmpl").is_ok(),
    );
    let s = assert_serves_balanced(&d, 0, 0, "the template dropped");
    assert_eq!(
        (s.counters.clones, s.counters.clones_refused),
        (KEPT + 1, FLOOD as u64 - KEPT + 1),
        "{s}"
    );
}

/// A connection that runs a shared clone is never closed for being idle:
/// closing it would stop counting a clone that still maps its template,
/// and UNPARK of the template would then be served. A witness connection,
/// idle for less time than the clone's, is closed by the same timeout.
#[test]
fn a_running_clone_is_never_timed_out_as_idle() {
    const TEST: &str = "a_running_clone_is_never_timed_out_as_idle";
    let _g = serial();
    if !reserve_2m(8, TEST) {
        return;
    }
    let d = TestDaemon::start(|c| c.limits.idle_timeout_secs = 1);
    let mem = memfd("idle-clone", SIZE, false);
    {
        let mut owner = d.client();
        park_via(&mut owner, "tmpl", whole(&mem, SIZE))
            .result
            .expect("parked");
    }
    let mut cloner = d.client();
    let (r, snap) = clone_via(&mut cloner, "tmpl", CloneMode::Shared);
    r.expect("cloned");
    let mut witness = d.client();
    witness.stats().expect("the witness handshakes");
    wait_until(
        "the idle witness is closed",
        Duration::from_secs(10),
        || d.stats().sessions.active <= 1,
    );
    let s = cloner.stats().expect("the clone's connection still serves");
    assert_eq!(s.parked[0].shared_clones, 1, "the clone still counts: {s}");
    expect_refused(
        d.client().unpark("tmpl"),
        Status::Invalid,
        "running shared clone",
    );
    drop((snap, cloner, witness));
    wait_until(
        "UNPARK once the clone ended",
        Duration::from_secs(10),
        || d.client().unpark("tmpl").is_ok(),
    );
    assert_serves_balanced(&d, 0, 0, "the template dropped");
}
