//! Hostile tenants (issue 11): each attack a compromised VMM can mount with
//! ordinary syscalls, run against a live in-process daemon with real child
//! processes (`fork`, `setuid` where the uid matters), real memory and real
//! `SCM_RIGHTS`. Each test asserts what the attack must not achieve: no byte
//! of one tenant visible to another, the daemon alive and serving, its fd
//! table and pool counts balanced afterwards.
//!
//! The daemon runs in this process, so its fd table is `/proc/self/fd`; the
//! tests of this binary are serialized (`serial`) because they compare that
//! table and the host's huge-page counts before and after.

use test_support::prelude::{
    hugepages_2m, map_raw as map, open_fds, reserve_2m, serial, unmap_raw as unmap, wait_until,
    TestDaemon,
};
use test_support::tenant::{
    alloc_2m, assert_hugepages_balanced, fill_secret, in_child, memfd_2m, read_u64, root_or_skip,
    tenant_a, tenant_b_sees_nothing, B_SECRET, MIB, NOBODY, SECRET,
};

use std::ffi::CString;
use std::io::IoSlice;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use backend::client::Client;
use backend::proto::{AllocRequest, ClearMode, Code, Header, PagePolicy, HEADER_SIZE, MAX_FDS};
use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};

/// Waits until the daemon's (this process's) fd table is back at `baseline`.
fn assert_fds_back_to(baseline: usize, what: &str) {
    wait_until(
        &format!("the daemon's fd count returns to {baseline} after {what}"),
        SETTLE,
        || open_fds() <= baseline,
    );
}

/// A handshake header with `n` copies of `fd` attached (`SCM_RIGHTS`).
fn send_header_with_fds(sock: &UnixStream, fd: RawFd, n: usize) -> nix::Result<usize> {
    let header = Header::request(Code::Handshake, 1, 0)
        .expect("header")
        .encode();
    let raw = vec![fd; n];
    let iov = [IoSlice::new(&header)];
    let cmsg = [ControlMessage::ScmRights(&raw)];
    sendmsg::<()>(sock.as_raw_fd(), &iov, &cmsg, MsgFlags::MSG_NOSIGNAL, None)
}

/// Lets `uid` reach the daemon's socket (the test's temporary directory and
/// the socket itself are root-only).
fn open_socket_to_everyone(d: &TestDaemon) {
    for (path, mode) in [(d.dir(), 0o755), (d.socket().as_path(), 0o777)] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }
}

fn connect_raw(path: &Path) -> UnixStream {
    UnixStream::connect(path).expect("connect")
}

/// More than `MAX_FDS` fds on one frame, from an allowed peer and from a
/// refused uid: the kernel installs the fds that fit and truncates
/// (`MSG_CTRUNC`); the daemon must close every one it got, refuse the frame
/// and keep serving. Before the fix each frame leaked 64 fds for good.
#[test]
fn fds_beyond_the_frame_limit_never_leak() {
    let _g = serial();
    if !root_or_skip() {
        return;
    }
    let d = TestDaemon::start(|_| {});
    open_socket_to_everyone(&d);
    // A warm-up client, so lazily created daemon fds exist before the baseline.
    let mut c = d.client();
    c.stats().expect("stats");
    drop(c);
    let payload: OwnedFd = UnixStream::pair().expect("pair").0.into();
    std::thread::sleep(Duration::from_millis(100));
    let baseline = open_fds();

    // Allowed peer (this uid): 30 connections, one frame each of 200 fds.
    for _ in 0..30 {
        let s = connect_raw(&d.socket());
        send_header_with_fds(&s, payload.as_raw_fd(), 200).expect("sendmsg 200 fds");
        // The daemon closes the connection on the refused frame.
        let mut byte = [0u8; HEADER_SIZE];
        let _ = nix::sys::socket::recv(s.as_raw_fd(), &mut byte, MsgFlags::empty());
    }
    // Exactly MAX_FDS + 1 fds: no truncation, refused by the frame limit.
    let s = connect_raw(&d.socket());
    send_header_with_fds(&s, payload.as_raw_fd(), MAX_FDS + 1).expect("sendmsg 65 fds");
    let mut byte = [0u8; HEADER_SIZE];
    let _ = nix::sys::socket::recv(s.as_raw_fd(), &mut byte, MsgFlags::empty());
    drop(s);
    assert_fds_back_to(baseline, "frames of 200 and 65 fds from an allowed peer");

    // A refused uid: 20 connections of 200 fds each.
    let socket = CString::new(d.socket().as_os_str().as_encoded_bytes()).expect("path");
    let fd = payload.as_raw_fd();
    let code = in_child(Some(NOBODY), || {
        for _ in 0..20 {
            let path = Path::new(socket.to_str().unwrap_or_default());
            let Ok(s) = UnixStream::connect(path) else {
                return 2;
            };
            if send_header_with_fds(&s, fd, 200).is_err() {
                return 3;
            }
            let mut byte = [0u8; HEADER_SIZE];
            let _ = nix::sys::socket::recv(s.as_raw_fd(), &mut byte, MsgFlags::empty());
        }
        0
    });
    assert_eq!(code, 0, "the refused tenant could not run its attack");
    assert_fds_back_to(baseline, "frames of 200 fds from a refused uid");

    // Still serving, and nothing counted as an allocation.
    let mut c = d.client();
    let stats = c.stats().expect("stats after the attack");
    assert_eq!(stats.allocations.active, 0, "{stats}");
    assert!(d.stats().counters.peers_refused >= 20, "{}", d.stats());
    drop(c);
    let _ = payload.as_fd();
    d.shutdown();
}

/// How long a wait for the daemon to settle (a region scrubbed, discarded,
/// out of quarantine) may take: each normally takes milliseconds, but tests
/// run beside builds and other test binaries on small CI machines. A wait
/// that ends early costs nothing.
const SETTLE: Duration = Duration::from_secs(30);

fn wait_discarded(d: &TestDaemon, n: u64) {
    wait_until(&format!("{n} damaged region(s) discarded"), SETTLE, || {
        d.stats().counters.regions_discarded >= n
    });
    wait_until("the quarantine is empty", SETTLE, || {
        d.stats().pools.iter().all(|k| k.quarantined_bytes == 0)
    });
}

/// A grows its memfd past the region (the seals allow growing), writes past
/// the end, FREEs. The region must be discarded, not pooled: B gets a file
/// of exactly its size with none of A's bytes, and every page comes back.
#[test]
fn a_grown_file_is_discarded_not_served() {
    let _g = serial();
    if !reserve_2m(8, "a_grown_file_is_discarded_not_served") {
        return;
    }
    let free_before = hugepages_2m("free_hugepages");
    let d = TestDaemon::start(|_| {});
    let size = 4 * MIB;
    let code = tenant_a(&d, None, size, false, |a| {
        let fd = a.fds[0].as_raw_fd();
        // SAFETY: ftruncate on the tenant's own fd.
        if unsafe { libc::ftruncate(fd, (2 * size) as libc::off_t) } != 0 {
            return 20;
        }
        let p = map(fd, 2 * size);
        if p.is_null() {
            return 21;
        }
        fill_secret(p, 2 * size);
        unmap(p, 2 * size);
        0
    });
    assert_eq!(code, 0, "tenant A's attack did not run");
    wait_discarded(&d, 1);
    tenant_b_sees_nothing(&d, size, false);
    tenant_b_sees_nothing(&d, size, false);
    assert_hugepages_balanced(d, free_before);
}

/// A truncates its hugetlbfs file to 0 (path mode) and FREEs: the scrubber
/// would SIGBUS on the first store. The daemon must live on, discard the
/// region and serve B clean memory.
#[test]
fn a_truncated_path_file_does_not_kill_the_daemon() {
    let _g = serial();
    if !reserve_2m(8, "a_truncated_path_file_does_not_kill_the_daemon") {
        return;
    }
    let free_before = hugepages_2m("free_hugepages");
    let d = TestDaemon::start(|_| {});
    let size = 4 * MIB;
    let code = tenant_a(&d, None, size, true, |a| {
        let fd = a.fds[0].as_raw_fd();
        let p = map(fd, size);
        if p.is_null() {
            return 20;
        }
        fill_secret(p, size);
        unmap(p, size);
        // SAFETY: ftruncate on the tenant's own fd.
        if unsafe { libc::ftruncate(fd, 0) } != 0 {
            return 21;
        }
        0
    });
    assert_eq!(code, 0, "tenant A's attack did not run");
    wait_discarded(&d, 1);
    tenant_b_sees_nothing(&d, size, true);
    tenant_b_sees_nothing(&d, size, false);
    assert_hugepages_balanced(d, free_before);
}

/// A punches a hole in its memfd (`F_SEAL_SHRINK` does not cover it). With
/// pages to spare the hole is refilled with fresh zeroed pages and the
/// region is scrubbed as usual; with the host's pool exhausted (the
/// issue's SIGBUS) it is discarded. Either way the daemon lives and B
/// reads zeros.
#[test]
fn a_punched_hole_is_refilled_or_discarded() {
    let _g = serial();
    if !reserve_2m(12, "a_punched_hole_is_refilled_or_discarded") {
        return;
    }
    let free_before = hugepages_2m("free_hugepages");
    let d = TestDaemon::start(|_| {});
    let size = 4 * MIB;
    let punch = |a: &backend::client::Allocation| {
        let fd = a.fds[0].as_raw_fd();
        let p = map(fd, size);
        if p.is_null() {
            return 20;
        }
        fill_secret(p, size);
        unmap(p, size);
        // SAFETY: fallocate on the tenant's own fd.
        let r = unsafe {
            libc::fallocate(
                fd,
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                0,
                (2 * MIB) as libc::off_t,
            )
        };
        if r != 0 {
            return 21;
        }
        0
    };
    // Pages to spare: refilled, scrubbed, pooled.
    assert_eq!(tenant_a(&d, None, size, false, punch), 0, "attack 1");
    wait_until("the region is clean in the pool", SETTLE, || {
        d.stats().pools.iter().any(|k| k.clean_bytes == size)
    });
    assert_eq!(d.stats().counters.regions_discarded, 0);
    tenant_b_sees_nothing(&d, size, false);

    // No page to spare when the daemon checks the region: A punches, then
    // the host's free 2 MiB pages are taken (by this test) before A FREEs.
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let (ready_r, ready_w) = nix::unistd::pipe().expect("pipe");
    let (go_r, go_w) = nix::unistd::pipe().expect("pipe");
    let hog = std::thread::spawn(move || {
        let mut b = [0u8; 1];
        let _ = nix::unistd::read(&ready_r, &mut b);
        let spare = hugepages_2m("free_hugepages") - hugepages_2m("resv_hugepages");
        let len = spare * 2 * MIB;
        // SAFETY: a fresh anonymous hugetlb mapping; aliases nothing.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        let _ = nix::unistd::write(&go_w, b"g");
        let _ = rx.recv();
        if p != libc::MAP_FAILED {
            unmap(p.cast(), len);
        }
    });
    let code = tenant_a(&d, None, size, false, |a| {
        let r = punch(a);
        if r != 0 {
            return r;
        }
        let _ = nix::unistd::write(&ready_w, b"r");
        let mut b = [0u8; 1];
        let _ = nix::unistd::read(&go_r, &mut b);
        0
    });
    assert_eq!(code, 0, "attack 2");
    wait_discarded(&d, 1);
    let _ = tx.send(());
    hog.join().expect("hog thread");
    tenant_b_sees_nothing(&d, size, false);
    assert_hugepages_balanced(d, free_before);
}

/// The kernel facts the reuse proof rests on, on this kernel: a write lease
/// on the daemon's own reopened description of a hugetlb memfd is refused
/// while any other description is open, in flight in an unreceived
/// `SCM_RIGHTS` message, or only behind a shared mapping, and granted once
/// all are gone; a `dup` of the daemon's own does not count; the original
/// `memfd_create` description is not counted at all.
#[test]
fn write_lease_sees_every_other_description() {
    use backend::sys::{reopen, write_lease_free};
    let _g = serial();
    if !reserve_2m(2, "write_lease_sees_every_other_description") {
        return;
    }
    let Some(original) = memfd_2m() else {
        test_support::skip!(
            "no 2 MiB hugetlb memfd: {}",
            std::io::Error::last_os_error()
        );
        return;
    };
    assert!(
        !write_lease_free(original.as_fd()).expect("lease"),
        "a lease on the original memfd description is refused even alone (it is not counted)"
    );
    let own = reopen(original.as_fd()).expect("reopen");
    assert!(
        write_lease_free(own.as_fd()).expect("lease"),
        "alone: granted"
    );
    let dup = own.try_clone().expect("dup");
    assert!(
        write_lease_free(own.as_fd()).expect("lease"),
        "a dup does not count"
    );
    drop(dup);

    let tenant = reopen(original.as_fd()).expect("reopen");
    assert!(
        !write_lease_free(own.as_fd()).expect("lease"),
        "open: refused"
    );
    // In flight: sent to a socket nobody reads, every other copy closed.
    let (a, b) = UnixStream::pair().expect("pair");
    let raw = [tenant.as_raw_fd()];
    let iov = [IoSlice::new(b"x")];
    sendmsg::<()>(
        a.as_raw_fd(),
        &iov,
        &[ControlMessage::ScmRights(&raw)],
        MsgFlags::empty(),
        None,
    )
    .expect("send");
    drop(tenant);
    assert!(
        !write_lease_free(own.as_fd()).expect("lease"),
        "in flight: refused"
    );
    let mut fds = Vec::new();
    let mut buf = [0u8; 1];
    backend::sys::recv_with_fds(b.as_fd(), &mut buf, &mut fds, 1, false).expect("recv");
    assert_eq!(fds.len(), 1);
    let p = map(fds[0].as_raw_fd(), 2 * MIB);
    assert!(!p.is_null());
    drop(fds);
    assert!(
        !write_lease_free(own.as_fd()).expect("lease"),
        "mapped only: refused"
    );
    unmap(p, 2 * MIB);
    assert!(
        write_lease_free(own.as_fd()).expect("lease"),
        "all gone: granted"
    );
    // A copy of the original in flight is invisible: why it is never sent.
    let raw = [original.as_raw_fd()];
    sendmsg::<()>(
        a.as_raw_fd(),
        &iov,
        &[ControlMessage::ScmRights(&raw)],
        MsgFlags::empty(),
        None,
    )
    .expect("send");
    assert!(
        write_lease_free(own.as_fd()).expect("lease"),
        "the original description in flight goes unseen (so it must never be sent)"
    );
}

/// The fd-in-flight attack: A sends its region's fd to itself over a
/// socketpair and leaves it unreceived (no process shows it in `/proc`),
/// closes every other copy and the mapping, FREEs. B allocates and writes
/// its secret. A then receives the fd: it must not be B's file, and must
/// not hold one byte of B's.
fn fd_in_flight(paths: bool) {
    let _g = serial();
    if !reserve_2m(8, "fd_in_flight") {
        return;
    }
    let free_before = hugepages_2m("free_hugepages");
    let d = TestDaemon::start(|_| {});
    let size = 4 * MIB;
    let (freed_r, freed_w) = nix::unistd::pipe().expect("pipe");
    let (go_r, go_w) = nix::unistd::pipe().expect("pipe");
    let socket = d.socket();
    let parent = std::thread::spawn(move || {
        in_child(None, move || {
            let Ok(mut c) = Client::connect(&socket) else {
                return 10;
            };
            let Ok(a) = c.alloc(alloc_2m(size, paths)) else {
                return 11;
            };
            let p = map(a.fds[0].as_raw_fd(), size);
            if p.is_null() {
                return 12;
            }
            fill_secret(p, size);
            unmap(p, size);
            let Ok(st) = nix::sys::stat::fstat(a.fds[0].as_fd()) else {
                return 13;
            };
            let Ok((s1, s2)) = UnixStream::pair() else {
                return 14;
            };
            let raw = [a.fds[0].as_raw_fd()];
            let iov = [IoSlice::new(b"x")];
            if sendmsg::<()>(
                s1.as_raw_fd(),
                &iov,
                &[ControlMessage::ScmRights(&raw)],
                MsgFlags::empty(),
                None,
            )
            .is_err()
            {
                return 15;
            }
            let id = a.id;
            drop(a);
            if c.free(id).is_err() {
                return 16;
            }
            let _ = nix::unistd::write(&freed_w, &st.st_ino.to_le_bytes());
            let mut b = [0u8; 1];
            let _ = nix::unistd::read(&go_r, &mut b);
            let mut fds = Vec::new();
            let mut buf = [0u8; 1];
            if backend::sys::recv_with_fds(s2.as_fd(), &mut buf, &mut fds, 1, false).is_err()
                || fds.len() != 1
            {
                return 17;
            }
            let p = map(fds[0].as_raw_fd(), size);
            if p.is_null() {
                return 18;
            }
            // SAFETY: our live mapping of `size` bytes.
            let bytes = unsafe { std::slice::from_raw_parts(p, size as usize) };
            let stolen = bytes.iter().filter(|&&b| b == B_SECRET).count();
            unmap(p, size);
            if stolen > 0 {
                return 30;
            }
            0
        })
    });
    let a_inode = read_u64(&freed_r);
    // No process shows A's region, but its fd is in flight: the lease is
    // refused and the region stays quarantined, withheld, counted.
    wait_until("A's region is withheld", SETTLE, || {
        d.stats().counters.regions_withheld == 1
    });
    let withheld = |d: &TestDaemon| d.stats().pool_sum(|p| p.withheld_bytes);
    assert_eq!(withheld(&d), size, "{}", d.stats());
    // B allocates, checks it got a clean file that is not A's, writes.
    let mut b = d.client();
    let alloc = b.alloc(alloc_2m(size, paths)).expect("B allocates");
    let fd = &alloc.fds[0];
    assert_ne!(
        nix::sys::stat::fstat(fd.as_fd()).expect("fstat").st_ino,
        a_inode,
        "B got the inode A still reaches through its fd in flight"
    );
    let p = map(fd.as_raw_fd(), size);
    assert!(!p.is_null());
    // SAFETY: B's live mapping of `size` bytes.
    let bytes = unsafe { std::slice::from_raw_parts_mut(p, size as usize) };
    assert!(bytes.iter().all(|&x| x == 0), "B's memory is not clean");
    bytes.fill(B_SECRET);
    let _ = nix::unistd::write(&go_w, b"g");
    let code = parent.join().expect("tenant A thread");
    assert_eq!(code, 0, "tenant A (30: it read B's secret)");
    // A received its fd, read, and exited: nothing references the file any
    // more, so the re-check proves it free and it is reused after detaching.
    wait_until(
        "A's region is proved free once its fd is gone",
        SETTLE,
        || withheld(&d) == 0 && d.stats().pool_sum(|p| p.quarantined_bytes) == 0,
    );
    assert_eq!(
        d.stats().pool_sum(|p| p.clean_bytes),
        size,
        "A's region is clean in the pool: {}",
        d.stats()
    );
    assert_eq!(d.stats().counters.regions_discarded, 0);
    unmap(p, size);
    let id = alloc.id;
    drop(alloc);
    b.free(id).expect("B frees");
    drop(b);
    // The daemon still serves, and both regions are recycled as usual.
    tenant_b_sees_nothing(&d, size, paths);
    tenant_b_sees_nothing(&d, size, paths);
    assert_eq!(d.stats().counters.regions_discarded, 0);
    assert_hugepages_balanced(d, free_before);
}

#[test]
fn an_fd_in_flight_never_reaches_the_next_tenant_memfd() {
    fd_in_flight(false);
}

#[test]
fn an_fd_in_flight_never_reaches_the_next_tenant_path() {
    fd_in_flight(true);
}

/// One tenant (uid 65534) opens 100 connections, handshakes and goes
/// silent. Its uid gets `max_connections_per_uid` of them, the rest are
/// closed at once; root is still served promptly; the silent ones are
/// closed after `idle_timeout_secs`. Then with a per-uid cap above the
/// general pool, the flood fills every general slot and root still gets
/// one of the operators' reserved slots.
#[test]
fn idle_connection_floods_starve_nobody() {
    let _g = serial();
    if !root_or_skip() {
        return;
    }
    for (per_uid, expect_held) in [(8usize, 8u64), (100, 12)] {
        let d = TestDaemon::start(|c| {
            c.allowed_uids = vec![0, NOBODY];
            c.limits.max_connections = 16;
            c.limits.reserved_connections = 4;
            c.limits.max_connections_per_uid = per_uid;
            c.limits.idle_timeout_secs = 2;
        });
        open_socket_to_everyone(&d);
        let (held_r, held_w) = nix::unistd::pipe().expect("pipe");
        let (go_r, go_w) = nix::unistd::pipe().expect("pipe");
        let socket = d.socket();
        let flood = std::thread::spawn(move || {
            in_child(Some(NOBODY), move || {
                let mut conns = Vec::new();
                for _ in 0..100 {
                    let Ok(s) = UnixStream::connect(&socket) else {
                        continue;
                    };
                    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
                    if let Ok(c) = Client::from_stream(s) {
                        conns.push(c);
                    }
                }
                let _ = nix::unistd::write(&held_w, &(conns.len() as u64).to_le_bytes());
                let mut b = [0u8; 1];
                let _ = nix::unistd::read(&go_r, &mut b);
                0
            })
        });
        let held = read_u64(&held_r);
        assert_eq!(held, expect_held, "connections the flooding uid got");
        // Root is served promptly while the flood holds its connections.
        let t = std::time::Instant::now();
        let mut root = d.client();
        root.stats().expect("root is served");
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "root waited {:?}",
            t.elapsed()
        );
        drop(root);
        // The silent connections are closed after the idle timeout.
        wait_until("the idle connections are closed", SETTLE, || {
            d.stats().sessions.active == 0
        });
        let _ = nix::unistd::write(&go_w, b"g");
        assert_eq!(flood.join().expect("flood thread"), 0);
        d.shutdown();
    }
}

/// Lazy ALLOC right after another tenant's FREE, no UFFD ever sent, the fd
/// mapped and read: a uid not in `pool.lazy_dirty_uids` (the default: none)
/// never gets the dirty region, so it reads no byte of A's. Page detaching
/// is off here so that dirty really means A's bytes. With the uid listed,
/// the same sequence does get dirty memory (the control).
/// Tries at handing a listed uid a dirty region before the control half of
/// [`lazy_on_dirty_memory_only_for_named_uids`] gives up: each try is lost
/// only when the scrubbers clear the region between its leaving quarantine
/// and the lazy ALLOC, which a loaded machine makes more likely.
const CONTROL_TRIES: usize = 10;

#[test]
fn lazy_on_dirty_memory_only_for_named_uids() {
    use backend::proto::RegionInfo;
    let _g = serial();
    if !reserve_2m(72, "lazy_on_dirty_memory_only_for_named_uids") {
        return;
    }
    // Large enough that the scrubbers do not always win the race.
    let size = 128 * MIB;
    for trusted in [false, true] {
        let d = TestDaemon::start(|c| {
            c.pool.detach_pages = false;
            c.pool.recheck_ms = 10;
            // A scrubber claims one page at a time, so the region is still
            // dirty (and can be handed out lazily) while it is scrubbed;
            // with whole-region batches the control lost the race in CI.
            c.scrub.batch = backend::daemon::ByteSize(2 * MIB);
            if trusted {
                c.pool.lazy_dirty_uids = vec![0];
            }
        });
        let mut got_dirty = false;
        for attempt in 0..CONTROL_TRIES {
            let code = tenant_a(&d, None, size, false, |a| {
                let p = map(a.fds[0].as_raw_fd(), size);
                if p.is_null() {
                    return 20;
                }
                fill_secret(p, size);
                unmap(p, size);
                0
            });
            assert_eq!(code, 0, "tenant A");
            wait_until("A's region left quarantine", SETTLE, || {
                d.stats().pools.iter().all(|k| k.quarantined_bytes == 0)
            });
            let mut b = d.client();
            let mut req = alloc_2m(size, false);
            req.clear_mode = ClearMode::Lazy;
            let alloc = b.alloc(req).expect("lazy alloc");
            let lazy = alloc.regions[0].flags & RegionInfo::FLAG_LAZY != 0;
            let p = map(alloc.fds[0].as_raw_fd(), size);
            assert!(!p.is_null());
            // SAFETY: B's live mapping of `size` bytes.
            let bytes = unsafe { std::slice::from_raw_parts(p, size as usize) };
            let leaked = bytes.iter().filter(|&&x| x == SECRET).count();
            unmap(p, size);
            if !trusted {
                assert!(!lazy, "an untrusted uid got a dirty lazy region");
                assert_eq!(leaked, 0, "an untrusted lazy client read A's bytes");
            } else if lazy && leaked > 0 {
                println!("OBSERVED: the control got a dirty lazy region at attempt {attempt}");
                got_dirty = true;
            }
            let id = alloc.id;
            drop(alloc);
            b.free(id).expect("free");
            if got_dirty {
                break;
            }
        }
        // The control must run: a listed uid does get the dirty region (else
        // the untrusted half could pass for a reason other than the policy).
        assert!(
            !trusted || got_dirty,
            "control: the scrubbers cleaned the region first in {CONTROL_TRIES} tries"
        );
        d.shutdown();
    }
}

/// Access works as documented: an allowed non-root uid can reach the socket
/// through `socket_group`; a list of allowed uids never locks root out; a
/// FREE of another tenant's allocation id reads exactly like one of an id
/// that does not exist.
#[test]
fn access_allowed_uid_connects_root_stays_and_ids_do_not_leak() {
    use backend::client::ClientError;
    let _g = serial();
    if !root_or_skip() {
        return;
    }
    let d = TestDaemon::start(|c| {
        c.allowed_uids = vec![NOBODY];
        c.socket_group = Some(NOBODY);
    });
    // The test's own temporary directory is 0700; a real deployment's
    // runtime directory is created by the daemon (0710, the socket group)
    // or by systemd.
    std::fs::set_permissions(d.dir(), std::fs::Permissions::from_mode(0o711)).expect("chmod");
    let mode = std::fs::metadata(d.socket())
        .expect("socket")
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o660, "socket mode with socket_group");
    // Root is still allowed, and owns an allocation (4 KiB pages: no huge
    // pages needed).
    let mut root = d.client();
    let mine = root
        .alloc(AllocRequest {
            page_policy: PagePolicy::Base4K,
            ..alloc_2m(2 * MIB, false)
        })
        .expect("root allocates");
    let (id_r, id_w) = nix::unistd::pipe().expect("pipe");
    nix::unistd::write(&id_w, &mine.id.to_le_bytes()).expect("write id");
    nix::unistd::write(&id_w, &mine.regions[0].region_id.to_le_bytes()).expect("write id");
    assert!(
        root.stats()
            .expect("root stats")
            .region(mine.regions[0].region_id)
            .is_some(),
        "root (an operator) sees every region"
    );
    let socket = d.socket();
    let code = in_child(Some(NOBODY), move || {
        let foreign = read_u64(&id_r);
        let foreign_region = read_u64(&id_r);
        let Ok(mut c) = Client::connect(&socket) else {
            return 40;
        };
        let Ok(sent) = c.stats_json() else {
            return 41;
        };
        // The tenant's document reads into the typed STATS and back to the
        // same JSON (the parts it may not see are absent, not null).
        let Ok(stats) = serde_json::from_value::<backend::stats::Stats>(sent.clone()) else {
            return 45;
        };
        if serde_json::to_value(&stats).ok().as_ref() != Some(&sent) {
            return 46;
        }
        let sees_foreign = stats
            .regions
            .as_deref()
            .is_none_or(|r| r.iter().any(|r| r.id == foreign_region));
        if sees_foreign || stats.quarantine.is_some() || stats.rebalance.is_some() {
            return 43;
        }
        let missing = foreign + 1_000_000;
        let norm = |r: Result<(), ClientError>, id: u64| match r {
            Err(ClientError::Refused { status, message }) => {
                Some((status, message.replace(&id.to_string(), "ID")))
            }
            _ => None,
        };
        let a = norm(c.free(foreign), foreign);
        let b = norm(c.free(missing), missing);
        if a.is_none() || a != b {
            return 42;
        }
        let norm_rb = |r: Result<(u64, u64), ClientError>, id: u64| match r {
            Err(ClientError::Refused { status, message }) => {
                Some((status, message.replace(&id.to_string(), "ID")))
            }
            _ => None,
        };
        let missing_region = foreign_region + 1_000_000;
        let a = norm_rb(c.rebalance(foreign_region, 0, 0, 0), foreign_region);
        let b = norm_rb(c.rebalance(missing_region, 0, 0, 0), missing_region);
        if a.is_none() || a != b {
            return 44;
        }
        0
    });
    assert_eq!(
        code, 0,
        "uid 65534 (40: cannot connect, 41: not served, 42: a foreign id reads unlike a missing one, 43: STATS shows another tenant, 44: REBALANCE tells a foreign region from a missing one)"
    );
    // Root's allocation is untouched by the attempt.
    root.free(mine.id).expect("root frees its own allocation");
    d.shutdown();
}

/// A daemon that died (SIGKILL, or a crash) leaves its path-mode region
/// files on the hugetlbfs mount, with their pages and a tenant's data. The
/// next daemon releases them at start (never reuses them), says so in
/// STATS, and the pages come back.
#[test]
fn restart_releases_files_of_a_dead_instance() {
    let _g = serial();
    if !reserve_2m(4, "restart_releases_files_of_a_dead_instance") {
        return;
    }
    let d = TestDaemon::start(|_| {});
    let Some(dir) = d
        .stats()
        .hugetlbfs
        .and_then(|h| h.get("2M").map(std::path::PathBuf::from))
    else {
        test_support::skip!("no 2 MiB hugetlbfs mount");
        d.shutdown();
        return;
    };
    d.shutdown();
    // A pid that is certainly dead: a child that has exited and been reaped.
    let dead = std::process::Command::new("true")
        .spawn()
        .expect("spawn true");
    let pid = dead.id();
    let mut dead = dead;
    dead.wait().expect("wait");
    let free_before = hugepages_2m("free_hugepages");
    let path = dir.join(format!("hugemem-r1.{pid}.0"));
    {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .expect("create leftover");
        file.set_len(2 * MIB).expect("size");
        let p = map(file.as_raw_fd(), 2 * MIB);
        assert!(!p.is_null());
        fill_secret(p, 2 * MIB);
        unmap(p, 2 * MIB);
    }
    assert_eq!(
        hugepages_2m("free_hugepages"),
        free_before - 1,
        "the leftover holds a page"
    );
    let d = TestDaemon::start(|_| {});
    assert!(!path.exists(), "the leftover file was not released");
    let stats = d.stats();
    // At least ours (a crashed run elsewhere may have left more).
    assert!(stats.counters.leftover_files_released >= 1, "{stats}");
    assert!(stats.counters.leftover_bytes_released >= 2 * MIB, "{stats}");
    assert!(
        hugepages_2m("free_hugepages") >= free_before,
        "its page came back"
    );
    d.shutdown();
}

/// Path mode: a tenant (uid 65534) owns its hugetlbfs file while it uses it
/// and may even `chmod 0666` it. At FREE, before quarantine, the daemon takes
/// the file back (owner root, mode 0600; hugetlbfs has no ACLs), so after
/// FREE the tenant cannot open the path again — not before the reuse proof
/// runs, not after the region went to the next tenant.
#[test]
fn a_released_path_is_unreachable_to_its_tenant() {
    let _g = serial();
    if !root_or_skip() || !reserve_2m(4, "a_released_path_is_unreachable_to_its_tenant") {
        return;
    }
    // A hugetlbfs mount of its own that uid 65534 may traverse (the host's
    // mounts are root-only, mode 1770), as an operator who serves path mode
    // to non-root uids sets one up (docs/operations.md).
    let Some(mount) = SearchableHugetlbfs::mount() else {
        return;
    };
    let dir = mount.path().to_path_buf();
    let d = TestDaemon::start(move |c| {
        c.allowed_uids = vec![NOBODY];
        c.socket_group = Some(NOBODY);
        c.hugetlbfs.dir_2m = Some(dir);
    });
    std::fs::set_permissions(d.dir(), std::fs::Permissions::from_mode(0o711)).expect("chmod");
    let size = 4 * MIB;
    let (freed_r, freed_w) = nix::unistd::pipe().expect("pipe");
    let (go_r, go_w) = nix::unistd::pipe().expect("pipe");
    let socket = d.socket();
    let tenant = std::thread::spawn(move || {
        in_child(Some(NOBODY), move || {
            // An early failure is reported through the pipe the parent waits on.
            let fail = |code: u64| {
                let _ = nix::unistd::write(&freed_w, &code.to_le_bytes());
                i32::try_from(code).unwrap_or(99)
            };
            let Ok(mut c) = Client::connect(&socket) else {
                return fail(10);
            };
            let Ok(a) = c.alloc(alloc_2m(size, true)) else {
                return fail(11);
            };
            let Some(path) = a.paths.first().cloned() else {
                return fail(12);
            };
            // The tenant's own file while it uses it: it opens it by path and
            // opens it up to everyone.
            let Ok(f) = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
            else {
                return fail(13);
            };
            if std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).is_err() {
                return fail(14);
            }
            drop(f);
            let id = a.id;
            drop(a);
            if c.free(id).is_err() {
                return fail(15);
            }
            let tries = |code| match std::fs::OpenOptions::new().read(true).open(&path) {
                Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => 0,
                _ => code,
            };
            let first = tries(30);
            let _ = fail(0);
            let mut b = [0u8; 1];
            let _ = nix::unistd::read(&go_r, &mut b);
            if first != 0 {
                return first;
            }
            tries(31)
        })
    });
    let early = read_u64(&freed_r);
    if early != 0 {
        panic!(
            "tenant A failed with code {}",
            tenant.join().expect("tenant A thread")
        );
    }
    wait_until("A's region is clean in the pool", SETTLE, || {
        d.stats().pool_sum(|p| p.clean_bytes) == size
    });
    let mut b = d.client();
    let alloc = b.alloc(alloc_2m(size, true)).expect("B allocates");
    assert_eq!(d.stats().counters.regions_pooled, 1, "B got A's file");
    let path = alloc.paths.first().cloned().expect("a path");
    let meta = std::fs::metadata(&path).expect("stat");
    assert_eq!(
        (
            std::os::unix::fs::MetadataExt::uid(&meta),
            meta.permissions().mode() & 0o777
        ),
        (0, 0o600),
        "the daemon took the file back and reset its mode"
    );
    let _ = nix::unistd::write(&go_w, b"g");
    let code = tenant.join().expect("tenant A thread");
    assert_eq!(
        code, 0,
        "tenant A (30: it opened its path after FREE, 31: after B got the file)"
    );
    b.free(alloc.id).expect("B frees");
    d.shutdown();
    drop(mount);
}

/// A 2 MiB hugetlbfs mounted on a temporary directory, mode 0711; unmounted
/// (lazily) on drop.
struct SearchableHugetlbfs {
    dir: tempfile::TempDir,
}

impl SearchableHugetlbfs {
    fn mount() -> Option<Self> {
        let dir = tempfile::tempdir().expect("tempdir");
        let target = CString::new(dir.path().as_os_str().as_encoded_bytes()).expect("path");
        let fstype = CString::new("hugetlbfs").expect("fstype");
        let opts = CString::new("pagesize=2M,mode=0711").expect("options");
        // SAFETY: mount(2) with valid C strings that live across the call.
        let r = unsafe {
            libc::mount(
                fstype.as_ptr(),
                target.as_ptr(),
                fstype.as_ptr(),
                0,
                opts.as_ptr().cast(),
            )
        };
        if r != 0 {
            test_support::skip!(
                "cannot mount a hugetlbfs of 2 MiB pages: {}",
                std::io::Error::last_os_error()
            );
            return None;
        }
        // The temporary directory's parent must be traversable too.
        let _ = std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711));
        Some(Self { dir })
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for SearchableHugetlbfs {
    fn drop(&mut self) {
        if let Ok(target) = CString::new(self.dir.path().as_os_str().as_encoded_bytes()) {
            // SAFETY: umount2 with a valid C string.
            unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
        }
    }
}
