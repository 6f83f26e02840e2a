//! Lazy mode against the real kernel: the daemon-side fault service
//! (`backend::fault`) and the VMM side (`backend::lazy`), with dirty pooled
//! memory (2 MiB pages filled with a stale `0xEE` pattern, then marked dirty).
//!
//! Every wait has a deadline; faulting threads hold their mapping so a failed
//! test never unmaps under them; children are killed on drop. Without free
//! 2 MiB pages or MINOR_HUGETLBFS a test prints `SKIP:` and passes.
//!
//! The service tests run one at a time (a process-wide lock), so thread and
//! fd counts taken before and after a test are its own.
//!
//! Three tests re-execute this binary as a child (`HUGEMEM_LAZY_ROLE`): a VMM
//! that is killed while it faults, and a stand-in daemon (speaking the real
//! protocol and running the real fault service) that is killed with SIGKILL
//! while a lazy guest runs.

use test_support::lazy::{touch, wait_deadline};
use test_support::prelude::{serial, Map};

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use backend::client::Client;
use backend::fault::{FaultError, FaultMapping, FaultService, FaultServiceConfig, StopReason};
use backend::lazy::{GuestMapping, LazyGuest, LazyOptions, PreparedLazy};
use backend::proto::{
    recv_message, send_message, AllocRequest, ClearMode, Header, PagePolicy as WirePolicy,
    RegionInfo, Reply, ReplyBody, Request, Status, ANY_NODE, FEATURE_LAZY,
};
use backend::uffd::{abi, CreateFlags, RegisterMode, Uffd};
use guest_mem::{PagePolicy, PageSize, PageState, Region, RegionSpec};

const HUGE: usize = 2 << 20;
const HUGE_U64: u64 = 2 << 20;
const STALE: u8 = 0xEE;
const DEADLINE: Duration = Duration::from_secs(20);
const ROLE_ENV: &str = "HUGEMEM_LAZY_ROLE";
const CHILD_SOCK_FD: i32 = 3;

// ---------------------------------------------------------------------------
// Helpers.

fn huge_pages() -> Result<(), String> {
    static RESERVED: OnceLock<Result<(), String>> = OnceLock::new();
    RESERVED
        .get_or_init(|| test_support::hugepages::free_pages(PageSize::Huge2M, 24, None))
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

fn setup(test: &str, features: u64) -> Option<Uffd> {
    match huge_pages().and_then(|()| uffd_with(features)) {
        Ok(u) => Some(u),
        Err(reason) => {
            test_support::skip!("{test}: {reason}");
            None
        }
    }
}

/// A pooled-looking region: populated (so every page is in the page cache),
/// filled with a previous tenant's pattern, then marked dirty.
fn dirty_region(pages: usize) -> Arc<Region> {
    let region = unpopulated_region(pages);
    region
        .prepare_eager(&topology(), &clearing::RunOptions::default())
        .expect("populate");
    // SAFETY: nothing else uses the region yet: no guest maps it and no
    // scrubber or service runs on it.
    unsafe { region.as_mut_slice() }.fill(STALE);
    region.mark_all_dirty();
    assert_eq!(region.states().counts().dirty, pages);
    Arc::new(region)
}

fn unpopulated_region(pages: usize) -> Region {
    let spec = RegionSpec::new("lazy-test", (pages * HUGE) as u64, None)
        .with_policy(PagePolicy::Strict(PageSize::Huge2M));
    Region::create(&topology(), &spec).expect("region")
}

fn topology() -> numa::Topology {
    numa::Topology::detect().expect("topology")
}

fn cfg(handlers: usize, scrubbers: usize) -> FaultServiceConfig {
    FaultServiceConfig {
        handler_threads: handlers,
        scrub_threads_per_node: scrubbers,
        label: "test".into(),
        ..FaultServiceConfig::default()
    }
}

/// Service threads and uffds alive in this process.
fn service_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|t| {
                    std::fs::read_to_string(t.path().join("comm"))
                        .is_ok_and(|c| c.starts_with("hm-uffd") || c.starts_with("hm-lazy"))
                })
                .count()
        })
        .unwrap_or(0)
}

fn uffds_open() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|f| {
                    std::fs::read_link(f.path())
                        .is_ok_and(|l| l.to_string_lossy() == "anon_inode:[userfaultfd]")
                })
                .count()
        })
        .unwrap_or(0)
}

fn mapping(map: &Map, region: &Arc<Region>) -> Vec<FaultMapping> {
    vec![FaultMapping {
        vmm_start: map.addr(),
        len: region.len(),
        region: Arc::clone(region),
        region_offset: 0,
    }]
}

// ---------------------------------------------------------------------------
// Daemon side: the fault service.

/// Concurrent faults on different pages: each page cleared once, every
/// reader sees zeros, nothing of the stale pattern is visible afterwards.
#[test]
fn service_clears_dirty_pages_on_fault() {
    let _g = serial();
    let Some(uffd) = setup(
        "service_clears_dirty_pages_on_fault",
        abi::UFFD_FEATURE_EXACT_ADDRESS,
    ) else {
        return;
    };
    let region = dirty_region(8);
    let guest = Map::shared(region.fd(), region.len() as usize);
    uffd.register(guest.addr(), region.len(), RegisterMode::MINOR)
        .expect("register");
    let keep = uffd.try_clone().expect("dup");
    let svc = FaultService::start(cfg(2, 0), uffd, mapping(&guest, &region), None).expect("start");
    let readers: Vec<_> = (0..8)
        .map(|p| touch(&guest, p * HUGE + 0x1_2345 + p * 4096))
        .collect();
    for (p, r) in readers.into_iter().enumerate() {
        assert_eq!(
            r.recv_timeout(DEADLINE).expect("fault served"),
            0,
            "page {p}"
        );
    }
    assert!(
        guest.none_is(0, 8 * HUGE, STALE),
        "stale bytes visible to the guest"
    );
    // Counters move just after the wake-up the readers saw.
    wait_deadline("the counters", || svc.stats().latency.count == 8);
    let s = svc.stats();
    println!("OBSERVED: 8 faults: {s:?}");
    assert_eq!((s.faults, s.minor, s.served_cleared), (8, 8, 8));
    assert_eq!(s.fault_bytes_cleared, 8 * HUGE_U64);
    assert_eq!(s.latency.count, 8);
    assert_eq!(region.states().counts().mapped, 8);
    let report = svc.stop();
    assert_eq!(report.reason, StopReason::Requested);
    assert_eq!(keep.fdinfo().expect("fdinfo").total, 0);
}

/// Many vCPUs on one page: one clear, everyone woken.
#[test]
fn concurrent_faults_on_one_page_clear_it_once() {
    let _g = serial();
    let Some(uffd) = setup("concurrent_faults_on_one_page_clear_it_once", 0) else {
        return;
    };
    let region = dirty_region(4);
    let guest = Map::shared(region.fd(), region.len() as usize);
    uffd.register(guest.addr(), region.len(), RegisterMode::MINOR)
        .expect("register");
    let svc = FaultService::start(cfg(3, 0), uffd, mapping(&guest, &region), None).expect("start");
    let readers: Vec<_> = (0..6).map(|i| touch(&guest, 2 * HUGE + i * 8192)).collect();
    for r in readers {
        assert_eq!(r.recv_timeout(DEADLINE).expect("served"), 0);
    }
    // Events of woken threads may still sit in the queue; let them drain.
    wait_deadline("every read event handled", || {
        let s = svc.stats();
        s.served_cleared + s.coalesced + s.served_mapped == s.faults
    });
    let s = svc.stop().stats;
    println!("OBSERVED: 6 readers of one page: {s:?}");
    assert_eq!(s.served_cleared, 1, "one clear");
    assert_eq!(s.served_cleared + s.coalesced + s.served_mapped, s.faults);
    assert_eq!(region.states().get(2), Ok(PageState::Mapped));
    assert_eq!(
        region.states().counts().dirty,
        3,
        "untouched pages stay dirty"
    );
}

/// Scrubbers clear every page and install it ahead: the guest then reads
/// everything without a single fault.
#[test]
fn scrubber_installs_pages_ahead_of_faults() {
    let _g = serial();
    let Some(uffd) = setup("scrubber_installs_pages_ahead_of_faults", 0) else {
        return;
    };
    let threads0 = service_threads();
    let region = dirty_region(8);
    let guest = Map::shared(region.fd(), region.len() as usize);
    uffd.register(guest.addr(), region.len(), RegisterMode::MINOR)
        .expect("register");
    let mut c = cfg(1, 1);
    c.topology = Some(Arc::new(topology()));
    let svc = FaultService::start(c, uffd, mapping(&guest, &region), None).expect("start");
    wait_deadline("the scrubber to finish", || {
        region.states().counts().mapped == 8
    });
    assert_eq!(svc.dirty_pages(), 0);
    assert!(guest.none_is(0, 8 * HUGE, STALE));
    let s = svc.stop().stats;
    assert_eq!(service_threads(), threads0, "handler and scrubber joined");
    println!("OBSERVED: scrubbed ahead: {s:?}");
    assert_eq!((s.faults, s.scrub_pages, s.precontinued), (0, 8, 8));
    assert_eq!(s.scrub_bytes, 8 * HUGE_U64);
}

/// Stopping a service (FREE) with a fault in flight: threads joined, its uffd
/// copy closed, the fault stays pending (the VMM's copy keeps the uffd, so
/// nothing uncleared is mapped), and a later service serves it. The first
/// service runs without scrubbers, so pages 1..4 are still dirty at the stop
/// in every run (a scrubber could win that race; that scrubbers are joined
/// on stop is checked in `scrubber_installs_pages_ahead_of_faults`).
#[test]
fn stopped_service_leaves_faults_pending_and_leaks_nothing() {
    let _g = serial();
    let Some(uffd) = setup("stopped_service_leaves_faults_pending_and_leaks_nothing", 0) else {
        return;
    };
    let (threads0, uffds0) = (service_threads(), uffds_open());
    let region = dirty_region(4);
    let guest = Map::shared(region.fd(), region.len() as usize);
    uffd.register(guest.addr(), region.len(), RegisterMode::MINOR)
        .expect("register");
    let svc = FaultService::start(
        cfg(2, 0),
        uffd.try_clone().expect("dup"),
        mapping(&guest, &region),
        None,
    )
    .expect("start");
    assert_eq!(touch(&guest, 0).recv_timeout(DEADLINE).expect("served"), 0);
    svc.stop();
    assert_eq!(service_threads(), threads0, "every service thread joined");
    // `uffds0` counted the test's own uffd (the VMM's copy): only it is left.
    assert_eq!(uffds_open(), uffds0, "only the VMM's copy is open");
    assert_eq!(region.states().counts().clearing, 0);

    // A fault after the stop waits; no uncleared page shows up.
    let late_page = 1;
    assert_eq!(
        region.states().get(late_page),
        Ok(PageState::Dirty),
        "no scrubber ran: page 1 is still dirty"
    );
    let late = touch(&guest, late_page * HUGE + 5);
    wait_deadline("the late fault to be raised", || {
        uffd.fdinfo().is_ok_and(|i| i.total == 1)
    });
    assert!(
        late.recv_timeout(Duration::from_millis(50)).is_err(),
        "nobody serves it"
    );
    let svc = FaultService::start(
        cfg(1, 0),
        uffd.try_clone().expect("dup"),
        mapping(&guest, &region),
        None,
    )
    .expect("restart");
    assert_eq!(
        late.recv_timeout(DEADLINE)
            .expect("served by the new service"),
        0
    );
    drop(svc);
    assert_eq!(service_threads(), threads0);
}

/// A page another thread (a pool scrubber) holds in `Clearing`, and that
/// will never be installed by it: the fault is re-checked until the page is
/// clean, then installed.
#[test]
fn fault_on_a_page_a_pool_scrubber_holds_is_served_when_it_is_done() {
    let _g = serial();
    let Some(uffd) = setup(
        "fault_on_a_page_a_pool_scrubber_holds_is_served_when_it_is_done",
        0,
    ) else {
        return;
    };
    let region = dirty_region(2);
    let guest = Map::shared(region.fd(), region.len() as usize);
    uffd.register(guest.addr(), region.len(), RegisterMode::MINOR)
        .expect("register");
    // The "pool scrubber" claims page 1 before the service starts.
    region
        .states()
        .try_transition(1, PageState::Dirty, PageState::Clearing)
        .expect("claim");
    let svc = FaultService::start(cfg(1, 0), uffd, mapping(&guest, &region), None).expect("start");
    let reader = touch(&guest, HUGE + 99);
    wait_deadline("the fault to be deferred", || svc.stats().coalesced == 1);
    assert!(
        reader.recv_timeout(Duration::from_millis(20)).is_err(),
        "not served while Clearing"
    );
    // SAFETY: this thread owns page 1 through its Clearing state; no guest
    // has it mapped (the reader is blocked in its fault).
    unsafe { region.as_ptr().wrapping_add(HUGE).write_bytes(0, HUGE) };
    region
        .states()
        .try_transition(1, PageState::Clearing, PageState::Clean)
        .expect("done");
    assert_eq!(reader.recv_timeout(DEADLINE).expect("served once clean"), 0);
    assert!(guest.none_is(HUGE, HUGE, STALE));
    // Counted once, as coalesced; its wait is in the latency histogram.
    wait_deadline("the counters", || svc.stats().latency.count == 1);
    assert_eq!((svc.stats().coalesced, svc.stats().served_clean), (1, 0));
    assert_eq!(region.states().get(1), Ok(PageState::Mapped));
    drop(svc);
}

/// A dirty page missing from the page cache would not MINOR-fault: refused.
#[test]
fn dirty_but_not_resident_region_is_refused() {
    let _g = serial();
    let Some(uffd) = setup("dirty_but_not_resident_region_is_refused", 0) else {
        return;
    };
    let region = unpopulated_region(2);
    region.mark_all_dirty();
    let region = Arc::new(region);
    let guest = Map::shared(region.fd(), region.len() as usize);
    match FaultService::start(cfg(1, 0), uffd, mapping(&guest, &region), None) {
        Err(FaultError::NotResident { page: 0, .. }) => {}
        other => panic!("expected NotResident, got {other:?}"),
    }
    let region2 = dirty_region(2);
    let bad = vec![FaultMapping {
        vmm_start: guest.addr() + 4096,
        len: HUGE_U64,
        region: region2,
        region_offset: 0,
    }];
    let uffd = uffd_with(0).expect("uffd");
    assert!(matches!(
        FaultService::start(cfg(1, 0), uffd, bad, None),
        Err(FaultError::BadMapping { .. })
    ));
}

/// A VMM that registered MISSING too: a never-allocated page raises MISSING
/// and is filled with zeros by `UFFDIO_COPY`.
#[test]
fn missing_fault_is_filled_with_zeros() {
    let _g = serial();
    let Some(uffd) = setup("missing_fault_is_filled_with_zeros", 0) else {
        return;
    };
    let region = Arc::new(unpopulated_region(2));
    let guest = Map::shared(region.fd(), region.len() as usize);
    uffd.register(
        guest.addr(),
        region.len(),
        RegisterMode::MISSING | RegisterMode::MINOR,
    )
    .expect("register");
    let svc = FaultService::start(cfg(1, 0), uffd, mapping(&guest, &region), None).expect("start");
    assert_eq!(
        touch(&guest, HUGE + 17)
            .recv_timeout(DEADLINE)
            .expect("served"),
        0
    );
    let s = svc.stop().stats;
    assert_eq!((s.missing, s.served_adopted), (1, 1));
    assert_eq!(region.states().get(1), Ok(PageState::Mapped));
    assert_eq!(region.states().get(0), Ok(PageState::Unpopulated));
}

/// `munmap` of all guest RAM (EVENT_UNMAP): the service drops the ranges and ends.
#[test]
fn unmap_of_all_guest_ram_ends_the_service() {
    let _g = serial();
    let Some(uffd) = setup(
        "unmap_of_all_guest_ram_ends_the_service",
        abi::UFFD_FEATURE_EVENT_UNMAP,
    ) else {
        return;
    };
    let region = dirty_region(2);
    let guest = Map::shared(region.fd(), region.len() as usize);
    uffd.register(guest.addr(), region.len(), RegisterMode::MINOR)
        .expect("register");
    let svc = FaultService::start(cfg(1, 0), uffd, mapping(&guest, &region), None).expect("start");
    assert_eq!(touch(&guest, 0).recv_timeout(DEADLINE).expect("served"), 0);
    // munmap waits until the service reads the UNMAP event.
    let unmapper = std::thread::spawn(move || drop(guest));
    assert_eq!(svc.wait_ended(DEADLINE), Some(StopReason::AllUnmapped));
    unmapper.join().expect("munmap returned");
    let s = svc.stop().stats;
    assert_eq!(s.unmap_events, 1);
}

const VMM_DIES_TEST: &str = "vmm_killed_mid_faults_ends_the_service";
const VMM_ROLE: &str = "vmm";

/// The VMM (a child) is SIGKILLed while its threads fault on every page:
/// the service notices through the VMM's pidfd, joins its threads, leaves no
/// page half-cleared, and closes its uffd.
#[test]
fn vmm_killed_mid_faults_ends_the_service() {
    if role().as_deref() == Some(VMM_ROLE) {
        return vmm_child();
    }
    if role().is_some() {
        return;
    }
    let _g = serial();
    if setup(VMM_DIES_TEST, 0).is_none() {
        return;
    }
    let (threads0, uffds0) = (service_threads(), uffds_open());
    let region = dirty_region(16);
    let (ours, theirs) = UnixStream::pair().expect("socketpair");
    let child = spawn_role(VMM_DIES_TEST, VMM_ROLE, Some(&OwnedFd::from(theirs)));
    backend::proto::socket::send_all(ours.as_fd(), &region.len().to_le_bytes(), &[region.fd()])
        .expect("send memfd");
    let mut fds = Vec::new();
    let hello = recv_exact(ours.as_fd(), 8, &mut fds);
    let vmm_addr = u64::from_le_bytes(hello.try_into().expect("8 bytes"));
    let uffd = Uffd::from_owned_fd(fds.pop().expect("uffd")).expect("a userfaultfd");
    let pid = i32::try_from(child.id()).expect("pid");
    let pidfd = backend::daemon::peers::peer::pidfd_open(pid).expect("pidfd");
    let maps = vec![FaultMapping {
        vmm_start: vmm_addr,
        len: region.len(),
        region: Arc::clone(&region),
        region_offset: 0,
    }];
    // One handler, so faults queue up behind each other and the kill lands mid-run.
    let svc = FaultService::start(cfg(1, 0), uffd, maps, Some(pidfd)).expect("start");
    wait_deadline("a few faults", || svc.stats().served_cleared >= 3);
    child.kill9();
    // The pidfd, or a fill failing with ESRCH if the address space went
    // first (the kernel tears the mm down before it signals the pidfd).
    let ended = svc.wait_ended(DEADLINE);
    assert!(
        matches!(ended, Some(StopReason::PeerExited | StopReason::VmmGone)),
        "{ended:?}"
    );
    let report = svc.stop();
    println!(
        "OBSERVED: VMM killed mid-run: ended {:?}, {:?}",
        report.reason, report.stats
    );
    let counts = region.states().counts();
    assert_eq!(counts.clearing, 0, "no page left half-cleared: {counts:?}");
    assert_eq!(counts.total(), 16);
    assert_eq!(service_threads(), threads0);
    assert_eq!(
        uffds_open(),
        uffds0,
        "the VMM's uffd closed with the service"
    );
}

fn vmm_child() {
    let sock = child_socket();
    let mut fds = Vec::new();
    let len = u64::from_le_bytes(
        recv_exact(sock.as_fd(), 8, &mut fds)
            .try_into()
            .expect("8 bytes"),
    );
    let memfd = fds.pop().expect("memfd");
    let guest = Map::shared(memfd.as_fd(), usize::try_from(len).expect("fits"));
    let uffd = uffd_with(0).expect("uffd");
    uffd.register(guest.addr(), len, RegisterMode::MINOR)
        .expect("register");
    backend::proto::socket::send_all(sock.as_fd(), &guest.addr().to_le_bytes(), &[uffd.as_fd()])
        .expect("send uffd");
    // Four threads fault over every page until the parent kills us.
    let pages = usize::try_from(len).expect("fits") / HUGE;
    let workers: Vec<_> = (0..4)
        .map(|t| {
            let g = Arc::clone(&guest);
            std::thread::spawn(move || {
                for p in (t..pages).step_by(4) {
                    assert_eq!(g.read(p * HUGE), 0);
                }
            })
        })
        .collect();
    for w in workers {
        let _ = w.join();
    }
    std::thread::sleep(DEADLINE);
}

// ---------------------------------------------------------------------------
// VMM side: LazyGuest and its fallback.

/// The fallback alone (no daemon): every fault is cleared through the VMM's
/// own second mapping.
#[test]
fn local_fallback_serves_dirty_memory() {
    let _g = serial();
    if setup("local_fallback_serves_dirty_memory", 0).is_none() {
        return;
    }
    let region = dirty_region(4);
    let guest = Map::shared(region.fd(), region.len() as usize);
    let info = region_info(&region);
    let m = GuestMapping {
        region_id: info.region_id,
        region_offset: 0,
        addr: guest.addr(),
        len: region.len(),
    };
    let lazy = PreparedLazy::new(&[m], &[info], &[region.fd()], LazyOptions::default())
        .expect("prepare")
        .start_local()
        .expect("start");
    assert!(lazy.wait_fallback(DEADLINE));
    let readers: Vec<_> = (0..4).map(|p| touch(&guest, p * HUGE + 4096 * p)).collect();
    for r in readers {
        assert_eq!(r.recv_timeout(DEADLINE).expect("served"), 0);
    }
    assert!(guest.none_is(0, 4 * HUGE, STALE));
    wait_deadline("the counters", || lazy.stats().cleared == 4);
    let s = lazy.stats();
    assert_eq!((s.cleared, s.stale, s.unknown), (4, 0, 0));
}

fn region_info(region: &Region) -> RegionInfo {
    RegionInfo {
        region_id: 5,
        guest_phys: 0,
        size: region.len(),
        page_size: HUGE_U64,
        node: ANY_NODE,
        flags: RegionInfo::FLAG_LAZY,
    }
}

const KILL_SERVE_TEST: &str = "daemon_killed_while_lazy_guest_runs_fallback_serves";
const KILL_SWALLOW_TEST: &str = "daemon_killed_holding_an_unanswered_fault";
const DAEMON_ROLE: &str = "daemon";
const SWALLOW_ROLE: &str = "daemon-swallow";
const KILL_PAGES: usize = 8;

/// kill -9 of the daemon while a lazy guest runs: pages faulted before are
/// served by the daemon, pages faulted after by the VMM's fallback; the guest
/// never hangs and never sees the stale pattern.
#[test]
fn daemon_killed_while_lazy_guest_runs_fallback_serves() {
    if role().as_deref() == Some(DAEMON_ROLE) {
        return mini_daemon(false);
    }
    if role().is_some() {
        return;
    }
    let _g = serial();
    if setup(KILL_SERVE_TEST, 0).is_none() {
        return;
    }
    let (daemon, client, alloc, guest, lazy) = lazy_guest_with_child(KILL_SERVE_TEST, DAEMON_ROLE);
    for p in 0..KILL_PAGES / 2 {
        assert_eq!(
            touch(&guest, p * HUGE + 99)
                .recv_timeout(DEADLINE)
                .expect("daemon served"),
            0
        );
    }
    assert!(!lazy.stats().active);
    daemon.kill9();
    assert!(
        lazy.wait_fallback(DEADLINE),
        "the watcher noticed the daemon died"
    );
    let readers: Vec<_> = (KILL_PAGES / 2..KILL_PAGES)
        .map(|p| touch(&guest, p * HUGE + 7))
        .collect();
    for r in readers {
        assert_eq!(r.recv_timeout(DEADLINE).expect("fallback served"), 0);
    }
    assert!(guest.none_is(0, KILL_PAGES * HUGE, STALE));
    wait_deadline("the counters", || {
        lazy.stats().cleared == (KILL_PAGES / 2) as u64
    });
    let s = lazy.stats();
    println!("OBSERVED: after kill -9 of the daemon: {s:?}");
    assert_eq!(s.cleared, (KILL_PAGES / 2) as u64);
    drop((lazy, alloc, client));
}

/// kill -9 of a daemon that read a fault event and never answered it: the
/// fallback wakes the range, the fault comes again and is served.
#[test]
fn daemon_killed_holding_an_unanswered_fault() {
    if role().as_deref() == Some(SWALLOW_ROLE) {
        return mini_daemon(true);
    }
    if role().is_some() {
        return;
    }
    let _g = serial();
    if setup(KILL_SWALLOW_TEST, 0).is_none() {
        return;
    }
    let (daemon, client, alloc, guest, lazy) =
        lazy_guest_with_child(KILL_SWALLOW_TEST, SWALLOW_ROLE);
    let blocked = touch(&guest, 3 * HUGE + 0x777);
    // The daemon has read the event (pending 0) and the thread still waits (total 1).
    wait_deadline("the daemon to read the fault", || {
        lazy.uffd()
            .fdinfo()
            .is_ok_and(|i| (i.pending, i.total) == (0, 1))
    });
    assert!(
        blocked.recv_timeout(Duration::from_millis(50)).is_err(),
        "the daemon did not answer"
    );
    daemon.kill9();
    assert_eq!(
        blocked
            .recv_timeout(DEADLINE)
            .expect("served after the kill"),
        0
    );
    assert!(guest.none_is(3 * HUGE, HUGE, STALE));
    wait_deadline("the counters", || lazy.stats().cleared == 1);
    let s = lazy.stats();
    println!("OBSERVED: unanswered fault after kill -9: {s:?}");
    assert!(s.active && s.cleared == 1);
    drop((lazy, alloc, client));
}

/// Spawns the stand-in daemon, connects, ALLOCs lazily, maps, attaches.
fn lazy_guest_with_child(
    test: &str,
    role: &str,
) -> (
    ChildGuard,
    Client,
    backend::client::Allocation,
    Arc<Map>,
    LazyGuest,
) {
    let (ours, theirs) = UnixStream::pair().expect("socketpair");
    let daemon = spawn_role(test, role, Some(&OwnedFd::from(theirs)));
    ours.set_read_timeout(Some(DEADLINE)).expect("timeout");
    let mut client = Client::from_stream(ours).expect("handshake");
    assert_ne!(client.features() & FEATURE_LAZY, 0);
    let alloc = client
        .alloc(AllocRequest {
            total_size: (KILL_PAGES * HUGE) as u64,
            page_policy: WirePolicy::Huge2M,
            clear_mode: ClearMode::Lazy,
            lock: false,
            parts: vec![],
            want_paths: false,
        })
        .expect("alloc");
    let info = alloc.regions[0];
    assert_ne!(info.flags & RegionInfo::FLAG_LAZY, 0);
    let guest = Map::shared(alloc.fds[0].as_fd(), info.size as usize);
    let m = GuestMapping {
        region_id: info.region_id,
        region_offset: 0,
        addr: guest.addr(),
        len: info.size,
    };
    let lazy =
        LazyGuest::attach(&mut client, &alloc, &[m], LazyOptions::default()).expect("attach");
    (daemon, client, alloc, guest, lazy)
}

/// A stand-in for the daemon: the real protocol and the real fault service
/// over one dirty region (or, `swallow`, a "service" that reads one fault and
/// never answers).
fn mini_daemon(swallow: bool) {
    let sock = UnixStream::from(child_socket());
    let region = dirty_region(KILL_PAGES);
    let mut services = Vec::new();
    let mut swallowers = Vec::new();
    while let Ok(mut frame) = recv_message(&sock) {
        let req = Request::decode(frame.header.code, &frame.payload).expect("decodes");
        let mut fds = Vec::new();
        let reply = match req {
            Request::Handshake { .. } => Reply::ok(ReplyBody::Handshake {
                version: 1,
                features: FEATURE_LAZY,
            }),
            Request::Alloc { .. } => {
                fds.push(region.fd());
                Reply::ok(ReplyBody::Alloc {
                    alloc_id: 1,
                    regions: vec![region_info(&region)],
                    paths: vec![],
                    token: None,
                })
            }
            Request::Uffd { ranges, .. } if frame.fds.len() == 1 => {
                let uffd =
                    Uffd::from_owned_fd(frame.fds.pop().expect("one fd")).expect("userfaultfd");
                if swallow {
                    // Read one fault, never answer it, keep the uffd open.
                    swallowers.push(std::thread::spawn(move || {
                        assert!(uffd.wait_readable(Some(DEADLINE)).expect("poll"));
                        let ev = uffd.read_event().expect("read");
                        std::thread::sleep(DEADLINE);
                        drop((uffd, ev));
                    }));
                } else {
                    let maps = ranges
                        .iter()
                        .map(|r| FaultMapping {
                            vmm_start: r.vmm_addr,
                            len: r.len,
                            region: Arc::clone(&region),
                            region_offset: r.offset,
                        })
                        .collect();
                    services
                        .push(FaultService::start(cfg(2, 0), uffd, maps, None).expect("service"));
                }
                Reply::ok(ReplyBody::Empty)
            }
            _ => Reply::error(Status::Unsupported, "not in the stand-in daemon"),
        };
        let payload = reply.encode();
        let header = Header::reply_to(&frame.header, payload.len()).expect("header");
        send_message(&sock, &header, &payload, &fds).expect("reply");
    }
    drop(services);
}

// ---------------------------------------------------------------------------
// Child processes.

/// Kills (SIGKILL) and reaps the child on drop unless done already.
struct ChildGuard(Option<Child>);

impl ChildGuard {
    fn id(&self) -> u32 {
        self.0.as_ref().expect("child").id()
    }

    fn kill9(&self) {
        let pid = i32::try_from(self.id()).expect("pid");
        // SAFETY: kill(2) with our own child's pid and SIGKILL touches no memory.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
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

fn role() -> Option<String> {
    std::env::var(ROLE_ENV).ok()
}

/// Re-executes this test binary running only `test` as `role`, with `sock` as fd 3.
fn spawn_role(test: &str, role: &str, sock: Option<&OwnedFd>) -> ChildGuard {
    let exe = std::env::current_exe().expect("current exe");
    let mut cmd = Command::new(exe);
    cmd.args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(ROLE_ENV, role)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    if let Some(sock) = sock {
        let raw = sock.as_raw_fd();
        let hook = move || {
            // SAFETY: `raw` is the parent's socket, open in the forked child;
            // dup2 copies it to fd 3 without CLOEXEC.
            if unsafe { libc::dup2(raw, CHILD_SOCK_FD) } < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        };
        // SAFETY: the hook runs between fork and exec and only calls dup2,
        // which is async-signal-safe and does not allocate.
        unsafe { cmd.pre_exec(hook) };
    }
    ChildGuard(Some(cmd.spawn().expect("spawn child")))
}

fn child_socket() -> OwnedFd {
    let link = std::fs::read_link(format!("/proc/self/fd/{CHILD_SOCK_FD}")).expect("fd 3");
    assert!(
        link.to_string_lossy().starts_with("socket:"),
        "fd 3 is {link:?}"
    );
    // SAFETY: the parent placed our end of the socketpair at fd 3 before exec
    // (checked above); nothing else in this process owns it.
    unsafe { OwnedFd::from_raw_fd(CHILD_SOCK_FD) }
}

fn recv_exact(sock: BorrowedFd<'_>, n: usize, fds: &mut Vec<OwnedFd>) -> Vec<u8> {
    let deadline = Instant::now() + DEADLINE;
    let mut out = vec![0u8; n];
    let mut got = 0;
    while got < n {
        assert!(
            Instant::now() < deadline,
            "peer sent nothing before the deadline"
        );
        let k = backend::proto::socket::recv_some(sock, &mut out[got..], fds, false).expect("recv");
        assert_ne!(k, 0, "peer closed the socket");
        got += k;
    }
    out
}
