//! A hostile tenant across a takeover (`takeover::receive` and
//! `Daemon::start_inherited`, as `hugemem serve --takeover` does, with
//! both daemons in this process): a region whose file its tenant grew
//! fails the successor's checks and goes back to the kernel with its
//! allocation, and the successor's books still balance (the soak found
//! them off by the region and the allocation).
//!
//! The tests are serialized (`serial`): they share the host's huge pages.

use std::os::fd::AsRawFd;
use std::time::Duration;

use backend::client::{Client, ClientError};
use backend::daemon::{takeover, Config, Daemon};
use backend::proto::Status;
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

#[test]
fn a_grown_file_is_dropped_at_a_takeover_and_the_books_balance() {
    const TEST: &str = "a_grown_file_is_dropped_at_a_takeover_and_the_books_balance";
    let _g = serial();
    if !reserve_2m(8, TEST) {
        return;
    }
    let free_before = hugepages_2m("free_hugepages");
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = Config {
        socket: dir.path().join("hugemem.sock"),
        ..Config::default()
    };
    cfg.pool.recheck_ms = 50;
    let socket = cfg.socket.clone();
    let old = Daemon::start(cfg.clone()).expect("daemon starts");
    let mut tenant = Client::connect(&socket).expect("connect");
    tenant
        .set_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let grown = tenant.alloc(alloc_2m(4 * MIB, false)).expect("ALLOC");
    let kept = tenant.alloc(alloc_2m(2 * MIB, false)).expect("ALLOC");
    // SAFETY: ftruncate on this test's own fd of its region.
    let r = unsafe { libc::ftruncate(grown.fds[0].as_raw_fd(), (6 * MIB) as libc::off_t) };
    assert_eq!(r, 0, "grow: {}", std::io::Error::last_os_error());
    assert_balanced(&old.stats(), "before the takeover");

    let inherited = takeover::receive(&socket).expect("takeover: state received");
    let new = Daemon::start_inherited(cfg, inherited).expect("the successor starts");
    old.shutdown().expect("the predecessor exits");
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
    wait_until(
        "the successor holds nothing in use",
        Duration::from_secs(30),
        || new.stats().allocations.active == 0,
    );
    assert_balanced(&new.stats(), "at the end");
    new.shutdown().expect("the successor exits");
    wait_until(
        &format!("HugePages_Free (2 MiB) returns to {free_before}"),
        Duration::from_secs(30),
        || hugepages_2m("free_hugepages") >= free_before,
    );
}
