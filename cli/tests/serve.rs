//! `hugemem serve` as a real process: SIGTERM stops it cleanly, a SIGKILLed
//! one leaves a stale socket the next start replaces, and `kill -9` while a
//! lazy guest runs leaves the VMM on its fallback with nothing stale read.
//!
//! Tests are serialized by one lock (shared huge-page pools); waits are
//! deadline-based.

use std::os::fd::AsFd;
use std::path::Path;
use std::time::Duration;

use backend::client::Client;
use backend::daemon::{Config, Daemon};
use backend::lazy::{LazyGuest, LazyOptions};
use test_support::lazy::{
    lazy_alloc_from_dirty_pool, mapping, reserve, touch, wait_deadline, DEADLINE, HUGE, PAGES,
    SIZE, STALE,
};
use test_support::prelude::{serial, wait_until, Map};

fn wait_for_socket(path: &Path) {
    wait_until(
        "the daemon's socket answers",
        Duration::from_secs(30),
        || Client::connect(path).is_ok(),
    );
}

#[test]
fn sigterm_stops_hugemem_serve_cleanly() {
    let _s = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("run").join("hugemem.sock");
    let config = dir.path().join("hugemem.toml");
    std::fs::write(&config, "[pool]\nlimit = \"1G\"\ntarget = \"512M\"\n").expect("config");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_hugemem"))
        .args(["serve", "--config"])
        .arg(&config)
        .arg("--socket")
        .arg(&socket)
        .spawn()
        .expect("spawn hugemem serve");
    wait_for_socket(&socket);
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&socket).expect("meta").permissions(),
    );
    assert_eq!(mode & 0o777, 0o600, "socket mode");
    let stats = Client::connect(&socket)
        .expect("connect")
        .stats()
        .expect("stats");
    assert!(stats.pools.is_empty(), "{stats}");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_hugemem"))
        .args(["status", "--socket"])
        .arg(&socket)
        .output()
        .expect("hugemem status");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("sessions:"));
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pid"));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
    let status = child.wait().expect("wait");
    assert!(status.success(), "hugemem serve exited with {status}");
    assert!(!socket.exists(), "socket removed on SIGTERM");
}

#[test]
fn a_killed_daemon_leaves_a_stale_socket_that_the_next_start_replaces() {
    let _s = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("hugemem.sock");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_hugemem"))
        .args(["serve", "--socket"])
        .arg(&socket)
        .spawn()
        .expect("spawn hugemem serve");
    wait_for_socket(&socket);
    child.kill().expect("SIGKILL");
    child.wait().expect("reap");
    assert!(socket.exists(), "a killed daemon cannot clean up");
    let d = Daemon::start(Config {
        socket: socket.clone(),
        ..Config::default()
    })
    .expect("restart over a stale socket");
    Client::connect(&socket)
        .expect("connect")
        .stats()
        .expect("stats");
    d.shutdown().expect("shutdown");
}

/// The acceptance test: a real `hugemem serve` is SIGKILLed while a lazy
/// guest runs; faults before are served by it, faults after by the VMM's
/// fallback; nothing hangs, nothing stale is read.
#[test]
fn kill9_of_hugemem_serve_while_a_lazy_guest_runs() {
    let _s = serial();
    if !reserve("kill9_of_hugemem_serve_while_a_lazy_guest_runs") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("hugemem.sock");
    let config = dir.path().join("hugemem.toml");
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    std::fs::write(
        &config,
        format!("[pool]\nrecheck_ms = 20\nlazy_dirty_uids = [{uid}]\ndetach_pages = false\n"),
    )
    .expect("config");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_hugemem"))
        .args(["serve", "--config"])
        .arg(&config)
        .arg("--socket")
        .arg(&socket)
        .env("RUST_LOG", "warn")
        .spawn()
        .expect("spawn hugemem serve");
    let guard = KillOnDrop(&mut child);
    wait_until_socket(&socket);
    let mut client = Client::connect(&socket).expect("connect");
    client.set_timeout(Some(DEADLINE)).expect("timeout");
    let stats_sock = socket.clone();
    let stats = move || {
        Client::connect(&stats_sock)
            .and_then(|mut c| c.stats())
            .unwrap_or_default()
    };
    let alloc = lazy_alloc_from_dirty_pool(&mut client, &stats);
    let guest = Map::shared(alloc.fds[0].as_fd(), SIZE as usize);
    let lazy = LazyGuest::attach(
        &mut client,
        &alloc,
        &[mapping(&alloc, &guest)],
        LazyOptions::default(),
    )
    .expect("attach");
    for p in 0..4 {
        assert_eq!(
            touch(&guest, p * HUGE)
                .recv_timeout(DEADLINE)
                .expect("daemon served"),
            0
        );
    }
    guard.kill9();
    assert!(
        lazy.wait_fallback(DEADLINE),
        "the VMM noticed the daemon died"
    );
    let readers: Vec<_> = (4..PAGES).map(|p| touch(&guest, p * HUGE + 123)).collect();
    for r in readers {
        assert_eq!(r.recv_timeout(DEADLINE).expect("served after kill -9"), 0);
    }
    assert!(
        guest.none_is(0, guest.len(), STALE),
        "stale bytes visible after the daemon died"
    );
    let s = lazy.stats();
    println!("OBSERVED: kill -9 of hugemem serve: fallback {s:?}");
    drop(guest);
    drop(lazy);
    drop(alloc);
    drop(client);
}

struct KillOnDrop<'a>(&'a mut std::process::Child);

impl KillOnDrop<'_> {
    fn kill9(&self) {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.0.id()).expect("pid"));
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).expect("SIGKILL");
    }
}

impl Drop for KillOnDrop<'_> {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_until_socket(path: &Path) {
    wait_deadline("the daemon's socket", || Client::connect(path).is_ok());
}
