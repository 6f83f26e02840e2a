//! Lazy mode through the real daemon: ALLOC(lazy) from the dirty pool, the
//! UFFD request, faults served zeroed, the fallback to kernel demand faults,
//! and UFFD refusals (`kill -9` of a real `hugemem serve` while a lazy guest
//! runs is in `cli/tests/serve.rs`). The helpers are `test_support::lazy`.
//!
//! A dirty pooled region exists only between quarantine and the scrubbers
//! finishing it, so the tests make one (eager ALLOC, write a stale pattern,
//! FREE) and ask for lazy memory the moment STATS shows dirty bytes; when the
//! scrubbers won the race (the region came back CLEAN), the cycle is
//! repeated a few times. Waits have deadlines; tests are serialised.

use test_support::lazy::{
    lazy_alloc_from_dirty_pool, mapping, req, reserve, touch, DEADLINE, HUGE, PAGES, SIZE, STALE,
};
use test_support::prelude::{serial, Map};

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::time::Instant;

use backend::client::Client;
use backend::daemon::{Config, Daemon};
use backend::lazy::{LazyGuest, LazyOptions};
use backend::proto::socket::{recv_message, send_message};
use backend::proto::{ClearMode, Header, RegionInfo, Reply, ReplyBody, Request, Status, UffdRange};

fn in_process_daemon() -> (backend::daemon::DaemonHandle, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = Config {
        socket: dir.path().join("hugemem.sock"),
        ..Config::default()
    };
    cfg.pool.recheck_ms = 20;
    // These tests exercise lazy mode on dirty memory: this uid is trusted with it.
    // SAFETY: geteuid has no preconditions and cannot fail.
    cfg.pool.lazy_dirty_uids = vec![unsafe { libc::geteuid() }];
    // Dirty pooled memory exists only without detaching (a detached region
    // is refaulted kernel-zeroed and goes straight to clean).
    cfg.pool.detach_pages = false;
    cfg.metrics.listen = Some("127.0.0.1:0".parse().expect("addr"));
    (Daemon::start(cfg).expect("daemon"), dir)
}

#[test]
fn lazy_alloc_from_the_dirty_pool_is_served_on_fault() {
    let _s = serial();
    if !reserve("lazy_alloc_from_the_dirty_pool_is_served_on_fault") {
        return;
    }
    let (daemon, _dir) = in_process_daemon();
    let mut client = Client::connect(daemon.socket_path()).expect("connect");
    assert_ne!(
        client.features() & backend::proto::FEATURE_LAZY,
        0,
        "the daemon offers lazy mode"
    );
    let started = Instant::now();
    let alloc = lazy_alloc_from_dirty_pool(&mut client, &|| daemon.stats());
    let guest = Map::shared(alloc.fds[0].as_fd(), SIZE as usize);
    let lazy = LazyGuest::attach(
        &mut client,
        &alloc,
        &[mapping(&alloc, &guest)],
        LazyOptions::default(),
    )
    .expect("attach");
    println!(
        "OBSERVED: lazy ALLOC + attach after {:?}",
        started.elapsed()
    );
    let readers: Vec<_> = (0..PAGES)
        .step_by(3)
        .map(|p| touch(&guest, p * HUGE + 4096 * (p % 7)))
        .collect();
    for r in readers {
        assert_eq!(r.recv_timeout(DEADLINE).expect("fault served"), 0);
    }
    // Whatever the guest reads, faulted or installed ahead by the scrubbers, is clean.
    assert!(guest.none_is(0, guest.len(), STALE), "stale bytes visible");
    assert!(!lazy.stats().active, "the daemon served, not the fallback");
    // STATS shows this connection's lazy allocation and its fault counters.
    let sent = client.stats_json().expect("stats");
    let stats: backend::stats::Stats = serde_json::from_value(sent.clone()).expect("typed STATS");
    // Read into the typed STATS and written back, the document (fault
    // counters included) is the JSON the daemon sent.
    assert_eq!(serde_json::to_value(&stats).expect("to JSON"), sent);
    let mine = &stats.lazy.as_deref().expect("lazy list")[0];
    assert_eq!(mine.alloc, alloc.id, "{stats}");
    assert!(mine.attached, "{stats}");
    assert!(mine.faults.is_some(), "{stats}");
    // The metrics endpoint sums the fault services daemon-wide.
    let addr = daemon.metrics_addr().expect("metrics on");
    let scrape = || {
        let (status, _, body) = test_support::prelude::http_get(addr, "GET", "/metrics");
        assert_eq!(status, "HTTP/1.1 200 OK", "{body}");
        test_support::prelude::parse_openmetrics(&body)
    };
    let stats = client.stats().expect("stats");
    let m = scrape();
    let faults = stats.lazy.as_deref().expect("lazy list")[0]
        .faults
        .expect("fault counters");
    let seen = |k: &str| {
        faults
            .counters()
            .iter()
            .find(|(name, _, _)| *name == k)
            .map(|(_, _, v)| *v as f64)
            .expect(k)
    };
    assert_eq!(m["hugemem_fault_services"], 1.0);
    for k in ["faults", "minor", "served_cleared", "scrub_pages"] {
        assert!(
            m[&format!("hugemem_fault_{k}_total")] >= seen(k),
            "{k}: endpoint below STATS read before it"
        );
    }
    // Pages reach the guest through a fault the service served, or installed
    // ahead by its scrubbers (which win the race when the guest is slow):
    // one or the other happened.
    let work = |m: &std::collections::BTreeMap<String, f64>| {
        m["hugemem_fault_faults_total"] + m["hugemem_fault_precontinued_total"]
    };
    assert!(work(&m) >= 1.0, "{m:?}");
    let served = work(&m);
    // A second UFFD for the same allocation is refused.
    let again = backend::lazy::PreparedLazy::new(
        &[mapping(&alloc, &guest)],
        &alloc.regions,
        &[alloc.fds[0].as_fd()],
        LazyOptions {
            fallback: false,
            ..LazyOptions::default()
        },
    );
    // (registering the same range on a second uffd fails with EBUSY, which is fine too)
    if let Ok(p) = again {
        let e = client
            .call_with_fds(&p.request(alloc.id), &[p.uffd().as_fd()])
            .expect_err("second UFFD");
        assert!(e.to_string().contains("refused"), "{e}");
    }
    drop(guest);
    drop(lazy);
    client.free(alloc.id).expect("free");
    // The stopped service's counts stay in the sums (counters never go down).
    let m = scrape();
    assert_eq!(m["hugemem_fault_services"], 0.0);
    assert!(work(&m) >= served, "{m:?}");
    daemon.shutdown().expect("shutdown");
}

#[test]
fn lazy_alloc_without_dirty_memory_falls_back_to_kernel_demand_faults() {
    let _s = serial();
    if !reserve("lazy_alloc_without_dirty_memory_falls_back_to_kernel_demand_faults") {
        return;
    }
    let (daemon, _dir) = in_process_daemon();
    let sock = UnixStream::connect(daemon.socket_path()).expect("connect");
    let call = |r: &Request, id: u32| {
        let payload = r.encode();
        send_message(
            &sock,
            &Header::request(r.code(), id, payload.len()).expect("header"),
            &payload,
            &[],
        )
        .expect("send");
        let frame = recv_message(&sock).expect("reply");
        (
            Reply::decode(frame.header.code, &frame.payload).expect("decode"),
            frame.fds,
        )
    };
    call(
        &Request::Handshake {
            min_version: 1,
            max_version: 1,
            features: 1,
        },
        1,
    );
    let started = Instant::now();
    let (reply, fds) = call(
        &Request::Alloc {
            req: req(ClearMode::Lazy),
            wait_ms: None,
        },
        2,
    );
    let took = started.elapsed();
    assert_eq!(reply.status, Status::Ok);
    println!(
        "OBSERVED: lazy ALLOC on an empty pool: {took:?}, note: {}",
        reply.message
    );
    assert!(
        reply.message.starts_with("lazy:"),
        "the fallback says so: {:?}",
        reply.message
    );
    let ReplyBody::Alloc { regions, .. } = reply.body else {
        panic!("not an ALLOC body")
    };
    assert_eq!(
        regions[0].flags & (RegionInfo::FLAG_CLEAN | RegionInfo::FLAG_LAZY),
        RegionInfo::FLAG_CLEAN
    );
    let m = Map::shared(fds[0].as_fd(), SIZE as usize);
    assert!(
        m.none_is(0, m.len(), STALE) && m.read(SIZE as usize - 1) == 0,
        "kernel-zeroed pages"
    );
    drop(m);
    daemon.shutdown().expect("shutdown");
}

#[test]
fn uffd_requests_are_checked() {
    let _s = serial();
    if !reserve("uffd_requests_are_checked") {
        return;
    }
    let (daemon, _dir) = in_process_daemon();
    let mut client = Client::connect(daemon.socket_path()).expect("connect");
    let eager = client.alloc(req(ClearMode::Eager)).expect("alloc");
    let uffd = backend::uffd::Uffd::new(backend::uffd::CreateFlags::new()).expect("uffd");
    uffd.api(0).expect("api");
    let range = UffdRange {
        region_id: eager.regions[0].region_id,
        offset: 0,
        vmm_addr: 1 << 40,
        len: SIZE,
    };
    let uffd_req = |alloc_id| Request::Uffd {
        alloc_id,
        ranges: vec![range],
    };
    let refused = |r: Result<_, backend::client::ClientError>| match r {
        Err(backend::client::ClientError::Refused { status, message }) => (status, message),
        other => panic!("expected a refusal, got {other:?}"),
    };
    // Not this connection's allocation.
    let (st, _) = refused(client.call_with_fds(&uffd_req(999), &[uffd.as_fd()]));
    assert_eq!(st, Status::NotFound);
    // No fd, two fds, an fd that is not a uffd.
    let (st, msg) = refused(client.call(&uffd_req(eager.id)));
    assert_eq!(st, Status::Invalid, "{msg}");
    let (st, msg) =
        refused(client.call_with_fds(&uffd_req(eager.id), &[uffd.as_fd(), uffd.as_fd()]));
    assert_eq!(st, Status::Invalid, "{msg}");
    // An eager allocation has nothing to serve.
    let (st, msg) = refused(client.call_with_fds(&uffd_req(eager.id), &[uffd.as_fd()]));
    assert_eq!(st, Status::Invalid);
    assert!(msg.contains("no lazy region"), "{msg}");
    client.free(eager.id).expect("free");
    daemon.shutdown().expect("shutdown");
}
