//! Regions on real huge pages: each page size, the fallback chain, exhaustion,
//! placement on node 0, reuse clearing, growing, seals, hugetlbfs files, the
//! vm-memory adapter.
//!
//! Huge pages are reserved through `guest_mem::ensure_free` (`numa::hugepages`
//! in free mode: pools only grow), and `/dev/hugepages-2M` is mounted through
//! `numa::HugePages::mount_hugetlbfs` when missing. Where the kernel gives
//! fewer pages than asked, or this process is not root, a test skips through
//! `test_support::skip!` and returns. Pools are
//! shared with the tests of other crates running at the same time, so sizes
//! stay small and the tests of this file that use huge pages take one lock.

#![allow(clippy::undocumented_unsafe_blocks)]

use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::sync::{Mutex, MutexGuard, PoisonError};

use clearing::RunOptions;
use guest_mem::vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use guest_mem::{
    guest_memory, AdapterError, Backing, PagePolicy, PageSize, PageState, PoolCounts, PrepareError,
    Region, RegionError, RegionSpec,
};
use numa::{PageLocation, Topology};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

static HUGE: Mutex<()> = Mutex::new(());

fn huge_lock() -> MutexGuard<'static, ()> {
    HUGE.lock().unwrap_or_else(PoisonError::into_inner)
}

fn topology() -> Topology {
    Topology::detect().expect("detect topology")
}

/// Makes `pages` pages of `size` free on node 0, or skips `test`.
fn reserve(size: PageSize, pages: u64, test: &str) -> bool {
    test_support::hugepages::reserve(size, pages, Some(0), test)
}

/// `/dev/hugepages-2M`, mounted (as `hugemem hugepages` does) when it is
/// not a hugetlbfs mount yet; `None` (after skipping) when that cannot be done.
fn hugetlbfs_2m(test: &str) -> Option<std::path::PathBuf> {
    match numa::HugePages::host().mount_hugetlbfs(2 * MIB, std::path::Path::new("/dev")) {
        Ok(m) => Some(m.path),
        Err(e) => {
            test_support::skip!("{test}: no hugetlbfs at /dev/hugepages-2M: {e}");
            None
        }
    }
}

/// Host-wide (total, free, resv, surplus) of a pool.
fn pool(size: PageSize) -> Option<(u64, u64, u64, u64)> {
    PoolCounts::read(size, None)
        .expect("read pool")
        .map(|p| (p.total, p.free, p.resv, p.surplus))
}

fn pools() -> [Option<(u64, u64, u64, u64)>; 2] {
    [pool(PageSize::Huge1G), pool(PageSize::Huge2M)]
}

static ZERO: [u8; 1 << 20] = [0; 1 << 20];

/// True when every byte is zero (memcmp per MiB, fast even in debug builds).
fn all_zero(bytes: &[u8]) -> bool {
    bytes.chunks(ZERO.len()).all(|c| c == &ZERO[..c.len()])
}

/// Allocates `spec` (create + populate), or prints SKIP when the pool was
/// emptied by someone else between reserving and allocating.
fn allocate(topo: &Topology, spec: &RegionSpec, test: &str) -> Option<Region> {
    match Region::allocate(topo, spec, &RunOptions::default()) {
        Ok((region, report)) => {
            println!(
                "{test}: prepared {} bytes of {} pages in {:.3} s = {:.2} GB/s (populated {}, cleared {}, skipped {}; {} threads)",
                report.bytes,
                region.page_size(),
                report.seconds,
                report.gb_per_s(),
                report.populated,
                report.cleared,
                report.skipped,
                report.run.nodes.iter().map(|n| n.threads).sum::<usize>(),
            );
            Some(region)
        }
        Err(e @ RegionError::Unavailable { .. }) => {
            test_support::skip!(
                "{test}: pages reserved for this test were taken by another process: {e}"
            );
            None
        }
        Err(e) => panic!("{test}: allocate failed: {e:?}"),
    }
}

/// Checks the region is on node 0 and prints how long the check took.
fn assert_on_node0(region: &Region, test: &str) {
    let report = region.verify_placement().expect("move_pages query");
    println!(
        "{test}: placement of {} {} pages verified in {:.6} s",
        report.pages,
        region.page_size(),
        report.seconds
    );
    assert_eq!(report.node, Some(0));
    assert!(
        report.misplaced.is_empty(),
        "misplaced pages: {:?}",
        report.misplaced
    );
    assert_eq!(report.on_node, report.pages);
    assert_eq!(report.not_present, 0);
}

#[test]
fn region_on_1g_pages_placed_cleared_and_reused() {
    let _g = huge_lock();
    let test = "1G region";
    if !reserve(PageSize::Huge1G, 1, test) {
        return;
    }
    let topo = topology();
    let spec = RegionSpec::new("gm-test-1g", GIB, Some(0))
        .with_policy(PagePolicy::Strict(PageSize::Huge1G));
    let Some(region) = allocate(&topo, &spec, test) else {
        return;
    };
    assert_eq!(region.page_size(), PageSize::Huge1G);
    assert_eq!(region.fallback(), None);
    assert_eq!(region.states().len(), 1);
    assert_eq!(region.states().counts().clean, 1);
    assert_on_node0(&region, test);
    // SAFETY (test): nothing else uses the region.
    assert!(all_zero(unsafe { region.as_slice() }));

    // Reuse: poison, hand back dirty, prepare clears it with a clearing kernel.
    (unsafe { region.as_mut_slice() }).fill(0xAA);
    assert_eq!(region.mark_all_dirty(), (1, 0));
    let report = region
        .prepare_eager(&topo, &RunOptions::default())
        .expect("clear");
    println!(
        "{test}: cleared 1 GiB reused page in {:.3} s = {:.2} GB/s",
        report.seconds,
        report.gb_per_s()
    );
    assert_eq!(
        (report.populated, report.cleared, report.skipped),
        (0, 1, 0)
    );
    assert!(all_zero(unsafe { region.as_slice() }));
    assert_on_node0(&region, test);
}

#[test]
fn region_on_2m_pages() {
    let _g = huge_lock();
    let test = "2M region";
    if !reserve(PageSize::Huge2M, 4, test) {
        return;
    }
    let topo = topology();
    let spec = RegionSpec::new("gm-test-2m", 8 * MIB, Some(0))
        .with_policy(PagePolicy::Strict(PageSize::Huge2M));
    let before = pool(PageSize::Huge2M).expect("2M pool");
    let Some(region) = allocate(&topo, &spec, test) else {
        return;
    };
    assert_eq!(region.page_size(), PageSize::Huge2M);
    assert_eq!(region.states().counts().clean, 4);
    assert_on_node0(&region, test);
    assert!(all_zero(unsafe { region.as_slice() }));
    let during = pool(PageSize::Huge2M).expect("2M pool");
    drop(region);
    let after = pool(PageSize::Huge2M).expect("2M pool");
    println!("{test}: 2M pool (total, free, resv, surplus) before {before:?}, with the region {during:?}, after {after:?}");
    // The pages came from the pool and went back (other processes may move
    // the pool too, so only check what this region must have done).
    assert!(
        during.1 + 4 <= before.1 || during.0 > before.0,
        "region did not take 4 pages from the pool"
    );
}

#[test]
fn region_on_4k_pages_with_a_short_last_granule() {
    let test = "4K region";
    let topo = topology();
    // 3 MiB + 4 KiB: two 2 MiB state granules, the second 1 MiB + 4 KiB long.
    let size = 3 * MIB + 4096;
    let spec = RegionSpec::new("gm-test-4k", size, Some(0))
        .with_policy(PagePolicy::Strict(PageSize::Base4K));
    let region = allocate(&topo, &spec, test).expect("4K regions need no pool");
    assert_eq!(region.page_size(), PageSize::Base4K);
    assert_eq!(region.states().len(), 2);
    assert_eq!(region.page_range(1), (2 * MIB, MIB + 4096));
    assert_eq!(region.states().counts().clean, 2);
    let report = region.verify_placement().expect("query");
    assert_eq!(report.pages, 769);
    assert!(report.misplaced.is_empty(), "{:?}", report.misplaced);
    assert_eq!(report.on_node, 769);
    assert!(all_zero(unsafe { region.as_slice() }));
}

#[test]
fn unpopulated_pages_are_reported_not_present() {
    let topo = topology();
    let spec = RegionSpec::new("gm-test-lazy", 4 * MIB, Some(0))
        .with_policy(PagePolicy::Strict(PageSize::Base4K));
    let region = Region::create(&topo, &spec).expect("create");
    assert_eq!(region.states().counts().unpopulated, 2);
    let report = region.verify_placement().expect("query");
    assert_eq!(
        (report.pages, report.not_present, report.on_node),
        (1024, 1024, 0)
    );
    assert!(report.misplaced.is_empty());
    // Touching a page behind the states' back shows up as not "not present".
    (unsafe { region.as_mut_slice() })[0] = 1;
    let report = region.verify_placement().expect("query");
    assert_eq!((report.not_present, report.on_node), (1023, 1));
}

#[test]
fn best_falls_back_to_2m_below_1g_and_says_why() {
    let _g = huge_lock();
    let test = "best 6 MiB";
    if !reserve(PageSize::Huge2M, 3, test) {
        return;
    }
    let topo = topology();
    let spec = RegionSpec::new("gm-test-best", 6 * MIB, Some(0));
    let Some(region) = allocate(&topo, &spec, test) else {
        return;
    };
    assert_eq!(region.page_size(), PageSize::Huge2M);
    assert_eq!(
        region.fallback(),
        Some("1G: the size is not a multiple of it")
    );
    assert_on_node0(&region, test);
}

#[test]
fn best_falls_back_when_1g_pages_are_short() {
    let _g = huge_lock();
    let test = "best fallback";
    let topo = topology();
    let available = PoolCounts::read(PageSize::Huge1G, None)
        .expect("read")
        .map_or(0, |p| p.available());
    let node_free = PoolCounts::read(PageSize::Huge1G, Some(0))
        .expect("read")
        .map_or(0, |p| p.free);
    let gib = available.min(node_free) + 1;
    if gib > 4 {
        test_support::skip!(
            "{test}: {} 1 GiB pages are free; asking for more would need {gib} GiB",
            gib - 1
        );
        return;
    }
    // More 1 GiB pages than are free: 2M if the 2M pool holds the size, else 4K.
    // Created only (reservation, no population), so this costs no memory.
    let spec = RegionSpec::new("gm-test-fallback", gib * GIB, Some(0));
    let region = Region::create(&topo, &spec).expect("best never fails while memory is free");
    let reasons = region
        .fallback()
        .expect("a fallback is reported")
        .to_string();
    println!(
        "{test}: {gib} GiB landed on {} pages: {reasons}",
        region.page_size()
    );
    assert_ne!(region.page_size(), PageSize::Huge1G);
    assert!(
        reasons.starts_with(&format!("1G: {gib} pages needed")),
        "{reasons}"
    );
    if region.page_size() == PageSize::Base4K {
        assert!(reasons.contains("; 2M: "), "{reasons}");
    }
}

#[test]
fn strict_exhaustion_fails_before_allocating() {
    let _g = huge_lock();
    let topo = topology();
    for size in [PageSize::Huge1G, PageSize::Huge2M] {
        // Other crates' tests move the pools at the same time; a few tries
        // find a quiet moment to compare before and after.
        let mut unchanged = false;
        for _ in 0..5 {
            let before = pools();
            let free = PoolCounts::read(size, Some(0))
                .expect("read")
                .map_or(0, |p| p.free);
            let spec = RegionSpec::new("gm-test-exhaust", (free + 1) * size.bytes(), Some(0))
                .with_policy(PagePolicy::Strict(size));
            let err = Region::create(&topo, &spec).expect_err("more than the pool holds");
            let msg = err.to_string();
            assert!(matches!(err, RegionError::Unavailable { .. }), "{err:?}");
            assert!(msg.contains("free pages: host 1G"), "{msg}");
            assert!(msg.contains("; node 0 1G "), "{msg}");
            assert!(
                msg.contains(&format!("{size}: {} pages needed", free + 1)),
                "{msg}"
            );
            let after = pools();
            if before == after {
                println!("exhaustion {size}: {msg}");
                unchanged = true;
                break;
            }
        }
        assert!(
            unchanged,
            "{size} pool counts changed around every failed allocation"
        );
    }
}

#[test]
fn unknown_node_fails_before_allocating() {
    let topo = topology();
    let spec = RegionSpec::new("gm-test-node", 2 * MIB, Some(7));
    let err = Region::create(&topo, &spec).expect_err("no node 7");
    assert!(
        matches!(err, RegionError::UnknownNode { node: 7, .. }),
        "{err:?}"
    );
    let ids: Vec<_> = topo.nodes().iter().map(|n| n.id).collect();
    assert_eq!(
        err.to_string(),
        format!("NUMA node 7 does not exist (this host has nodes {ids:?})")
    );
}

#[test]
fn bad_specs_are_refused() {
    let topo = topology();
    let err = Region::create(&topo, &RegionSpec::new("gm-test", 0, None)).expect_err("empty");
    assert!(matches!(err, RegionError::BadSize(0)));
    let err = Region::create(&topo, &RegionSpec::new("a/b", 2 * MIB, None)).expect_err("slash");
    assert!(matches!(err, RegionError::BadName(_)));
    let err = Region::create(&topo, &RegionSpec::new("a\0b", 2 * MIB, None)).expect_err("nul");
    assert!(matches!(err, RegionError::BadName(_)));
    let spec =
        RegionSpec::new("gm-test", 3 * MIB, None).with_policy(PagePolicy::Strict(PageSize::Huge2M));
    let err = Region::create(&topo, &spec).expect_err("not a multiple");
    assert!(
        err.to_string()
            .contains("2M: the size is not a multiple of it"),
        "{err}"
    );
    let spec = RegionSpec::new("gm-test", 2 * MIB, None)
        .with_backing(Backing::HugetlbfsDir("/tmp".into()));
    assert!(matches!(
        Region::create(&topo, &spec),
        Err(RegionError::NotHugetlbfs(_))
    ));
}

#[test]
fn unbound_region_may_be_anywhere() {
    let _g = huge_lock();
    let test = "unbound 2M region";
    if !reserve(PageSize::Huge2M, 2, test) {
        return;
    }
    let topo = topology();
    let spec = RegionSpec::new("gm-test-unbound", 4 * MIB, None)
        .with_policy(PagePolicy::Strict(PageSize::Huge2M));
    let Some(region) = allocate(&topo, &spec, test) else {
        return;
    };
    let report = region.verify_placement().expect("query");
    assert_eq!(report.node, None);
    assert_eq!((report.on_node, report.misplaced.len()), (2, 0));
}

#[test]
fn reused_region_is_cleared_to_zero() {
    let _g = huge_lock();
    let test = "reuse";
    if !reserve(PageSize::Huge2M, 4, test) {
        return;
    }
    let topo = topology();
    let spec = RegionSpec::new("gm-test-reuse", 8 * MIB, Some(0))
        .with_policy(PagePolicy::Strict(PageSize::Huge2M));
    let Some(region) = allocate(&topo, &spec, test) else {
        return;
    };
    region.mark_mapped().expect("all clean");
    assert_eq!(region.states().counts().mapped, 4);
    // A guest wrote everything.
    (unsafe { region.as_mut_slice() }).fill(0xAA);
    assert_eq!(region.mark_all_dirty(), (4, 0));
    // One page is already clean again (say, the scrubber got to it).
    let page = region.states().claim_dirty(2).expect("a dirty page");
    let (offset, len) = region.page_range(page);
    (unsafe { region.as_mut_slice() })[offset as usize..(offset + len) as usize].fill(0);
    region
        .states()
        .try_transition(page, PageState::Clearing, PageState::Clean)
        .expect("finish");
    let report = region
        .prepare_eager(&topo, &RunOptions::default())
        .expect("prepare");
    assert_eq!(
        (report.populated, report.cleared, report.skipped),
        (0, 3, 1)
    );
    assert!(all_zero(unsafe { region.as_slice() }));
    assert_eq!(region.states().counts().clean, 4);
    // Nothing left to do.
    let report = region
        .prepare_eager(&topo, &RunOptions::default())
        .expect("prepare");
    assert_eq!(
        (report.populated, report.cleared, report.skipped),
        (0, 0, 4)
    );
    assert_on_node0(&region, test);
}

#[test]
fn hugetlbfs_file_backing() {
    let _g = huge_lock();
    let test = "hugetlbfs file";
    let Some(dir) = hugetlbfs_2m(test) else {
        return;
    };
    let dir = dir.as_path();
    if !reserve(PageSize::Huge2M, 2, test) {
        return;
    }
    let topo = topology();
    // The mount fixes the page size: strict 1G cannot be met there.
    let spec = RegionSpec::new("gm-test-file", 4 * MIB, Some(0))
        .with_backing(Backing::HugetlbfsDir(dir.into()));
    let err = Region::create(
        &topo,
        &spec
            .clone()
            .with_policy(PagePolicy::Strict(PageSize::Huge1G)),
    )
    .expect_err("1G on a 2M mount");
    assert!(
        err.to_string()
            .contains("1G: the hugetlbfs mount has another page size"),
        "{err}"
    );
    let Some(region) = allocate(&topo, &spec, test) else {
        return;
    };
    assert_eq!(region.page_size(), PageSize::Huge2M);
    assert_eq!(
        region.fallback(),
        None,
        "the mount's size is the caller's choice"
    );
    let path = region.path().expect("a file").to_path_buf();
    assert!(path.starts_with(dir));
    assert_eq!(
        std::fs::metadata(&path).expect("file exists").len(),
        4 * MIB
    );
    assert_on_node0(&region, test);
    drop(region);
    assert!(!path.exists(), "{} was not unlinked", path.display());
}

#[test]
fn vm_memory_adapter_maps_shared_without_noreserve() {
    let _g = huge_lock();
    let test = "adapter";
    if !reserve(PageSize::Huge2M, 4, test) {
        return;
    }
    let topo = topology();
    let spec = |name: &str| {
        RegionSpec::new(name, 4 * MIB, Some(0)).with_policy(PagePolicy::Strict(PageSize::Huge2M))
    };
    let Some(low) = allocate(&topo, &spec("gm-test-low"), test) else {
        return;
    };
    let Some(high) = allocate(&topo, &spec("gm-test-high"), test) else {
        return;
    };
    // Given out of order; sorted by the adapter.
    let mem =
        guest_memory(&[(GuestAddress(GIB), &high), (GuestAddress(0), &low)]).expect("guest memory");
    assert_eq!(mem.num_regions(), 2);
    let r = mem.find_region(GuestAddress(GIB)).expect("high region");
    assert_eq!(r.flags(), libc::MAP_SHARED);
    assert_eq!(r.prot(), libc::PROT_READ | libc::PROT_WRITE);
    assert_eq!(r.is_hugetlbfs(), Some(true));
    assert_eq!(r.len(), 4 * MIB);

    // What the VMM writes lands in hugemem's pages and back.
    mem.write_obj(0x1122_3344_5566_7788u64, GuestAddress(GIB + 3 * MIB))
        .expect("write");
    let mine = unsafe { high.as_slice() };
    assert_eq!(
        &mine[(3 * MIB) as usize..(3 * MIB + 8) as usize],
        &0x1122_3344_5566_7788u64.to_ne_bytes()
    );
    (unsafe { low.as_mut_slice() })[4096] = 0x5A;
    assert_eq!(mem.read_obj::<u8>(GuestAddress(4096)).expect("read"), 0x5A);

    // The VMM's mapping is shared and reserves: no "nr" (MAP_NORESERVE) in smaps.
    let host = r
        .get_host_address(guest_mem::vm_memory::MemoryRegionAddress(0))
        .expect("host address") as usize;
    let flags = vm_flags(host).expect("mapping in smaps");
    assert!(
        flags.contains(&"sh".to_string()) && !flags.contains(&"nr".to_string()),
        "{flags:?}"
    );
    assert!(flags.contains(&"ht".to_string()), "{flags:?}");

    // Refusals.
    let err = guest_memory(&[(GuestAddress(4096), &low)]).expect_err("misaligned");
    assert!(matches!(err, AdapterError::Misaligned { .. }), "{err:?}");
    let err = guest_memory(&[(GuestAddress(0), &low), (GuestAddress(2 * MIB), &high)])
        .expect_err("overlap");
    assert!(matches!(err, AdapterError::Collection(_)), "{err:?}");
    assert!(matches!(
        guest_memory(&[]),
        Err(AdapterError::Collection(_))
    ));
    low.mark_all_dirty();
    let err = guest_memory(&[(GuestAddress(0), &low)]).expect_err("dirty");
    assert!(
        matches!(err, AdapterError::NotPrepared { dirty: 2, .. }),
        "{err:?}"
    );
    let lazy = Region::create(
        &topo,
        &RegionSpec::new("gm-test-lazy", 2 * MIB, Some(0))
            .with_policy(PagePolicy::Strict(PageSize::Base4K)),
    )
    .expect("create");
    let err = guest_memory(&[(GuestAddress(0), &lazy)]).expect_err("unpopulated");
    assert!(
        matches!(err, AdapterError::NotPrepared { unpopulated: 1, .. }),
        "{err:?}"
    );
}

/// The `VmFlags` of the mapping that starts at `addr`, from /proc/self/smaps.
fn vm_flags(addr: usize) -> Option<Vec<String>> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let mut in_mapping = false;
    for line in smaps.lines() {
        if let Some((range, _)) = line.split_once(' ') {
            if let Some((start, _)) = range.split_once('-') {
                if let Ok(start) = usize::from_str_radix(start, 16) {
                    in_mapping = start == addr;
                    continue;
                }
            }
        }
        if in_mapping {
            if let Some(flags) = line.strip_prefix("VmFlags:") {
                return Some(flags.split_whitespace().map(str::to_string).collect());
            }
        }
    }
    None
}

#[test]
fn placement_query_reports_locations() {
    // PageLocation is what misplaced pages carry; make sure the variants we
    // match on are the ones the query returns for an unmapped address.
    let locs = numa::move_pages_query(None, &[4096]).expect("query");
    assert!(matches!(locs[0], PageLocation::Error(_)));
}

#[test]
fn populate_failure_is_an_error_of_the_preparation() {
    let _g = huge_lock();
    let test = "populate failure";
    let Some(dir) = hugetlbfs_2m(test) else {
        return;
    };
    let dir = dir.as_path();
    if !reserve(PageSize::Huge2M, 2, test) {
        return;
    }
    let topo = topology();
    let spec = RegionSpec::new("gm-test-fail", 4 * MIB, Some(0))
        .with_backing(Backing::HugetlbfsDir(dir.into()));
    let region = Region::create(&topo, &spec).expect("create");
    // Someone truncates the file under the mapping: populating the second
    // page now fails (the kernel would deliver SIGBUS to a plain access).
    let path = region.path().expect("file").to_path_buf();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open")
        .set_len(2 * MIB)
        .expect("truncate");
    let err = region
        .prepare_eager(&topo, &RunOptions::default())
        .expect_err("page 1 is beyond EOF");
    let PrepareError::Run(clearing::RunError::Work { source, .. }) = &err else {
        panic!("unexpected error {err:?}");
    };
    assert_eq!(source.page, 1);
    assert_eq!(source.offset, 2 * MIB);
    assert_eq!(
        source.source.raw_os_error(),
        Some(libc::EFAULT),
        "{source:?}"
    );
    println!("{test}: {err}: {source}: {}", source.source);
    // The failed page is dirty (maybe partly populated), the other one clean.
    assert_eq!(region.states().get(1), Ok(PageState::Dirty));
    assert_eq!(region.states().get(0), Ok(PageState::Clean));
    drop(region);
    assert!(!path.exists());
}

#[test]
fn memfd_cannot_be_shrunk_by_a_vmm() {
    let topo = topology();
    let spec = RegionSpec::new("gm-test-seal", 4 * MIB, None)
        .with_policy(PagePolicy::Strict(PageSize::Base4K));
    let region = Region::create(&topo, &spec).expect("create");
    let seals = unsafe { libc::fcntl(region.fd().as_raw_fd(), libc::F_GET_SEALS) };
    assert_eq!(seals, libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL);
    // Another open file description of the memfd, as a VMM would have.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/proc/self/fd/{}", region.fd().as_raw_fd()))
        .expect("reopen the memfd");
    for len in [0, 2 * MIB, 4 * MIB - 4096] {
        let err = file.set_len(len).expect_err("sealed");
        assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
    }
    // No further seals either (F_SEAL_SEAL).
    let added = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_GROW) };
    assert_eq!(added, -1);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::EPERM)
    );
    assert_eq!(file.metadata().expect("stat").len(), 4 * MIB);
    // Growing is allowed; it only adds pages beyond the region, which keeps
    // its length (the daemon's mapping and everything it hands out).
    file.set_len(8 * MIB).expect("growing is allowed");
    assert_eq!(region.len(), 4 * MIB);
}

/// Checks that `region` is `len` bytes with `clean` clean pages followed by
/// `tail` pages in `tail_state`.
fn assert_states(region: &Region, len: u64, clean: usize, tail_state: PageState, tail: usize) {
    assert_eq!(region.len(), len);
    assert_eq!(region.states().len(), clean + tail);
    for page in 0..clean + tail {
        let want = if page < clean {
            PageState::Clean
        } else {
            tail_state
        };
        assert_eq!(region.states().get(page), Ok(want), "page {page}");
    }
}

#[test]
fn clean_region_grows_in_place_on_its_node() {
    let _g = huge_lock();
    let test = "grow";
    if !reserve(PageSize::Huge2M, 8, test) {
        return;
    }
    let topo = topology();
    let spec = RegionSpec::new("gm-test-grow", 4 * MIB, Some(0))
        .with_policy(PagePolicy::Strict(PageSize::Huge2M));
    let Some(mut region) = allocate(&topo, &spec, test) else {
        return;
    };
    let inode = |r: &Region| {
        std::fs::File::from(r.try_clone_fd().expect("dup"))
            .metadata()
            .expect("stat")
            .ino()
    };
    let first_inode = inode(&region);
    assert_states(&region, 4 * MIB, 2, PageState::Clean, 0);

    // 4 MiB -> 8 MiB: old pages stay clean, new ones are unpopulated.
    region.grow(&topo, 8 * MIB).expect("grow to 8 MiB");
    assert_states(&region, 8 * MIB, 2, PageState::Unpopulated, 2);
    assert_eq!(inode(&region), first_inode, "same file");
    let report = region
        .prepare_eager(&topo, &RunOptions::default())
        .expect("prepare");
    assert_eq!(
        (report.populated, report.cleared, report.skipped),
        (2, 0, 2)
    );
    assert_states(&region, 8 * MIB, 4, PageState::Clean, 0);
    assert!(all_zero(unsafe { region.as_slice() }));
    assert_on_node0(&region, test);

    // Not a multiple of the page size, or not larger: refused, unchanged.
    for bad in [9 * MIB, 8 * MIB, 2 * MIB] {
        let err = region.grow(&topo, bad).expect_err("bad length");
        assert!(matches!(err, RegionError::BadGrow { .. }), "{err}");
        assert_states(&region, 8 * MIB, 4, PageState::Clean, 0);
    }

    // More than node 0 has: a clear error naming the free pages; nothing
    // changed, in the region or in the pools.
    let node_free = PoolCounts::read(PageSize::Huge2M, Some(0))
        .expect("read pool")
        .map_or(0, |p| p.free);
    let before = pool(PageSize::Huge2M);
    let err = region
        .grow(&topo, 8 * MIB + (node_free + 1) * 2 * MIB)
        .expect_err("beyond the pool");
    assert!(matches!(err, RegionError::GrowUnavailable { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("free pages:"), "{msg}");
    println!("{test}: {msg}");
    assert_eq!(pool(PageSize::Huge2M), before);
    assert_states(&region, 8 * MIB, 4, PageState::Clean, 0);
    assert!(all_zero(unsafe { region.as_slice() }));

    // A VMM grows the file and writes beyond the region: when the region
    // later grows over those pages they are cleared, not just populated.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/proc/self/fd/{}", region.fd().as_raw_fd()))
        .expect("reopen the memfd");
    file.set_len(10 * MIB).expect("a VMM may grow the file");
    {
        let len = 10 * MIB as usize;
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
        unsafe {
            std::slice::from_raw_parts_mut(ptr.cast::<u8>(), len)[8 * MIB as usize..].fill(0xEE)
        };
        assert_eq!(unsafe { libc::munmap(ptr, len) }, 0);
    }
    drop(file);
    assert_eq!(region.len(), 8 * MIB);
    region.grow(&topo, 12 * MIB).expect("grow to 12 MiB");
    assert_eq!(region.states().get(4), Ok(PageState::Dirty));
    assert_eq!(region.states().get(5), Ok(PageState::Unpopulated));
    let report = region
        .prepare_eager(&topo, &RunOptions::default())
        .expect("prepare");
    assert_eq!(
        (report.populated, report.cleared, report.skipped),
        (1, 1, 4)
    );
    assert_states(&region, 12 * MIB, 6, PageState::Clean, 0);
    assert!(all_zero(unsafe { region.as_slice() }));
    assert_on_node0(&region, test);
}
