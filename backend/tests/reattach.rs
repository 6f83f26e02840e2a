//! Re-attach after a daemon restart (issue 20), without the restore itself:
//! the ALLOC reply's token (only when negotiated), REATTACH refusals that
//! all read alike, the per-connection limit on refusals, and an orphaned
//! allocation (made by the test hook `DaemonHandle::orphan_for_tests`,
//! standing for a restart) taken back on a new connection, through
//! `Client::reattach` and `Client::reconnect`.
//!
//! 4 KiB memory where the page size does not matter (no huge pages
//! needed); the lazy case takes 2 MiB pages (`test_support::lazy`).

use test_support::lazy::{lazy_alloc_from_dirty_pool, reserve as reserve_lazy};
use test_support::prelude::{refused, serial, TestDaemon};
use test_support::tokens::{euid, req_4k, without_id};

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use backend::client::{Client, ClientError};
use backend::daemon::connections::session::MAX_REATTACH_REFUSALS;
use backend::proto::socket::{recv_message, send_message};
use backend::proto::{
    Code, Header, RegionInfo, Reply, ReplyBody, Request, Status, FEATURE_LAZY, FEATURE_REATTACH,
    FEATURE_REBALANCE,
};

const MIB: u64 = 1 << 20;

#[test]
fn alloc_returns_a_token_only_when_negotiated() {
    let _s = serial();
    let d = TestDaemon::start(|_| {});
    // The client negotiates FEATURE_REATTACH and gets a token.
    let mut c = d.client();
    assert_ne!(c.features() & FEATURE_REATTACH, 0, "negotiated");
    let a = c.alloc(req_4k(MIB)).expect("alloc");
    let t1 = a.token().expect("a token when negotiated");
    let b = c.alloc(req_4k(MIB)).expect("alloc");
    assert_ne!(b.token(), Some(t1), "each allocation has its own token");

    // A client that did not negotiate it sees the old bytes exactly.
    let sock = UnixStream::connect(d.socket()).expect("connect");
    sock.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let call = |req: &Request, id: u32| {
        let payload = req.encode();
        let header = Header::request(req.code(), id, payload.len()).expect("header");
        send_message(&sock.as_fd(), &header, &payload, &[]).expect("send");
        recv_message(&sock.as_fd()).expect("reply")
    };
    let hs = call(
        &Request::Handshake {
            min_version: 1,
            max_version: 1,
            features: FEATURE_LAZY | FEATURE_REBALANCE,
        },
        1,
    );
    match Reply::decode(Code::Handshake, &hs.payload).expect("decode") {
        Reply {
            status: Status::Ok,
            body: ReplyBody::Handshake { features, .. },
            ..
        } => assert_eq!(features & FEATURE_REATTACH, 0),
        other => panic!("handshake: {other:?}"),
    }
    let frame = call(
        &Request::Alloc {
            req: req_4k(MIB),
            wait_ms: None,
        },
        2,
    );
    let reply = Reply::decode(Code::Alloc, &frame.payload).expect("decode");
    assert_eq!(reply.status, Status::Ok, "{}", reply.message);
    let msg_len = reply.message.len();
    // status, message, then the ALLOC body of one region, nothing more.
    assert_eq!(frame.payload.len(), 8 + msg_len + 16 + 40);
    let flags = &frame.payload[8 + msg_len + 12..8 + msg_len + 16];
    assert_eq!(flags, &0u32.to_le_bytes(), "reply flags word");
    let ReplyBody::Alloc { token, .. } = reply.body else {
        panic!("not an ALLOC body");
    };
    assert_eq!(token, None);
    assert_eq!(frame.fds.len(), 1);
    drop(frame.fds);
    drop(sock);

    drop((a.fds, b.fds));
    c.free(a.id).expect("free");
    c.free(b.id).expect("free");
    d.shutdown();
}

#[test]
fn reattach_refusals_read_alike_and_an_orphan_comes_back() {
    let _s = serial();
    let d = TestDaemon::start(|_| {});
    let mut owner = d.client();
    let a = owner.alloc(req_4k(2 * MIB)).expect("alloc");
    let token = a.token().expect("token");
    let mut wrong = token;
    wrong[15] ^= 1;
    let mut other = d.client();

    // A live allocation is nobody's to re-attach: not its own
    // connection's, not another's, even with the right token.
    let (status, live_own) = refused(owner.reattach(a.id, token));
    assert_eq!(status, Status::NotFound);
    let (status, live_other) = refused(other.reattach(a.id, token));
    assert_eq!(status, Status::NotFound);
    assert_eq!(live_own, live_other);
    let expected = without_id(&live_own, a.id);

    // An unknown id.
    let unknown = a.id + 1000;
    let (status, msg) = refused(other.reattach(unknown, token));
    assert_eq!(status, Status::NotFound);
    assert_eq!(without_id(&msg, unknown), expected);

    // Orphaned (a restart), but another uid's: the right token does not help.
    assert!(d.handle().orphan_for_tests(a.id, Some(euid() + 1)));
    let (status, msg) = refused(other.reattach(a.id, token));
    assert_eq!(
        (status, without_id(&msg, a.id)),
        (Status::NotFound, expected.clone())
    );

    // Ours again, orphaned: a wrong token.
    assert!(d.handle().orphan_for_tests(a.id, Some(euid())));
    let (status, msg) = refused(other.reattach(a.id, wrong));
    assert_eq!(
        (status, without_id(&msg, a.id)),
        (Status::NotFound, expected.clone())
    );

    // The old connection no longer owns it: FREE is refused like any
    // other id, and its close releases nothing.
    let (status, msg) = refused(owner.free(a.id));
    assert_eq!(
        (status, without_id(&msg, a.id)),
        (Status::NotFound, expected)
    );
    drop(owner);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(d.stats().allocations.active, 1, "the orphan is kept");

    // The right token from a new connection: the region table comes back.
    let regions = other.reattach(a.id, token).expect("reattach");
    assert_eq!(regions, a.regions, "the table the VMM mapped");
    assert_ne!(regions[0].flags & RegionInfo::FLAG_CLEAN, 0);
    // Once re-attached it is live again: no second re-attach.
    assert_eq!(
        refused(d.client().reattach(a.id, token)).0,
        Status::NotFound
    );
    let counters = d.stats().counters;
    assert_eq!(counters.reattach_ok, 1);
    assert_eq!(counters.reattach_refused, 6);

    // FREE works on the new connection.
    drop(a.fds);
    other.free(a.id).expect("free on the new connection");
    assert_eq!(d.stats().allocations.active, 0);
    d.shutdown();
}

#[test]
fn too_many_refused_reattach_close_the_connection() {
    let _s = serial();
    let d = TestDaemon::start(|_| {});
    let mut c = d.client();
    let a = c.alloc(req_4k(MIB)).expect("alloc");
    let token = a.token().expect("token");
    let mut guesser = d.client();
    for i in 0..MAX_REATTACH_REFUSALS {
        let mut guess = token;
        guess[0] = guess[0].wrapping_add(1 + i as u8);
        assert_eq!(
            refused(guesser.reattach(a.id, guess)).0,
            Status::NotFound,
            "refusal {i}"
        );
    }
    // The 9th: the daemon closed the connection after the 8th reply.
    match guesser.reattach(a.id, token) {
        Err(ClientError::Proto(_)) => {}
        other => panic!("expected the connection to be closed, got {other:?}"),
    }
    // Other connections are not affected.
    drop(a.fds);
    c.free(a.id).expect("free");
    d.shutdown();
}

#[test]
fn reconnect_retries_until_the_deadline_then_reattaches() {
    let _s = serial();
    // Nothing listens: connect is retried (10 ms doubling to 200 ms) until
    // the deadline, then its error comes back.
    let dir = tempfile::tempdir().expect("tempdir");
    let started = Instant::now();
    let r = Client::reconnect(
        &dir.path().join("none.sock"),
        &[],
        started + Duration::from_millis(300),
    );
    assert!(matches!(r, Err(ClientError::Connect { .. })), "{r:?}");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(2),
        "{took:?}"
    );

    let d = TestDaemon::start(|_| {});
    let mut c = d.client();
    let mut req = req_4k(MIB);
    req.lock = true;
    let a = c.alloc(req).expect("alloc");
    let b = c.alloc(req_4k(MIB)).expect("alloc");
    let token_a = a.token().expect("token");
    let token_b = b.token().expect("token");
    assert!(d.handle().orphan_for_tests(a.id, None));
    assert!(d.handle().orphan_for_tests(b.id, None));
    drop(c);
    let mut again = Client::reconnect(
        &d.socket(),
        &[(a.id, token_a), (b.id, token_b)],
        Instant::now() + Duration::from_secs(10),
    )
    .expect("reconnect");
    assert_eq!(d.stats().counters.reattach_ok, 2);
    drop((a.fds, b.fds));
    again.free(a.id).expect("free a");
    again.free(b.id).expect("free b");
    d.shutdown();
}

/// A lazy VM across a daemon restart (issue 20): the daemon serves the
/// first faults; the connection goes (the restart, emulated by the test hook
/// that orphans the allocation) and the VMM's fallback serves the next ones;
/// the VMM re-attaches and hands the uffd back, and the daemon's resumed
/// service serves the rest, clearing only pages that fault. Every page reads
/// zero (the region held a previous tenant's bytes) or what the guest wrote,
/// and a page the fallback installed is not cleared again.
#[test]
fn a_reattached_lazy_allocation_resumes_after_the_fallback() {
    use backend::lazy::{LazyGuest, LazyOptions};
    use test_support::lazy::{mapping, touch, DEADLINE, HUGE, PAGES, SIZE};
    use test_support::prelude::Map;
    let _s = serial();
    if !reserve_lazy("a_reattached_lazy_allocation_resumes_after_the_fallback") {
        return;
    }
    let d = TestDaemon::start(|cfg| {
        cfg.pool.lazy_dirty_uids = vec![euid()];
        // Dirty pooled memory exists only without detaching.
        cfg.pool.detach_pages = false;
    });
    let mut c = d.client();
    let a = lazy_alloc_from_dirty_pool(&mut c, &|| d.stats());
    let token = a.token().expect("token");
    let map = Map::shared(a.fds[0].as_fd(), SIZE as usize);
    let mut guest = LazyGuest::attach(&mut c, &a, &[mapping(&a, &map)], LazyOptions::default())
        .expect("attach");
    let mut written = Vec::new();
    // A page the lazy service's scrubbers installed ahead of the guest
    // does not fault: its page-table entry is dropped first (what a balloon
    // does), so the touch faults and whoever serves now serves it.
    let unmap_page = |off: usize| {
        let at = (map.addr() as usize + off) as *mut libc::c_void;
        // SAFETY: one huge page inside the test's own live mapping; its
        // contents stay in the file (MAP_SHARED hugetlb), only this
        // process's page-table entry goes.
        let r = unsafe { libc::madvise(at, HUGE, libc::MADV_DONTNEED) };
        assert_eq!(r, 0, "MADV_DONTNEED");
    };
    let mut step = |page: usize, who: &str| {
        let off = page * HUGE;
        if !written.contains(&page) {
            unmap_page(off);
        }
        let got = touch(&map, off)
            .recv_timeout(DEADLINE)
            .unwrap_or_else(|_| panic!("page {page} ({who}) never served"));
        assert_eq!(got, 0, "page {page} ({who}) read stale bytes");
        map.fill(off, 8, 0x42);
        written.push(page);
    };
    // The daemon serves.
    step(0, "daemon");
    // "Restart": the allocation is orphaned, the connection goes; the
    // VMM's fallback serves.
    assert!(d.handle().orphan_for_tests(a.id, None));
    // The connection ends for both sides (the watcher holds a duplicate of
    // the socket, so closing the client's fd alone would end nothing), as
    // when the daemon dies.
    nix::sys::socket::shutdown(
        std::os::fd::AsRawFd::as_raw_fd(&c.socket()),
        nix::sys::socket::Shutdown::Both,
    )
    .expect("shutdown");
    drop(c);
    assert!(guest.wait_fallback(DEADLINE), "the fallback took over");
    // The fallback installs pages alone once the daemon is gone. Here the
    // daemon lives on and stops the allocation's fault service when it
    // closes the session, before its count of live sessions drops; until
    // then its scrubbers may still install a page ahead of the next touch.
    d.wait_stats(
        DEADLINE,
        "the daemon's end of the session (its fault service stopped)",
        |s| s.counters.sessions_active == 0,
    );
    step(PAGES / 2, "fallback");
    step(PAGES / 2 + 1, "fallback");
    let by_fallback = guest.stats().faults;
    assert!(by_fallback >= 2, "{:?}", guest.stats());
    // Re-attach and hand the uffd back: the daemon serves again.
    let mut again = d.client();
    let regions = again.reattach(a.id, token).expect("reattach");
    assert_eq!(regions.len(), 1);
    guest.hand_back(&mut again, a.id).expect("hand back");
    assert!(!guest.stats().active, "the fallback stood down");
    for page in [1, PAGES - 1, PAGES / 2 + 2] {
        step(page, "resumed daemon");
    }
    assert_eq!(
        guest.stats().faults,
        by_fallback,
        "after the hand-back the fallback served nothing"
    );
    // What the guest wrote is still there, pages it never touched read zero.
    for &page in &written {
        assert!(
            map.all(page * HUGE, 8, 0x42),
            "page {page} lost the guest's bytes"
        );
    }
    drop(guest);
    drop(map);
    drop(a.fds);
    again.free(a.id).expect("free");
    d.shutdown();
}
