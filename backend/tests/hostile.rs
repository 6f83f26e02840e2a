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

mod common;
use common::{serial, wait_until, TestDaemon};

use std::ffi::CString;
use std::io::IoSlice;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use backend::client::Client;
use backend::proto::{AllocRequest, ClearMode, Code, Header, PagePolicy, HEADER_SIZE, MAX_FDS};
use guest_mem::PageSize;
use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{fork, ForkResult};
use serde_json::Value;

/// The uid the unprivileged tenants run as.
const NOBODY: u32 = 65534;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .count()
}

/// Waits until the daemon's (this process's) fd table is back at `baseline`.
fn assert_fds_back_to(baseline: usize, what: &str) {
    wait_until(
        &format!("the daemon's fd count returns to {baseline} after {what}"),
        Duration::from_secs(10),
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

/// Runs `child` in a forked process as `uid` (when given) and returns its
/// exit code. The child only makes syscalls and exits with `_exit`.
fn in_child(uid: Option<u32>, child: impl FnOnce() -> i32) -> i32 {
    // SAFETY: the child only runs `child` (plain syscalls through nix/libc on
    // data prepared before the fork) and leaves with `_exit`, never
    // returning into the test harness or running destructors.
    match unsafe { fork() }.expect("fork") {
        ForkResult::Child => {
            let code = match uid {
                Some(uid) => {
                    // SAFETY: setgid is a plain syscall on an integer.
                    let gid_ok = unsafe { libc::setgid(uid) } == 0;
                    // SAFETY: setuid is a plain syscall on an integer.
                    let ok = gid_ok && unsafe { libc::setuid(uid) } == 0;
                    if ok {
                        child()
                    } else {
                        90
                    }
                }
                None => child(),
            };
            // SAFETY: ends the forked child without unwinding into the
            // parent's copy of the test harness.
            unsafe { libc::_exit(code) }
        }
        ForkResult::Parent { child } => match waitpid(child, None).expect("waitpid") {
            WaitStatus::Exited(_, code) => code,
            other => panic!("tenant child ended with {other:?}"),
        },
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
    assert_eq!(stats["allocations"]["active"].as_u64(), Some(0), "{stats}");
    assert!(
        d.stats()["counters"]["peers_refused"].as_u64() >= Some(20),
        "{}",
        d.stats()
    );
    drop(c);
    let _ = payload.as_fd();
    d.shutdown();
}

const MIB: u64 = 1 << 20;
/// What tenant A writes everywhere it can; B must never read it.
const SECRET: u8 = 0xA5;

fn hugepages_2m(what: &str) -> u64 {
    let path = format!("/sys/kernel/mm/hugepages/hugepages-2048kB/{what}");
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .trim()
        .parse()
        .expect("page count")
}

/// Reserves `n` free 2 MiB pages; false (after a recorded skip) when the
/// host cannot give them.
fn reserve_2m(n: u64) -> bool {
    match guest_mem::ensure_free(PageSize::Huge2M, n, None) {
        Ok(r) if r.met => true,
        Ok(r) => {
            test_support::skip!("only {} free 2 MiB pages, {n} needed", r.free);
            false
        }
        Err(e) => {
            test_support::skip!("cannot reserve 2 MiB pages: {e}");
            false
        }
    }
}

fn alloc_2m(size: u64, paths: bool) -> AllocRequest {
    AllocRequest {
        total_size: size,
        page_policy: PagePolicy::Huge2M,
        clear_mode: ClearMode::Eager,
        lock: false,
        parts: Vec::new(),
        want_paths: paths,
    }
}

fn counter(stats: &Value, name: &str) -> u64 {
    stats["counters"][name]
        .as_u64()
        .unwrap_or_else(|| panic!("counter {name} missing: {stats}"))
}

/// `mmap(MAP_SHARED)` of `len` bytes of `fd`, or null.
fn map(fd: RawFd, len: u64) -> *mut u8 {
    // SAFETY: a fresh shared mapping chosen by the kernel; aliases nothing.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            usize::try_from(len).expect("len"),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        std::ptr::null_mut()
    } else {
        p.cast()
    }
}

fn unmap(p: *mut u8, len: u64) {
    // SAFETY: `p` is a mapping of `len` bytes this test made with `map`.
    unsafe { libc::munmap(p.cast(), usize::try_from(len).expect("len")) };
}

/// Fills `len` bytes at `p` (a live mapping of at least that) with SECRET.
fn fill_secret(p: *mut u8, len: u64) {
    // SAFETY: the caller's live read-write mapping of at least `len` bytes.
    unsafe { std::ptr::write_bytes(p, SECRET, usize::try_from(len).expect("len")) };
}

/// Tenant B: allocates `size` bytes like A did and checks that its file has
/// exactly that size and that not one byte of A's is in it.
fn tenant_b_sees_nothing(d: &TestDaemon, size: u64, paths: bool) {
    let mut b = d.client();
    let a = b.alloc(alloc_2m(size, paths)).expect("tenant B allocates");
    for (fd, info) in a.fds.iter().zip(&a.regions) {
        let st = nix::sys::stat::fstat(fd.as_fd()).expect("fstat");
        assert_eq!(
            u64::try_from(st.st_size).expect("size"),
            info.size,
            "B's file is not the size of its region"
        );
        let p = map(fd.as_raw_fd(), info.size);
        assert!(!p.is_null(), "B maps its region");
        // SAFETY: B's live mapping of info.size bytes; nobody writes it now.
        let bytes = unsafe { std::slice::from_raw_parts(p, info.size as usize) };
        let leaked = bytes.iter().filter(|&&b| b != 0).count();
        unmap(p, info.size);
        assert_eq!(leaked, 0, "B's fresh region holds {leaked} non-zero bytes");
    }
    b.free(a.id).expect("B frees");
}

/// Shuts the daemon down and waits until the host's free 2 MiB pages are
/// back where they were before the test started it.
fn assert_hugepages_balanced(d: TestDaemon, free_before: u64) {
    d.shutdown();
    wait_until(
        &format!("HugePages_Free (2 MiB) returns to {free_before}"),
        Duration::from_secs(10),
        || hugepages_2m("free_hugepages") >= free_before,
    );
}

/// Runs tenant A in a forked child (root, or `uid`): connects, allocates
/// `size` bytes, hands the allocation to `attack` (which returns its exit
/// code), then the child FREEs and exits.
fn tenant_a(
    d: &TestDaemon,
    uid: Option<u32>,
    size: u64,
    paths: bool,
    attack: impl FnOnce(&backend::client::Allocation) -> i32,
) -> i32 {
    let socket = d.socket();
    in_child(uid, move || {
        let Ok(mut c) = Client::connect(&socket) else {
            return 10;
        };
        let Ok(a) = c.alloc(alloc_2m(size, paths)) else {
            return 11;
        };
        let code = attack(&a);
        if code != 0 {
            return code;
        }
        let id = a.id;
        drop(a);
        if c.free(id).is_err() {
            return 12;
        }
        0
    })
}

fn wait_discarded(d: &TestDaemon, n: u64) {
    wait_until(
        &format!("{n} damaged region(s) discarded"),
        Duration::from_secs(10),
        || counter(&d.stats(), "regions_discarded") >= n,
    );
    wait_until("the quarantine is empty", Duration::from_secs(10), || {
        d.stats()["pools"]
            .as_array()
            .is_none_or(|p| p.iter().all(|k| k["quarantined_bytes"].as_u64() == Some(0)))
    });
}

/// A grows its memfd past the region (the seals allow growing), writes past
/// the end, FREEs. The region must be discarded, not pooled: B gets a file
/// of exactly its size with none of A's bytes, and every page comes back.
#[test]
fn a_grown_file_is_discarded_not_served() {
    let _g = serial();
    if !reserve_2m(8) {
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
    if !reserve_2m(8) {
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
    if !reserve_2m(12) {
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
    wait_until(
        "the region is clean in the pool",
        Duration::from_secs(10),
        || {
            d.stats()["pools"]
                .as_array()
                .is_some_and(|p| p.iter().any(|k| k["clean_bytes"].as_u64() == Some(size)))
        },
    );
    assert_eq!(counter(&d.stats(), "regions_discarded"), 0);
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
