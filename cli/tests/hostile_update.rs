//! Another uid against `hugemem update` and the launcher's control socket,
//! with the real `hugemem` binary and real processes (`fork` + `setuid` to
//! uid 65534 where the uid matters):
//!
//! - `hugemem launch` refuses a control socket in a directory another uid
//!   could write (where it could rename the socket away and bind its own);
//! - `hugemem update` refuses a socket another uid listens on, and sends it
//!   nothing: not the request, not the `--qemu` path in it;
//! - the launcher, at its end, leaves a socket file it did not bind.
//!
//! The tests that act as another uid need root and skip otherwise.

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::Duration;

use test_support::prelude::{wait_until, TestDaemon};
use test_support::tenant::{in_child, read_u64, root_or_skip, say, NOBODY};

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");

/// The QEMU path `hugemem update` is given: it must not reach a squatter.
const SECRET_QEMU: &str = "/opt/root-only/qemu-system-x86_64";

fn mkdir(path: &Path, mode: u32) -> PathBuf {
    std::fs::create_dir(path).expect("mkdir");
    // Set after creation: the umask does not apply to chmod.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    path.to_owned()
}

fn chown(path: &Path, uid: u32) {
    std::os::unix::fs::chown(path, Some(uid), Some(uid)).expect("chown");
}

/// `hugemem launch` with a control socket at `control`, against a daemon
/// socket where none listens: the launch ends at the first check that fails.
fn launch_with_control(control: &Path, daemon: &Path) -> Output {
    let out = Command::new("timeout")
        .args(["60", HUGEMEM, "launch", "--socket"])
        .arg(daemon)
        .args(["--size", "2M", "--page-size", "4K", "--control-socket"])
        .arg(control)
        .args(["--", "qemu-system-x86_64"])
        .output()
        .expect("run hugemem launch");
    assert_ne!(out.status.code(), Some(124), "hugemem launch hung");
    out
}

fn write_u64(fd: &OwnedFd, v: u64) -> bool {
    nix::unistd::write(fd, &v.to_le_bytes()).is_ok_and(|n| n == 8)
}

/// A control socket in a directory another uid can write is refused before
/// anything else happens, with the directory, its owner and mode named; in
/// a private directory (under the sticky `/tmp`) the same launch goes on to
/// the daemon.
#[test]
fn launch_refuses_a_control_socket_another_uid_could_replace() {
    let dir = tempfile::tempdir().expect("tempdir");
    let no_daemon = dir.path().join("no-daemon.sock");
    let open = mkdir(&dir.path().join("open"), 0o777);
    let shared = mkdir(&dir.path().join("shared"), 0o1777);
    let under_open = mkdir(&open.join("private"), 0o700);
    let mut cases = vec![
        (open.join("vm.sock"), open.clone(), "mode 0777"),
        (shared.join("vm.sock"), shared.clone(), "mode 1777"),
        (
            under_open.join("vm.sock"),
            open.clone(),
            "without the sticky bit",
        ),
    ];
    if root_or_skip() {
        let theirs = mkdir(&dir.path().join("theirs"), 0o755);
        chown(&theirs, NOBODY);
        cases.push((
            theirs.join("vm.sock"),
            theirs.clone(),
            "owner uid 65534, mode 0755) belongs to another user",
        ));
    }
    for (control, named, why) in &cases {
        let out = launch_with_control(control, &no_daemon);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{control:?}: {stderr}");
        let expected = format!("control socket directory {}", named.display());
        assert!(stderr.contains(&expected), "{control:?}: {stderr}");
        assert!(stderr.contains(why), "{control:?}: {why:?} not in {stderr}");
        assert!(
            stderr.contains("only you or root can write"),
            "{control:?}: no advice in {stderr}"
        );
        assert!(
            !stderr.contains("daemon"),
            "{control:?}: refused before the daemon: {stderr}"
        );
        assert!(!control.exists(), "{control:?}: nothing may be bound");
    }
    // A private directory passes: the launch gets as far as the daemon.
    let private = mkdir(&dir.path().join("private"), 0o700);
    let control = private.join("vm.sock");
    let out = launch_with_control(&control, &no_daemon);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cannot connect to the hugemem daemon")
            && !stderr.contains("control socket directory"),
        "{stderr}"
    );
    assert!(!control.exists(), "the launcher removes its socket");
}

/// uid 65534 listens where `hugemem update` connects (as it would after
/// renaming a launcher's socket away): root's update refuses it, says
/// whose listener it is, exits 1, and the squatter reads 0 bytes.
#[test]
fn update_sends_nothing_to_a_squatted_socket() {
    if !root_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let squat = mkdir(&dir.path().join("squat"), 0o755);
    chown(&squat, NOBODY);
    let control = squat.join("vm.sock");
    let (ready_r, ready_w) = nix::unistd::pipe().expect("pipe");
    let (heard_r, heard_w) = nix::unistd::pipe().expect("pipe");
    let path = control.clone();
    let squatter = std::thread::spawn(move || {
        in_child(Some(NOBODY), move || {
            let Ok(listener) = UnixListener::bind(&path) else {
                return 10;
            };
            if !write_u64(&ready_w, 1) {
                return 11;
            }
            let Ok((mut stream, _)) = listener.accept() else {
                return 12;
            };
            if stream
                .set_read_timeout(Some(Duration::from_secs(30)))
                .is_err()
            {
                return 13;
            }
            let mut request = [0u8; 4096];
            let heard = stream.read(&mut request).unwrap_or(0);
            if heard > 0 {
                // What the probe's squatter answered: a forged report.
                say(&format!(
                    "squatter got: {}",
                    String::from_utf8_lossy(&request[..heard])
                ));
                let _ = stream.write_all(
                    br#"{"ok":{"old_pid":1,"new_pid":2,"program":"forged-by-65534","handoff":true,"ram_transferred_bytes":0,"ram_total_bytes":0,"guest_ram_bytes":0,"qemu_downtime_ms":0,"qemu_total_ms":0,"update_ms":0.0,"switch_ms":0.0,"migrate_at_ns":0,"resumed_at_ns":0}}
"#,
                );
            }
            if write_u64(&heard_w, heard as u64) {
                0
            } else {
                14
            }
        })
    });
    assert_eq!(read_u64(&ready_r), 1, "the squatter listens");
    let out = Command::new("timeout")
        .args(["60", HUGEMEM, "update", "--json", "--qemu", SECRET_QEMU])
        .arg(&control)
        .output()
        .expect("run hugemem update");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(1),
        "stdout {stdout}; stderr {stderr}"
    );
    assert!(stdout.is_empty(), "no report may be printed: {stdout}");
    assert!(
        stderr.contains("runs as uid 65534")
            && stderr.contains("not as you (uid 0) or root")
            && stderr.contains("nothing was sent"),
        "{stderr}"
    );
    assert_eq!(
        read_u64(&heard_r),
        0,
        "the squatter read bytes of the request"
    );
    assert_eq!(
        squatter.join().expect("squatter thread"),
        0,
        "the squatter's exit code"
    );
}

/// A stand-in QEMU: says it is ready, then waits to be stopped (a live
/// update is not asked for here, so nothing talks to its monitor).
fn stand_in_qemu(dir: &Path) -> PathBuf {
    let path = dir.join("qemu-system-x86_64");
    let script = r#"#!/bin/sh
trap 'exit 0' TERM
touch "$(dirname "$0")/ready"
while :; do sleep 0.01; done
"#;
    std::fs::write(&path, script).expect("write the stand-in QEMU");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    path
}

/// SIGTERM to a launcher the test did not get to end.
struct StopLauncher(Child);

impl Drop for StopLauncher {
    fn drop(&mut self) {
        // Not once it was reaped: its pid may name another process by now.
        if !matches!(self.0.try_wait(), Ok(None)) {
            return;
        }
        if let Ok(pid) = i32::try_from(self.0.id()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        let _ = self.0.wait();
    }
}

/// While the launcher runs, its socket is renamed away and another bound at
/// the path; when the launcher ends, the other one is still there.
#[test]
fn the_launcher_removes_only_the_socket_it_bound() {
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let qemu = stand_in_qemu(dir.path());
    let control = dir.path().join("vm.sock");
    let launcher = Command::new(HUGEMEM)
        .args(["launch", "--socket"])
        .arg(daemon.socket())
        .args(["--size", "64M", "--page-size", "4K", "--control-socket"])
        .arg(&control)
        .arg("--")
        .arg(&qemu)
        .spawn()
        .expect("spawn hugemem launch");
    let mut launcher = StopLauncher(launcher);
    wait_until("the stand-in QEMU", Duration::from_secs(30), || {
        dir.path().join("ready").exists()
    });
    let bound = std::fs::metadata(&control).expect("the launcher's socket");
    std::fs::rename(&control, dir.path().join("moved.sock")).expect("rename");
    let replacement = UnixListener::bind(&control).expect("bind the replacement");
    let replaced = std::fs::metadata(&control).expect("the replacement");
    assert_ne!(replaced.ino(), bound.ino());
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(launcher.0.id()).expect("pid")),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM to the launcher");
    let mut status = None;
    wait_until("the launcher's exit", Duration::from_secs(30), || {
        status = launcher.0.try_wait().expect("try_wait");
        status.is_some()
    });
    assert_eq!(status.and_then(|s| s.code()), Some(0), "the VMM's status");
    let after = std::fs::metadata(&control).expect("the replacement is still there");
    assert_eq!(
        (after.dev(), after.ino()),
        (replaced.dev(), replaced.ino()),
        "the file at the path is the replacement"
    );
    assert!(
        std::os::unix::net::UnixStream::connect(&control).is_ok(),
        "the replacement still listens"
    );
    drop(replacement);
    daemon.wait_stats(Duration::from_secs(10), "FREE", |s| {
        s.allocations.active == 0
    });
    daemon.shutdown();
}
