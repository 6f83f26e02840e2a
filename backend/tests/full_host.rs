//! A full host (issue 18): the host has exactly the huge pages the tests'
//! allocations need and not one more, as on a host where every page is
//! spoken for. Honest tenants take turns on those pages; every ALLOC must be
//! served, every FREE recycled (no region discarded, no tenant blamed), and
//! after the first allocation every later one comes from the pool. Each
//! test sets the pool to exactly its pages (`test_support::hugepages::
//! exactly`), shrinking what earlier tests or runs left, and gives them
//! back at the end.

use std::os::fd::{AsRawFd, OwnedFd};
use std::time::Duration;

use backend::client::Client;
use backend::proto::{AllocRequest, ClearMode, PagePolicy, RegionInfo};
use test_support::hugepages::{available_2m, exactly, PageSize};
use test_support::prelude::{map_raw as map, serial, unmap_raw as unmap, wait_until, TestDaemon};
use test_support::tenant::{alloc_2m, fill_secret, in_child, root_or_skip, say, MIB};

/// Long enough for anything the daemon does in milliseconds on a loaded
/// machine.
const SETTLE: Duration = Duration::from_secs(30);

/// What a forked tenant reports by exit code.
const OK: i32 = 0;
const NO_CONNECT: i32 = 10;
const REFUSED: i32 = 11;
const NO_MAP: i32 = 20;
const LEAKED: i32 = 30;
const NOT_FREED: i32 = 12;

/// A tenant in a forked child: connects, ALLOCs `size` bytes of 2 MiB pages
/// (lazy or eager), maps them, checks that not one byte of an earlier
/// tenant's is there, writes its own secret everywhere, unmaps, closes and
/// FREEs. Its exit code says how far it got.
fn honest_tenant(d: &TestDaemon, size: u64, lazy: bool) -> i32 {
    tenant(d, size, PagePolicy::Huge2M, lazy, None, None)
}

/// [`honest_tenant`] on pages of `policy`, which once connected waits for a
/// byte on `go` before its ALLOC, and writes one to `freed` right after its
/// FREE.
fn tenant(
    d: &TestDaemon,
    size: u64,
    policy: PagePolicy,
    lazy: bool,
    go: Option<OwnedFd>,
    freed: Option<OwnedFd>,
) -> i32 {
    let socket = d.socket();
    in_child(None, move || {
        let Ok(mut c) = Client::connect(&socket) else {
            return NO_CONNECT;
        };
        if let Some(go) = &go {
            let mut b = [0u8; 1];
            if nix::unistd::read(go, &mut b) != Ok(1) {
                return NO_CONNECT;
            }
        }
        let mut req = alloc_2m(size, false);
        req.page_policy = policy;
        if lazy {
            req.clear_mode = ClearMode::Lazy;
        }
        let a = match c.alloc(req) {
            Ok(a) => a,
            Err(e) => {
                say(&format!(
                    "tenant refused ({}): {e}",
                    if lazy { "lazy" } else { "eager" }
                ));
                return REFUSED;
            }
        };
        // A lazy region flagged LAZY would need a fault service; an honest
        // tenant of an uid not trusted with dirty memory never gets one.
        if a.regions[0].flags & RegionInfo::FLAG_LAZY != 0 {
            return LEAKED;
        }
        let p = map(a.fds[0].as_raw_fd(), size);
        if p.is_null() {
            return NO_MAP;
        }
        // SAFETY: the live mapping of `size` bytes just made.
        let bytes = unsafe { std::slice::from_raw_parts(p, size as usize) };
        let leaked = any_non_zero(bytes, size);
        fill_secret(p, size);
        unmap(p, size);
        if leaked {
            return LEAKED;
        }
        let id = a.id;
        drop(a);
        if c.free(id).is_err() {
            return NOT_FREED;
        }
        if let Some(freed) = &freed {
            let _ = nix::unistd::write(freed, b"f");
        }
        OK
    })
}

/// Whether `bytes` hold anything but zeros. Up to 256 MiB every byte is
/// read; beyond, the first 8 bytes of every 4 KiB (an earlier tenant's page
/// that was not cleared holds its secret in every byte, so a page that
/// leaked shows in each of them; a debug build reads 2 GiB byte by byte
/// too slowly for back-to-back VMs).
fn any_non_zero(bytes: &[u8], size: u64) -> bool {
    if size <= 256 * MIB {
        bytes.iter().any(|&b| b != 0)
    } else {
        bytes.chunks(4096).any(|c| c[..8] != [0u8; 8])
    }
}

/// Honest eager and lazy tenants take turns on exactly the pages of one
/// allocation, with the default configuration (pin defence on). The issue's
/// report: the refault of a detached region raced the next ALLOC for the
/// free pages and lost, the region was "damaged by its tenant", and from
/// then on every ALLOC paid for fresh pages.
#[test]
fn honest_tenants_alternate_on_exactly_one_allocation_of_pages() {
    alternate(
        0,
        "honest_tenants_alternate_on_exactly_one_allocation_of_pages",
    );
}

/// The same with 8 pages to spare: the CI host (a floor of 64 free
/// 2 MiB pages, then a test's own reservation of 72).
#[test]
fn honest_tenants_alternate_with_a_few_pages_to_spare() {
    alternate(8, "honest_tenants_alternate_with_a_few_pages_to_spare");
}

fn alternate(spare: u64, test: &str) {
    let _g = serial();
    if !root_or_skip() {
        return;
    }
    let size = 128 * MIB;
    let Some(_pages) = exactly(PageSize::Huge2M, size / (2 * MIB) + spare, test) else {
        return;
    };
    let d = TestDaemon::start(|_| {});
    let rounds = 12;
    for round in 0..rounds {
        let lazy = round % 2 == 1;
        let code = honest_tenant(&d, size, lazy);
        let s = d.stats();
        eprintln!(
            "round {round} ({}): exit {code}; discarded {}, fresh {}, pooled {}, given back {:?}",
            if lazy { "lazy" } else { "eager" },
            s.counters.regions_discarded,
            s.counters.regions_fresh,
            s.counters.regions_pooled,
            s.given_back
                .as_deref()
                .unwrap_or_default()
                .iter()
                .map(|g| g.why.as_str())
                .collect::<Vec<_>>()
        );
        assert_eq!(code, OK, "round {round}: the tenant's exit code");
    }
    wait_until("the last region is back in the pool", SETTLE, || {
        d.stats().pools.iter().all(|p| p.quarantined_bytes == 0)
    });
    let s = d.stats();
    assert_eq!(s.counters.regions_discarded, 0, "{s}");
    assert!(
        s.given_back.as_deref().unwrap_or_default().is_empty(),
        "{s}"
    );
    assert_eq!(s.counters.allocs_failed, 0, "{s}");
    assert_eq!(
        s.counters.regions_fresh, 1,
        "after the first ALLOC every one must come from the pool: {s}"
    );
    d.shutdown();
}

/// The next tenant's ALLOC arrives the moment the last one's FREE is
/// answered, while its region is detached (punched, reserved again,
/// refaulted) or scrubbed: on a host with 8 pages to spare, a lazy ALLOC's
/// fresh demand-faulted memory could take the punched pages (the issue's
/// race). Every ALLOC must be served, from the pool after the first, and no
/// region discarded.
#[test]
fn an_alloc_arrives_during_the_detach() {
    let _g = serial();
    if !root_or_skip() {
        return;
    }
    let size = 128 * MIB;
    let Some(_pages) = exactly(
        PageSize::Huge2M,
        size / (2 * MIB) + 8,
        "an_alloc_arrives_during_the_detach",
    ) else {
        return;
    };
    for detach in [true, false] {
        let d = TestDaemon::start(|c| c.pool.detach_pages = detach);
        back_to_back(&d, size, PagePolicy::Huge2M, 16);
        d.shutdown();
    }
}

/// A first tenant, then `rounds` pairs: tenant B's ALLOC (eager and lazy in
/// turn) waits for tenant A's FREE and goes out the moment it is answered.
/// Every tenant must end well (no refusal, no byte of another), and at the
/// end nothing was discarded or given back short, nothing downgraded, and
/// every ALLOC after the first came from the pool.
fn back_to_back(d: &TestDaemon, size: u64, policy: PagePolicy, rounds: u64) {
    let one = |lazy, go, freed| tenant(d, size, policy, lazy, go, freed);
    assert_eq!(one(false, None, None), OK, "the first tenant");
    for round in 0..rounds {
        let (go_r, go_w) = nix::unistd::pipe().expect("pipe");
        let lazy = round % 2 == 0;
        let (a, b) = std::thread::scope(|scope| {
            let a = scope.spawn(|| one(!lazy, None, Some(go_w)));
            let b = scope.spawn(|| one(lazy, Some(go_r), None));
            (
                a.join().expect("tenant A's thread"),
                b.join().expect("tenant B's thread"),
            )
        });
        let s = d.stats();
        eprintln!(
            "round {round}: A {a}, B {b} ({}); discarded {}, short {}, fresh {}, pooled {}",
            if lazy { "lazy" } else { "eager" },
            s.counters.regions_discarded,
            s.counters.regions_short,
            s.counters.regions_fresh,
            s.counters.regions_pooled,
        );
        assert_eq!((a, b), (OK, OK), "round {round}: the tenants' exit codes");
    }
    wait_until("the last region is back in the pool", SETTLE, || {
        d.stats().pools.iter().all(|p| p.quarantined_bytes == 0)
    });
    let s = d.stats();
    assert_eq!(s.counters.regions_discarded, 0, "{s}");
    assert_eq!(s.counters.regions_short, 0, "{s}");
    assert_eq!(s.counters.downgrades, 0, "{s}");
    assert_eq!(s.counters.regions_fresh, 1, "{s}");
    assert_eq!(s.counters.allocs_ok, 1 + 2 * rounds, "{s}");
}

/// A 2 GiB VM on exactly two 1 GiB pages, back to back: each tenant's ALLOC
/// arrives as the last one's FREE is answered, eager and lazy in turn; every
/// one is served from the pool after the first, nothing is discarded, no
/// byte of one reaches the next.
#[test]
fn a_2g_vm_on_exactly_two_1g_pages_back_to_back() {
    let _g = serial();
    if !root_or_skip() {
        return;
    }
    let size = 2 << 30;
    let Some(_pages) = exactly(
        PageSize::Huge1G,
        2,
        "a_2g_vm_on_exactly_two_1g_pages_back_to_back",
    ) else {
        return;
    };
    let d = TestDaemon::start(|_| {});
    back_to_back(&d, size, PagePolicy::Huge1G, 4);
    d.shutdown();
}

/// A tenant pins a page of its region (`vmsplice` into a pipe it keeps)
/// and FREEs, on a host with exactly its pages: the detach's punch gets
/// every page back but the pinned one, the host has none to spare for its
/// hole, and the region goes back to the kernel as **pinned**, blamed on
/// the tenant, never served. Once the tenant lets go the page comes back
/// and the next tenant is served, reading zeros.
#[test]
fn a_pin_on_a_full_host_is_the_tenants_doing() {
    a_pin_on_a_full_host(
        Keep::PinnedPage,
        "a_pin_on_a_full_host_is_the_tenants_doing",
    );
}

/// [`a_pin_on_a_full_host_is_the_tenants_doing`] for a tenant of a lazy
/// region that touched only the page it pins: the rest are holes that never
/// had a page, whose reservations the punch keeps, so the one pinned page
/// is all the host misses. The verdict is the pin, not holes the tenant
/// never punched.
#[test]
fn a_pin_in_a_region_of_holes_is_a_pin_not_holes() {
    a_pin_on_a_full_host(
        Keep::PinnedPageOfHoles,
        "a_pin_in_a_region_of_holes_is_a_pin_not_holes",
    );
}

/// A tenant keeps one page of its region pinned past its FREE, on a host
/// with exactly the region's pages: the region goes back to the kernel as
/// pinned, and once the pin goes the next tenant is served zeros.
fn a_pin_on_a_full_host(keep: Keep, test: &str) {
    let _g = serial();
    if !root_or_skip() {
        return;
    }
    let size = 16 * MIB;
    let pages = size / (2 * MIB);
    let Some(_pages) = exactly(PageSize::Huge2M, pages, test) else {
        return;
    };
    let holes = matches!(keep, Keep::PinnedPageOfHoles);
    // A region of holes keeps them: no helper faults them in ahead.
    let d = TestDaemon::start(|c| c.pool.refault_ahead = !holes);
    let tenant = Keeper::start(&d, size, keep);
    wait_until("the pinned region is given back", SETTLE, || {
        d.stats().counters.regions_pinned == 1
    });
    let s = d.stats();
    assert_eq!(
        s.counters.regions_discarded, 1,
        "a pin counts as discarded: {s}"
    );
    assert_eq!(s.counters.regions_short, 0, "{s}");
    let why = s.given_back.as_deref().unwrap_or_default()[0].why.clone();
    let in_file = if holes { 1 } else { pages };
    assert!(
        why.contains("held by a pin") && why.contains(&format!("1 of the {in_file} 2M pages")),
        "{why}"
    );
    // While the pin lasts the host has one page too few: the ALLOC is
    // refused (a strict 2 MiB policy never falls back), waiting for nobody.
    let mut c = d.client();
    assert!(
        c.alloc(alloc_2m(size, false)).is_err(),
        "served with a page still pinned"
    );
    tenant.let_go();
    wait_until("the pinned page is back in the host's pool", SETTLE, || {
        available_2m() >= pages
    });
    next_tenant_reads_zeros(&d, size);
    d.shutdown();
}

/// The operator shrinks the host's pool while a released region is still
/// mapped by its tenant: its pages become surplus, and at the detach's
/// punch they go back to the kernel, not to the pool, so the holes cannot
/// be reserved again. Every page came back: the region goes back to the
/// kernel as **short**, and nobody is blamed.
#[test]
fn a_pool_shrunk_under_a_released_region_blames_nobody() {
    let _g = serial();
    if !root_or_skip() {
        return;
    }
    let size = 16 * MIB;
    let pages = size / (2 * MIB);
    let test = "a_pool_shrunk_under_a_released_region_blames_nobody";
    let Some(full_host) = exactly(PageSize::Huge2M, pages, test) else {
        return;
    };
    let d = TestDaemon::start(|_| {});
    let tenant = Keeper::start(&d, size, Keep::Mapping);
    // Its pages are in use (mapped): shrinking the pool to nothing makes
    // them surplus, freed to the kernel when the file lets them go. (The
    // pages held back for the full host go first: reserved pages are never
    // taken out of a pool.)
    drop(full_host);
    let pool = numa::HugePages::host();
    let two_mib = PageSize::Huge2M.bytes();
    let total = pool.pool(two_mib, None).expect("2 MiB pool").total;
    pool.reserve(two_mib, 0, None, numa::ReserveMode::Exact)
        .expect("shrink the 2 MiB pool");
    let surplus = pool.pool(two_mib, None).expect("2 MiB pool").surplus;
    assert_eq!(surplus, pages, "the tenant's pages are surplus now");
    tenant.let_go();
    wait_until("the region is given back as short", SETTLE, || {
        d.stats().counters.regions_short == 1
    });
    let s = d.stats();
    assert_eq!(s.counters.regions_discarded, 0, "nobody is blamed: {s}");
    assert_eq!(s.counters.regions_pinned, 0, "{s}");
    let why = s.given_back.as_deref().unwrap_or_default()[0].why.clone();
    assert!(
        why.contains("no tenant at fault") && why.contains(&format!("all {pages} 2M pages")),
        "{why}"
    );
    // The pool back as it was: the next tenant is served and reads zeros.
    pool.reserve(two_mib, total, None, numa::ReserveMode::Exact)
        .expect("the 2 MiB pool back");
    next_tenant_reads_zeros(&d, size);
    d.shutdown();
}

/// Allocates `size` bytes of 2 MiB pages in this process, checks that every
/// byte reads zero, and FREEs.
fn next_tenant_reads_zeros(d: &TestDaemon, size: u64) {
    let mut c = d.client();
    let a = c
        .alloc(alloc_2m(size, false))
        .expect("the next tenant is served");
    let m = map(a.fds[0].as_raw_fd(), size);
    assert!(!m.is_null());
    // SAFETY: the live mapping of `size` bytes just made.
    let leaked = any_non_zero(
        unsafe { std::slice::from_raw_parts(m, size as usize) },
        size,
    );
    unmap(m, size);
    assert!(!leaked, "the next tenant read an earlier tenant's bytes");
    let id = a.id;
    drop(a);
    c.free(id).expect("free");
}

/// What a [`Keeper`] keeps of its region after its FREE.
#[derive(Clone, Copy)]
enum Keep {
    /// One page, pinned by a pipe it was `vmsplice`d into; the mapping and
    /// the fds go before the FREE.
    PinnedPage,
    /// [`Keep::PinnedPage`] of a lazy ALLOC's fresh region, of which it
    /// touched only that page: every other page is a reserved hole.
    PinnedPageOfHoles,
    /// Its whole mapping (the region stays quarantined, held).
    Mapping,
}

/// A tenant in a forked child that ALLOCs `size` bytes of 2 MiB pages,
/// writes its secret, FREEs, and keeps what [`Keep`] says until
/// [`Keeper::let_go`]. [`Keeper::start`] returns once the FREE is answered.
struct Keeper {
    child: std::thread::JoinHandle<i32>,
    go: OwnedFd,
}

impl Keeper {
    fn start(d: &TestDaemon, size: u64, keep: Keep) -> Self {
        let (freed_r, freed_w) = nix::unistd::pipe().expect("pipe");
        let (go_r, go_w) = nix::unistd::pipe().expect("pipe");
        let socket = d.socket();
        let child = std::thread::spawn(move || {
            in_child(None, move || {
                let Ok(mut c) = Client::connect(&socket) else {
                    return NO_CONNECT;
                };
                let holes = matches!(keep, Keep::PinnedPageOfHoles);
                let request = AllocRequest {
                    clear_mode: if holes {
                        ClearMode::Lazy
                    } else {
                        ClearMode::Eager
                    },
                    ..alloc_2m(size, false)
                };
                let Ok(a) = c.alloc(request) else {
                    return REFUSED;
                };
                let p = map(a.fds[0].as_raw_fd(), size);
                if p.is_null() {
                    return NO_MAP;
                }
                fill_secret(p, if holes { 4096 } else { size });
                let mut pin = None;
                if matches!(keep, Keep::PinnedPage | Keep::PinnedPageOfHoles) {
                    let Ok((pipe_r, pipe_w)) = nix::unistd::pipe() else {
                        return 13;
                    };
                    let iov = libc::iovec {
                        iov_base: p.cast(),
                        iov_len: 4096,
                    };
                    // SAFETY: vmsplice reads the iovec (our live mapping) and
                    // makes the pipe reference that page; no memory of ours
                    // is written.
                    if unsafe { libc::vmsplice(pipe_w.as_raw_fd(), &iov, 1, 0) } != 4096 {
                        return 14;
                    }
                    unmap(p, size);
                    pin = Some(pipe_r);
                }
                let id = a.id;
                drop(a);
                if c.free(id).is_err() {
                    return NOT_FREED;
                }
                let _ = nix::unistd::write(&freed_w, b"f");
                let mut b = [0u8; 1];
                let _ = nix::unistd::read(&go_r, &mut b);
                match pin {
                    Some(pipe) => drop(pipe),
                    None => unmap(p, size),
                }
                OK
            })
        });
        let mut b = [0u8; 1];
        assert_eq!(
            nix::unistd::read(&freed_r, &mut b),
            Ok(1),
            "the tenant FREEd"
        );
        Self { child, go: go_w }
    }

    /// Lets the tenant drop what it kept and exit; checks it ended well.
    fn let_go(self) {
        nix::unistd::write(&self.go, b"g").expect("let the tenant go");
        assert_eq!(
            self.child.join().expect("tenant"),
            OK,
            "the tenant's exit code"
        );
    }
}
