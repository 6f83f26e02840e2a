//! Tenants across a takeover (`takeover::receive` and
//! `Daemon::start_inherited`, as `hugemem serve --takeover` does, with
//! both daemons in this process), two cases the soak found:
//! - a region whose file its tenant grew fails the successor's checks and
//!   goes back to the kernel with its allocation, and the successor's
//!   books still balance (they were off by the region and the allocation);
//! - a connection that re-attached a lazy allocation, which then moved on
//!   (HANDOFF) and went, keeps serving across the takeover (its stale lazy
//!   record failed to resume and closed it, releasing what it held).
//!
//! The tests are serialized (`serial`): they share the host's huge pages.

use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::Duration;

use backend::client::{Client, ClientError};
use backend::daemon::{restart::takeover, Config, Daemon, DaemonHandle};
use backend::proto::{AllocRequest, ClearMode, Status};
use test_support::prelude::{hugepages_2m, reserve_2m, serial, wait_until};
use test_support::tenant::{alloc_2m, MIB};

/// The books of a STATS document: allocations made − released == active,
/// bytes created − released == held.
fn assert_balanced(s: &backend::stats::Stats, case: &str) {
    assert_eq!(
        s.counters.allocs_ok - s.counters.allocs_released,
        s.allocations.active,
        "{case}: allocations made − released: {s}"
    );
    assert_eq!(
        s.totals.created_bytes - s.totals.released_bytes,
        s.totals.held_bytes,
        "{case}: bytes created − released: {s}"
    );
}

/// A daemon on a socket in `dir`, re-checking quarantine quickly, after
/// `tweak`: its configuration (for the successor), its handle and a
/// connected client.
fn start(dir: &Path, tweak: impl FnOnce(&mut Config)) -> (Config, DaemonHandle, Client) {
    let mut cfg = Config {
        socket: dir.join("hugemem.sock"),
        ..Config::default()
    };
    cfg.pool.recheck_ms = 50;
    tweak(&mut cfg);
    let d = Daemon::start(cfg.clone()).expect("daemon starts");
    let c = connect(&cfg);
    (cfg, d, c)
}

fn connect(cfg: &Config) -> Client {
    let c = Client::connect(&cfg.socket).expect("connect");
    c.set_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    c
}

/// The takeover: the successor serves, the predecessor exits.
fn take_over(cfg: &Config, old: DaemonHandle) -> DaemonHandle {
    let inherited = takeover::receive(&cfg.socket).expect("takeover: state received");
    let new = Daemon::start_inherited(cfg.clone(), inherited).expect("the successor starts");
    old.shutdown().expect("the predecessor exits");
    new
}

/// Waits until the successor holds nothing, checks its books, shuts it
/// down and waits for the host's free 2 MiB pages.
fn settle(new: DaemonHandle, free_before: u64) {
    wait_until("nothing in use", Duration::from_secs(30), || {
        new.stats().allocations.active == 0
    });
    assert_balanced(&new.stats(), "at the end");
    new.shutdown().expect("the successor exits");
    wait_until(
        &format!("HugePages_Free (2 MiB) returns to {free_before}"),
        Duration::from_secs(30),
        || hugepages_2m("free_hugepages") >= free_before,
    );
}

#[test]
fn a_grown_file_is_dropped_at_a_takeover_and_the_books_balance() {
    const TEST: &str = "a_grown_file_is_dropped_at_a_takeover_and_the_books_balance";
    let _g = serial();
    if !reserve_2m(8, TEST) {
        return;
    }
    let free_before = hugepages_2m("free_hugepages");
    let dir = tempfile::tempdir().expect("tempdir");
    let (cfg, old, mut tenant) = start(dir.path(), |_| {});
    let grown = tenant.alloc(alloc_2m(4 * MIB, false)).expect("ALLOC");
    let kept = tenant.alloc(alloc_2m(2 * MIB, false)).expect("ALLOC");
    // SAFETY: ftruncate on this test's own fd of its region.
    let r = unsafe { libc::ftruncate(grown.fds[0].as_raw_fd(), (6 * MIB) as libc::off_t) };
    assert_eq!(r, 0, "grow: {}", std::io::Error::last_os_error());
    assert_balanced(&old.stats(), "before the takeover");

    let new = take_over(&cfg, old);
    let s = new.stats();
    assert_eq!(
        s.allocations.active, 1,
        "only the allocation not grown: {s}"
    );
    assert_balanced(&s, "after the takeover");
    match tenant.free(grown.id) {
        Err(ClientError::Refused {
            status: Status::NotFound,
            ..
        }) => {}
        other => panic!("FREE of the allocation whose file grew: {other:?}"),
    }
    tenant.free(kept.id).expect("FREE of the allocation kept");
    drop((grown, kept, tenant));
    settle(new, free_before);
}

/// A lazy allocation re-attached on connection A after a restart (the
/// test hook orphans it), then handed off to connection B, which FREEs
/// it (its region goes back to the kernel: no pool): A's record of it is
/// stale. A takeover must not pass it on (the successor found its region
/// gone and closed A, releasing A's other allocation; a region still
/// pooled, it kept the record): A and what it owns are served on, and A
/// lists no lazy allocation.
#[test]
fn a_stale_lazy_record_does_not_close_its_connection_at_a_takeover() {
    const TEST: &str = "a_stale_lazy_record_does_not_close_its_connection_at_a_takeover";
    let _g = serial();
    if !reserve_2m(8, TEST) {
        return;
    }
    let free_before = hugepages_2m("free_hugepages");
    let dir = tempfile::tempdir().expect("tempdir");
    let (cfg, old, mut a) = start(dir.path(), |c| {
        c.pool.limit = backend::daemon::ByteSize(0);
        c.pool.target = backend::daemon::ByteSize(0);
    });
    let lazy = a
        .alloc(AllocRequest {
            clear_mode: ClearMode::Lazy,
            ..alloc_2m(2 * MIB, false)
        })
        .expect("lazy ALLOC");
    let other = a.alloc(alloc_2m(2 * MIB, false)).expect("ALLOC");
    let token = lazy.token().expect("a token");
    assert!(old.orphan_for_tests(lazy.id, None), "orphaned");
    a.reattach(lazy.id, token).expect("REATTACH on A");
    let mut b = connect(&cfg);
    let moved = b.handoff(lazy.id, token, false).expect("HANDOFF to B");
    let id = moved.id;
    drop((lazy, moved));
    b.free(id).expect("B FREEs it");

    let new = take_over(&cfg, old);
    let s = a.stats().expect("A is still served after the takeover");
    assert_eq!(
        s.lazy.as_deref().map(<[_]>::len),
        Some(0),
        "A's lazy allocations after the takeover: {s}"
    );
    a.free(other.id).expect("A still owns its other allocation");
    drop((other, a, b));
    settle(new, free_before);
}
