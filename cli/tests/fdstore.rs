//! `hugemem serve --fd-store` under systemd's file-descriptor store (issue
//! 20): `systemctl restart` (SIGTERM, then a new start) and a crash
//! (`kill -9`) keep the pool, the allocations and the listening socket.
//!
//! systemd itself cannot run here (docs/operations.md, "Testing the unit");
//! as `tests/systemd.rs` does for readiness and socket activation, this test
//! speaks systemd's side of the protocols to the real binary
//! (`test_support::fake_systemd`).

use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

use backend::client::Client;
use test_support::fake_systemd::FakeSystemd;
use test_support::hugepages::{exactly, PageSize};
use test_support::prelude::{map_raw as map, serial, unmap_raw as unmap, wait_until};
use test_support::process::wait_clean_and_present;
use test_support::tenant::{alloc_2m, root_or_skip, MIB};

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(7) % 253) as u8 + 1
}

/// One restart or crash with a running tenant and a clean pooled region.
fn restart_keeps_everything(crash: bool, test: &str) {
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let size = 64 * MIB;
    let Some(_pages) = exactly(PageSize::Huge2M, 2 * size / (2 * MIB), test) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("hugemem.sock");
    let config = dir.path().join("hugemem.toml");
    std::fs::write(&config, "[pool]\nlimit = \"1G\"\ntarget = \"512M\"\n").expect("config");
    let systemd = FakeSystemd::new(dir.path());
    let mut daemon = systemd.start(Path::new(env!("CARGO_BIN_EXE_hugemem")), &socket, &config);
    wait_until("READY=1", Duration::from_secs(30), || {
        systemd.ready_count() == 1
    });

    let mut tenant = Client::connect(&socket).expect("connect");
    let a = tenant.alloc(alloc_2m(size, false)).expect("tenant ALLOC");
    let token = a.token().expect("a re-attach token in the ALLOC reply");
    let p = map(a.fds[0].as_raw_fd(), size);
    // SAFETY: the tenant's live mapping of `size` bytes.
    let bytes = unsafe { std::slice::from_raw_parts_mut(p, size as usize) };
    for (i, b) in bytes.iter_mut().enumerate().step_by(4096) {
        *b = pattern(i);
    }
    let mut other = Client::connect(&socket).expect("connect");
    let first = other.alloc(alloc_2m(size, false)).expect("second ALLOC");
    let id = first.id;
    drop(first);
    other.free(id).expect("FREE");
    wait_clean_and_present(&mut other, size);
    drop(other);
    let before = tenant.stats().expect("stats");
    // Let the store catch up with the last change (a crash loses less
    // recent ones: the test would then find the region untracked).
    wait_until(
        "the fd store holds both regions and a state",
        Duration::from_secs(10),
        || {
            let n = systemd.names();
            n.iter().filter(|n| n.starts_with("hugemem-r")).count() == 2
                && n.iter().any(|n| n.starts_with("hugemem-state-"))
                && n.iter().any(|n| n == "hugemem-listener")
        },
    );
    std::thread::sleep(Duration::from_millis(600));

    if crash {
        daemon.signal(nix::sys::signal::Signal::SIGKILL);
        let _ = daemon.wait("the daemon");
    } else {
        daemon.signal(nix::sys::signal::Signal::SIGTERM);
        assert!(daemon.wait("the daemon").success(), "a clean stop");
    }
    // A client connecting while no daemon runs waits in the kept socket's
    // backlog (the socket file stays).
    let waiting = std::os::unix::net::UnixStream::connect(&socket)
        .expect("the kept socket accepts while the daemon restarts");
    let started = Instant::now();
    let mut daemon = systemd.start(Path::new(env!("CARGO_BIN_EXE_hugemem")), &socket, &config);
    let mut early = Client::from_stream(waiting).expect("served once the daemon is back");
    assert_eq!(early.stats().expect("stats").allocations.active, 1);
    wait_until("READY=1", Duration::from_secs(30), || {
        systemd.ready_count() == 2
    });

    // The VMM re-attaches with its token; its memory never changed.
    let mut tenant = Client::reconnect(
        &socket,
        &[(a.id, token)],
        Instant::now() + Duration::from_secs(30),
    )
    .expect("re-attach");
    let back_ms = started.elapsed().as_secs_f64() * 1e3;
    for (i, b) in bytes.iter().enumerate().step_by(4096) {
        assert_eq!(*b, pattern(i), "the tenant's byte {i} changed");
    }
    let after = tenant.stats().expect("stats");
    assert_eq!(after.allocations.active, 1, "{after}");
    assert_eq!(
        after.counters.fd_store_restores,
        before.counters.fd_store_restores + 1,
        "the restart from the fd store is counted: {after}"
    );
    assert_eq!(
        after.counters.bytes_created, before.counters.bytes_created,
        "no region created anew: {after}"
    );
    // The pool is back: a clean stop's exact state serves it warm at once;
    // after a crash it goes through quarantine (detached, refaulted) first.
    let mut next = Client::connect(&socket).expect("connect");
    let warm = Instant::now();
    let b = next
        .alloc(alloc_2m(size, false))
        .expect("ALLOC from the kept pool");
    let warm_ms = warm.elapsed().as_secs_f64() * 1e3;
    let s = next.stats().expect("stats");
    assert_eq!(
        s.counters.regions_pooled,
        before.counters.regions_pooled + 1,
        "served from the kept pool: {s}"
    );
    assert_eq!(
        s.counters.regions_fresh, before.counters.regions_fresh,
        "{s}"
    );
    if !crash {
        assert_eq!(
            s.scrub.bytes, 0,
            "nothing re-zeroed after a clean stop: {s}"
        );
        assert_eq!(
            s.counters.pages_detached, before.counters.pages_detached,
            "nothing detached after a clean stop: {s}"
        );
    }
    println!(
        "OBSERVED: {}: back and re-attached after {back_ms:.1} ms; ALLOC from the kept pool {warm_ms:.2} ms; re-zeroed by scrubbers {} B, pages detached +{}",
        if crash { "kill -9" } else { "SIGTERM restart" },
        s.scrub.bytes,
        s.counters.pages_detached - before.counters.pages_detached,
    );
    unmap(p, size);
    let id = a.id;
    drop(a);
    tenant.free(id).expect("FREE of the re-attached allocation");
    let bid = b.id;
    drop(b);
    next.free(bid).expect("FREE");
    drop(early);
    daemon.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(daemon.wait("the daemon").success());
}

#[test]
fn systemctl_restart_keeps_the_pool_the_allocations_and_the_socket() {
    restart_keeps_everything(
        false,
        "systemctl_restart_keeps_the_pool_the_allocations_and_the_socket",
    );
}

#[test]
fn kill_9_keeps_the_pool_the_allocations_and_the_socket() {
    restart_keeps_everything(true, "kill_9_keeps_the_pool_the_allocations_and_the_socket");
}
