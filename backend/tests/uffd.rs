//! `backend::uffd` against the real kernel: handshake, MINOR faults on
//! hugetlbfs served with `UFFDIO_CONTINUE` (in one process and across a
//! VMM/daemon process split with the uffd passed over `SCM_RIGHTS`), MISSING
//! vs MINOR on fresh pages, `EEXIST`, and what closing the uffd does to a
//! waiting fault.
//!
//! Huge pages are reserved with `guest_mem::ensure_free`; without them (or
//! without `UFFD_FEATURE_MINOR_HUGETLBFS`) a test prints `SKIP:` and passes.
//! Every wait has a deadline; a failing test never leaves a thread or child
//! blocked in a fault for good (mappings are kept alive by the faulting
//! thread, children are killed on drop).
//!
//! Two tests re-execute this binary as a child (`HUGEMEM_UFFD_ROLE`): the
//! cross-process test, and the close test, whose child might die of SIGBUS.

use test_support::prelude::Map;

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use backend::proto::socket::{recv_some, send_all};
use backend::uffd::{
    abi, CreateFlags, FaultKind, Features, Fill, PageFault, RegisterMode, Uffd, UffdError,
    UffdEvent,
};

const HUGE: usize = 2 << 20;
const HUGE_U64: u64 = 2 << 20;
const DEADLINE: Duration = Duration::from_secs(20);
const ROLE_ENV: &str = "HUGEMEM_UFFD_ROLE";
/// The fd number the child finds its socket at.
const CHILD_SOCK_FD: i32 = 3;

// ---------------------------------------------------------------------------
// Helpers.

/// Reserves enough free 2 MiB pages once per test process.
fn huge_pages() -> Result<(), String> {
    static RESERVED: OnceLock<Result<(), String>> = OnceLock::new();
    RESERVED
        .get_or_init(|| test_support::hugepages::free_pages(guest_mem::PageSize::Huge2M, 16, None))
        .clone()
}

/// A fresh uffd after the handshake, or the reason to skip.
fn uffd_with(features: u64) -> Result<Uffd, String> {
    let uffd = Uffd::new(CreateFlags::new()).map_err(|e| format!("no userfaultfd: {e}"))?;
    let info = uffd.api(features).map_err(|e| format!("handshake: {e}"))?;
    if !info.available.contains(abi::UFFD_FEATURE_MINOR_HUGETLBFS) {
        return Err(format!(
            "kernel lacks MINOR_HUGETLBFS (offers {})",
            info.available
        ));
    }
    Ok(uffd)
}

/// Runs the preconditions; records a skip and returns `None` when unmet.
fn setup(test: &str, features: u64) -> Option<Uffd> {
    match huge_pages().and_then(|()| uffd_with(features)) {
        Ok(uffd) => Some(uffd),
        Err(reason) => {
            test_support::skip!("{test}: {reason}");
            None
        }
    }
}

/// A hugetlb memfd of `pages` 2 MiB pages.
fn huge_memfd(pages: usize) -> OwnedFd {
    let name = c"uffd-test";
    // SAFETY: `name` is a NUL-terminated literal; memfd_create returns a new fd or -1.
    let fd = unsafe {
        libc::memfd_create(
            name.as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_HUGETLB | libc::MFD_HUGE_2MB,
        )
    };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: memfd_create just returned `fd`; nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let len = i64::try_from(pages * HUGE).expect("small");
    // SAFETY: ftruncate on an fd we own; no memory is passed.
    let rc = unsafe { libc::ftruncate(fd.as_raw_fd(), len) };
    assert_eq!(rc, 0, "ftruncate: {}", std::io::Error::last_os_error());
    fd
}

/// A thread that reads (or writes `value` to) `map[off]`, probably blocking
/// in a fault; it reports its tid first and the byte it saw last. It holds
/// the mapping, so a failing test cannot unmap under it.
struct Toucher {
    tid: u32,
    done: Receiver<u8>,
}

fn touch(map: &Arc<Map>, off: usize, write: Option<u8>) -> Toucher {
    let map = Arc::clone(map);
    let (tid_tx, tid_rx) = mpsc::channel();
    let (done_tx, done) = mpsc::channel();
    std::thread::spawn(move || {
        // SAFETY: gettid has no arguments and cannot fail.
        let tid = unsafe { libc::gettid() };
        let _ = tid_tx.send(u32::try_from(tid).expect("tids are positive"));
        if let Some(v) = write {
            map.write(off, v);
        }
        let _ = done_tx.send(map.read(off));
    });
    let tid = tid_rx
        .recv_timeout(DEADLINE)
        .expect("toucher thread started");
    Toucher { tid, done }
}

impl Toucher {
    fn finished(&self) -> u8 {
        self.done
            .recv_timeout(DEADLINE)
            .expect("faulting thread resumed before the deadline")
    }
}

/// Waits (with the deadline) for the next event, which must be a page fault.
fn next_fault(uffd: &Uffd) -> PageFault {
    assert!(
        uffd.wait_readable(Some(DEADLINE)).expect("poll"),
        "no fault event before the deadline"
    );
    match uffd.read_event().expect("read") {
        Some(UffdEvent::PageFault(pf)) => pf,
        other => panic!("expected a page fault, got {other:?}"),
    }
}

fn errno_of(e: &UffdError) -> Option<i32> {
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<std::io::Error>())
        .and_then(std::io::Error::raw_os_error)
}

/// Kills and reaps the child unless it was waited for.
struct ChildGuard(Option<Child>);

impl ChildGuard {
    fn wait_output(mut self) -> std::process::Output {
        self.0
            .take()
            .expect("child")
            .wait_with_output()
            .expect("wait for child")
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Re-executes this test binary running only `test` with `ROLE_ENV=role`,
/// with `sock` as fd 3 (if any), as user `nobody` if asked, stdout captured.
fn spawn_role(test: &str, role: &str, sock: Option<&OwnedFd>, as_nobody: bool) -> ChildGuard {
    let exe = std::env::current_exe().expect("current exe");
    let mut cmd = Command::new(exe);
    cmd.args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(ROLE_ENV, role)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if as_nobody {
        // std drops supplementary groups too when root changes uid.
        cmd.uid(65534).gid(65534);
    }
    if let Some(sock) = sock {
        let raw = sock.as_raw_fd();
        let hook = move || {
            // SAFETY: `raw` is the parent's socket, still open in the forked
            // child; dup2 only copies a descriptor and clears CLOEXEC on the
            // copy, so the socket survives exec as fd 3.
            if unsafe { libc::dup2(raw, CHILD_SOCK_FD) } < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        };
        // SAFETY: the hook runs between fork and exec and calls only dup2,
        // which is async-signal-safe and allocates nothing.
        unsafe { cmd.pre_exec(hook) };
    }
    ChildGuard(Some(cmd.spawn().expect("spawn child")))
}

/// Which role this process plays (children only).
fn role() -> Option<String> {
    std::env::var(ROLE_ENV).ok()
}

/// Waits until `fd` is readable or the deadline passes.
fn readable(fd: BorrowedFd<'_>, timeout: Duration) -> bool {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: one live pollfd, count 1.
    unsafe { libc::poll(&mut pfd, 1, ms) > 0 }
}

/// Receives exactly `n` bytes (plus any fds) before the deadline.
fn recv_exact(sock: BorrowedFd<'_>, n: usize, fds: &mut Vec<OwnedFd>) -> Vec<u8> {
    let deadline = Instant::now() + DEADLINE;
    let mut out = vec![0u8; n];
    let mut got = 0;
    while got < n {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            readable(sock, left),
            "peer sent nothing before the deadline"
        );
        let k = recv_some(sock, &mut out[got..], fds, true).expect("recv");
        assert_ne!(k, 0, "peer closed the socket");
        got += k;
    }
    out
}

/// A child's stdout line saying it could not run its part (the parent
/// records the skip through `test_support::skip!`).
const CHILD_CANNOT_RUN: &str = "CHILD-CANNOT-RUN:";

/// Echoes the child's `OBSERVED:`/[`CHILD_CANNOT_RUN`] notes (the test
/// harness prints them after "test name ... " on the same line).
fn print_child_notes(stdout: &str) {
    for line in stdout.lines() {
        if let Some(at) = line
            .find("OBSERVED:")
            .or_else(|| line.find(CHILD_CANNOT_RUN))
        {
            println!("child: {}", &line[at..]);
        }
    }
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

// ---------------------------------------------------------------------------
// Handshake.

#[test]
fn api_handshake_reports_minor_hugetlbfs() {
    let uffd = Uffd::new(CreateFlags::new()).expect("userfaultfd");
    let info = uffd.api(abi::UFFD_FEATURE_THREAD_ID).expect("UFFDIO_API");
    println!(
        "OBSERVED: UFFDIO_API features {:#x} = {}",
        info.available.0, info.available
    );
    println!("OBSERVED: UFFDIO_API ioctls {:#x}", info.ioctls);
    if !info.available.contains(abi::UFFD_FEATURE_MINOR_HUGETLBFS) {
        test_support::skip!("kernel lacks MINOR_HUGETLBFS");
        return;
    }
    assert!(info
        .available
        .contains(abi::UFFD_FEATURE_MISSING_HUGETLBFS | abi::UFFD_FEATURE_THREAD_ID));
    assert_eq!(info.enabled, Features(abi::UFFD_FEATURE_THREAD_ID));
    for nr in [abi::NR_API, abi::NR_REGISTER, abi::NR_UNREGISTER] {
        assert_ne!(info.ioctls & (1 << nr), 0, "ioctl {nr:#x} missing");
    }
    // The fd advertises what the handshake enabled.
    let fdinfo = uffd.fdinfo().expect("fdinfo");
    assert_eq!(fdinfo.features, Features(abi::UFFD_FEATURE_THREAD_ID));
    assert_eq!((fdinfo.pending, fdinfo.total), (0, 0));
}

#[test]
fn api_names_missing_features() {
    let uffd = Uffd::new(CreateFlags::new()).expect("userfaultfd");
    let bogus = 1u64 << 40;
    match uffd.api(abi::UFFD_FEATURE_THREAD_ID | bogus) {
        Err(UffdError::MissingFeatures { missing, available }) => {
            assert_eq!(missing, Features(bogus));
            assert!(available.contains(abi::UFFD_FEATURE_THREAD_ID));
            let msg = UffdError::MissingFeatures { missing, available }.to_string();
            assert!(msg.contains("lacks features 0x10000000000"), "{msg}");
        }
        other => panic!("expected MissingFeatures, got {other:?}"),
    }
}

#[test]
fn api_twice_is_refused() {
    let uffd = Uffd::new(CreateFlags::new()).expect("userfaultfd");
    uffd.api(0).expect("first handshake");
    match uffd.api(0) {
        Err(e @ UffdError::Api(_)) => assert_eq!(errno_of(&e), Some(libc::EINVAL)),
        other => panic!("expected an Api error, got {other:?}"),
    }
}

#[test]
fn device_fallback_creates_working_uffd() {
    if !std::path::Path::new("/dev/userfaultfd").exists() {
        test_support::skip!("no /dev/userfaultfd");
        return;
    }
    let uffd = Uffd::new_via_device(CreateFlags::new()).expect("USERFAULTFD_IOC_NEW");
    let info = uffd.api(0).expect("handshake on the device's uffd");
    assert_ne!(info.available.0, 0);
    // It is a real uffd: the peer-side check accepts it.
    Uffd::from_owned_fd(uffd.into_owned_fd()).expect("is a userfaultfd");
}

#[test]
fn idle_uffd_has_no_event() {
    let uffd = Uffd::new(CreateFlags::new()).expect("userfaultfd");
    uffd.api(0).expect("handshake");
    assert!(!uffd
        .wait_readable(Some(Duration::from_millis(1)))
        .expect("poll"));
    assert!(uffd.read_event().expect("read").is_none());
}

const NOBODY_TEST: &str = "unprivileged_creation_tries_the_device";
const NOBODY_ROLE: &str = "nobody";

/// Without privilege and with `vm.unprivileged_userfaultfd = 0`, the syscall
/// is refused; `Uffd::new` then tries `/dev/userfaultfd` and reports both
/// errors. User-mode-only creation stays allowed (it is the opt-in).
#[test]
fn unprivileged_creation_tries_the_device() {
    if role().as_deref() == Some(NOBODY_ROLE) {
        return nobody_child();
    }
    if role().is_some() {
        return;
    }
    // SAFETY: geteuid has no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        test_support::skip!("{NOBODY_TEST}: needs root to switch to nobody");
        return;
    }
    let out = spawn_role(NOBODY_TEST, NOBODY_ROLE, None, true).wait_output();
    let stdout = String::from_utf8_lossy(&out.stdout);
    print_child_notes(&stdout);
    assert!(
        out.status.success(),
        "child failed: {:?}; stdout:\n{stdout}",
        out.status
    );
}

fn nobody_child() {
    let sysctl =
        std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd").unwrap_or_default();
    // What the kernel must do for this uid: userfaultfd(2) without
    // UFFD_USER_MODE_ONLY is allowed when the sysctl is 1; otherwise only the
    // device can give one, and only when this uid may open it.
    let sysctl_allows = sysctl.trim() == "1";
    let device_opens = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/userfaultfd")
        .is_ok();
    match Uffd::new(CreateFlags::new()) {
        Err(UffdError::CreateViaDevice { syscall, source }) => {
            println!(
                "OBSERVED: unprivileged (sysctl {}): userfaultfd(2) gave {syscall}, /dev/userfaultfd gave {source}",
                sysctl.trim()
            );
            assert_eq!(syscall.raw_os_error(), Some(libc::EPERM));
            assert!(
                !sysctl_allows && !device_opens,
                "creation failed although the sysctl is {} and the device opens: {device_opens}",
                sysctl.trim()
            );
        }
        Ok(_) => {
            println!(
                "OBSERVED: unprivileged creation worked (sysctl {}, device opens: {device_opens})",
                sysctl.trim()
            );
            assert!(
                sysctl_allows || device_opens,
                "an unprivileged uid got a kernel-mode uffd with the sysctl at {} and no usable device",
                sysctl.trim()
            );
        }
        Err(e) => panic!("unexpected error: {e:?}"),
    }
    let umo = Uffd::new(CreateFlags::new().user_mode_only())
        .expect("user-mode-only is allowed unprivileged");
    umo.api(0).expect("handshake");
}

// ---------------------------------------------------------------------------
// MINOR faults on hugetlbfs, one process.

/// The lazy-mode path: page in the page cache (stale marker), guest view
/// registered MINOR, the "daemon" clears it through its own view and
/// continues; the faulting thread sees the cleared data.
#[test]
fn minor_fault_served_with_continue() {
    let Some(uffd) = setup(
        "minor_fault_served_with_continue",
        abi::UFFD_FEATURE_THREAD_ID,
    ) else {
        return;
    };
    let memfd = huge_memfd(2);
    let daemon = Map::shared(memfd.as_fd(), 2 * HUGE);
    let guest = Map::shared(memfd.as_fd(), 2 * HUGE);
    daemon.fill(0, 2 * HUGE, 0xEE); // previous tenant's data, now in the page cache

    let ioctls = uffd
        .register(guest.addr(), 2 * HUGE_U64, RegisterMode::MINOR)
        .expect("register MINOR");
    assert!(
        ioctls.continue_() && ioctls.wake(),
        "ioctls {:#x}",
        ioctls.0
    );
    assert!(!ioctls.zeropage(), "hugetlbfs offers no ZEROPAGE");

    let off = HUGE + 0x12345;
    let t = touch(&guest, off, None);
    let pf = next_fault(&uffd);
    println!(
        "OBSERVED: read fault on a cached page: flags {:#x}, address {:#x} (touched {:#x})",
        pf.flags,
        pf.address,
        guest.addr() + off as u64
    );
    assert_eq!(pf.kind(), FaultKind::Minor);
    assert!(!pf.is_write());
    assert_eq!(pf.thread_id, t.tid);
    // Without EXACT_ADDRESS, hugetlbfs reports the huge page's start.
    assert_eq!(pf.address, guest.addr() + HUGE_U64);
    let page = pf.page_start(HUGE_U64);
    assert_eq!(page, guest.addr() + HUGE_U64);

    daemon.fill(HUGE, HUGE, 0x5A); // the "clear"
    assert_eq!(
        uffd.continue_range(page, HUGE_U64, true).expect("continue"),
        Fill::Done
    );
    assert_eq!(t.finished(), 0x5A);
    assert!(guest.all(HUGE, HUGE, 0x5A));
    assert_eq!(uffd.fdinfo().expect("fdinfo").total, 0);
}

/// EXACT_ADDRESS gives the byte address; a write fault has WRITE and MINOR,
/// and the write lands in the shared page cache.
#[test]
fn minor_write_fault_with_exact_address() {
    let features = abi::UFFD_FEATURE_EXACT_ADDRESS | abi::UFFD_FEATURE_THREAD_ID;
    let Some(uffd) = setup("minor_write_fault_with_exact_address", features) else {
        return;
    };
    let memfd = huge_memfd(1);
    let daemon = Map::shared(memfd.as_fd(), HUGE);
    let guest = Map::shared(memfd.as_fd(), HUGE);
    daemon.fill(0, HUGE, 0xEE);
    uffd.register(guest.addr(), HUGE_U64, RegisterMode::MINOR)
        .expect("register MINOR");

    let off = 0x1_2345;
    let t = touch(&guest, off, Some(0x77));
    let pf = next_fault(&uffd);
    println!(
        "OBSERVED: write fault: flags {:#x}, address {:#x} (touched {:#x})",
        pf.flags,
        pf.address,
        guest.addr() + off as u64
    );
    assert_eq!(pf.kind(), FaultKind::Minor);
    assert!(pf.is_write());
    assert_eq!(pf.address, guest.addr() + off as u64);

    daemon.fill(0, HUGE, 0);
    assert_eq!(
        uffd.continue_range(pf.page_start(HUGE_U64), HUGE_U64, true)
            .expect("continue"),
        Fill::Done
    );
    assert_eq!(t.finished(), 0x77);
    assert_eq!(
        daemon.read(off),
        0x77,
        "the guest's write is in the shared page"
    );
    assert_eq!(daemon.read(off + 1), 0);
}

/// Fills with `wake = false` leave the thread asleep until UFFDIO_WAKE; a
/// second CONTINUE of a mapped range is `AlreadyMapped`, not an error.
#[test]
fn second_continue_reports_already_mapped() {
    let Some(uffd) = setup("second_continue_reports_already_mapped", 0) else {
        return;
    };
    let memfd = huge_memfd(2);
    let daemon = Map::shared(memfd.as_fd(), 2 * HUGE);
    let guest = Map::shared(memfd.as_fd(), 2 * HUGE);
    daemon.fill(0, 2 * HUGE, 0x11);
    uffd.register(guest.addr(), 2 * HUGE_U64, RegisterMode::MINOR)
        .expect("register MINOR");

    let t = touch(&guest, 64, None);
    let pf = next_fault(&uffd);
    let page = pf.page_start(HUGE_U64);
    assert_eq!(
        uffd.continue_range(page, HUGE_U64, false)
            .expect("continue, no wake"),
        Fill::Done
    );
    assert_eq!(
        uffd.fdinfo().expect("fdinfo").total,
        1,
        "the thread still waits (DONTWAKE)"
    );
    uffd.wake(page, HUGE_U64).expect("wake");
    assert_eq!(t.finished(), 0x11);

    let again = uffd
        .continue_range(page, HUGE_U64, true)
        .expect("EEXIST is not an error");
    assert_eq!(again, Fill::AlreadyMapped);
    assert!(again.is_served());

    // Proactive continue of a page nobody touched yet, then again.
    let second = guest.addr() + HUGE_U64;
    assert_eq!(
        uffd.continue_range(second, HUGE_U64, true)
            .expect("continue"),
        Fill::Done
    );
    assert_eq!(
        uffd.continue_range(second, HUGE_U64, false)
            .expect("continue"),
        Fill::AlreadyMapped
    );
    assert_eq!(guest.read(HUGE + 7), 0x11);
}

/// A page the memfd never allocated raises MISSING, not MINOR (docs/platform.md#userfaultfd:
/// MINOR needs the page in the page cache). UFFDIO_COPY serves it; CONTINUE
/// on it fails with EFAULT; once populated through the daemon's view, the
/// next page's fault is MINOR.
#[test]
fn fresh_pages_raise_missing_not_minor() {
    let Some(uffd) = setup("fresh_pages_raise_missing_not_minor", 0) else {
        return;
    };
    let memfd = huge_memfd(2);
    let daemon = Map::shared(memfd.as_fd(), 2 * HUGE);
    let guest = Map::shared(memfd.as_fd(), 2 * HUGE);
    let ioctls = uffd
        .register(
            guest.addr(),
            2 * HUGE_U64,
            RegisterMode::MISSING | RegisterMode::MINOR,
        )
        .expect("register MISSING|MINOR");
    assert!(ioctls.copy() && ioctls.continue_());

    // Page 0: fresh -> MISSING; CONTINUE cannot serve it, COPY can.
    let t = touch(&guest, 100, None);
    let pf = next_fault(&uffd);
    println!(
        "OBSERVED: fault on a never-allocated page: flags {:#x}",
        pf.flags
    );
    assert_eq!(pf.kind(), FaultKind::Missing);
    let page = pf.page_start(HUGE_U64);
    assert_eq!(page, guest.addr());
    match uffd.continue_range(page, HUGE_U64, true) {
        Err(e @ UffdError::Continue { .. }) => {
            println!(
                "OBSERVED: CONTINUE on a page not in the page cache: {:?}",
                errno_of(&e).map(std::io::Error::from_raw_os_error)
            );
            assert_eq!(errno_of(&e), Some(libc::EFAULT));
        }
        other => panic!("expected a Continue error, got {other:?}"),
    }
    let src = vec![0x33u8; HUGE];
    assert_eq!(uffd.copy(page, &src, true).expect("copy"), Fill::Done);
    assert_eq!(t.finished(), 0x33);
    assert_eq!(
        daemon.read(HUGE - 1),
        0x33,
        "COPY put the page in the shared file"
    );
    assert_eq!(
        uffd.copy(page, &src, true).expect("copy again"),
        Fill::AlreadyMapped
    );

    // Page 1: allocated (and zeroed by the kernel) through the daemon's view -> MINOR.
    daemon.fill(HUGE, HUGE, 0x44);
    let t = touch(&guest, HUGE + 100, None);
    let pf = next_fault(&uffd);
    println!(
        "OBSERVED: fault on the same kind of page after it was populated elsewhere: flags {:#x}",
        pf.flags
    );
    assert_eq!(pf.kind(), FaultKind::Minor);
    assert_eq!(
        uffd.continue_range(pf.page_start(HUGE_U64), HUGE_U64, true)
            .expect("continue"),
        Fill::Done
    );
    assert_eq!(t.finished(), 0x44);
}

/// Registered MINOR only, a never-allocated page raises no event at all: the
/// kernel allocates and zeroes it during the fault.
#[test]
fn fresh_page_under_minor_only_is_not_reported() {
    let Some(uffd) = setup("fresh_page_under_minor_only_is_not_reported", 0) else {
        return;
    };
    let memfd = huge_memfd(1);
    let guest = Map::shared(memfd.as_fd(), HUGE);
    uffd.register(guest.addr(), HUGE_U64, RegisterMode::MINOR)
        .expect("register MINOR");
    let t = touch(&guest, 5, None);
    assert_eq!(t.finished(), 0, "kernel-zeroed page, no event");
    assert!(uffd.read_event().expect("read").is_none());
}

#[test]
fn unregister_lets_faults_through() {
    let Some(uffd) = setup("unregister_lets_faults_through", 0) else {
        return;
    };
    let memfd = huge_memfd(1);
    let daemon = Map::shared(memfd.as_fd(), HUGE);
    let guest = Map::shared(memfd.as_fd(), HUGE);
    daemon.fill(0, HUGE, 0x21);
    uffd.register(guest.addr(), HUGE_U64, RegisterMode::MINOR)
        .expect("register");
    uffd.unregister(guest.addr(), HUGE_U64).expect("unregister");
    assert_eq!(touch(&guest, 9, None).finished(), 0x21);
    assert!(uffd.read_event().expect("read").is_none());
}

// ---------------------------------------------------------------------------
// Closing the uffd while a fault waits.

/// A second fd on the uffd keeps it alive: closing one copy neither wakes the
/// thread nor drops the fault, and the other copy serves it. This is why the
/// VMM should keep its own copy after sending one to the daemon.
#[test]
fn closing_one_copy_keeps_fault_pending() {
    let Some(uffd) = setup("closing_one_copy_keeps_fault_pending", 0) else {
        return;
    };
    let memfd = huge_memfd(1);
    let daemon = Map::shared(memfd.as_fd(), HUGE);
    let guest = Map::shared(memfd.as_fd(), HUGE);
    daemon.fill(0, HUGE, 0xEE);
    uffd.register(guest.addr(), HUGE_U64, RegisterMode::MINOR)
        .expect("register");
    let keep = uffd.try_clone().expect("dup");

    let t = touch(&guest, 0, None);
    let pf = next_fault(&uffd);
    drop(uffd);
    let info = keep.fdinfo().expect("fdinfo");
    assert_eq!(
        (info.pending, info.total),
        (0, 1),
        "the read fault still waits after one copy closed"
    );

    daemon.fill(0, HUGE, 0x5A);
    assert_eq!(
        keep.continue_range(pf.page_start(HUGE_U64), HUGE_U64, true)
            .expect("continue"),
        Fill::Done
    );
    assert_eq!(t.finished(), 0x5A);
}

const CLOSE_TEST: &str = "closing_last_uffd_under_blocked_fault";
const CLOSE_ROLE: &str = "close";

/// Closing the last fd of the uffd while a thread waits on a MINOR fault. Run
/// in a child because the outcome might have been SIGBUS. Observed: the
/// thread wakes and maps the page-cache page as it is (stale, uncleared data).
#[test]
fn closing_last_uffd_under_blocked_fault() {
    if role().as_deref() == Some(CLOSE_ROLE) {
        return close_child();
    }
    if role().is_some() {
        return;
    }
    if let Err(reason) = huge_pages() {
        test_support::skip!("{CLOSE_TEST}: {reason}");
        return;
    }
    let out = spawn_role(CLOSE_TEST, CLOSE_ROLE, None, false).wait_output();
    let stdout = String::from_utf8_lossy(&out.stdout);
    print_child_notes(&stdout);
    if let Some(at) = stdout.find(CHILD_CANNOT_RUN) {
        let reason = stdout[at + CHILD_CANNOT_RUN.len()..]
            .lines()
            .next()
            .unwrap_or("");
        test_support::skip!("{CLOSE_TEST}: the child cannot run:{reason}");
        return;
    }
    use std::os::unix::process::ExitStatusExt;
    assert!(
        out.status.success(),
        "child failed: {:?} (signal {:?}); stdout:\n{stdout}",
        out.status,
        out.status.signal()
    );
    assert!(stdout.contains("OBSERVED: thread resumed"), "{stdout}");
}

fn close_child() {
    // The parent records the skip: a child only says why it cannot run.
    // The parent made the pages available (`huge_pages`); the child needs
    // one of them. Asking again here for all 16 free would fail whenever
    // another test of the parent holds one at that moment.
    let uffd = match uffd_with(0) {
        Ok(uffd) => uffd,
        Err(reason) => return println!("{CHILD_CANNOT_RUN} {reason}"),
    };
    let memfd = huge_memfd(1);
    let daemon = Map::shared(memfd.as_fd(), HUGE);
    let guest = Map::shared(memfd.as_fd(), HUGE);
    daemon.fill(0, HUGE, 0xEE);
    uffd.register(guest.addr(), HUGE_U64, RegisterMode::MINOR)
        .expect("register");
    let t = touch(&guest, 0, None);
    let pf = next_fault(&uffd);
    assert_eq!(pf.kind(), FaultKind::Minor);
    drop(uffd); // the last reference: the kernel releases the uffd
    let v = t.finished();
    println!("OBSERVED: thread resumed after the last uffd fd closed and read {v:#x} (stale page-cache data {:#x})", 0xEE);
    assert_eq!(v, 0xEE);
    assert!(
        guest.all(0, HUGE, 0xEE),
        "the uncleared page is now mapped in the guest view"
    );
}

// ---------------------------------------------------------------------------
// Across processes: the VMM (child) creates and registers, the daemon
// (parent) serves.

const CROSS_TEST: &str = "cross_process_daemon_serves_vmm_fault";
const CROSS_ROLE: &str = "vmm";

#[test]
fn cross_process_daemon_serves_vmm_fault() {
    if role().as_deref() == Some(CROSS_ROLE) {
        return vmm_child();
    }
    if role().is_some() {
        return;
    }
    if let Err(reason) = huge_pages() {
        test_support::skip!("{CROSS_TEST}: {reason}");
        return;
    }
    // Daemon side: owns the memfd; the page holds a previous tenant's data.
    let memfd = huge_memfd(1);
    let daemon = Map::shared(memfd.as_fd(), HUGE);
    daemon.fill(0, HUGE, 0xEE);

    let (ours, theirs) = std::os::unix::net::UnixStream::pair().expect("socketpair");
    let ours = OwnedFd::from(ours);
    let theirs = OwnedFd::from(theirs);
    let child = spawn_role(CROSS_TEST, CROSS_ROLE, Some(&theirs), false);
    drop(theirs);

    send_all(ours.as_fd(), &(HUGE as u64).to_le_bytes(), &[memfd.as_fd()]).expect("send memfd");
    let mut fds = Vec::new();
    let hello = recv_exact(ours.as_fd(), 17, &mut fds);
    if hello[16] == 0 {
        let out = child.wait_output();
        println!("{}", String::from_utf8_lossy(&out.stdout));
        test_support::skip!("{CROSS_TEST}: the child could not set up a uffd");
        return;
    }
    let (guest_addr, guest_tid) = (u64_at(&hello, 0), u64_at(&hello, 8));
    assert_eq!(fds.len(), 1, "one uffd");
    let uffd = Uffd::from_owned_fd(fds.pop().expect("fd")).expect("peer sent a userfaultfd");

    let pf = next_fault(&uffd);
    println!(
        "OBSERVED: cross-process fault: flags {:#x}, address {:#x}, tid {}",
        pf.flags, pf.address, pf.thread_id
    );
    assert_eq!(pf.kind(), FaultKind::Minor);
    assert!(pf.address >= guest_addr && pf.address < guest_addr + HUGE_U64);
    assert_eq!(u64::from(pf.thread_id), guest_tid);

    daemon.fill(0, HUGE, 0x5A); // clear (with a recognisable pattern)
    assert_eq!(
        uffd.continue_range(pf.page_start(HUGE_U64), HUGE_U64, true)
            .expect("continue"),
        Fill::Done
    );

    let verdict = recv_exact(ours.as_fd(), 1, &mut fds);
    let out = child.wait_output();
    let stdout = String::from_utf8_lossy(&out.stdout);
    print_child_notes(&stdout);
    assert_eq!(verdict[0], 1, "child saw wrong data; stdout:\n{stdout}");
    assert!(
        out.status.success(),
        "child failed: {:?}; stdout:\n{stdout}",
        out.status
    );
}

/// The VMM side: maps the received memfd, creates and registers a uffd for
/// its own mapping, hands the uffd over, then touches the page.
fn vmm_child() {
    let link = std::fs::read_link(format!("/proc/self/fd/{CHILD_SOCK_FD}")).expect("fd 3");
    assert!(
        link.to_string_lossy().starts_with("socket:"),
        "fd 3 is {link:?}"
    );
    // SAFETY: the parent placed our end of the socketpair at fd 3 with dup2
    // before exec (checked just above); nothing else in this process owns it.
    let sock = unsafe { OwnedFd::from_raw_fd(CHILD_SOCK_FD) };
    let mut fds = Vec::new();
    let len = recv_exact(sock.as_fd(), 8, &mut fds);
    let len = usize::try_from(u64_at(&len, 0)).expect("fits");
    let memfd = fds.pop().expect("memfd");
    let guest = Map::shared(memfd.as_fd(), len);

    // SAFETY: gettid has no arguments and cannot fail.
    let tid = u64::try_from(unsafe { libc::gettid() }).expect("positive");
    let uffd = match uffd_with(abi::UFFD_FEATURE_THREAD_ID) {
        Ok(u) => u,
        Err(reason) => {
            println!("{CHILD_CANNOT_RUN} {reason}");
            let mut msg = [0u8; 17];
            msg[16] = 0;
            send_all(sock.as_fd(), &msg, &[]).expect("send");
            return;
        }
    };
    uffd.register(guest.addr(), len as u64, RegisterMode::MINOR)
        .expect("register");
    let mut msg = Vec::with_capacity(17);
    msg.extend_from_slice(&guest.addr().to_le_bytes());
    msg.extend_from_slice(&tid.to_le_bytes());
    msg.push(1);
    // The VMM keeps its own copy of the uffd (see closing_last_uffd_under_blocked_fault).
    send_all(sock.as_fd(), &msg, &[uffd.as_fd()]).expect("send uffd");

    let first = guest.read(0x1000); // blocks until the daemon continues
    let ok = first == 0x5A && guest.all(0, len, 0x5A);
    println!("OBSERVED: child read {first:#x} after the daemon's CONTINUE");
    send_all(sock.as_fd(), &[u8::from(ok)], &[]).expect("send verdict");
    assert!(ok, "child saw {first:#x}");
}

// ---------------------------------------------------------------------------
// MISSING-mode fills and write protection on anonymous memory.

#[test]
fn zeropage_and_copy_on_anonymous_memory() {
    const PAGE: usize = 4096;
    let uffd = Uffd::new(CreateFlags::new()).expect("userfaultfd");
    uffd.api(0).expect("handshake");
    let anon = Map::anon(4 * PAGE);
    let ioctls = uffd
        .register(anon.addr(), 4 * PAGE as u64, RegisterMode::MISSING)
        .expect("register MISSING");
    assert!(ioctls.zeropage() && ioctls.copy() && ioctls.wake());

    assert_eq!(
        uffd.zeropage(anon.addr(), PAGE as u64, true)
            .expect("zeropage"),
        Fill::Done
    );
    assert_eq!(anon.read(17), 0);
    assert_eq!(
        uffd.zeropage(anon.addr(), PAGE as u64, true)
            .expect("zeropage again"),
        Fill::AlreadyMapped
    );

    let src = vec![0x77u8; 2 * PAGE];
    let dst = anon.addr() + PAGE as u64;
    assert_eq!(uffd.copy(dst, &src, true).expect("copy"), Fill::Done);
    assert!(anon.all(PAGE, 2 * PAGE, 0x77));

    // A fault served by COPY.
    let t = touch(&anon, 3 * PAGE + 5, None);
    let pf = next_fault(&uffd);
    assert_eq!(pf.kind(), FaultKind::Missing);
    assert_eq!(pf.page_start(PAGE as u64), anon.addr() + 3 * PAGE as u64);
    assert_eq!(
        uffd.copy(pf.page_start(PAGE as u64), &src[..PAGE], true)
            .expect("copy"),
        Fill::Done
    );
    assert_eq!(t.finished(), 0x77);
}

#[test]
fn zeropage_is_refused_on_hugetlbfs() {
    let Some(uffd) = setup("zeropage_is_refused_on_hugetlbfs", 0) else {
        return;
    };
    let memfd = huge_memfd(1);
    let guest = Map::shared(memfd.as_fd(), HUGE);
    uffd.register(guest.addr(), HUGE_U64, RegisterMode::MISSING)
        .expect("register MISSING");
    match uffd.zeropage(guest.addr(), HUGE_U64, true) {
        Err(e @ UffdError::ZeroPage { .. }) => assert_eq!(errno_of(&e), Some(libc::EINVAL)),
        other => panic!("expected a ZeroPage error, got {other:?}"),
    }
}

#[test]
fn write_protect_fault_on_anonymous_memory() {
    const PAGE: usize = 4096;
    let uffd = Uffd::new(CreateFlags::new()).expect("userfaultfd");
    let info = uffd
        .api(abi::UFFD_FEATURE_PAGEFAULT_FLAG_WP)
        .expect("handshake");
    assert!(info.available.contains(abi::UFFD_FEATURE_PAGEFAULT_FLAG_WP));
    let anon = Map::anon(PAGE);
    anon.write(0, 1); // WP needs a present page
    let ioctls = uffd
        .register(anon.addr(), PAGE as u64, RegisterMode::WP)
        .expect("register WP");
    assert!(ioctls.write_protect());
    uffd.write_protect(anon.addr(), PAGE as u64, true, true)
        .expect("protect");

    let t = touch(&anon, 0, Some(2));
    let pf = next_fault(&uffd);
    assert_eq!(pf.kind(), FaultKind::WriteProtect);
    assert!(pf.is_write());
    uffd.write_protect(anon.addr(), PAGE as u64, false, true)
        .expect("unprotect and wake");
    assert_eq!(t.finished(), 2);
}
