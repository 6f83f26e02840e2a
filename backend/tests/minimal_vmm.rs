//! Runs the example VMM (`client/examples/minimal_vmm.rs`) against a real
//! daemon: real 2 MiB huge pages, a real KVM guest, eager and lazy.
//!
//! The example's source file is compiled into this test as a module
//! (`#[path]` below) and its `minimal_vmm::run_vmm` is called: the test
//! runs the example's own code, not a copy. Cargo builds examples during
//! `cargo test` but tells integration tests only where `[[bin]]` targets are
//! (`CARGO_BIN_EXE_<name>`), and building the example from inside the test
//! (`cargo build --example`) would run cargo inside cargo on a locked target
//! directory. The example's `main` only parses arguments and calls `run_vmm`.

#[allow(dead_code)] // its `main` is the example binary's entry point, unused here
#[path = "../../client/examples/minimal_vmm.rs"]
mod minimal_vmm;

use std::os::fd::AsFd;
use std::time::Duration;

use backend::client::Client;
use backend::proto::{AllocRequest, ClearMode, PagePolicy, RegionInfo};
use test_support::prelude::{reserve_2m, serial, wait_until, Map, TestDaemon};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const HUGE: u64 = 2 << 20;
/// 64 huge pages of guest RAM: enough that a scrubber takes a while over a
/// freed region, which is what leaves dirty pages for the lazy tests.
const SIZE: u64 = 64 * HUGE;
const STALE: u8 = 0xEE;
const DEADLINE: Duration = Duration::from_secs(30);

/// KVM and 2 MiB pages for two guests' RAM; `false` after a skip.
fn prerequisites(test: &str) -> bool {
    if let Err(reason) = microguest::kvm_available() {
        test_support::skip!("{test}: {reason}");
        return false;
    }
    reserve_2m(2 * SIZE / HUGE, test)
}

/// What a clean guest reports over all of `SIZE` (its image at 1 MiB covers
/// no 2 MiB boundary).
fn clean_line() -> String {
    format!("HUGEMEM-GUEST pages={} nonzero=0 status=0", SIZE / HUGE)
}

fn active_allocations(daemon: &TestDaemon) -> u64 {
    daemon.stats().allocations.active
}

#[test]
fn the_default_socket_is_the_daemons() {
    assert_eq!(
        minimal_vmm::DEFAULT_SOCKET,
        backend::daemon::config::DEFAULT_SOCKET
    );
}

#[test]
fn eager_and_lazy_on_clean_memory_boot_the_micro_guest() {
    const TEST: &str = "eager_and_lazy_on_clean_memory_boot_the_micro_guest";
    let _s = serial();
    if !prerequisites(TEST) {
        return;
    }
    let daemon = TestDaemon::start(|_| {});
    for mode in [ClearMode::Eager, ClearMode::Lazy] {
        let report = minimal_vmm::run_vmm(&daemon.socket(), SIZE, mode)
            .unwrap_or_else(|e| panic!("example VMM, {mode:?}: {e:?}"));
        println!("OBSERVED: {mode:?}: {report:?}");
        assert_eq!(report.page_size, HUGE, "64 MiB on `best` is 2 MiB pages");
        assert_eq!(report.serial, clean_line());
        // No dirty memory is handed out lazily to a uid not listed in
        // `lazy_dirty_uids`: a lazy ALLOC here gets CLEAN regions and runs as is.
        assert_eq!(report.lazy_regions, 0, "{mode:?}");
        assert_eq!(
            active_allocations(&daemon),
            0,
            "the example FREEd its memory"
        );
    }
    daemon.shutdown();
}

/// Tries at a dirty region: one is lost only when the scrubbers clean the
/// region between its FREE and the example's lazy ALLOC.
const TRIES: usize = 20;

#[test]
fn lazy_on_dirty_pooled_memory_boots_a_guest_that_sees_only_zeros() {
    const TEST: &str = "lazy_on_dirty_pooled_memory_boots_a_guest_that_sees_only_zeros";
    let _s = serial();
    if !prerequisites(TEST) {
        return;
    }
    let daemon = TestDaemon::start(|cfg| {
        // This uid may get dirty memory lazily; without detaching, a freed
        // region stays dirty (a previous tenant's bytes) until scrubbed.
        // SAFETY: geteuid has no preconditions and cannot fail.
        cfg.pool.lazy_dirty_uids = vec![unsafe { libc::geteuid() }];
        cfg.pool.detach_pages = false;
        // A scrubber claims one page at a time: a region handed out lazily
        // has at most one page per scrubber being cleared, the rest is the
        // previous tenant's until the fault service clears it (with the
        // default 64 MiB batch the whole region could be claimed at once).
        cfg.scrub.batch = backend::daemon::ByteSize(HUGE);
    });
    let mut tenant = daemon.client();
    for attempt in 0..TRIES {
        leave_dirty_region(&daemon, &mut tenant);
        let report = minimal_vmm::run_vmm(&daemon.socket(), SIZE, ClearMode::Lazy)
            .unwrap_or_else(|e| panic!("example VMM, lazy: {e:?}"));
        println!("OBSERVED: attempt {attempt}: {report:?}");
        // The region held STALE in every byte: a guest that read any of it
        // would have reported nonzero=1 and `run_vmm` would have failed.
        assert_eq!(report.serial, clean_line());
        assert_eq!(active_allocations(&daemon), 0, "the example FREEd");
        if report.lazy_regions > 0 {
            assert_eq!(report.lazy_regions, report.regions);
            lazy_without_hand_off_shows_stale_bytes(&daemon, &mut tenant);
            daemon.shutdown();
            return;
        }
    }
    panic!("the example never got a LAZY region the new daemon served in {TRIES} tries");
}

/// The control: the same boot on a LAZY region mapped without the hand-off
/// sees the previous tenant's bytes, so the setup above does hand out
/// regions a guest would read stale data from. A try counts only when the
/// region still held them: a region whose every page a scrubber cleared
/// between its FREE and the ALLOC can still be handed out flagged LAZY.
fn lazy_without_hand_off_shows_stale_bytes(daemon: &TestDaemon, tenant: &mut Client) {
    for attempt in 0..TRIES {
        leave_dirty_region(daemon, tenant);
        let alloc = tenant.alloc(request(ClearMode::Lazy)).expect("lazy ALLOC");
        let lazy = alloc.regions[0].flags & RegionInfo::FLAG_LAZY != 0;
        let seen = lazy.then(|| {
            let (mem, _) = minimal_vmm::map_regions(&alloc, |_| false).expect("map");
            minimal_vmm::boot_and_check(&mem, HUGE)
        });
        let id = alloc.id;
        drop(alloc);
        tenant.free(id).expect("FREE");
        match seen {
            Some(Err(e)) => {
                println!("OBSERVED: without the hand-off (attempt {attempt}): {e:#}");
                assert!(e.to_string().contains("nonzero=1"), "{e:#}");
                return;
            }
            Some(Ok(line)) => {
                println!("OBSERVED: control attempt {attempt}: LAZY but already scrubbed ({line})")
            }
            None => println!("OBSERVED: control attempt {attempt}: the scrubbers were first"),
        }
    }
    panic!("the control never saw a previous tenant's bytes in {TRIES} tries");
}

fn request(clear_mode: ClearMode) -> AllocRequest {
    AllocRequest {
        total_size: SIZE,
        page_policy: PagePolicy::Huge2M,
        clear_mode,
        lock: false,
        parts: vec![],
        want_paths: false,
    }
}

/// The example's check is real: the same boot on memory that is not clean
/// (one nonzero word at a 2 MiB boundary, anonymous memory, no daemon) fails
/// with the guest's own report.
#[test]
fn the_check_fails_on_memory_that_is_not_clean() {
    const TEST: &str = "the_check_fails_on_memory_that_is_not_clean";
    if let Err(reason) = microguest::kvm_available() {
        test_support::skip!("{TEST}: {reason}");
        return;
    }
    let fresh = || {
        GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), SIZE as usize)])
            .expect("anonymous guest memory")
    };
    // The control: zeroed anonymous memory is clean.
    minimal_vmm::boot_and_check(&fresh(), HUGE).expect("clean memory");
    let mem = fresh();
    mem.write_obj(0x5eed_u64, GuestAddress(3 * HUGE))
        .expect("write");
    let err = minimal_vmm::boot_and_check(&mem, HUGE).expect_err("memory was not clean");
    println!("OBSERVED: {err:#}");
    assert!(err.to_string().contains("nonzero=1"), "{err:#}");
}

/// A previous tenant: eager ALLOC, every byte STALE, FREE; returns once the
/// region left quarantine (dirty, or already scrubbed or discarded).
fn leave_dirty_region(daemon: &TestDaemon, tenant: &mut Client) {
    let alloc = tenant
        .alloc(request(ClearMode::Eager))
        .expect("eager ALLOC");
    {
        let map = Map::shared(alloc.fds[0].as_fd(), SIZE as usize);
        map.fill(0, map.len(), STALE);
    }
    let id = alloc.id;
    drop(alloc); // nothing of the tenant holds the region now
    let discarded = daemon.stats().counters.regions_discarded;
    tenant.free(id).expect("FREE");
    wait_until("the region to leave quarantine", DEADLINE, || {
        let s = daemon.stats();
        s.pool_sum(|p| p.dirty_bytes) > 0
            || (s.pool_sum(|p| p.quarantined_bytes) == 0
                && (s.pool_sum(|p| p.clean_bytes) >= SIZE
                    || s.counters.regions_discarded > discarded))
    });
}

/// A lazy VM (the example VMM on dirty pooled memory) kept running across
/// a takeover (issue 20): its uffd is handed to the old daemon, the daemon
/// is replaced (`takeover::receive` + `Daemon::start_inherited`, as
/// `hugemem serve --takeover` does) before the guest boots, and the guest's
/// faults are served by the new daemon: it reads only zeros and its own
/// writes, and its VMM's fallback never ran (its connection stayed open).
#[test]
fn a_lazy_vm_runs_on_across_a_takeover() {
    use backend::daemon::{restart::takeover, Config, Daemon};
    const TEST: &str = "a_lazy_vm_runs_on_across_a_takeover";
    let _s = serial();
    if !prerequisites(TEST) {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = Config {
        socket: dir.path().join("hugemem.sock"),
        ..Config::default()
    };
    cfg.pool.recheck_ms = 50;
    // SAFETY: geteuid has no preconditions and cannot fail.
    cfg.pool.lazy_dirty_uids = vec![unsafe { libc::geteuid() }];
    cfg.pool.detach_pages = false;
    cfg.scrub.batch = backend::daemon::ByteSize(HUGE);
    let socket = cfg.socket.clone();
    let mut daemon = Some(Daemon::start(cfg.clone()).expect("daemon starts"));
    let mut tenant = Client::connect(&socket).expect("connect");
    for attempt in 0..TRIES {
        // A dirty region in the pool (a previous tenant's STALE bytes).
        let alloc = tenant
            .alloc(request(ClearMode::Eager))
            .expect("eager ALLOC");
        {
            let map = Map::shared(alloc.fds[0].as_fd(), SIZE as usize);
            map.fill(0, map.len(), STALE);
        }
        let id = alloc.id;
        drop(alloc);
        tenant.free(id).expect("FREE");
        let d = daemon.as_ref().expect("daemon");
        wait_until("the region to leave quarantine", DEADLINE, || {
            let s = d.stats();
            s.pool_sum(|p| p.quarantined_bytes) == 0
        });
        let mut served_before = 0;
        let mut new = None;
        let report = minimal_vmm::run_vmm_with(&socket, SIZE, ClearMode::Lazy, || {
            let old = daemon.take().expect("the running daemon");
            served_before = old.lazy_work();
            let inherited = takeover::receive(&socket).expect("takeover: state received");
            new = Some(Daemon::start_inherited(cfg.clone(), inherited).expect("successor starts"));
            old.shutdown().expect("the old daemon exits");
        })
        .unwrap_or_else(|e| panic!("example VMM, lazy, across a takeover: {e:?}"));
        daemon = new.take().or(daemon.take());
        let d = daemon.as_ref().expect("daemon");
        println!(
            "OBSERVED: attempt {attempt}: {report:?}; lazy work counted by the old daemon {served_before}, by the new {}",
            d.lazy_work()
        );
        assert_eq!(report.serial, clean_line());
        assert_eq!(
            report.fallback_faults, 0,
            "the VMM's connection never dropped"
        );
        assert_eq!(
            d.stats().allocations.active,
            0,
            "the example FREEd on the new daemon"
        );
        // A try counts when the new daemon's fault service had work left
        // (the old one's scrubbers may clear and install every page ahead
        // of the guest before the takeover).
        if report.lazy_regions > 0 && d.lazy_work() > 0 {
            drop(tenant);
            daemon.take().expect("daemon").shutdown().expect("shutdown");
            return;
        }
    }
    panic!("the example never got a LAZY region the new daemon served in {TRIES} tries");
}

/// Set in the child process of the update test: the fd of the paused
/// guest's state (`minimal_vmm::Paused::to_memfd`).
const RESUME_FD_ENV: &str = "MINIMAL_VMM_RESUME_FD";

/// The example VMM updates itself under a running guest (issue 26): the
/// test is the old VMM (`start_and_pause`: ALLOC, the counting guest runs,
/// its vCPU is paused and saved), and a child process — this test binary
/// again, running only this test with the state's memfd inherited — is the
/// new one (`resume`: HANDOFF on its own connection, its own mappings of
/// the same memory, a new VM with the saved vCPU). The guest counts on
/// from where it stopped; the old connection owns nothing afterwards; the
/// daemon's accounting balances.
#[test]
fn the_example_vmm_updates_itself_and_the_guest_counts_on() {
    const TEST: &str = "the_example_vmm_updates_itself_and_the_guest_counts_on";
    if let Ok(fd) = std::env::var(RESUME_FD_ENV) {
        // The child: the new VMM.
        let raw: i32 = fd.parse().expect("the state fd");
        // SAFETY: the parent created this memfd without CLOEXEC for this
        // process, which inherited it; nothing else here owns it.
        let state = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
        let paused = minimal_vmm::Paused::from_memfd(state).expect("the paused guest's state");
        let report = minimal_vmm::resume(&paused, 4 * minimal_vmm::COUNTS_PER_EXIT)
            .expect("the new VMM resumes the guest");
        println!(
            "UPDATED pause={} resume={} end={} takeover_us={}",
            report.counter_at_pause,
            report.counter_at_resume,
            report.counter_at_end,
            report.takeover.as_micros()
        );
        return;
    }
    let _s = serial();
    if !prerequisites(TEST) {
        return;
    }
    let daemon = TestDaemon::start(|_| {});
    let mut old = daemon.client();
    let (alloc, paused) = minimal_vmm::start_and_pause(
        &mut old,
        &daemon.socket(),
        SIZE,
        4 * minimal_vmm::COUNTS_PER_EXIT,
    )
    .expect("the old VMM runs the counting guest");
    assert!(paused.counter >= 4 * minimal_vmm::COUNTS_PER_EXIT);
    let id = alloc.id;
    // The old VMM's own mappings and fds go; its connection stays open
    // (it still owns the allocation) until the successor has taken over.
    drop(alloc);
    let state = paused.to_memfd().expect("state memfd");
    let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([TEST, "--exact", "--nocapture", "--test-threads", "1"])
        .env(
            RESUME_FD_ENV,
            std::os::fd::AsRawFd::as_raw_fd(&state).to_string(),
        )
        .output()
        .expect("run the new VMM");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the new VMM failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        // The harness may print "test NAME ... " before it on the same line.
        .find_map(|l| l.find("UPDATED ").map(|at| &l[at..]))
        .unwrap_or_else(|| panic!("no report from the new VMM: {stdout}"));
    println!("OBSERVED: {line}");
    let field = |name: &str| -> u64 {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} in {line}"))
    };
    // The guest's memory came over as it was, and it counted on.
    assert_eq!(field("pause"), u64::from(paused.counter));
    assert_eq!(
        field("resume"),
        field("pause"),
        "the counter went back or jumped"
    );
    assert!(field("end") >= field("resume") + 4 * u64::from(minimal_vmm::COUNTS_PER_EXIT));
    // The old connection owns nothing now: FREE is refused like an unknown
    // id, and the successor's FREE released the allocation.
    assert!(matches!(
        old.free(id),
        Err(backend::client::ClientError::Refused {
            status: backend::proto::Status::NotFound,
            ..
        })
    ));
    let stats = daemon.stats();
    assert_eq!(stats.allocations.active, 0);
    assert_eq!(stats.counters.handoff_ok, 1);
    assert_eq!(
        stats.counters.allocs_ok - stats.counters.allocs_released,
        stats.allocations.active,
        "accounting: {stats}"
    );
    drop(old);
    daemon.shutdown();
}
