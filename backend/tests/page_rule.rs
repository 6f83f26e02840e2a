//! The ALLOC rule on a real daemon with real hugetlb pages (issue 12):
//! `best` never serves a smaller page size while pages of the larger size
//! are in the daemon's hands (idle under another pool key, quarantined,
//! dirty), every wait has a deadline, a true shortage downgrades and says
//! which pages were missing (a strict policy refuses instead), and the
//! pool's hygiene (4 KiB regions given back, per-size limits, refill to
//! target, reasons in STATS).
//!
//! The host of these tests has few 1 GiB pages, so 2 MiB pages stand in for
//! the larger size and 4 KiB for the smaller one: sizes that are not whole
//! GiB make `best` mean 2M, then 4K. One test uses 1 GiB pages when two can
//! be reserved. "Exactly the host's pages": a test takes every free 2 MiB
//! page, so the larger size can only come from the daemon's own pool.

use test_support::prelude::{
    available_2m, map_raw, refused, region, region_state, reserve_2m, serial, wait_until,
    TestDaemon,
};

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use backend::proto::{AllocPart, AllocRequest, ClearMode, PagePolicy, Status};
use backend::stats::Stats;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn req(size: u64, policy: PagePolicy, paths: bool) -> AllocRequest {
    AllocRequest {
        total_size: size,
        page_policy: policy,
        clear_mode: ClearMode::Eager,
        lock: false,
        parts: vec![AllocPart { node: 0, size }],
        want_paths: paths,
    }
}

fn given_back(stats: &Stats, id: u64) -> Option<String> {
    stats
        .given_back
        .as_deref()?
        .iter()
        .find(|r| r.region == id)
        .map(|r| r.why.clone())
}

/// Every available 2 MiB page, as bytes (at most 256 pages: enough, and quick).
fn all_free_2m() -> u64 {
    available_2m().min(256) * 2 * MIB
}

/// A forked process that maps `len` bytes of `fd` and keeps the mapping
/// (and the fd) for `hold`, or until killed (`None`). Returns its pid.
fn holder(fd: i32, len: u64, hold: Option<Duration>) -> libc::pid_t {
    // SAFETY: the child only makes plain syscalls (mmap, usleep, pause,
    // alarm) on values prepared before the fork and leaves with `_exit`,
    // never returning into the test harness.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        // The blocks below: async-signal-safe calls on integers in the
        // forked child; `_exit` never returns.
        // SAFETY: as said.
        unsafe { libc::alarm(60) };
        let code = if map_raw(fd, len).is_null() { 3 } else { 0 };
        match hold {
            Some(d) if code == 0 => {
                // SAFETY: as above.
                unsafe { libc::usleep(u32::try_from(d.as_micros()).unwrap_or(u32::MAX)) };
            }
            None if code == 0 => loop {
                // SAFETY: as above.
                unsafe { libc::pause() };
            },
            _ => {}
        }
        // SAFETY: as above.
        unsafe { libc::_exit(code) };
    }
    pid
}

fn reap(pid: libc::pid_t) {
    let mut status = 0;
    // SAFETY: waiting for our own child; `status` is a valid out pointer.
    let r = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(r, pid, "waitpid: {}", std::io::Error::last_os_error());
}

/// (i) A hugetlbfs-path region idle in the pool holds every free 2 MiB page;
/// an fd-mode ALLOC of the same size gets 2 MiB pages (the path region goes
/// back to the kernel for a fresh memfd), not 4 KiB.
#[test]
fn idle_pages_under_the_other_backing_are_given_back_not_downgraded() {
    let _s = serial();
    if !reserve_2m(8, "idle_pages_under_the_other_backing") {
        return;
    }
    let d = TestDaemon::start(|_| {});
    if d.stats().hugetlbfs.is_none_or(|h| !h.contains_key("2M")) {
        test_support::skip!("no 2 MiB hugetlbfs mount");
        return;
    }
    let mut c = d.client();
    let size = all_free_2m();
    let a = c
        .alloc(req(size, PagePolicy::Best, true))
        .expect("path-mode ALLOC of every free 2M page");
    assert_eq!(a.regions[0].page_size, 2 * MIB);
    let path_region = a.regions[0].region_id;
    let id = a.id;
    drop(a);
    c.free(id).expect("free");
    wait_until(
        "the path region is clean in the pool",
        Duration::from_secs(30),
        || region_state(&d.stats(), path_region).as_deref() == Some("clean"),
    );
    assert!(available_2m() * 2 * MIB < size);
    let t = Instant::now();
    let b = c
        .alloc(req(size, PagePolicy::Best, false))
        .expect("fd-mode ALLOC of the same size");
    let took = t.elapsed();
    assert_eq!(
        b.regions[0].page_size,
        2 * MIB,
        "2M pages, not 4K: {:?}",
        b.note
    );
    assert!(b.note.is_empty(), "no downgrade note: {}", b.note);
    assert!(b.paths.is_empty());
    let s = d.stats();
    assert_eq!(s.counters.downgrades, 0, "{s}");
    let why = given_back(&s, path_region).expect("the path region was given back");
    assert!(why.contains("2M pages were wanted"), "{why}");
    eprintln!(
        "MEASURE {} fd ALLOC after a path-mode FREE (every free 2M page pooled as a file): {:.1} ms, 2M pages",
        size / MIB,
        took.as_secs_f64() * 1e3
    );
    c.free(b.id).expect("free");
    d.shutdown();
}

/// (ii) An ALLOC right after a FREE whose region a child still maps (it
/// exits 200 ms later) waits for it instead of downgrading, and is served
/// promptly after the exit: the quarantine watches the holder's pidfd (the
/// periodic re-check is 10 s here, longer than the ALLOC's wait).
#[test]
fn a_quarantined_region_is_waited_for_and_the_holders_exit_wakes_the_alloc() {
    let _s = serial();
    if !reserve_2m(8, "a_quarantined_region_is_waited_for") {
        return;
    }
    let d = TestDaemon::start(|c| c.pool.recheck_ms = 10_000);
    let mut c = d.client();
    let size = all_free_2m();
    let a = c
        .alloc(req(size, PagePolicy::Best, false))
        .expect("ALLOC of every free 2M page");
    assert_eq!(a.regions[0].page_size, 2 * MIB);
    let first = a.regions[0].region_id;
    let hold = Duration::from_millis(200);
    let child = holder(a.fds[0].as_raw_fd(), size, Some(hold));
    let forked = Instant::now();
    let id = a.id;
    drop(a);
    c.free(id).expect("free while the child maps it");
    c.set_alloc_wait(Some(Duration::from_secs(5)));
    let t = Instant::now();
    let b = c
        .alloc(req(size, PagePolicy::Best, false))
        .expect("ALLOC right after the FREE");
    let took = t.elapsed();
    let since_fork = forked.elapsed();
    reap(child);
    assert_eq!(
        b.regions[0].page_size,
        2 * MIB,
        "2M pages, not 4K: {}",
        b.note
    );
    assert!(b.note.is_empty(), "{}", b.note);
    let s = d.stats();
    assert_eq!(s.counters.downgrades, 0, "{s}");
    if b.regions[0].region_id == first {
        // Detached (kernel-zeroed, clean at once) or cleared on the ALLOC path.
        assert_eq!(
            s.counters.regions_recleared + s.counters.regions_pooled,
            1,
            "{s}"
        );
        assert_eq!(s.counters.regions_fresh, 1, "only the first ALLOC: {s}");
    } else {
        // The region left quarantine but failed a release check (a lease
        // refused while the exiting holder's references were still being
        // torn down: docs/security.md) and went back to the kernel: its
        // pages then served a fresh region, still of 2M pages.
        let why = given_back(&s, first).unwrap_or_default();
        assert!(
            why.contains("damaged") || why.contains("given back"),
            "{why}: {s}"
        );
        eprintln!("NOTE the quarantined region went back to the kernel: {why}");
    }
    assert!(since_fork >= hold, "served only after the holder exited");
    assert!(
        took < Duration::from_secs(3),
        "served promptly after the exit, not at the 10 s re-check: {took:?}"
    );
    eprintln!(
        "MEASURE {} MiB ALLOC waiting for a holder that exits {} ms after the fork: served {:.1} ms after the ALLOC was sent ({:.1} ms after the fork), 2M pages",
        size / MIB,
        hold.as_millis(),
        took.as_secs_f64() * 1e3,
        since_fork.as_secs_f64() * 1e3
    );
    c.free(b.id).expect("free");
    d.shutdown();
}

/// (iii) A deadline shorter than a holder that never exits: a clear error
/// naming the holder; nothing is lost (the region leaves quarantine once
/// the holder is gone and serves the next ALLOC).
#[test]
fn a_deadline_shorter_than_the_holder_fails_naming_it_and_loses_nothing() {
    let _s = serial();
    if !reserve_2m(8, "a_deadline_shorter_than_the_holder") {
        return;
    }
    let d = TestDaemon::start(|_| {});
    let mut c = d.client();
    let size = all_free_2m();
    let a = c
        .alloc(req(size, PagePolicy::Best, false))
        .expect("ALLOC of every free 2M page");
    let first = a.regions[0].region_id;
    let child = holder(a.fds[0].as_raw_fd(), size, None);
    let id = a.id;
    drop(a);
    c.free(id).expect("free");
    c.set_alloc_wait(Some(Duration::from_millis(300)));
    let t = Instant::now();
    let (status, msg) = refused(c.alloc(req(size, PagePolicy::Best, false)));
    let took = t.elapsed();
    assert_eq!(status, Status::NoMemory, "{msg}");
    // What it waited for, in general: the region may be another tenant's,
    // so its id and holder pid are for the operator (log, STATS), not the
    // client.
    assert!(
        msg.contains("1 region(s)")
            && msg.contains("1 still held")
            && msg.contains("nothing was allocated"),
        "says what it waited for: {msg}"
    );
    assert!(
        !msg.contains(&format!("pid {child}")) && !msg.contains(&format!("region {first}")),
        "names no other tenant's region or pid: {msg}"
    );
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(5),
        "{took:?}"
    );
    let s = d.stats();
    assert_eq!(s.counters.downgrades, 0, "a timeout never downgrades: {s}");
    assert_eq!(region_state(&s, first).as_deref(), Some("quarantined"));
    let why = region(&s, first).expect("region").why;
    assert!(
        why.starts_with(&format!("quarantined: pid {child} ")),
        "{why}"
    );
    eprintln!(
        "MEASURE refused after {:.1} ms: {msg}",
        took.as_secs_f64() * 1e3
    );
    // SAFETY: killing our own child.
    unsafe { libc::kill(child, libc::SIGKILL) };
    reap(child);
    wait_until(
        "the region leaves quarantine clean",
        Duration::from_secs(30),
        || region_state(&d.stats(), first).as_deref() == Some("clean"),
    );
    c.set_alloc_wait(None);
    let b = c
        .alloc(req(size, PagePolicy::Best, false))
        .expect("ALLOC again");
    assert_eq!(b.regions[0].region_id, first, "nothing was lost");
    c.free(b.id).expect("free");
    d.shutdown();
}

/// (iv) A true shortage: `best` downgrades and the reply says which pages
/// were missing, `downgrades` counts it; a strict policy refuses with the
/// same account. (v, first part) The 4 KiB region is given back to the
/// kernel at FREE, not pooled.
#[test]
fn a_true_shortage_downgrades_with_the_missing_pages_named_and_strict_refuses() {
    let _s = serial();
    if !reserve_2m(2, "a_true_shortage_downgrades") {
        return;
    }
    let d = TestDaemon::start(|_| {});
    let mut c = d.client();
    let free = available_2m();
    let size = (free + 2) * 2 * MIB;
    let (status, msg) = refused(c.alloc(req(size, PagePolicy::Huge2M, false)));
    assert_eq!(status, Status::NoMemory, "{msg}");
    assert!(msg.contains("2 x 2M pages missing on node 0"), "{msg}");
    assert!(msg.contains("never falls back"), "{msg}");
    let a = c
        .alloc(req(size, PagePolicy::Best, false))
        .expect("best ALLOC beyond the 2M pages");
    assert_eq!(a.regions[0].page_size, 4096);
    let want = format!("on 4K pages: 2 x 2M pages missing on node 0 ({free} free, 0 in the pool)");
    assert!(a.note.contains(&want), "note {:?} says {want:?}", a.note);
    let s = d.stats();
    assert_eq!(s.counters.downgrades, 1, "{s}");
    let r4k = a.regions[0].region_id;
    let id = a.id;
    drop(a);
    c.free(id).expect("free");
    let s = d.stats();
    assert!(
        region(&s, r4k).is_none(),
        "the 4K region is not pooled: {s}"
    );
    let why = given_back(&s, r4k).expect("given back");
    assert!(why.contains("over the 4K limit"), "{why}");
    assert_eq!(s.totals.held_bytes, 0, "{s}");
    eprintln!("MEASURE downgrade note: {want}");
    d.shutdown();
}

/// (v) Per-size limits: with `limit_2m` = one region's worth, the second
/// region freed goes back at once, with the reason in STATS. Refill: an
/// idle daemon with `refill` fills node 0 to its target with clean 2 MiB
/// regions (progress in STATS), which the next ALLOC of that size takes.
#[test]
fn per_size_limits_hold_and_refill_reaches_the_target() {
    let _s = serial();
    if !reserve_2m(8, "per_size_limits_hold_and_refill") {
        return;
    }
    let d = TestDaemon::start(|c| {
        c.pool.limit_2m = Some(backend::daemon::ByteSize(4 * MIB));
    });
    let mut c = d.client();
    let a = c.alloc(req(4 * MIB, PagePolicy::Huge2M, false)).expect("a");
    let b = c.alloc(req(4 * MIB, PagePolicy::Huge2M, false)).expect("b");
    let (ra, rb) = (a.regions[0].region_id, b.regions[0].region_id);
    let (ia, ib) = (a.id, b.id);
    drop((a, b));
    c.free(ia).expect("free a");
    c.free(ib).expect("free b");
    let s = d.stats();
    assert!(region(&s, ra).is_some(), "within the 2M limit: pooled: {s}");
    assert!(
        region(&s, rb).is_none(),
        "over the 2M limit: given back: {s}"
    );
    let why = given_back(&s, rb).expect("b given back");
    assert!(why.contains("over the 2M limit"), "{why}");
    wait_until("a is clean", Duration::from_secs(20), || {
        region_state(&d.stats(), ra).as_deref() == Some("clean")
    });
    let why = region(&d.stats(), ra).map(|r| r.why);
    assert_eq!(why.as_deref(), Some("pooled: clean, within target"));
    d.shutdown();

    let target = 8 * MIB;
    let d = TestDaemon::start(|c| {
        c.pool.refill = true;
        c.pool.target = backend::daemon::ByteSize(target);
        c.pool.recheck_ms = 20;
    });
    let t = Instant::now();
    wait_until("refill reaches the target", Duration::from_secs(20), || {
        let s = d.stats();
        s.pool_sum(|p| p.clean_bytes) >= target
    });
    let filled = t.elapsed();
    let s = d.handle().stats();
    let refill = s.refill.clone().expect("the operator's STATS has refill");
    assert!(refill.enabled, "{s}");
    assert!(refill.regions >= 1, "{s}");
    assert_eq!(refill.bytes, target, "{s}");
    let mut c = d.client();
    let a = c
        .alloc(req(target, PagePolicy::Best, false))
        .expect("ALLOC");
    assert_eq!(a.regions[0].page_size, 2 * MIB);
    assert_eq!(
        d.stats().counters.regions_pooled,
        1,
        "served from the refilled pool"
    );
    eprintln!(
        "MEASURE refill of an idle daemon to an {} MiB target on 2M pages: {:.1} ms",
        target / MIB,
        filled.as_secs_f64() * 1e3
    );
    c.free(a.id).expect("free");
    d.shutdown();
}

/// (i) with 1 GiB pages when two can be reserved: a 2 GiB path-mode region
/// idle in the pool, then a 2 GiB fd-mode `best` ALLOC gets 1 GiB pages.
#[test]
fn one_gib_pages_idle_as_files_serve_an_fd_alloc() {
    let _s = serial();
    if !test_support::prelude::reserve(
        guest_mem::PageSize::Huge1G,
        2,
        None,
        "one_gib_pages_idle_as_files_serve_an_fd_alloc",
    ) {
        return;
    }
    let d = TestDaemon::start(|_| {});
    if d.stats().hugetlbfs.is_none_or(|h| !h.contains_key("1G")) {
        test_support::skip!("no 1 GiB hugetlbfs mount");
        return;
    }
    let mut c = d.client();
    let a = c
        .alloc(req(2 * GIB, PagePolicy::Best, true))
        .expect("path ALLOC");
    assert_eq!(a.regions[0].page_size, GIB);
    let path_region = a.regions[0].region_id;
    let id = a.id;
    drop(a);
    c.free(id).expect("free");
    wait_until("clean in the pool", Duration::from_secs(60), || {
        region_state(&d.stats(), path_region).as_deref() == Some("clean")
    });
    let t = Instant::now();
    let b = c
        .alloc(req(2 * GIB, PagePolicy::Best, false))
        .expect("fd ALLOC");
    let took = t.elapsed();
    assert_eq!(b.regions[0].page_size, GIB, "1G pages: {}", b.note);
    assert!(b.note.is_empty(), "{}", b.note);
    assert_eq!(d.stats().counters.downgrades, 0);
    eprintln!(
        "MEASURE 2G fd ALLOC after a 2G path-mode FREE on 1G pages: {:.1} ms",
        took.as_secs_f64() * 1e3
    );
    c.free(b.id).expect("free");
    d.shutdown();
}
