//! NUMA tests that need a kernel with two or more NUMA nodes that have memory.
//!
//! This machine has one node, so `tests/numa_guest.rs` builds this file as a
//! static binary and runs it inside a Linux guest under QEMU's software
//! emulation (TCG) with 2 nodes (4 with `HUGEMEM_NUMA_NODES=4`), through
//! `scripts/numa-guest run`. The file compiles to tests only with
//! `--cfg hugemem_numa_guest`, which that static build sets: on the host a
//! plain `cargo test` builds an empty binary instead of tests that could only
//! skip (and clippy still checks the code). Inside a guest with fewer than two
//! nodes that have memory, a test skips through `test_support::skip!`, and the
//! host driver fails the run on any skip.
//!
//! What runs, against the real kernel:
//! - **topology**: `numa::Topology::detect` sees every node with CPUs, memory,
//!   the distance table (10 local, 20 remote: QEMU's default) and per-node
//!   1 GiB and 2 MiB pools with the counts from the kernel command line; a
//!   thread pinned to a node's CPUs runs on that node.
//! - **placement**: a `guest_mem::Region` of 2 MiB pages bound to each node
//!   has every page on it; the clearing runner with one job per node over an
//!   `mbind`-bound anonymous mapping places every 4 KiB page on its node.
//! - **pool per node**: a strict 1 GiB region on node 1 takes node 1's page;
//!   a second one is refused with an error naming the free pages per node,
//!   while node 0's page is still there for a region on node 0.
//! - **migration** of 2 MiB and 1 GiB pages of a region that another process
//!   maps: `MPOL_MF_MOVE` leaves them, `MPOL_MF_MOVE_ALL` moves them from
//!   node 0 to node 1, and both processes still read the same data.
//! - **userfaultfd MINOR** on hugetlbfs with `backend::uffd`: the handshake
//!   offers `MINOR_HUGETLBFS`, and a minor fault on a page the region holds is
//!   resolved with `UFFDIO_CONTINUE`, mapping the page from the right node.
//!
//! Each test that ran its checks to the end prints `NUMA-TEST-DONE <name>`;
//! the host driver requires one per test, so a test that skipped inside the
//! guest fails the run instead of passing silently. Results are printed as
//! parseable lines (`NUMA-TOPOLOGY`, `NUMA-PLACEMENT`, `NUMA-CLEAR`,
//! `NUMA-POOL`, `NUMA-MIGRATE`, `NUMA-UFFD`); throughput measured under TCG is
//! labelled `(TCG emulation)` and says nothing about real hardware.
//!
//! The tests share the per-node huge-page pools (one 1 GiB page per node in
//! the guest), so they take one lock and run one at a time.
#![cfg(any(hugemem_numa_guest, clippy))]

use std::collections::BTreeMap;
use std::env;
use std::fs::{self, OpenOptions};
use std::io::{self, BufRead, BufReader, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::process::{ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use backend::uffd::{abi, CreateFlags, Fill, RegisterMode, Uffd, UffdEvent};
use clearing::{ClearKernel, Job, RunOptions, CLEAR_ALIGN, CLEAR_MIN_CHUNK};
use guest_mem::{AnonMapping, PagePolicy, PageSize, PoolCounts, Region, RegionError, RegionSpec};
use numa::{
    MbindFlags, MemPolicyMode, Node, NodeId, NodeMask, PageLocation, Topology, HUGE_PAGE_1G,
    HUGE_PAGE_2M,
};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// Longest wait for a child process or a faulting thread.
const DEADLINE: Duration = Duration::from_secs(120);
/// The kernel's distance of a node to itself, and QEMU's default to another node.
const LOCAL_DISTANCE: u32 = 10;
const QEMU_REMOTE_DISTANCE: u32 = 20;
/// Label for every throughput figure measured here.
const TCG: &str = "(TCG emulation)";
/// Set by the guest's /init.
const GUEST_ENV: &str = "HUGEMEM_NUMA_GUEST";
const GUEST_NODES_ENV: &str = "HUGEMEM_NUMA_GUEST_NODES";
/// The migration tests re-execute this binary, running only
/// [`numa_child_maps_shared_region`], with these set.
const CHILD_PATH_ENV: &str = "HUGEMEM_NUMA_CHILD_MAP";
const CHILD_LEN_ENV: &str = "HUGEMEM_NUMA_CHILD_LEN";
const CHILD_PAGE_ENV: &str = "HUGEMEM_NUMA_CHILD_PAGE";
const CHILD_SEED_ENV: &str = "HUGEMEM_NUMA_CHILD_SEED";
const CHILD_TEST: &str = "numa_child_maps_shared_region";

static SERIAL: Mutex<()> = Mutex::new(());

// ---------------------------------------------------------------------------
// Helpers.

/// A test's hold on the machine's NUMA resources.
struct Numa {
    _serial: MutexGuard<'static, ()>,
    topology: Topology,
}

impl Numa {
    /// Nodes that have memory, ascending.
    fn memory_nodes(&self) -> Vec<&Node> {
        self.topology
            .nodes()
            .iter()
            .filter(|n| !n.is_memoryless())
            .collect()
    }
}

/// The topology, or `None` after printing `SKIP` where fewer than two nodes
/// have memory.
fn numa(test: &str) -> Option<Numa> {
    let serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    let topology = Topology::detect().expect("detect the NUMA topology");
    let with_memory = topology
        .nodes()
        .iter()
        .filter(|n| !n.is_memoryless())
        .count();
    if with_memory < 2 {
        test_support::skip!(
            "{test}: needs ≥2 NUMA nodes (runs inside the QEMU guest via integration/tests/numa_guest.rs)"
        );
        return None;
    }
    Some(Numa {
        _serial: serial,
        topology,
    })
}

fn in_guest() -> bool {
    env::var_os(GUEST_ENV).is_some()
}

/// Marks a test that ran all its checks (the host driver counts these).
fn done(test: &str) {
    println!("NUMA-TEST-DONE {test}");
}

/// Free pages of `size` in `node`'s pool.
fn free_pages(size: PageSize, node: NodeId) -> u64 {
    PoolCounts::read(size, Some(node))
        .expect("read the node's pool counts")
        .map_or(0, |p| p.free)
}

/// True when `node` has `pages` free pages of `size`; prints `SKIP` otherwise.
fn has_free(test: &str, size: PageSize, pages: u64, node: NodeId) -> bool {
    let free = free_pages(size, node);
    if free < pages {
        test_support::skip!(
            "{test}: needs {pages} free {size} pages on node {node}, it has {free}"
        );
        return false;
    }
    true
}

/// Per-node pool sizes the kernel command line asks for:
/// `hugepagesz=1G hugepages=0:1,1:1` gives `{(1 GiB, 0): 1, (1 GiB, 1): 1}`.
/// Host-wide counts (`hugepages=N`) are not per node and are left out.
fn parse_node_pools(cmdline: &str) -> BTreeMap<(u64, NodeId), u64> {
    let mut size = None;
    let mut pools = BTreeMap::new();
    for word in cmdline.split_whitespace() {
        if let Some(text) = word.strip_prefix("hugepagesz=") {
            size = PageSize::parse(text).map(PageSize::bytes);
        } else if let Some(list) = word.strip_prefix("hugepages=") {
            let Some(size) = size else { continue };
            for item in list.split(',') {
                let Some((node, count)) = item.split_once(':') else {
                    continue;
                };
                if let (Ok(node), Ok(count)) = (node.parse(), count.parse()) {
                    pools.insert((size, node), count);
                }
            }
        }
    }
    pools
}

/// The value of pattern word `i`.
fn pattern(seed: u64, i: usize) -> u64 {
    (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed
}

fn fill_pattern(bytes: &mut [u8], seed: u64) {
    for (i, word) in bytes.chunks_exact_mut(8).enumerate() {
        word.copy_from_slice(&pattern(seed, i).to_ne_bytes());
    }
}

/// Byte offset of the first word that differs from the pattern.
fn pattern_mismatch(bytes: &[u8], seed: u64) -> Option<usize> {
    bytes
        .chunks_exact(8)
        .enumerate()
        .position(|(i, w)| w != pattern(seed, i).to_ne_bytes())
        .map(|i| i * 8)
}

/// `count` page addresses from `base`, `step` bytes apart.
fn page_addrs(base: usize, step: u64, count: u64) -> Vec<usize> {
    let step = usize::try_from(step).expect("page size fits usize");
    let count = usize::try_from(count).expect("page count fits usize");
    (0..count).map(|i| base + i * step).collect()
}

/// `node:count,…` of where the pages are (errors as `err<errno>`).
fn summarize(locations: &[PageLocation]) -> String {
    let mut by: BTreeMap<String, usize> = BTreeMap::new();
    for loc in locations {
        let key = match loc {
            PageLocation::Node(n) => n.to_string(),
            PageLocation::Error(e) => format!("err{e}"),
        };
        *by.entry(key).or_default() += 1;
    }
    by.iter()
        .map(|(k, v)| format!("{k}:{v}"))
        .collect::<Vec<_>>()
        .join(",")
}

fn count_on(locations: &[PageLocation], node: NodeId) -> usize {
    locations
        .iter()
        .filter(|l| **l == PageLocation::Node(node))
        .count()
}

fn share(local: usize, pages: usize) -> f64 {
    if pages == 0 {
        return 0.0;
    }
    100.0 * local as f64 / pages as f64
}

/// A `MAP_SHARED` read-write view of an fd (a second mapping of a region's
/// file, as a VMM would have), unmapped on drop.
struct SharedView {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the view is shared memory owned by this value; the pointer is only
// an address, reads are volatile, and the unmap happens once, in drop, after
// every holder (`Arc`) is gone.
unsafe impl Send for SharedView {}
// SAFETY: as for `Send`; `&SharedView` hands out the address and volatile reads.
unsafe impl Sync for SharedView {}

impl SharedView {
    fn map(fd: BorrowedFd<'_>, len: usize) -> Self {
        // SAFETY: no MAP_FIXED, so the kernel picks a fresh range that aliases
        // no Rust object; `fd` is open for the duration of the call.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(
            ptr,
            libc::MAP_FAILED,
            "mmap of {len} bytes: {}",
            io::Error::last_os_error()
        );
        Self {
            ptr: ptr.cast(),
            len,
        }
    }

    fn addr(&self) -> usize {
        self.ptr as usize
    }

    fn read(&self, offset: usize) -> u8 {
        assert!(offset < self.len);
        // SAFETY: in bounds of this live mapping (checked above); volatile
        // because another mapping of the file may change it.
        unsafe { self.ptr.wrapping_add(offset).read_volatile() }
    }

    /// The whole view as bytes.
    ///
    /// # Safety
    ///
    /// Nothing may write the file's pages while the slice lives.
    unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr..ptr+len is this live mapping; the caller promises no
        // writer while the slice lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for SharedView {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping `map` created, unmapped only here; no
        // slice of it outlives `self`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// This test binary re-executed as a second process that maps a region's
/// memfd (see [`numa_child_maps_shared_region`]); killed on drop.
struct MapperChild {
    child: std::process::Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
}

impl MapperChild {
    /// Starts the child on `path` (`/proc/<pid>/fd/<n>` of the memfd) and
    /// waits until it has mapped and checked the whole region.
    fn spawn(path: &str, len: u64, page: u64, seed: u64) -> Self {
        let exe = env::current_exe().expect("path of this test binary");
        let mut child = Command::new(exe)
            .args([
                "--exact",
                CHILD_TEST,
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_PATH_ENV, path)
            .env(CHILD_LEN_ENV, len.to_string())
            .env(CHILD_PAGE_ENV, page.to_string())
            .env(CHILD_SEED_ENV, seed.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the mapping child");
        let stdout = child.stdout.take().expect("child stdout is piped");
        let (tx, lines) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                println!("  child| {line}");
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stdin = child.stdin.take();
        let me = Self {
            child,
            stdin,
            lines,
        };
        let mapped = me.expect_line("NUMA-CHILD mapped");
        assert!(
            mapped.contains("ok=true"),
            "the child read other data than the parent wrote: {mapped}"
        );
        me
    }

    /// The next line holding `prefix`, from `prefix` on, within the deadline
    /// (libtest may have printed `test … ... ` before it on the same line).
    fn expect_line(&self, prefix: &str) -> String {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some(at) = line.find(prefix) {
                        return line[at..].to_owned();
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    panic!("the child printed no `{prefix}` line within {DEADLINE:?}")
                }
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("the child exited before printing `{prefix}`")
                }
            }
        }
    }

    /// Sends `check`; returns the child's `NUMA-CHILD check …` line.
    fn check(&mut self) -> String {
        let stdin = self.stdin.as_mut().expect("child stdin is open");
        writeln!(stdin, "check").expect("write to the child");
        stdin.flush().expect("flush to the child");
        self.expect_line("NUMA-CHILD check")
    }

    /// Closes the child's stdin and waits (with the deadline) for it to exit
    /// successfully.
    fn finish(mut self) {
        drop(self.stdin.take());
        let deadline = Instant::now() + DEADLINE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(_) => {}
                // Its stdout closed: it is exiting.
                Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => {
                    panic!("the child did not exit within {DEADLINE:?}")
                }
            }
        }
        let status = self.child.wait().expect("wait for the child");
        assert!(status.success(), "the mapping child failed: {status}");
    }
}

impl Drop for MapperChild {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

// ---------------------------------------------------------------------------
// Tests.

#[test]
fn parse_node_pools_reads_per_node_counts() {
    let cmdline = "console=ttyS0 hugepages=4 hugepagesz=1G hugepages=0:1,1:2 hugepagesz=2M hugepages=0:256,1:128 quiet";
    let pools = parse_node_pools(cmdline);
    assert_eq!(pools.get(&(GIB, 0)), Some(&1));
    assert_eq!(pools.get(&(GIB, 1)), Some(&2));
    assert_eq!(pools.get(&(2 * MIB, 0)), Some(&256));
    assert_eq!(pools.get(&(2 * MIB, 1)), Some(&128));
    assert_eq!(pools.len(), 4);
}

#[test]
fn numa_topology() {
    const TEST: &str = "numa_topology";
    let Some(ctx) = numa(TEST) else { return };
    let topo = &ctx.topology;
    if let Some(want) = env::var(GUEST_NODES_ENV)
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        assert_eq!(topo.nodes().len(), want, "nodes seen: {:?}", topo.nodes());
    }
    let cmdline = fs::read_to_string("/proc/cmdline").expect("read /proc/cmdline");
    let expected = parse_node_pools(&cmdline);
    if in_guest() {
        assert!(
            !expected.is_empty(),
            "the guest's command line sets per-node pools: {cmdline}"
        );
    }
    for node in topo.nodes() {
        assert!(!node.cpus.is_empty(), "node {} has no online CPU", node.id);
        assert!(node.mem_total > 0, "node {} has no memory", node.id);
        assert_eq!(node.distances.len(), topo.nodes().len());
        for other in topo.nodes() {
            let d = topo.distance(node.id, other.id).expect("distance");
            if other.id == node.id {
                assert_eq!(d, LOCAL_DISTANCE, "distance {} -> itself", node.id);
            } else if in_guest() {
                assert_eq!(
                    d, QEMU_REMOTE_DISTANCE,
                    "distance {} -> {}",
                    node.id, other.id
                );
            } else {
                assert!(d > LOCAL_DISTANCE, "distance {} -> {}", node.id, other.id);
            }
        }
        let mut pools = String::new();
        for (size, name) in [(HUGE_PAGE_1G, "1G"), (HUGE_PAGE_2M, "2M")] {
            let pool = node
                .huge_pool(size)
                .unwrap_or_else(|| panic!("node {} has no {name} pool", node.id));
            if let Some(&want) = expected.get(&(size, node.id)) {
                assert_eq!(
                    pool.total, want,
                    "node {} {name} pool: the command line asks for {want}",
                    node.id
                );
            }
            pools.push_str(&format!(" {name}={}/{}", pool.free, pool.total));
        }
        // A thread pinned to the node's CPUs runs on the node.
        let worker = numa::spawn_pinned(
            format!("topo-{}", node.id),
            node.cpus.clone(),
            numa::current_cpu,
        )
        .expect("spawn a pinned thread");
        let (cpu, on) = worker
            .join()
            .expect("pinned thread panicked")
            .expect("pin to the node's CPUs")
            .expect("getcpu");
        assert_eq!(
            on, node.id,
            "thread pinned to node {} ran on cpu {cpu}",
            node.id
        );
        assert!(node.cpus.contains(&cpu));
        println!(
            "NUMA-TOPOLOGY node={} cpus={:?} mem_mib={} distances={:?}{pools}",
            node.id,
            node.cpus,
            node.mem_total >> 20,
            node.distances
        );
    }
    done(TEST);
}

#[test]
fn numa_region_placement() {
    const TEST: &str = "numa_region_placement";
    const SIZE: u64 = 32 * MIB;
    let Some(ctx) = numa(TEST) else { return };
    let pages = SIZE / HUGE_PAGE_2M;
    for node in ctx.memory_nodes() {
        if !has_free(TEST, PageSize::Huge2M, pages, node.id) {
            return;
        }
    }
    for node in ctx.memory_nodes() {
        let spec = RegionSpec::new(format!("numa-place-{}", node.id), SIZE, Some(node.id))
            .with_policy(PagePolicy::Strict(PageSize::Huge2M));
        let (region, report) = Region::allocate(&ctx.topology, &spec, &RunOptions::default())
            .unwrap_or_else(|e| panic!("allocate 32 MiB of 2M pages on node {}: {e:?}", node.id));
        assert_eq!(report.populated as u64, pages);
        let placement = region.verify_placement().expect("verify_placement");
        assert!(
            placement.misplaced.is_empty(),
            "node {}: misplaced pages {:?}",
            node.id,
            placement.misplaced
        );
        assert_eq!(placement.on_node, placement.pages);
        // The same question asked directly, one address per huge page.
        let addrs = page_addrs(region.as_ptr() as usize, HUGE_PAGE_2M, pages);
        let locations = numa::move_pages_query(None, &addrs).expect("move_pages query");
        let local = count_on(&locations, node.id);
        println!(
            "NUMA-PLACEMENT kind=region-2M node={} pages={} local={local} share={:.1}% populate_gb_per_s={:.2} {TCG}",
            node.id,
            addrs.len(),
            share(local, addrs.len()),
            report.gb_per_s()
        );
        assert_eq!(
            local,
            addrs.len(),
            "node {}: pages are on {}",
            node.id,
            summarize(&locations)
        );
    }
    done(TEST);
}

#[test]
fn numa_runner_placement() {
    const TEST: &str = "numa_runner_placement";
    const PER_NODE: usize = 64 << 20;
    let Some(ctx) = numa(TEST) else { return };
    let nodes = ctx.memory_nodes();
    let mut map =
        AnonMapping::new(PER_NODE * nodes.len(), PageSize::Base4K).expect("map anonymous memory");
    // The exclusive borrow keeps every other access out while the runner
    // writes through raw addresses.
    let buf = map.as_mut_slice();
    // A pointer-to-integer `as` cast exposes the provenance, as clear_jobs needs.
    let base = buf.as_mut_ptr() as usize;
    let mut jobs = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        let start = base + i * PER_NODE;
        // Bound before any page exists: the runner's first touch allocates.
        numa::mbind(
            start,
            PER_NODE,
            MemPolicyMode::Bind,
            &NodeMask::single(node.id),
            MbindFlags::default(),
        )
        .expect("mbind a slice to its node");
        jobs.push(Job {
            start,
            len: PER_NODE,
            align: CLEAR_ALIGN,
            min_chunk: CLEAR_MIN_CHUNK,
            max_threads: node.cpus.len().max(1),
            node: Some(node.id),
        });
    }
    // SAFETY: every job's range lies inside `map`, which is mapped read-write
    // (anonymous, so always backed) and exclusively borrowed through `buf` for
    // the whole call; the jobs are disjoint slices of it; `base` came from an
    // `as usize` cast, which exposes the pointer's provenance.
    let report = unsafe {
        clearing::clear_jobs(
            &ctx.topology,
            &jobs,
            ClearKernel::default_kernel(),
            &RunOptions::default(),
        )
    }
    .expect("clear one job per node");
    assert!(buf.first() == Some(&0) && buf.last() == Some(&0));
    for stats in &report.nodes {
        println!(
            "NUMA-CLEAR node={:?} bytes={} seconds={:.3} threads={} gib_per_s={:.2} {TCG}",
            stats.node,
            stats.bytes,
            stats.seconds,
            stats.threads,
            stats.gib_per_s()
        );
    }
    let mut failures = Vec::new();
    for (job, node) in jobs.iter().zip(&nodes) {
        let addrs = page_addrs(job.start, 4096, (PER_NODE / 4096) as u64);
        let locations = numa::move_pages_query(None, &addrs).expect("move_pages query");
        let local = count_on(&locations, node.id);
        println!(
            "NUMA-PLACEMENT kind=runner-anon-4K node={} pages={} local={local} share={:.1}%",
            node.id,
            addrs.len(),
            share(local, addrs.len())
        );
        if local != addrs.len() {
            failures.push(format!("node {}: {}", node.id, summarize(&locations)));
        }
    }
    assert!(failures.is_empty(), "pages off their node: {failures:?}");
    done(TEST);
}

#[test]
fn numa_pool_per_node() {
    const TEST: &str = "numa_pool_per_node";
    let Some(ctx) = numa(TEST) else { return };
    let size = PageSize::Huge1G;
    let free1 = free_pages(size, 1);
    if free1 == 0 || free1 > 4 {
        test_support::skip!("{TEST}: needs 1 to 4 free 1G pages on node 1, it has {free1}");
        return;
    }
    let free0 = free_pages(size, 0);
    if !has_free(TEST, size, 1, 0) {
        return;
    }
    let strict = |name: &str, gib: u64, node: NodeId| {
        RegionSpec::new(name, gib * GIB, Some(node)).with_policy(PagePolicy::Strict(size))
    };
    let opts = RunOptions::default();

    // Node 1's whole 1G pool.
    let (on1, _) = Region::allocate(&ctx.topology, &strict("numa-pool-n1", free1, 1), &opts)
        .expect("strict 1G region on node 1 while its pool has free pages");
    let placed = on1.verify_placement().expect("verify_placement");
    assert!(placed.misplaced.is_empty() && placed.on_node == placed.pages);
    assert_eq!(free_pages(size, 1), 0);
    assert_eq!(
        free_pages(size, 0),
        free0,
        "node 0's pool must be untouched"
    );

    // One more on node 1 is refused before anything is allocated, although
    // node 0 still has a free 1G page; the error names the pools per node.
    let err = match Region::allocate(&ctx.topology, &strict("numa-pool-n1-more", 1, 1), &opts) {
        Ok(_) => panic!("a second strict 1G region on node 1 was allocated"),
        Err(e) => e,
    };
    let msg = err.to_string();
    println!("NUMA-POOL refused: {msg}");
    assert!(matches!(err, RegionError::Unavailable { .. }), "{err:?}");
    assert!(msg.contains("0 free on the node"), "{msg}");
    assert!(msg.contains(&format!("node 0 1G {free0} free")), "{msg}");
    assert!(msg.contains("node 1 1G 0 free"), "{msg}");

    // Node 0's page is still there for a region on node 0.
    let (on0, _) = Region::allocate(&ctx.topology, &strict("numa-pool-n0", 1, 0), &opts)
        .expect("strict 1G region on node 0");
    let placed = on0.verify_placement().expect("verify_placement");
    assert!(placed.misplaced.is_empty() && placed.on_node == placed.pages);
    println!(
        "NUMA-POOL node=1 1G={free1} allocated, second refused; node=0 1G allocated while node 1 was empty"
    );
    drop(on0);
    drop(on1);
    assert_eq!(free_pages(size, 1), free1, "node 1's pages came back");
    assert_eq!(free_pages(size, 0), free0, "node 0's page came back");
    done(TEST);
}

/// How a migration step is asked for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Via {
    MovePages,
    Mbind,
}

/// Moves every page of `region` to `to` with `MPOL_MF_MOVE_ALL` (`via`
/// `move_pages` or `mbind`), then checks placement and data in this process
/// and in `child`, and prints the throughput.
fn move_all_and_check(
    region: &Region,
    child: &mut MapperChild,
    via: Via,
    to: NodeId,
    seed: u64,
    note: &str,
) {
    let page = region.page_size();
    let size = region.len();
    let pages = size / page.bytes();
    let addrs = page_addrs(region.as_ptr() as usize, page.bytes(), pages);
    let from = numa::move_pages_query(None, &addrs).expect("move_pages query");
    let started = Instant::now();
    match via {
        Via::MovePages => {
            let targets = vec![to; addrs.len()];
            let statuses =
                numa::move_pages(None, &addrs, &targets, true).expect("move_pages(MOVE_ALL)");
            assert_eq!(
                count_on(&statuses, to),
                addrs.len(),
                "{}",
                summarize(&statuses)
            );
        }
        Via::Mbind => numa::mbind(
            region.as_ptr() as usize,
            usize::try_from(size).expect("size fits usize"),
            MemPolicyMode::Bind,
            &NodeMask::single(to),
            MbindFlags {
                move_all: true,
                ..MbindFlags::default()
            },
        )
        .expect("mbind(MPOL_MF_MOVE_ALL)"),
    }
    let seconds = started.elapsed().as_secs_f64();
    let after = numa::move_pages_query(None, &addrs).expect("move_pages query");
    assert_eq!(count_on(&after, to), addrs.len(), "{}", summarize(&after));
    // SAFETY: nobody writes the region any more; the child only reads it.
    let mismatch = pattern_mismatch(unsafe { region.as_slice() }, seed);
    assert_eq!(mismatch, None, "the parent reads other data after the move");
    let checked = child.check();
    assert!(checked.contains("ok=true"), "{checked}");
    assert!(
        checked.contains(&format!("nodes={to}:{pages}")),
        "{checked}"
    );
    println!(
        "NUMA-MIGRATE size={page} via={} flags=MOVE_ALL pages={pages} bytes={size} from={} to={to} seconds={seconds:.3} gb_per_s={:.2} {note} {TCG}",
        if via == Via::Mbind { "mbind" } else { "move_pages" },
        summarize(&from),
        size as f64 / 1e9 / seconds,
    );
}

/// Migrates a node-0 region of `page` pages that a second process maps to
/// node 1 and back, checking data and placement in both processes.
fn migrate_shared(test: &str, page: PageSize, size: u64) {
    let Some(ctx) = numa(test) else { return };
    let pages = size / page.bytes();
    if !has_free(test, page, pages, 0) || !has_free(test, page, pages, 1) {
        return;
    }
    let spec = RegionSpec::new(format!("numa-migrate-{page}"), size, Some(0))
        .with_policy(PagePolicy::Strict(page));
    let (region, prepared) = Region::allocate(&ctx.topology, &spec, &RunOptions::default())
        .unwrap_or_else(|e| panic!("allocate {size} bytes of {page} pages on node 0: {e:?}"));
    let seed = 0x5EED_0000_0000_0000 ^ size;
    let started = Instant::now();
    // SAFETY: nothing else maps or uses the region yet (the child starts below).
    fill_pattern(unsafe { region.as_mut_slice() }, seed);
    println!(
        "NUMA-MIGRATE size={page} setup: populate {:.2} s, pattern fill {:.2} s {TCG}",
        prepared.seconds,
        started.elapsed().as_secs_f64()
    );
    let addrs = page_addrs(region.as_ptr() as usize, page.bytes(), pages);
    let before = numa::move_pages_query(None, &addrs).expect("move_pages query");
    assert_eq!(count_on(&before, 0), addrs.len(), "{}", summarize(&before));

    let path = format!(
        "/proc/{}/fd/{}",
        std::process::id(),
        region.fd().as_raw_fd()
    );
    let mut child = MapperChild::spawn(&path, size, page.bytes(), seed);

    // MPOL_MF_MOVE leaves pages that another process maps (-EACCES each).
    let targets = vec![1; addrs.len()];
    let statuses = numa::move_pages(None, &addrs, &targets, false).expect("move_pages(MOVE)");
    let after = numa::move_pages_query(None, &addrs).expect("move_pages query");
    println!(
        "NUMA-MIGRATE size={page} via=move_pages flags=MOVE statuses={} now={} (shared pages stay)",
        summarize(&statuses),
        summarize(&after)
    );
    assert_eq!(
        count_on(&after, 0),
        addrs.len(),
        "MPOL_MF_MOVE moved pages another process maps"
    );

    // MPOL_MF_MOVE_ALL moves them. The first move writes guest memory of
    // node 1 that QEMU may never have backed yet; the move back lands on the
    // pages just freed on node 0, so it shows the copy alone.
    move_all_and_check(&region, &mut child, Via::MovePages, 1, seed, "first");
    move_all_and_check(&region, &mut child, Via::MovePages, 0, seed, "back");
    if page == PageSize::Huge2M {
        // mbind(MPOL_MF_MOVE_ALL) over the whole range: the call a
        // rebalancer makes for a region.
        move_all_and_check(&region, &mut child, Via::Mbind, 1, seed, "range");
    }
    child.finish();
    done(test);
}

#[test]
fn numa_migrate_shared_2m() {
    migrate_shared("numa_migrate_shared_2m", PageSize::Huge2M, 64 * MIB);
}

#[test]
fn numa_migrate_shared_1g() {
    migrate_shared("numa_migrate_shared_1g", PageSize::Huge1G, GIB);
}

/// The second process of the migration tests, started by
/// [`MapperChild::spawn`] with `--ignored` (it is no test of its own). Maps the parent's memfd `MAP_SHARED`
/// through `/proc/<pid>/fd/<n>`, checks the pattern, then answers `check`
/// lines on stdin with the pattern check and where its own mapping's pages
/// are, until stdin closes.
#[test]
#[ignore = "the migration tests' second process; they run it with --ignored"]
fn numa_child_maps_shared_region() {
    let path = env::var_os(CHILD_PATH_ENV)
        .unwrap_or_else(|| panic!("{CHILD_PATH_ENV} is unset: only MapperChild::spawn runs this"));
    let number = |name: &str| -> u64 {
        env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} is not a number"))
    };
    let (len, page, seed) = (
        number(CHILD_LEN_ENV),
        number(CHILD_PAGE_ENV),
        number(CHILD_SEED_ENV),
    );
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .expect("open the parent's memfd through /proc");
    let view = SharedView::map(
        file.as_fd(),
        usize::try_from(len).expect("length fits usize"),
    );
    let addrs = page_addrs(view.addr(), page, len / page);
    // SAFETY: the parent wrote the pattern before starting this process and
    // only reads afterwards; migration copies pages without changing them.
    let check = || pattern_mismatch(unsafe { view.as_slice() }, seed).is_none();
    println!(
        "NUMA-CHILD mapped ok={} pid={}",
        check(),
        std::process::id()
    );
    for line in io::stdin().lock().lines() {
        match line.expect("read a command").trim() {
            "check" => {
                let ok = check();
                let nodes = numa::move_pages_query(None, &addrs).expect("move_pages query");
                println!("NUMA-CHILD check ok={ok} nodes={}", summarize(&nodes));
            }
            "" => {}
            other => panic!("unknown command {other:?}"),
        }
    }
}

#[test]
fn numa_uffd_minor_hugetlbfs() {
    const TEST: &str = "numa_uffd_minor_hugetlbfs";
    const LEN: usize = 4 << 20;
    const HUGE: usize = 2 << 20;
    const OFFSET: usize = HUGE + 0x1234;
    const BYTE: u8 = 0x5A;
    let Some(ctx) = numa(TEST) else { return };
    let node = ctx
        .memory_nodes()
        .last()
        .map(|n| n.id)
        .expect("two memory nodes");
    if !has_free(TEST, PageSize::Huge2M, 2, node) {
        return;
    }
    // The region's pages exist (populated, in the file's page cache) on
    // `node`: what hugemem hands a VMM in lazy mode, where the daemon serves
    // the VMM's minor faults on them.
    let spec = RegionSpec::new("numa-uffd", LEN as u64, Some(node))
        .with_policy(PagePolicy::Strict(PageSize::Huge2M));
    let (region, _) = Region::allocate(&ctx.topology, &spec, &RunOptions::default())
        .expect("allocate 2 MiB pages for the uffd test");
    // SAFETY: no other mapping of the region exists yet.
    unsafe { region.as_mut_slice() }.fill(BYTE);

    let uffd = Uffd::new(CreateFlags::new()).expect("create a userfaultfd");
    let info = uffd.api(0).expect("UFFDIO_API handshake");
    println!(
        "NUMA-UFFD features={:#x} ({})",
        info.available.0, info.available
    );
    assert!(
        info.available.contains(abi::UFFD_FEATURE_MINOR_HUGETLBFS),
        "no MINOR_HUGETLBFS in {}",
        info.available
    );

    // The VMM's view of the same file, registered for minor faults.
    let view = Arc::new(SharedView::map(region.fd(), LEN));
    let start = view.addr() as u64;
    let ioctls = uffd
        .register(start, LEN as u64, RegisterMode::MINOR)
        .expect("register the view in MINOR mode");
    assert!(
        ioctls.continue_(),
        "UFFDIO_CONTINUE not offered: {ioctls:?}"
    );

    let (tx, rx) = mpsc::channel();
    let reader = Arc::clone(&view);
    thread::spawn(move || {
        // Blocks in a minor fault until the page is continued.
        let _ = tx.send(reader.read(OFFSET));
    });
    assert!(
        uffd.wait_readable(Some(DEADLINE)).expect("poll the uffd"),
        "no fault event within {DEADLINE:?}"
    );
    let event = uffd
        .read_event()
        .expect("read a uffd event")
        .expect("an event after poll");
    let UffdEvent::PageFault(fault) = event else {
        panic!("expected a page fault, got {event:?}");
    };
    assert!(fault.is_minor(), "not a minor fault: {fault:?}");
    let page = fault.page_start(HUGE as u64);
    assert_eq!(page, start + HUGE as u64, "{fault:?}");
    let started = Instant::now();
    let fill = uffd
        .continue_range(page, HUGE as u64, true)
        .expect("UFFDIO_CONTINUE");
    let continue_us = started.elapsed().as_micros();
    assert_eq!(fill, Fill::Done);
    let seen = rx
        .recv_timeout(DEADLINE)
        .expect("the faulting thread resumed");
    assert_eq!(seen, BYTE, "the continued page shows other data");
    let location = numa::move_pages_query(None, &[view.addr() + HUGE]).expect("query");
    assert_eq!(location, vec![PageLocation::Node(node)]);
    uffd.unregister(start, LEN as u64)
        .expect("unregister the view");
    println!(
        "NUMA-UFFD minor fault at page 1 of 2M, UFFDIO_CONTINUE {continue_us} us, page on node {node} {TCG}"
    );
    done(TEST);
}

#[test]
fn numa_rebalance_through_daemon() {
    const TEST: &str = "numa_rebalance_through_daemon";
    let Some(_ctx) = numa(TEST) else { return };
    // Starts hugemem's daemon on a private socket, ALLOCs a region on node 0
    // through the client, maps it as a VMM would, REBALANCEs it to node 1 and
    // checks placement (move_pages on the client's mapping), data and STATS.
    let report = backend::daemon::process::guest_check::check_rebalance_through_daemon()
        .unwrap_or_else(|e| panic!("{e}"));
    println!("NUMA-REBALANCE {report} {TCG}");
    done(TEST);
}

#[test]
fn numa_migrate_bench() {
    const TEST: &str = "numa_migrate_bench";
    let Some(_ctx) = numa(TEST) else { return };
    // The same amount moved as 4 KiB, 2 MiB and 1 GiB pages, node 0 -> 1 -> 0,
    // plus the clearing runner's locality (`hugemem bench migrate`). 1 GiB is
    // rounded up to one whole page; the guest has one free per node.
    let report = integration::checks::bench_migrate(256 << 20).unwrap_or_else(|e| panic!("{e}"));
    for line in report.lines() {
        println!("NUMA-MIGRATE-BENCH {line}");
    }
    done(TEST);
}

#[test]
fn numa_mlock_per_node() {
    const TEST: &str = "numa_mlock_per_node";
    let Some(_ctx) = numa(TEST) else { return };
    // Whether per-node parallel batched locking pays with several nodes: the
    // bench splits the region per node, binds each part and locks it from a
    // worker pinned there, against one mlock call over the whole region.
    // 4 KiB shmem only: the guest has no python3 to grow hugetlb pools.
    let cfg = hugemem_bench::mlock::MlockBenchConfig {
        size: 256 << 20,
        reps: 1,
        chunk: None,
        threads_per_node: 1,
        hugetlb: false,
        hugetlb_page: None,
    };
    let report = hugemem_bench::mlock::run(&cfg, &mut |_| {}).expect("bench mlock in the guest");
    let f = &report.shmem_4k;
    println!(
        "NUMA-MLOCK nodes={} single_lock_s={:.3} batched_lock_s={:.3} single_max_stall_ms={:.1} batched_max_stall_ms={:.1} {TCG}",
        report.nodes, f.single_lock_s, f.batched_lock_s, f.single_max_stall_ms, f.batched_max_stall_ms
    );
    assert!(report.nodes >= 2, "the bench saw {} node(s)", report.nodes);
    done(TEST);
}
