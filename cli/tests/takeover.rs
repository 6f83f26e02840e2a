//! `hugemem serve --takeover` between real processes (issue 20): a running
//! daemon hands its listening socket, pool, allocations and live
//! connections to a new one, and exits; tenants keep their connections,
//! memory and allocation ids, and the clean pool is served warm at once.
//!
//! Tests are serialized by one lock (shared huge-page pools); waits are
//! deadline-based.

use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use backend::client::Client;
use test_support::hugepages::{exactly, PageSize};
use test_support::prelude::{map_raw as map, serial, unmap_raw as unmap, wait_until};
use test_support::tenant::{alloc_2m, root_or_skip, MIB};

fn serve(socket: &Path, config: &Path, takeover: bool) -> Child {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_hugemem"));
    cmd.args(["serve", "--config"])
        .arg(config)
        .arg("--socket")
        .arg(socket);
    if takeover {
        cmd.arg("--takeover");
    }
    cmd.spawn().expect("spawn hugemem serve")
}

/// A daemon process, killed if a test fails while it runs (it would hold
/// the tests' lock and huge pages otherwise).
struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

fn wait_exit(child: &mut Child, what: &str) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            return s;
        }
        assert!(Instant::now() < deadline, "{what} did not exit");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A pattern a tenant writes and reads back: byte i of page p.
fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(31) % 251) as u8 + 1
}

#[test]
fn a_takeover_keeps_the_pool_the_allocation_and_the_connection() {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let size = 64 * MIB;
    // One allocation in use and one clean pooled region: 64 pages.
    let Some(_pages) = exactly(
        PageSize::Huge2M,
        2 * size / (2 * MIB),
        "a_takeover_keeps_the_pool_the_allocation_and_the_connection",
    ) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("hugemem.sock");
    let config = dir.path().join("hugemem.toml");
    std::fs::write(&config, "[pool]\nlimit = \"1G\"\ntarget = \"512M\"\n").expect("config");
    let mut old = Daemon(serve(&socket, &config, false));
    wait_until("the daemon answers", Duration::from_secs(30), || {
        Client::connect(&socket).is_ok()
    });
    // The tenant: mapped, written, connection open.
    let mut tenant = Client::connect(&socket).expect("connect");
    let a = tenant.alloc(alloc_2m(size, false)).expect("tenant ALLOC");
    // A region through the pool: allocated, freed, clean again.
    let mut other = Client::connect(&socket).expect("connect");
    let first = other.alloc(alloc_2m(size, false)).expect("second ALLOC");
    let id = first.id;
    drop(first);
    other.free(id).expect("FREE");
    wait_until(
        "a clean region in the pool",
        Duration::from_secs(30),
        || {
            other.stats().is_ok_and(|s| {
                s.pools.iter().any(|p| p.clean_bytes == size)
                    && s.regions
                        .as_ref()
                        .is_some_and(|r| r.iter().all(|r| r.not_present.unwrap_or(0) == 0))
            })
        },
    );
    let p = map(a.fds[0].as_raw_fd(), size);
    assert!(!p.is_null());
    // SAFETY: the tenant's live mapping of `size` bytes.
    let bytes = unsafe { std::slice::from_raw_parts_mut(p, size as usize) };
    for (i, b) in bytes.iter_mut().enumerate().step_by(4096) {
        *b = pattern(i);
    }
    let before = tenant.stats().expect("stats");

    let started = Instant::now();
    let mut new = Daemon(serve(&socket, &config, true));
    let status = wait_exit(&mut old.0, "the old daemon");
    assert!(status.success(), "the old daemon exited with {status}");
    let handed = started.elapsed();

    // The same connection goes on, served by the new daemon.
    let after = tenant.stats().expect("STATS on the same connection");
    assert_eq!(after.pid, new.0.id(), "served by the new daemon: {after}");
    assert_eq!(after.allocations, before.allocations, "{after}");
    assert!(
        after.pools.iter().any(|p| p.clean_bytes == size),
        "the clean pool came over: {after}"
    );
    for (i, b) in bytes.iter().enumerate().step_by(4096) {
        assert_eq!(*b, pattern(i), "the tenant's byte {i} changed");
    }
    // The clean region is served warm: from the pool, nothing re-zeroed.
    let mut next = Client::connect(&socket).expect("a new connection");
    let warm = Instant::now();
    let b = next
        .alloc(alloc_2m(size, false))
        .expect("ALLOC after the takeover");
    let warm_ms = warm.elapsed().as_secs_f64() * 1e3;
    let s = next.stats().expect("stats");
    assert_eq!(
        s.counters.regions_pooled,
        before.counters.regions_pooled + 1,
        "served from the pool: {s}"
    );
    assert_eq!(
        s.counters.regions_fresh, before.counters.regions_fresh,
        "{s}"
    );
    assert_eq!(s.scrub.bytes, 0, "nothing re-zeroed by the new daemon: {s}");
    eprintln!(
        "takeover: old exited after {:.1} ms, warm ALLOC {warm_ms:.2} ms",
        handed.as_secs_f64() * 1e3
    );
    // The allocation id still belongs to the tenant's connection.
    unmap(p, size);
    let id = a.id;
    drop(a);
    tenant.free(id).expect("FREE of the inherited allocation");
    let bid = b.id;
    drop(b);
    next.free(bid).expect("FREE");
    let pid = nix::unistd::Pid::from_raw(i32::try_from(new.0.id()).expect("pid"));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
    let status = wait_exit(&mut new.0, "the new daemon");
    assert!(status.success(), "the new daemon exited with {status}");
    assert!(
        !socket.exists(),
        "socket removed by the new daemon's SIGTERM"
    );
}
