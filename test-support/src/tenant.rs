//! The tenant harness of the hostile-tenant tests: forked tenant processes
//! (as root or another uid), the secrets they write, and the checks that no
//! byte of one reaches another.

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::time::Duration;

use backend::client::Client;
use backend::proto::{AllocRequest, ClearMode, PagePolicy};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{fork, ForkResult};

use crate::daemon::{wait_until, TestDaemon};
use crate::hugepages::hugepages_2m;
use crate::map::{map_raw as map, unmap_raw as unmap};

/// The uid the unprivileged tenants run as.
pub const NOBODY: u32 = 65534;

/// Runs `child` in a forked process as `uid` (when given) and returns its
/// exit code. The child only makes syscalls and exits with `_exit`.
///
/// The daemon of these tests runs in this process, so a plain fork would
/// hand the child a copy of every region fd the daemon (and the test) has
/// open: the holder scan then rightly sees the child holding regions it
/// never asked for, and an ALLOC of the child can wait on a region it holds
/// itself (a CI failure once). A real tenant is a process of its own, so
/// the child first closes every inherited region fd (the daemon's mappings
/// are `MADV_DONTFORK`); every child here gets its regions after the fork.
pub fn in_child(uid: Option<u32>, child: impl FnOnce() -> i32) -> i32 {
    // SAFETY: the child only runs `child` (plain syscalls through nix/libc on
    // data prepared before the fork) and leaves with `_exit`, never
    // returning into the test harness or running destructors.
    match unsafe { fork() }.expect("fork") {
        ForkResult::Child => {
            // A child stuck on a pipe its failed parent never writes ends
            // with SIGALRM instead of lingering.
            // SAFETY: alarm is async-signal-safe and takes an integer.
            unsafe { libc::alarm(60) };
            close_inherited_region_fds();
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

/// Closes every fd of this (just forked) process that names a daemon
/// region's file (a memfd or hugetlbfs file called `hugemem-r<id>`) or the
/// test's held-back pages (`guest_mem::Ballast`, whose reservation must go
/// when the test lets it go).
fn close_inherited_region_fds() {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    let fds: Vec<i32> = dir
        .filter_map(Result::ok)
        .filter(|e| {
            std::fs::read_link(e.path()).is_ok_and(|t| {
                let t = t.to_string_lossy();
                t.contains("hugemem-r") || t.contains("hugemem-ballast")
            })
        })
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    for fd in fds {
        // SAFETY: an fd this child inherited and that nothing in the child
        // uses (every child gets its own regions after the fork).
        unsafe { libc::close(fd) };
    }
}

/// True when running as root: the tests that act as another uid (`setuid`)
/// and read other processes' fds need it; they skip otherwise.
pub fn root_or_skip() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        true
    } else {
        crate::skip!("needs root (setuid to tenant uids, /proc of other processes)");
        false
    }
}

/// One MiB.
pub const MIB: u64 = 1 << 20;
/// What tenant A writes everywhere it can; B must never read it.
pub const SECRET: u8 = 0xA5;

/// An eager ALLOC of `size` bytes of 2 MiB pages, with hugetlbfs paths
/// when `paths`.
pub fn alloc_2m(size: u64, paths: bool) -> AllocRequest {
    AllocRequest {
        total_size: size,
        page_policy: PagePolicy::Huge2M,
        clear_mode: ClearMode::Eager,
        lock: false,
        parts: Vec::new(),
        want_paths: paths,
    }
}

/// Fills `len` bytes at `p` (a live mapping of at least that) with SECRET.
// Safe to call by contract of this test harness: every caller passes a
// mapping it just made with `map_raw` (a forked child reports a failure by
// exit code, so the helpers stay plain functions).
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn fill_secret(p: *mut u8, len: u64) {
    // SAFETY: the caller's live read-write mapping of at least `len` bytes.
    unsafe { std::ptr::write_bytes(p, SECRET, usize::try_from(len).expect("len")) };
}

/// Tenant B: allocates `size` bytes like A did and checks that its file has
/// exactly that size and that not one byte of A's is in it.
pub fn tenant_b_sees_nothing(d: &TestDaemon, size: u64, paths: bool) {
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
pub fn assert_hugepages_balanced(d: TestDaemon, free_before: u64) {
    d.shutdown();
    wait_until(
        &format!("HugePages_Free (2 MiB) returns to {free_before}"),
        Duration::from_secs(30),
        || hugepages_2m("free_hugepages") >= free_before,
    );
}

/// Runs tenant A in a forked child (root, or `uid`): connects, allocates
/// `size` bytes, hands the allocation to `attack` (which returns its exit
/// code), then the child FREEs and exits.
pub fn tenant_a(
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
        let a = match c.alloc(alloc_2m(size, paths)) {
            Ok(a) => a,
            Err(e) => {
                say(&format!("tenant A refused: {e}"));
                return 11;
            }
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

/// In a forked tenant: connects to `socket`, allocates `size` bytes on
/// 2 MiB pages, maps the allocation's first fd and fills it with A's
/// secret. The client (its connection owns the allocation), the allocation
/// and the mapping; or the child's exit code: 10 no connection, 11 ALLOC
/// refused, 12 mmap failed.
pub fn secret_tenant(
    socket: &std::path::Path,
    size: u64,
) -> Result<(Client, backend::client::Allocation, *mut u8), i32> {
    let mut c = Client::connect(socket).map_err(|_| 10)?;
    let a = c.alloc(alloc_2m(size, false)).map_err(|_| 11)?;
    let p = map(a.fds[0].as_raw_fd(), size);
    if p.is_null() {
        return Err(12);
    }
    fill_secret(p, size);
    Ok((c, a, p))
}

/// Writes `msg` and a newline to the test's stderr from a forked child:
/// straight to fd 2, taking no lock a thread of the parent may have held at
/// the fork.
pub fn say(msg: &str) {
    let line = format!("{msg}\n");
    let _ = nix::unistd::write(std::io::stderr(), line.as_bytes());
}

/// Tenant B's secret.
pub const B_SECRET: u8 = 0x5B;

/// The next little-endian `u64` read from the pipe `fd`; panics when it closes first.
pub fn read_u64(fd: &OwnedFd) -> u64 {
    let mut b = [0u8; 8];
    let mut got = 0;
    while got < 8 {
        match nix::unistd::read(fd, &mut b[got..]) {
            Ok(0) | Err(_) => panic!("pipe closed after {got} bytes"),
            Ok(n) => got += n,
        }
    }
    u64::from_le_bytes(b)
}

/// A 2 MiB hugetlb memfd of one page, or `None` where there is none.
pub fn memfd_2m() -> Option<OwnedFd> {
    let name = CString::new("hostile-lease").expect("name");
    // SAFETY: memfd_create with a valid C string; returns a new fd or -1.
    let fd = unsafe {
        libc::memfd_create(
            name.as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_HUGETLB | libc::MFD_HUGE_2MB,
        )
    };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
    let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    // SAFETY: ftruncate on our own fd.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), (2 * MIB) as libc::off_t) } != 0 {
        return None;
    }
    Some(fd)
}
