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

use backend::proto::{Code, Header, HEADER_SIZE, MAX_FDS};
use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{fork, ForkResult};

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
