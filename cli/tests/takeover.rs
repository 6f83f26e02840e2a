//! `hugemem serve --takeover` between real processes (issue 20): a running
//! daemon hands its listening socket, pool, allocations and live
//! connections to a new one, and exits; tenants keep their connections,
//! memory and allocation ids, and the clean pool is served warm at once.
//!
//! Tests are serialized by one lock (shared huge-page pools); waits are
//! deadline-based.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use backend::client::Client;
use test_support::hugepages::{exactly, PageSize};
use test_support::prelude::{map_raw as map, serial, unmap_raw as unmap, wait_until};
use test_support::process::{wait_clean_and_present, ServeProcess as Daemon};
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

/// A running daemon (`hugemem serve`) on a socket in `dir`, with a config
/// whose `[pool]` section is `pool`; returns the socket, the config and the
/// process, once the socket answers.
fn first_daemon(dir: &Path, pool: &str) -> (PathBuf, PathBuf, Daemon) {
    let socket = dir.join("hugemem.sock");
    let config = dir.join("hugemem.toml");
    std::fs::write(&config, format!("[pool]\n{pool}")).expect("config");
    let daemon = Daemon(serve(&socket, &config, false));
    wait_until("the daemon answers", Duration::from_secs(30), || {
        Client::connect(&socket).is_ok()
    });
    (socket, config, daemon)
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
    let (socket, config, mut old) = first_daemon(dir.path(), "limit = \"1G\"\ntarget = \"512M\"\n");
    // The tenant: mapped, written, connection open.
    let mut tenant = Client::connect(&socket).expect("connect");
    let a = tenant.alloc(alloc_2m(size, false)).expect("tenant ALLOC");
    // A region through the pool: allocated, freed, clean again.
    let mut other = Client::connect(&socket).expect("connect");
    let first = other.alloc(alloc_2m(size, false)).expect("second ALLOC");
    let id = first.id;
    drop(first);
    other.free(id).expect("FREE");
    wait_clean_and_present(&mut other, size);
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
    let status = old.wait("the old daemon");
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
    new.signal(nix::sys::signal::Signal::SIGTERM);
    let status = new.wait("the new daemon");
    assert!(status.success(), "the new daemon exited with {status}");
    assert!(
        !socket.exists(),
        "socket removed by the new daemon's SIGTERM"
    );
}

/// Ten takeovers while sixteen tenants ALLOC, write and FREE in a loop on
/// connections of their own: no request fails, no connection is lost, and
/// at the end every allocation is gone, the pool's totals balance, and the
/// host's free huge pages are what they were.
#[test]
fn ten_takeovers_under_sixteen_tenants_lose_nothing() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    const TENANTS: usize = 16;
    const TAKEOVERS: usize = 10;
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let size = 8 * MIB;
    let pages = (TENANTS as u64) * size / (2 * MIB) + 16;
    let Some(_pages) = exactly(
        PageSize::Huge2M,
        pages,
        "ten_takeovers_under_sixteen_tenants_lose_nothing",
    ) else {
        return;
    };
    let free_before = test_support::hugepages::hugepages_2m("free_hugepages");
    let dir = tempfile::tempdir().expect("tempdir");
    let (socket, config, mut daemon) =
        first_daemon(dir.path(), "limit = \"1G\"\ntarget = \"512M\"\n");
    let stop = Arc::new(AtomicBool::new(false));
    let longest_us = Arc::new(AtomicU64::new(0));
    let tenants: Vec<_> = (0..TENANTS)
        .map(|t| {
            let (socket, stop, longest_us) =
                (socket.clone(), Arc::clone(&stop), Arc::clone(&longest_us));
            std::thread::spawn(move || -> Result<u64, String> {
                let mut c = Client::connect(&socket).map_err(|e| format!("connect: {e}"))?;
                c.set_timeout(Some(Duration::from_secs(60)))
                    .map_err(|e| e.to_string())?;
                let mut rounds = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let t0 = Instant::now();
                    let a = c
                        .alloc(alloc_2m(size, false))
                        .map_err(|e| format!("tenant {t} round {rounds}: ALLOC: {e}"))?;
                    let alloc_us = t0.elapsed().as_micros() as u64;
                    let p = map(a.fds[0].as_raw_fd(), size);
                    // SAFETY: this tenant's live mapping of `size` bytes.
                    let bytes = unsafe { std::slice::from_raw_parts_mut(p, size as usize) };
                    let dirty = bytes.iter().step_by(4096).any(|&b| b != 0);
                    bytes
                        .iter_mut()
                        .step_by(4096)
                        .for_each(|b| *b = t as u8 + 1);
                    unmap(p, size);
                    if dirty {
                        return Err(format!("tenant {t} round {rounds}: memory not zero"));
                    }
                    let id = a.id;
                    drop(a);
                    let t1 = Instant::now();
                    c.free(id)
                        .map_err(|e| format!("tenant {t} round {rounds}: FREE: {e}"))?;
                    let free_us = t1.elapsed().as_micros() as u64;
                    longest_us.fetch_max(alloc_us.max(free_us), Ordering::Relaxed);
                    rounds += 1;
                }
                Ok(rounds)
            })
        })
        .collect();
    let mut stalls = Vec::new();
    for i in 0..TAKEOVERS {
        std::thread::sleep(Duration::from_millis(300));
        let t0 = Instant::now();
        let next = Daemon(serve(&socket, &config, true));
        let status = daemon.wait("the old daemon");
        assert!(
            status.success(),
            "takeover {i}: the old daemon exited with {status}"
        );
        stalls.push(t0.elapsed().as_secs_f64() * 1e3);
        // The new daemon is the one the next takeover is from.
        daemon = next;
    }
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let mut rounds = 0;
    for (t, h) in tenants.into_iter().enumerate() {
        let r = h
            .join()
            .expect("tenant thread")
            .unwrap_or_else(|e| panic!("tenant {t} failed: {e}"));
        assert!(r > 0, "tenant {t} made no round");
        rounds += r;
    }
    let mut c = Client::connect(&socket).expect("connect");
    let s = c.stats().expect("stats");
    assert_eq!(s.allocations.active, 0, "every allocation freed: {s}");
    assert_eq!(s.counters.allocs_failed, 0, "{s}");
    assert_eq!(
        s.counters.takeovers, TAKEOVERS as u64,
        "every takeover counted: {s}"
    );
    assert_eq!(
        s.counters.allocs_ok - s.counters.allocs_released,
        s.allocations.active,
        "allocations accounted for: {s}"
    );
    assert_eq!(
        s.totals.created_bytes - s.totals.released_bytes,
        s.totals.held_bytes,
        "the pool's totals balance: {s}"
    );
    println!(
        "OBSERVED: {TAKEOVERS} takeovers, {rounds} ALLOC+FREE rounds by {TENANTS} tenants, 0 failed; \
         takeover to old exit (ms): {stalls:?}; longest ALLOC or FREE: {:.1} ms; \
         allocs_ok {} regions_fresh {} regions_pooled {}",
        longest_us.load(Ordering::Relaxed) as f64 / 1e3,
        s.counters.allocs_ok,
        s.counters.regions_fresh,
        s.counters.regions_pooled,
    );
    drop(c);
    daemon.signal(nix::sys::signal::Signal::SIGTERM);
    let status = daemon.wait("the last daemon");
    assert!(status.success(), "the last daemon exited with {status}");
    wait_until(
        "the host's free pages are back",
        Duration::from_secs(10),
        || test_support::hugepages::hugepages_2m("free_hugepages") == free_before,
    );
}

/// A successor that refuses (here: a stand-in that receives everything and
/// answers `REFUSED`) leaves the running daemon serving as before: the
/// tenant's connection, allocation and pool stay, scrubbing goes on.
#[test]
fn a_refused_takeover_leaves_the_daemon_serving() {
    use backend::daemon::restart::takeover::channel;
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let size = 16 * MIB;
    let Some(_pages) = exactly(
        PageSize::Huge2M,
        2 * size / (2 * MIB),
        "a_refused_takeover_leaves_the_daemon_serving",
    ) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let (socket, _config, mut daemon) =
        first_daemon(dir.path(), "limit = \"1G\"\ntarget = \"512M\"\n");
    let mut tenant = Client::connect(&socket).expect("connect");
    let a = tenant.alloc(alloc_2m(size, false)).expect("ALLOC");
    let before = tenant.stats().expect("stats");

    let control = std::os::unix::net::UnixStream::connect(channel::control_path(&socket))
        .expect("the control socket");
    channel::write_line(&control, channel::HELLO).expect("hello");
    let (state, fds) = channel::recv_all(&control).expect("the state and fds");
    let doc =
        backend::daemon::restart::takeover::State::from_memfd(state).expect("a trusted document");
    assert_eq!(doc.allocations.len(), 1, "{doc:?}");
    assert_eq!(doc.connections.len(), 1, "{doc:?}");
    drop(fds);
    channel::write_line(&control, "REFUSED a test says no").expect("refuse");
    drop(control);

    // Served on by the same daemon, on the same connection.
    wait_until("the daemon thaws", Duration::from_secs(10), || {
        tenant.stats().is_ok_and(|s| s.pid == before.pid)
    });
    let id = a.id;
    drop(a);
    tenant.free(id).expect("FREE after a refused takeover");
    wait_until(
        "the freed region is scrubbed clean",
        Duration::from_secs(30),
        || {
            tenant
                .stats()
                .is_ok_and(|s| s.pools.iter().any(|p| p.clean_bytes == size))
        },
    );
    let b = tenant
        .alloc(alloc_2m(size, false))
        .expect("ALLOC from the pool");
    let id = b.id;
    drop(b);
    tenant.free(id).expect("FREE");
    assert!(
        daemon.0.try_wait().expect("try_wait").is_none(),
        "the daemon still runs"
    );
    daemon.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(daemon.wait("the daemon").success());
}

/// A state document of a newer version is refused whole, with a message
/// naming both versions, and the predecessor is told (it serves on).
#[test]
fn a_newer_state_document_is_refused_with_its_version() {
    use backend::daemon::restart::takeover::{channel, state};
    let _s = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("hugemem.sock");
    let config = dir.path().join("hugemem.toml");
    std::fs::write(&config, "").expect("config");
    let control = std::os::unix::net::UnixListener::bind(channel::control_path(&socket))
        .expect("a stand-in predecessor's control socket");
    let predecessor = std::thread::spawn(move || {
        let (s, _) = control.accept().expect("accept");
        let hello = channel::read_line(&s, Duration::from_secs(30)).expect("hello");
        assert_eq!(hello, channel::HELLO);
        let doc = state::State {
            format: state::FORMAT.into(),
            version: state::VERSION + 1,
            daemon_version: "99.0.0".into(),
            pid: std::process::id(),
            seq: 1,
            last: true,
            listener: None,
            metrics: None,
            socket_owned: true,
            next_region: 1,
            next_alloc: 1,
            next_session: 1,
            regions: Vec::new(),
            allocations: Vec::new(),
            connections: Vec::new(),
            fills: Vec::new(),
            clone_templates: Vec::new(),
            counters: Default::default(),
        };
        channel::send_all(&s, &doc.to_memfd().expect("memfd"), &[]).expect("send");
        channel::read_line(&s, Duration::from_secs(30)).expect("answer")
    });
    let out = Command::new(env!("CARGO_BIN_EXE_hugemem"))
        .args(["serve", "--takeover", "--config"])
        .arg(&config)
        .arg("--socket")
        .arg(&socket)
        .output()
        .expect("hugemem serve --takeover");
    let answer = predecessor.join().expect("stand-in");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "refused: {stderr}");
    assert!(answer.starts_with("REFUSED"), "{answer}");
    assert!(
        answer.contains(&format!("version {}", state::VERSION + 1)),
        "{answer}"
    );
    assert!(stderr.contains("version"), "{stderr}");
    assert!(!socket.exists(), "nothing was served");
}

/// A tenant that FREEs its allocation while an fd of it sits in flight (sent
/// over a socket nobody reads) gains nothing from a takeover: the region
/// comes over quarantined, stays withheld in the new daemon (its write lease
/// still fails), and is never handed to the next tenant; once the fd in
/// flight is gone it is proved free and pooled.
#[test]
fn an_fd_in_flight_across_a_takeover_gains_nothing() {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let _s = serial();
    if !root_or_skip() {
        return;
    }
    let size = 16 * MIB;
    let Some(_pages) = exactly(
        PageSize::Huge2M,
        2 * size / (2 * MIB),
        "an_fd_in_flight_across_a_takeover_gains_nothing",
    ) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let (socket, config, mut old) = first_daemon(
        dir.path(),
        "limit = \"1G\"\ntarget = \"512M\"\nrecheck_ms = 50\n",
    );
    let mut tenant = Client::connect(&socket).expect("connect");
    let a = tenant.alloc(alloc_2m(size, false)).expect("ALLOC");
    let (tx, rx) = std::os::unix::net::UnixStream::pair().expect("socketpair");
    let iov = [std::io::IoSlice::new(b"x")];
    let fds = [a.fds[0].as_raw_fd()];
    sendmsg::<()>(
        tx.as_raw_fd(),
        &iov,
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::empty(),
        None,
    )
    .expect("an fd in flight");
    let id = a.id;
    drop(a);
    tenant.free(id).expect("FREE");
    let withheld = |c: &mut Client| {
        c.stats()
            .map(|s| s.pools.iter().map(|p| p.withheld_bytes).sum::<u64>())
            .unwrap_or(0)
    };
    wait_until("the region is withheld", Duration::from_secs(30), || {
        withheld(&mut tenant) == size
    });
    let mut new = Daemon(serve(&socket, &config, true));
    assert!(old.wait("the old daemon").success());
    let s = tenant.stats().expect("stats");
    assert_eq!(s.pid, new.0.id(), "{s}");
    // Still withheld in the new daemon, after its own checks.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(withheld(&mut tenant), size, "withheld after the takeover");
    let mut next = Client::connect(&socket).expect("connect");
    let b = next
        .alloc(alloc_2m(size, false))
        .expect("the next tenant's ALLOC");
    let s2 = next.stats().expect("stats");
    assert_eq!(
        s2.counters.regions_pooled, s.counters.regions_pooled,
        "the withheld region was not handed out: {s2}"
    );
    assert!(
        s2.regions
            .as_ref()
            .is_some_and(|r| r.iter().all(|r| r.id != id || r.alloc_id.is_none())),
        "{s2}"
    );
    // The fd in flight goes: the region is proved free and pooled.
    drop((tx, rx));
    wait_until(
        "the region leaves quarantine",
        Duration::from_secs(30),
        || withheld(&mut next) == 0,
    );
    let bid = b.id;
    drop(b);
    next.free(bid).expect("FREE");
    new.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(new.wait("the new daemon").success());
}
