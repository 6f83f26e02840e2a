//! The systemd protocols of `hugemem serve`, spoken to the real binary by
//! this test the way systemd speaks them (systemd itself cannot run here:
//! docs/operations.md, "Testing the unit", says why):
//!
//! * readiness: a real `AF_UNIX` datagram socket named by `NOTIFY_SOCKET`
//!   receives `READY=1` once the daemon serves (a client gets STATS at
//!   once, with no retry) and `STOPPING=1` on SIGTERM;
//! * socket activation: a listening socket bound by the test is passed as
//!   fd 3 with `LISTEN_FDS=1` and `LISTEN_PID` = the daemon's pid (set by
//!   `sh -c 'LISTEN_PID=$$ exec …'`, so the pid is the exec'd daemon's). A
//!   client that connected before the daemon started is served; the daemon
//!   leaves the socket file alone (same inode and mode after a stop), the
//!   uid check still refuses a stranger, and a second daemon on the same
//!   descriptor serves a client that connected while none ran;
//! * `hugemem hugepages --config` (the unit's privileged `ExecStartPre=`)
//!   reserves what the config's `[hugepages]` section says.
//!
//! Each test starts a daemon or changes the 2 MiB pool: run them under the
//! machine lock.

mod common;
use common::serial;

use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixDatagram, UnixListener};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use backend::client::Client;
use serde_json::Value;

/// The test's end of `NOTIFY_SOCKET`.
struct Notify {
    sock: UnixDatagram,
    path: PathBuf,
}

impl Notify {
    fn new(dir: &Path) -> Self {
        let path = dir.join("notify.sock");
        let sock = UnixDatagram::bind(&path).expect("bind the notify socket");
        Self { sock, path }
    }

    /// The next datagram, as text; fails the test after `timeout`.
    fn recv(&self, timeout: Duration) -> String {
        self.sock.set_read_timeout(Some(timeout)).expect("timeout");
        let mut buf = vec![0u8; 4096];
        let n = self
            .sock
            .recv(&mut buf)
            .unwrap_or_else(|e| panic!("no sd_notify message within {timeout:?}: {e}"));
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }
}

/// `hugemem serve --socket SOCKET` with `NOTIFY_SOCKET`; with `fd3`, as
/// systemd starts a socket-activated service: `fd3` is duplicated onto fd 3
/// and `LISTEN_FDS=1`, `LISTEN_PID=<the daemon's pid>` are set.
fn spawn_serve(socket: &Path, notify: &Notify, fd3: Option<RawFd>) -> Child {
    let bin = env!("CARGO_BIN_EXE_hugemem");
    let mut cmd = Command::new("/bin/sh");
    cmd.arg("-c")
        .arg(if fd3.is_some() {
            "LISTEN_PID=$$ LISTEN_FDS=1 exec \"$0\" \"$@\""
        } else {
            "exec \"$0\" \"$@\""
        })
        .arg(bin)
        .args(["serve", "--socket"])
        .arg(socket)
        .env("NOTIFY_SOCKET", &notify.path)
        .env_remove("LISTEN_PID")
        .env_remove("LISTEN_FDS")
        .stdin(Stdio::null());
    if let Some(fd) = fd3 {
        // SAFETY: the closure runs in the forked child before exec and only
        // calls `onto_fd3` (dup2/fcntl, async-signal-safe, no allocation).
        unsafe {
            cmd.pre_exec(move || onto_fd3(fd));
        }
    }
    cmd.spawn().expect("spawn hugemem serve")
}

/// Makes `fd` (the test's open listening socket) the child's fd 3,
/// inherited across exec. Runs between fork and exec.
fn onto_fd3(fd: RawFd) -> std::io::Result<()> {
    let r = if fd == 3 {
        // dup2(3, 3) would keep FD_CLOEXEC: clear it instead.
        // SAFETY: fcntl(F_SETFD) on an open descriptor of this process.
        unsafe { libc::fcntl(3, libc::F_SETFD, 0) }
    } else {
        // SAFETY: dup2 of an open descriptor onto 3; whatever 3 was in the
        // child (nothing the child uses: it execs right after) is replaced.
        unsafe { libc::dup2(fd, 3) }
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn sigterm(child: &Child) {
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pid"));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
}

/// Waits for `child` to exit (at most `timeout`), returning its status.
fn wait_exit(child: &mut Child, timeout: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            return s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("hugemem serve did not exit within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A client on its own thread that connects now and asks STATS; its
/// connection waits in the listening socket's backlog until a daemon serves.
fn early_client(socket: &Path) -> std::thread::JoinHandle<Value> {
    let stream = std::os::unix::net::UnixStream::connect(socket).expect("connect before serve");
    std::thread::spawn(move || {
        let mut c = Client::from_stream(stream).expect("handshake once a daemon serves");
        c.set_timeout(Some(Duration::from_secs(60)))
            .expect("timeout");
        c.stats().expect("stats")
    })
}

#[test]
fn serve_notifies_ready_when_serving_and_stopping_on_sigterm() {
    let _s = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("run").join("hugemem.sock");
    let notify = Notify::new(dir.path());
    let mut child = spawn_serve(&socket, &notify, None);
    let msg = notify.recv(Duration::from_secs(60));
    assert!(msg.lines().any(|l| l == "READY=1"), "{msg:?}");
    assert!(
        msg.lines()
            .any(|l| l == format!("STATUS=serving {}", socket.display())),
        "{msg:?}"
    );
    // Ready means serving: no retry, no wait.
    let stats = Client::connect(&socket)
        .expect("connect right after READY=1")
        .stats()
        .expect("stats");
    assert_eq!(stats["pid"].as_u64(), Some(u64::from(child.id())));
    sigterm(&child);
    let msg = notify.recv(Duration::from_secs(30));
    assert!(msg.lines().any(|l| l == "STOPPING=1"), "{msg:?}");
    assert!(
        msg.lines().any(|l| l == "STATUS=stopping on SIGTERM"),
        "{msg:?}"
    );
    let status = wait_exit(&mut child, Duration::from_secs(60));
    assert!(status.success(), "hugemem serve exited with {status}");
    assert!(!socket.exists(), "a socket the daemon bound is removed");
}

#[test]
fn serve_takes_the_socket_systemd_passes_and_leaves_it_in_place() {
    let _s = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    // Others may traverse the directory and connect: the uid check, not
    // the file mode, must be what refuses a stranger below.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let socket = dir.path().join("hugemem.sock");
    let listener = UnixListener::bind(&socket).expect("bind, as hugemem.socket does");
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666)).expect("chmod");
    let before = std::fs::metadata(&socket).expect("meta");
    let notify = Notify::new(dir.path());

    // A VMM that connects before the daemon runs is served once it does.
    let early = early_client(&socket);
    let mut child = spawn_serve(&socket, &notify, Some(listener.as_raw_fd()));
    let msg = notify.recv(Duration::from_secs(60));
    assert!(msg.lines().any(|l| l == "READY=1"), "{msg:?}");
    assert!(
        msg.lines()
            .any(|l| l == format!("STATUS=serving {} (socket-activated)", socket.display())),
        "{msg:?}"
    );
    let stats = early.join().expect("early client");
    assert_eq!(stats["pid"].as_u64(), Some(u64::from(child.id())));
    let after = std::fs::metadata(&socket).expect("meta");
    assert_eq!(
        (after.ino(), after.mode()),
        (before.ino(), before.mode()),
        "the daemon neither re-created nor chmod-ed the passed socket"
    );

    // The peer check applies unchanged: uid 65534 reaches the socket (mode
    // 0666) but is not allowed.
    let out = Command::new(env!("CARGO_BIN_EXE_hugemem"))
        .args(["status", "--socket"])
        .arg(&socket)
        .uid(65534)
        .gid(65534)
        .output()
        .expect("hugemem status as uid 65534");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a stranger got STATS: {err}");
    assert!(err.contains("uid 65534 is not allowed"), "{err}");

    sigterm(&child);
    let msg = notify.recv(Duration::from_secs(30));
    assert!(msg.lines().any(|l| l == "STOPPING=1"), "{msg:?}");
    let status = wait_exit(&mut child, Duration::from_secs(60));
    assert!(status.success(), "hugemem serve exited with {status}");
    let left = std::fs::metadata(&socket).expect("the socket file stays with systemd");
    assert_eq!(left.ino(), before.ino());

    // Between two daemons (a restart) a VMM still connects; the next daemon
    // on the same descriptor serves it.
    let early = early_client(&socket);
    let mut child = spawn_serve(&socket, &notify, Some(listener.as_raw_fd()));
    let msg = notify.recv(Duration::from_secs(60));
    assert!(msg.lines().any(|l| l == "READY=1"), "{msg:?}");
    let stats = early.join().expect("client of the restart");
    assert_eq!(stats["pid"].as_u64(), Some(u64::from(child.id())));
    sigterm(&child);
    let status = wait_exit(&mut child, Duration::from_secs(60));
    assert!(status.success(), "hugemem serve exited with {status}");
    assert!(socket.exists());
}

#[test]
fn serve_refuses_a_passed_socket_bound_elsewhere() {
    let _s = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let other = dir.path().join("other.sock");
    let listener = UnixListener::bind(&other).expect("bind");
    let notify = Notify::new(dir.path());
    let socket = dir.path().join("hugemem.sock");
    let mut child = spawn_serve(&socket, &notify, Some(listener.as_raw_fd()));
    let status = wait_exit(&mut child, Duration::from_secs(60));
    assert!(
        !status.success(),
        "a daemon served a socket bound elsewhere"
    );
    assert!(!socket.exists(), "nor did it bind its own");
    notify.sock.set_nonblocking(true).expect("nonblocking");
    let mut buf = [0u8; 512];
    assert!(
        notify.sock.recv(&mut buf).is_err(),
        "no READY=1 from a daemon that did not start"
    );
}

const POOL_2M: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB";

fn nr_2m() -> u64 {
    std::fs::read_to_string(Path::new(POOL_2M).join("nr_hugepages"))
        .expect("read the 2 MiB pool")
        .trim()
        .parse()
        .expect("a number")
}

/// `hugemem hugepages --config FILE --json` with FILE holding `section`.
fn hugepages_with_config(dir: &Path, section: &str) -> (Option<i32>, Value, String) {
    let config = dir.join("hugemem.toml");
    std::fs::write(
        &config,
        format!("[pool]\ntarget = \"0\"\n\n[hugepages]\n{section}"),
    )
    .expect("config");
    let out = Command::new(env!("CARGO_BIN_EXE_hugemem"))
        .args(["hugepages", "--json", "--config"])
        .arg(&config)
        .output()
        .expect("hugemem hugepages");
    let json = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (
        out.status.code(),
        json,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn hugepages_reserves_what_the_config_section_says() {
    let _s = serial();
    if !Path::new(POOL_2M).is_dir() {
        test_support::skip!("no 2 MiB huge-page pool on this kernel");
        return;
    }
    if std::fs::metadata("/proc/self").map(|m| m.uid()).ok() != Some(0) {
        test_support::skip!("reserving huge pages needs root");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let before = nr_2m();
    let (code, report, err) = hugepages_with_config(
        dir.path(),
        &format!(
            "pages_2m = {}\nmode = \"total\"\nmount = false\n",
            before + 2
        ),
    );
    let pool = &report["pools"][0];
    if code == Some(3) {
        hugepages_with_config(
            dir.path(),
            &format!("pages_2m = {before}\nmode = \"exact\"\nmount = false\n"),
        );
        test_support::skip!("the kernel gave fewer 2 MiB pages than asked: {pool}");
        return;
    }
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(pool["size"], "2M");
    assert_eq!(pool["mode"], "total");
    assert_eq!(pool["requested"], before + 2);
    assert_eq!(pool["total"], before + 2);
    assert_eq!(nr_2m(), before + 2);
    assert_eq!(report["mounts"], Value::Array(vec![]), "mount = false");
    let (code, report, err) = hugepages_with_config(
        dir.path(),
        &format!("pages_2m = {before}\nmode = \"exact\"\nmount = false\n"),
    );
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(report["pools"][0]["mode"], "exact");
    assert_eq!(nr_2m(), before);
    // A section the daemon would refuse is refused here too (usage, 2).
    let (code, _, err) = hugepages_with_config(dir.path(), "pages_3m = 1\n");
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("pages_3m"), "{err}");
}
