//! Live checks against this host's kernel: topology, pinning and the
//! memory-policy syscalls on real mappings.
//!
//! They assume a host with NUMA node 0 holding CPUs and memory (every Linux
//! host has node 0). The hugetlb tests reserve their 2 MiB pages through
//! `numa::HugePages` (and give them back), and skip through
//! `test_support::skip!` when they cannot.
//!
//! Pinning and `set_mempolicy` change per-thread state, so those tests run
//! their body on a fresh thread: with `--test-threads=1` libtest runs tests on
//! the main thread, and the change would leak into later tests.

use std::fs;
use std::path::Path;
use std::process::Command;
use std::ptr;
use std::thread;

use numa::{
    current_affinity, current_cpu, get_mempolicy, get_mempolicy_node_of_addr, mbind, migrate_pages,
    move_pages, move_pages_query, parse_cpulist, pin_current_thread, pin_current_thread_to_node,
    set_mempolicy, spawn_pinned, HugePages, HugePagesError, MbindFlags, MemPolicyMode, MountState,
    NodeMask, PageLocation, PinError, PolicyError, ReserveMode, Topology,
};

const PAGE: usize = 4096;
const HUGE_2M: usize = 2 << 20;

/// An anonymous private mapping, unmapped on drop.
struct Mapping {
    addr: *mut u8,
    len: usize,
}

impl Mapping {
    /// `mmap(NULL, len, RW, MAP_PRIVATE|MAP_ANONYMOUS|extra)`.
    fn anonymous(len: usize, extra_flags: libc::c_int) -> std::io::Result<Self> {
        // SAFETY: a fresh anonymous private mapping at an address the kernel
        // chooses (no MAP_FIXED): it aliases no existing Rust memory.
        let addr = unsafe {
            libc::mmap(
                ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | extra_flags,
                -1,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self {
            addr: addr.cast(),
            len,
        })
    }

    fn addr(&self) -> usize {
        self.addr as usize
    }

    /// Writes one byte at `offset`, faulting the page in.
    fn touch(&self, offset: usize) {
        assert!(offset < self.len);
        let byte = self.addr.wrapping_add(offset);
        // SAFETY: `offset < len` (asserted), so `byte` is inside the live RW
        // mapping this object owns, and nothing else holds a reference into it.
        unsafe { byte.write_volatile(0x5a) };
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `addr`/`len` are exactly what mmap returned and this object
        // owns the mapping; no reference into it outlives `self`.
        unsafe { libc::munmap(self.addr.cast(), self.len) };
    }
}

/// Runs `f` on a fresh thread and returns its result, re-raising a panic.
fn on_fresh_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    match thread::spawn(f).join() {
        Ok(v) => v,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

fn sysfs_online_cpus() -> Vec<usize> {
    let text = fs::read_to_string("/sys/devices/system/cpu/online").expect("read cpu/online");
    parse_cpulist(&text).expect("parse cpu/online")
}

#[test]
fn detect_finds_node0_and_all_online_cpus() {
    let topo = Topology::detect().expect("detect");
    let node0 = topo.node(0).expect("node 0");
    assert!(node0.mem_total > 0, "node 0 has memory");
    assert!(node0.mem_free <= node0.mem_total);
    assert_eq!(topo.distance(0, 0), Some(10));

    let mut all: Vec<usize> = topo
        .nodes()
        .iter()
        .flat_map(|n| n.cpus.iter().copied())
        .collect();
    all.sort_unstable();
    assert_eq!(all, sysfs_online_cpus());
    let parallelism = thread::available_parallelism()
        .expect("available_parallelism")
        .get();
    assert!(
        all.len() >= parallelism,
        "{} online CPUs < available_parallelism {parallelism}",
        all.len()
    );
    if topo.nodes().len() == 1 {
        assert_eq!(node0.cpus, sysfs_online_cpus());
    }
    for &cpu in &node0.cpus {
        assert_eq!(topo.node_of_cpu(cpu), Some(0));
    }

    // The node's pools are the global sizes the kernel offers.
    let global = Path::new("/sys/kernel/mm/hugepages");
    if global.join("hugepages-2048kB").is_dir() {
        assert!(node0.huge_pool(numa::HUGE_PAGE_2M).is_some());
    }
    if global.join("hugepages-1048576kB").is_dir() {
        assert!(node0.huge_pool(numa::HUGE_PAGE_1G).is_some());
    }
}

#[test]
fn pin_to_node0_runs_on_node0() {
    let topo = Topology::detect().expect("detect");
    let cpus = topo.node(0).expect("node 0").cpus.clone();
    let (cpu, node, affinity) = on_fresh_thread(move || {
        pin_current_thread_to_node(&topo, 0).expect("pin to node 0");
        let (cpu, node) = current_cpu().expect("getcpu");
        (cpu, node, current_affinity().expect("getaffinity"))
    });
    assert_eq!(node, 0);
    assert!(cpus.contains(&cpu), "cpu {cpu} not in node 0 {cpus:?}");
    assert_eq!(affinity, cpus);
}

#[test]
fn pin_to_each_single_cpu() {
    for cpu in sysfs_online_cpus() {
        let (got, affinity) = on_fresh_thread(move || {
            pin_current_thread(&[cpu]).expect("pin");
            (
                current_cpu().expect("getcpu").0,
                current_affinity().expect("getaffinity"),
            )
        });
        assert_eq!(got, cpu);
        assert_eq!(affinity, vec![cpu]);
    }
}

#[test]
fn spawn_pinned_worker_runs_on_its_cpu() {
    let cpu = *sysfs_online_cpus().last().expect("an online CPU");
    let handle = spawn_pinned(format!("pinned-{cpu}"), vec![cpu], || {
        (thread::current().name().map(str::to_owned), current_cpu())
    })
    .expect("spawn");
    let (name, here) = handle.join().expect("worker panicked").expect("pinned");
    assert_eq!(name.as_deref(), Some(format!("pinned-{cpu}").as_str()));
    assert_eq!(here.expect("getcpu").0, cpu);
}

#[test]
fn pin_out_of_range_errors() {
    on_fresh_thread(|| {
        let before = current_affinity().expect("getaffinity");
        // Beyond cpu_set_t: refused before the syscall.
        assert!(matches!(
            pin_current_thread(&[4096]),
            Err(PinError::CpuOutOfRange(4096))
        ));
        // Inside cpu_set_t but no such CPU on this host: the kernel says EINVAL.
        let missing = 1000;
        assert!(!sysfs_online_cpus().contains(&missing));
        match pin_current_thread(&[missing]) {
            Err(PinError::Syscall {
                op: "sched_setaffinity",
                source,
            }) => {
                assert_eq!(source.raw_os_error(), Some(libc::EINVAL));
            }
            other => panic!("pinning to CPU {missing}: {other:?}"),
        }
        assert_eq!(
            current_affinity().expect("getaffinity"),
            before,
            "failed pin changed nothing"
        );
    });
}

#[test]
fn mbind_anonymous_page() {
    let map = Mapping::anonymous(PAGE, 0).expect("mmap");
    let bind = MbindFlags::default();
    mbind(
        map.addr(),
        PAGE,
        MemPolicyMode::Bind,
        &NodeMask::single(0),
        bind,
    )
    .expect("bind to node 0");
    map.touch(0);
    assert_eq!(
        move_pages_query(None, &[map.addr()]).expect("query"),
        vec![PageLocation::Node(0)]
    );

    // With MPOL_MF_MOVE|STRICT on a page already on node 0: nothing to move.
    let strict_move = MbindFlags {
        strict: true,
        move_pages: true,
        move_all: false,
    };
    mbind(
        map.addr(),
        PAGE,
        MemPolicyMode::Bind,
        &NodeMask::single(0),
        strict_move,
    )
    .expect("strict move");
    // MOVE_ALL needs CAP_SYS_NICE; the tests run as root.
    let move_all = MbindFlags {
        strict: false,
        move_pages: false,
        move_all: true,
    };
    mbind(
        map.addr(),
        PAGE,
        MemPolicyMode::Preferred,
        &NodeMask::single(0),
        move_all,
    )
    .expect("move all");
    mbind(
        map.addr(),
        PAGE,
        MemPolicyMode::Default,
        &NodeMask::new(),
        bind,
    )
    .expect("back to default");

    // Node 63 is not online here: the kernel checks the mask against the
    // nodes that have memory and answers EINVAL (observed on 6.18).
    let err = mbind(
        map.addr(),
        PAGE,
        MemPolicyMode::Bind,
        &NodeMask::single(63),
        bind,
    )
    .expect_err("node 63");
    assert!(
        matches!(err, PolicyError::InvalidArgument { op: "mbind" }),
        "{err:?}"
    );
    // An empty mask with Bind.
    let err = mbind(
        map.addr(),
        PAGE,
        MemPolicyMode::Bind,
        &NodeMask::new(),
        bind,
    )
    .expect_err("empty mask");
    assert!(
        matches!(err, PolicyError::InvalidArgument { .. }),
        "{err:?}"
    );
    // An address that is not page aligned.
    let err = mbind(
        map.addr() + 8,
        PAGE,
        MemPolicyMode::Bind,
        &NodeMask::single(0),
        bind,
    )
    .expect_err("unaligned");
    assert!(
        matches!(err, PolicyError::InvalidArgument { .. }),
        "{err:?}"
    );
}

#[test]
fn mbind_unmapped_range_is_not_mapped() {
    // Map three pages, unmap the middle one, bind across the hole.
    let map = Mapping::anonymous(3 * PAGE, 0).expect("mmap");
    // SAFETY: the middle page lies inside `map`, which nothing references;
    // `Mapping::drop` later unmaps the whole range, which is fine with a hole.
    let rc = unsafe { libc::munmap((map.addr() + PAGE) as *mut libc::c_void, PAGE) };
    assert_eq!(rc, 0);
    let err = mbind(
        map.addr(),
        3 * PAGE,
        MemPolicyMode::Bind,
        &NodeMask::single(0),
        MbindFlags::default(),
    )
    .expect_err("hole");
    // Observed on 6.18: EFAULT.
    assert!(
        matches!(err, PolicyError::NotMapped { op: "mbind" }),
        "{err:?}"
    );
}

#[test]
fn set_get_mempolicy_round_trip() {
    on_fresh_thread(|| {
        assert_eq!(
            get_mempolicy().expect("get"),
            (MemPolicyMode::Default, NodeMask::new())
        );

        set_mempolicy(MemPolicyMode::Bind, &NodeMask::single(0)).expect("set bind");
        assert_eq!(
            get_mempolicy().expect("get"),
            (MemPolicyMode::Bind, NodeMask::single(0))
        );

        set_mempolicy(MemPolicyMode::Interleave, &NodeMask::single(0)).expect("set interleave");
        assert_eq!(
            get_mempolicy().expect("get"),
            (MemPolicyMode::Interleave, NodeMask::single(0))
        );

        set_mempolicy(MemPolicyMode::Preferred, &NodeMask::single(0)).expect("set preferred");
        assert_eq!(
            get_mempolicy().expect("get"),
            (MemPolicyMode::Preferred, NodeMask::single(0))
        );

        set_mempolicy(MemPolicyMode::Local, &NodeMask::new()).expect("set local");
        assert_eq!(
            get_mempolicy().expect("get"),
            (MemPolicyMode::Local, NodeMask::new())
        );

        // Bind to a node that does not exist here: refused, policy unchanged.
        let err = set_mempolicy(MemPolicyMode::Bind, &NodeMask::single(63)).expect_err("node 63");
        assert!(
            matches!(
                err,
                PolicyError::InvalidArgument {
                    op: "set_mempolicy"
                }
            ),
            "{err:?}"
        );
        // Default takes no nodes.
        let err = set_mempolicy(MemPolicyMode::Default, &NodeMask::single(0))
            .expect_err("default with nodes");
        assert!(
            matches!(err, PolicyError::InvalidArgument { .. }),
            "{err:?}"
        );

        set_mempolicy(MemPolicyMode::Default, &NodeMask::new()).expect("reset");
        assert_eq!(
            get_mempolicy().expect("get"),
            (MemPolicyMode::Default, NodeMask::new())
        );
    });
}

#[test]
fn bound_thread_allocates_on_node0() {
    on_fresh_thread(|| {
        set_mempolicy(MemPolicyMode::Bind, &NodeMask::single(0)).expect("set bind");
        let map = Mapping::anonymous(4 * PAGE, 0).expect("mmap");
        let pages: Vec<usize> = (0..4).map(|i| map.addr() + i * PAGE).collect();
        for i in 0..4 {
            map.touch(i * PAGE);
        }
        let locations = move_pages_query(None, &pages).expect("query");
        set_mempolicy(MemPolicyMode::Default, &NodeMask::new()).expect("reset");
        assert_eq!(locations, vec![PageLocation::Node(0); 4]);
    });
}

#[test]
fn move_pages_query_touched_untouched_unmapped() {
    let map = Mapping::anonymous(2 * PAGE, 0).expect("mmap");
    map.touch(0);
    let pages = [map.addr(), map.addr() + PAGE];
    assert_eq!(
        move_pages_query(None, &pages).expect("query"),
        vec![PageLocation::Node(0), PageLocation::Error(-libc::ENOENT)]
    );
    // The same through our own pid.
    let pid = i32::try_from(std::process::id()).expect("pid fits i32");
    assert_eq!(
        move_pages_query(Some(pid), &pages[..1]).expect("query by pid"),
        vec![PageLocation::Node(0)]
    );

    // get_mempolicy(MPOL_F_NODE|MPOL_F_ADDR) agrees for the touched page.
    assert_eq!(
        get_mempolicy_node_of_addr(map.addr()).expect("node of addr"),
        0
    );

    // An address nothing is mapped at: per-page -EFAULT, not a call error.
    // Not a page we munmap ourselves: the tests of this file run in parallel
    // threads of one process, and another test's mmap may be handed that
    // very page between our munmap and the query (issue 10: -ENOENT, the
    // answer for a mapped page not yet touched). Nor a PROT_NONE page: that
    // is still a mapping (-ENOENT too). The last page of the address space
    // lies in the kernel half on every 64-bit Linux, above any user
    // mapping (TASK_SIZE), so no mmap can ever cover it; the kernel looks it
    // up among this process's mappings like any other address and finds
    // none.
    let hole_addr = usize::MAX & !(PAGE - 1);
    assert_eq!(
        move_pages_query(None, &[hole_addr]).expect("query"),
        vec![PageLocation::Error(-libc::EFAULT)]
    );
    let err = get_mempolicy_node_of_addr(hole_addr).expect_err("unmapped");
    assert!(
        matches!(
            err,
            PolicyError::NotMapped {
                op: "get_mempolicy"
            }
        ),
        "{err:?}"
    );
}

#[test]
fn move_pages_query_no_such_process() {
    // pid_max is at most 2^22 on Linux, so this pid cannot exist.
    let err = move_pages_query(Some(i32::MAX), &[0x1000]).expect_err("no such pid");
    assert!(
        matches!(err, PolicyError::NoSuchProcess { op: "move_pages" }),
        "{err:?}"
    );
}

#[test]
fn move_pages_to_same_node_and_to_absent_node() {
    let map = Mapping::anonymous(2 * PAGE, 0).expect("mmap");
    map.touch(0);
    map.touch(PAGE);
    let pages = [map.addr(), map.addr() + PAGE];
    assert_eq!(
        move_pages(None, &pages, &[0, 0], false).expect("move"),
        vec![PageLocation::Node(0); 2]
    );
    assert_eq!(
        move_pages(None, &pages, &[0, 0], true).expect("move all"),
        vec![PageLocation::Node(0); 2]
    );

    // An untouched page has nothing to move: per-page -ENOENT.
    let fresh = Mapping::anonymous(PAGE, 0).expect("mmap");
    assert_eq!(
        move_pages(None, &[fresh.addr()], &[0], false).expect("move"),
        vec![PageLocation::Error(-libc::ENOENT)]
    );

    // Node 63 has no memory: the call as a whole fails with ENODEV.
    let err = move_pages(None, &pages[..1], &[63], false).expect_err("node 63");
    assert!(
        matches!(err, PolicyError::NodeNotOnline { op: "move_pages" }),
        "{err:?}"
    );
    // Validation before the syscall.
    let err = move_pages(None, &pages, &[0], false).expect_err("lengths differ");
    assert!(
        matches!(err, PolicyError::InvalidArgument { .. }),
        "{err:?}"
    );
}

#[test]
fn migrate_pages_self_node0_to_node0() {
    let moved_back =
        migrate_pages(None, &NodeMask::single(0), &NodeMask::single(0)).expect("migrate");
    assert_eq!(moved_back, 0);
    // An empty target set is refused.
    let err = migrate_pages(None, &NodeMask::single(0), &NodeMask::new()).expect_err("empty to");
    assert!(
        matches!(
            err,
            PolicyError::InvalidArgument {
                op: "migrate_pages"
            }
        ),
        "{err:?}"
    );
    let err = migrate_pages(Some(i32::MAX), &NodeMask::single(0), &NodeMask::single(0))
        .expect_err("no pid");
    assert!(matches!(err, PolicyError::NoSuchProcess { .. }), "{err:?}");
}

const HUGE_2M_BYTES: u64 = HUGE_2M as u64;

/// Pages this test added to the 2 MiB pool; given back on drop.
struct Reservation {
    added: u64,
}

impl Reservation {
    /// Makes sure one 2 MiB page is free and not reserved by another mapping,
    /// through `numa::HugePages` (free mode changes nothing when there already
    /// is one). `Err(reason)` when that is impossible here.
    fn one_free_2m_page() -> Result<Self, String> {
        let pools = HugePages::host();
        let before = pools
            .pool(HUGE_2M_BYTES, None)
            .map_err(|e| format!("no 2 MiB pool: {e}"))?;
        let report = pools
            .reserve(HUGE_2M_BYTES, 1, None, ReserveMode::Free)
            .map_err(|e| e.to_string())?;
        let reservation = Self {
            added: report.after.total.saturating_sub(before.total),
        };
        if !report.met {
            return Err(format!(
                "asked for 1 free 2 MiB page, the kernel gave {report:?}"
            ));
        }
        Ok(reservation)
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.added == 0 {
            return;
        }
        // Shrink by what we added. Pages mapped by anyone else stay: the
        // kernel never frees in-use or reserved huge pages on shrink.
        let pools = HugePages::host();
        let result = pools.pool(HUGE_2M_BYTES, None).and_then(|now| {
            pools.reserve(
                HUGE_2M_BYTES,
                now.total.saturating_sub(self.added),
                None,
                ReserveMode::Exact,
            )
        });
        if let Err(e) = result {
            eprintln!(
                "warning: could not give back {} 2 MiB page(s): {e}",
                self.added
            );
        }
    }
}

/// Reserves 2 MiB pages on node 0 in each mode against the real kernel,
/// checks every report against sysfs, and gives them back.
#[test]
fn reserve_and_give_back_2m_pages_on_node0() {
    let pools = HugePages::host();
    let before = match pools.pool(HUGE_2M_BYTES, Some(0)) {
        Ok(p) => p,
        Err(e) => {
            test_support::skip!("no 2 MiB pool on node 0: {e}");
            return;
        }
    };
    let host_before = pools.pool(HUGE_2M_BYTES, None).expect("host pool");
    // Two more pages than there are now, as a floor on the node's pool.
    let grown = match pools.reserve(HUGE_2M_BYTES, before.total + 2, Some(0), ReserveMode::Total) {
        Ok(r) => r,
        Err(e @ HugePagesError::NotRoot { .. }) => {
            test_support::skip!("{e}");
            return;
        }
        Err(e) => panic!("reserve: {e}"),
    };
    let read = |node| pools.pool(HUGE_2M_BYTES, node).expect("read pool");
    let give_back = || {
        let r = pools
            .reserve(HUGE_2M_BYTES, before.total, Some(0), ReserveMode::Exact)
            .expect("give back");
        assert_eq!(r.after, read(Some(0)));
        r
    };
    if !grown.met {
        give_back();
        test_support::skip!("the kernel gave fewer 2 MiB pages than asked: {grown:?}");
        return;
    }
    assert_eq!(grown.total_before, before.total);
    assert_eq!(grown.after, read(Some(0)));
    assert_eq!(grown.shortfall(), 0);
    let node0 = grown
        .nodes
        .iter()
        .find(|n| n.node == 0)
        .expect("node 0 listed");
    assert_eq!(
        (node0.total, node0.free),
        (grown.after.total, grown.after.free)
    );
    // The host-wide pool grew by as much (no other process changes it under
    // the machine lock).
    assert_eq!(read(None).total, host_before.total + 2);

    // Free mode: already enough available, so nothing changes.
    let free = pools
        .reserve(HUGE_2M_BYTES, 2, None, ReserveMode::Free)
        .expect("free mode");
    assert!(free.met, "{free:?}");
    assert_eq!(free.after.total, read(None).total);
    assert_eq!(free.after.total, host_before.total + 2);

    let back = give_back();
    assert!(back.met, "{back:?}");
    assert_eq!(back.after.total, before.total);
    assert_eq!(read(None).total, host_before.total);
}

#[test]
fn unknown_node_is_refused_with_the_nodes_that_exist() {
    let topo = Topology::detect().expect("topology");
    let missing = topo.nodes().iter().map(|n| n.id).max().unwrap_or(0) + 1;
    match HugePages::host().reserve(HUGE_2M_BYTES, 1, Some(missing), ReserveMode::Total) {
        Err(HugePagesError::NoSuchNode { node, available }) => {
            assert_eq!(node, missing);
            assert_eq!(
                available,
                topo.nodes().iter().map(|n| n.id).collect::<Vec<_>>()
            );
        }
        other => panic!("expected NoSuchNode, got {other:?}"),
    }
}

/// Mounts a 2 MiB hugetlbfs with the `mount` syscall in a temporary
/// directory, finds it in /proc/mounts, does not mount it twice, unmounts it.
#[test]
fn mounts_hugetlbfs_in_a_temporary_directory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pools = HugePages::host();
    let m = match pools.mount_hugetlbfs(HUGE_2M_BYTES, dir.path()) {
        Ok(m) => m,
        Err(e @ HugePagesError::NotRoot { .. }) => {
            test_support::skip!("{e}");
            return;
        }
        Err(e) => panic!("mount: {e}"),
    };
    assert_eq!(m.state, MountState::Mounted);
    assert_eq!(m.path, dir.path().join("hugepages-2M"));
    let line = fs::read_to_string("/proc/mounts")
        .expect("mounts")
        .lines()
        .find(|l| l.split_whitespace().nth(1) == m.path.to_str())
        .map(str::to_owned);
    let again = pools.mount_hugetlbfs(HUGE_2M_BYTES, dir.path());
    let umount = Command::new("umount").arg(&m.path).status();
    let line = line.expect("the mount is in /proc/mounts");
    assert!(
        line.starts_with("hugetlbfs ") && line.contains("pagesize=2M"),
        "{line}"
    );
    assert_eq!(
        again.expect("second call").state,
        MountState::AlreadyMounted
    );
    assert!(matches!(umount, Ok(s) if s.success()), "umount: {umount:?}");
}

#[test]
fn move_pages_query_hugetlb_2m_page_on_node0() {
    let _reservation = match Reservation::one_free_2m_page() {
        Ok(r) => r,
        Err(reason) => {
            test_support::skip!("{reason}");
            return;
        }
    };
    let map = match Mapping::anonymous(HUGE_2M, libc::MAP_HUGETLB) {
        Ok(m) => m,
        Err(e) => {
            // Another process took the free page between the reservation and now.
            test_support::skip!("mmap of a 2 MiB hugetlb page failed after reserving one: {e}");
            return;
        }
    };
    map.touch(0);
    map.touch(HUGE_2M - 1);
    // Any address inside the huge page reports the page's node.
    let pages = [map.addr(), map.addr() + HUGE_2M / 2];
    assert_eq!(
        move_pages_query(None, &pages).expect("query"),
        vec![PageLocation::Node(0); 2]
    );
    assert_eq!(
        move_pages(None, &pages[..1], &[0], false).expect("move to 0"),
        vec![PageLocation::Node(0)]
    );
    assert_eq!(
        get_mempolicy_node_of_addr(map.addr()).expect("node of addr"),
        0
    );
    mbind(
        map.addr(),
        HUGE_2M,
        MemPolicyMode::Bind,
        &NodeMask::single(0),
        MbindFlags::default(),
    )
    .expect("mbind hugetlb");
    // A policy change on part of a huge page would split the hugetlb VMA
    // inside the page, which the kernel refuses.
    let err = mbind(
        map.addr(),
        PAGE,
        MemPolicyMode::Preferred,
        &NodeMask::single(0),
        MbindFlags::default(),
    )
    .expect_err("4 KiB of a 2 MiB page");
    assert!(
        matches!(err, PolicyError::InvalidArgument { .. }),
        "{err:?}"
    );
}
