//! A shared clone's VMM running as a non-root uid against the real daemon
//! in this process: it holds read-only fds of its template, and the
//! kernel checks a new open of the file (`/proc/self/fd/N`) against the
//! inode's owner and mode, not against that fd. The template's files are
//! the daemon's, mode 0444, while it is parked, so every way to write them
//! is refused: open `O_RDWR` or `O_WRONLY`, `fchmod`, `fchown`, a shared
//! writable mapping. Its bytes stay. While the same uid uses memory (an
//! ALLOC, a RESTORE) the files are its own, mode 0600, so a VMM of that
//! uid opens them again for writing (as QEMU does); released, they are
//! the daemon's again. A takeover keeps a template read-only.
//!
//! The tenant here is uid 65534, played by a thread of this process whose
//! effective ids are switched with the raw `setresuid`/`setresgid`
//! syscalls: Linux keeps credentials per thread, so the daemon's threads
//! stay root, and what the thread connects (`SO_PEERCRED`), creates and
//! opens is uid 65534's.
//!
//! The tests are serialized (`serial`): they share the host's huge pages.

mod park_peer;

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use backend::client::Client;
use backend::daemon::{restart::takeover, Config, Daemon};
use backend::proto::CloneMode;
use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;
use park_peer::clones::*;
use park_peer::*;
use test_support::prelude::{reserve_2m, serial, wait_until};
use test_support::tenant::{alloc_2m, root_or_skip, NOBODY};

const SIZE: u64 = 4 << 20;

/// Runs `f` on a thread of its own whose effective uid and gid are `uid`
/// and that has no supplementary groups (raw syscalls: only that thread's
/// credentials change; libc's wrappers would change every thread's).
fn as_uid<T: Send>(uid: u32, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            let keep = libc::c_long::from(-1i32);
            let id = libc::c_long::from(uid);
            let empty = std::ptr::null::<libc::gid_t>();
            // SAFETY: a raw syscall on this thread's credentials only, with
            // integers (-1 keeps the real and saved ids) and, for
            // setgroups, an empty list; the same for the two below.
            let no_groups = unsafe { libc::syscall(libc::SYS_setgroups, 0, empty) };
            // SAFETY: as above.
            let gid_set = unsafe { libc::syscall(libc::SYS_setresgid, keep, id, keep) };
            // SAFETY: as above.
            let uid_set = unsafe { libc::syscall(libc::SYS_setresuid, keep, id, keep) };
            let switched = no_groups == 0 && gid_set == 0 && uid_set == 0;
            assert!(
                switched,
                "switch the thread to uid {uid}: {}",
                std::io::Error::last_os_error()
            );
            f()
        })
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
    })
}

/// A new open of the file behind `fd` (`/proc/self/fd/N`), as a VMM's
/// `mem-path=/dev/fd/N` makes it.
fn reopen(fd: &impl AsFd, flags: OFlag) -> nix::Result<OwnedFd> {
    let path = format!("/proc/self/fd/{}", fd.as_fd().as_raw_fd());
    nix::fcntl::open(path.as_str(), flags | OFlag::O_CLOEXEC, Mode::empty())
}

/// The file's owner and permission bits.
fn owner_and_mode(fd: &impl AsFd) -> (u32, u32) {
    let st = nix::sys::stat::fstat(fd.as_fd()).expect("fstat");
    (st.st_uid, st.st_mode & 0o7777)
}

/// `mmap(PROT_READ|PROT_WRITE, MAP_SHARED)` of `fd`: its errno, or 0 when
/// it was mapped (and at once unmapped).
fn shared_writable_mapping(fd: &impl AsFd) -> Errno {
    let len = usize::try_from(SIZE).expect("size");
    // SAFETY: a mapping attempt that must fail; nothing is mapped when it
    // does, and a success is unmapped at once.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_fd().as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Errno::last();
    }
    // SAFETY: the mapping just made.
    unsafe { libc::munmap(p, len) };
    Errno::UnknownErrno
}

/// Every way a clone's VMM of uid `NOBODY` may try to write its template
/// through the read-only fd `fd` is refused, and the template keeps the
/// pattern; a private copy-on-write mapping (what the clone runs on)
/// works.
fn clone_cannot_write(fd: &OwnedFd, case: &str) {
    assert_eq!(
        owner_and_mode(fd),
        (0, 0o444),
        "{case}: the template's file"
    );
    for flags in [OFlag::O_RDWR, OFlag::O_WRONLY] {
        assert_eq!(
            reopen(fd, flags).err(),
            Some(Errno::EACCES),
            "{case}: open {flags:?}"
        );
    }
    let read_only = reopen(fd, OFlag::O_RDONLY)
        .unwrap_or_else(|e| panic!("{case}: open read-only (cloud-hypervisor's /dev/fd/N): {e}"));
    for (what, fd) in [
        ("the fd CLONE sent", fd),
        ("a read-only reopen", &read_only),
    ] {
        assert_eq!(
            nix::sys::stat::fchmod(fd.as_fd(), Mode::from_bits_truncate(0o666)),
            Err(Errno::EPERM),
            "{case}: fchmod of {what}"
        );
        assert_eq!(
            nix::unistd::fchown(fd.as_fd(), Some(NOBODY.into()), None),
            Err(Errno::EPERM),
            "{case}: fchown of {what}"
        );
        assert_eq!(
            shared_writable_mapping(fd),
            Errno::EACCES,
            "{case}: a shared writable mapping of {what}"
        );
    }
    let mut private = Private::of(fd, SIZE);
    private.bytes()[0] = !pattern(0);
    assert!(
        holds_pattern(fd, 0, SIZE, 0),
        "{case}: the template changed"
    );
}

/// A daemon's socket directory and socket opened to every uid (the
/// daemon still checks `SO_PEERCRED` against its allowed uids).
fn open_to_all(dir: &Path, socket: &Path) {
    for (path, mode) in [(dir, 0o755), (socket, 0o777)] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }
}

fn connect(socket: &Path) -> Client {
    let c = Client::connect(socket).expect("connect");
    c.set_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    c
}

#[test]
fn a_clone_of_a_non_root_uid_cannot_write_its_template() {
    const TEST: &str = "a_clone_of_a_non_root_uid_cannot_write_its_template";
    let _g = serial();
    if !root_or_skip() || !reserve_2m(12, TEST) {
        return;
    }
    let d = daemon_for_two_uids();
    let socket: PathBuf = d.socket();
    as_uid(NOBODY, || {
        let mut owner = connect(&socket);
        let a = owner.alloc(alloc_2m(SIZE, false)).expect("ALLOC as 65534");
        // In use: its own, so its VMM opens it again for writing.
        assert_eq!(owner_and_mode(&a.fds[0]), (NOBODY, 0o600), "in use");
        let rw = reopen(&a.fds[0], OFlag::O_RDWR).expect("the tenant reopens its memory O_RDWR");
        fill_mapped(&rw, SIZE);
        drop(rw);
        let run = park_via(&mut owner, "tmpl", whole(&a.fds[0], SIZE));
        assert_eq!(run.result.expect("PARK").alloc_id, a.id, "moved");
        // Parked: the daemon's, read-only to all; 65534 cannot take it back.
        assert_eq!(owner_and_mode(&a.fds[0]), (0, 0o444), "parked");
        assert_eq!(
            reopen(&a.fds[0], OFlag::O_RDWR).err(),
            Some(Errno::EACCES),
            "the parking VMM's fd reopened O_RDWR"
        );
        drop(a);

        let mut cloner = connect(&socket);
        let (r, snap) = clone_via(&mut cloner, "tmpl", CloneMode::Shared);
        r.expect("CLONE as 65534");
        let snap = snap.expect("the template");
        clone_cannot_write(&snap.memory[0].1, "a running clone");
        drop((snap, cloner));
        wait_until(
            "the clone no longer counts",
            Duration::from_secs(10),
            || connect(&socket).stats().expect("STATS").parked[0].shared_clones == 0,
        );

        // RESTORE: the owner's again, written through a new open.
        let (restored, received) = restore_via(&mut owner, "tmpl");
        let restored = restored.expect("RESTORE by the template's owner");
        let received = received.expect("the fake receiver got the VM");
        let memory = &received.memory[0].1;
        assert_eq!(owner_and_mode(memory), (NOBODY, 0o600), "restored");
        assert!(holds_pattern(memory, 0, SIZE, 0), "the VM's bytes");
        let rw = reopen(memory, OFlag::O_RDWR).expect("the restored VM's memory reopened O_RDWR");
        let p = test_support::prelude::map_raw(rw.as_raw_fd(), SIZE);
        assert!(!p.is_null(), "a shared writable mapping of the restored VM");
        // SAFETY: `p` is this test's live shared mapping of SIZE bytes.
        unsafe { p.write(!pattern(0)) };
        test_support::prelude::unmap_raw(p, SIZE);
        assert_eq!(read_at(memory, 0, 1), vec![!pattern(0)], "written");
        // Released: the daemon's again, before quarantine.
        owner.free(restored.id).expect("FREE");
        assert_eq!(owner_and_mode(memory), (0, 0o600), "released");
        assert_eq!(
            reopen(memory, OFlag::O_RDWR).err(),
            Some(Errno::EACCES),
            "a released region reopened O_RDWR"
        );
        drop((restored, received, rw));
    });
    wait_until("the memory released", Duration::from_secs(10), || {
        d.stats().allocations.active == 0
    });
    assert_serves_balanced(&d, 0, 0, "at the end");
}

/// A takeover keeps a template read-only: its successor makes it so
/// again even where its predecessor left it writable (a version before
/// templates were read-only; here, root's `fchmod 0777`).
#[test]
fn a_template_stays_read_only_across_a_takeover() {
    const TEST: &str = "a_template_stays_read_only_across_a_takeover";
    let _g = serial();
    if !root_or_skip() || !reserve_2m(12, TEST) {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = Config {
        socket: dir.path().join("hugemem.sock"),
        allowed_uids: vec![0, NOBODY],
        ..Config::default()
    };
    cfg.pool.recheck_ms = 50;
    let old = Daemon::start(cfg.clone()).expect("daemon starts");
    open_to_all(dir.path(), &cfg.socket);
    let socket = cfg.socket.clone();
    let parked = as_uid(NOBODY, || {
        let mut owner = connect(&socket);
        let a = owner.alloc(alloc_2m(SIZE, false)).expect("ALLOC as 65534");
        fill_mapped(&a.fds[0], SIZE);
        park_via(&mut owner, "tmpl", whole(&a.fds[0], SIZE))
            .result
            .expect("PARK");
        let (r, snap) = clone_via(&mut connect(&socket), "tmpl", CloneMode::Shared);
        r.expect("CLONE");
        snap.expect("the template").memory.remove(0).1
    });
    nix::sys::stat::fchmod(parked.as_fd(), Mode::from_bits_truncate(0o777)).expect("root's fchmod");

    let inherited = takeover::receive(&cfg.socket).expect("takeover: state received");
    let new = Daemon::start_inherited(cfg.clone(), inherited).expect("the successor starts");
    old.shutdown().expect("the predecessor exits");
    assert_eq!(new.stats().parked.len(), 1, "still parked");
    as_uid(NOBODY, || clone_cannot_write(&parked, "after a takeover"));
    drop(parked);
    as_uid(NOBODY, || {
        let mut owner = connect(&socket);
        wait_until("UNPARK", Duration::from_secs(10), || {
            owner.unpark("tmpl").is_ok()
        });
    });
    wait_until("nothing parked", Duration::from_secs(10), || {
        new.stats().parked.is_empty()
    });
    new.shutdown().expect("the successor exits");
}
