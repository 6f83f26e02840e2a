//! A check to run inside a multi-node guest (the QEMU-TCG harness).

use std::time::Instant;

use guest_mem::vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use guest_mem::PageSize;
use hugemem_client::stats::Stats;
use numa::{PageLocation, Topology};

use std::path::PathBuf;

use crate::client::Client;
use crate::daemon::{Config, Daemon};
use crate::proto::{AllocPart, AllocRequest, ClearMode, PagePolicy};

/// Why an in-guest check failed: what it found, in the words its report
/// uses (the harness prints it; a test matches on it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CheckFailed(pub String);

impl From<String> for CheckFailed {
    fn from(what: String) -> Self {
        Self(what)
    }
}

impl From<&str> for CheckFailed {
    fn from(what: &str) -> Self {
        Self(what.to_owned())
    }
}

/// A [`CheckFailed`] with `format!`'s arguments.
macro_rules! failed {
    ($($what:tt)*) => {
        CheckFailed(format!($($what)*))
    };
}

const PAGE: u64 = 2 << 20;
const PAGES: u64 = 8;

/// A private directory for the socket, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Result<Self, CheckFailed> {
        use std::os::unix::fs::DirBuilderExt;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let path = std::env::temp_dir().join(format!(
            "hugemem-rebalance-check-{}-{nanos}",
            std::process::id()
        ));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
        Ok(Self(path))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `PAGES` free 2 MiB pages on `node`: the pool as it is (the guest has
/// them from its kernel command line), else grown through
/// `guest_mem::ensure_free` (sysfs, no helper program).
fn reserve_2m(node: u32) -> Result<(), CheckFailed> {
    let free = guest_mem::PoolCounts::read(PageSize::Huge2M, Some(node))
        .map_err(|e| chain(&e))?
        .map_or(0, |p| p.free);
    if free >= PAGES {
        return Ok(());
    }
    let r = guest_mem::ensure_free(PageSize::Huge2M, PAGES, Some(node)).map_err(|e| {
        format!(
            "node {node} has {free} free 2M pages, {PAGES} needed: {}",
            chain(&e)
        )
    })?;
    if r.met {
        Ok(())
    } else {
        Err(failed!(
            "node {node}: only {} free 2M pages, {PAGES} needed",
            r.free
        ))
    }
}

fn pattern(seed: u64, i: u64) -> u64 {
    (i ^ seed).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

use crate::diag::chain;

/// Starts a daemon on a temporary socket, ALLOCs 16 MiB of 2 MiB pages
/// on the first node with memory through a client, writes a pattern
/// through the client's own mapping (as a VMM's guest would), sends
/// REBALANCE of the whole region to the second node, and checks with
/// `move_pages` on the *client's* mapping that every page is there, that
/// the pattern is intact, and that STATS reports the placement and the
/// new node. Then moves the first half back (a range) and checks that
/// STATS shows the region split 4/4. Returns one report line.
///
/// Run inside a multi-node guest as root (`MOVE_ALL` needs
/// `CAP_SYS_NICE`; the pools are grown through `numa::hugepages`).
///
/// # Errors
///
/// Which step failed and why, or that the machine has fewer than two
/// nodes with memory.
pub fn check_rebalance_through_daemon() -> Result<String, CheckFailed> {
    let topology = Topology::detect().map_err(|e| chain(&e))?;
    let nodes = migrate::memory_nodes(&topology);
    match nodes[..] {
        [a, b, ..] => check_between(a, b),
        _ => Err(failed!(
            "needs two NUMA nodes with memory; this machine has {nodes:?}"
        )),
    }
}

/// Writes the pattern of `seed` over the first `size` bytes of `mem`.
fn write_pattern(mem: &GuestMemoryMmap, seed: u64, size: u64) -> Result<(), CheckFailed> {
    for i in 0..size / 8 {
        mem.write_obj(pattern(seed, i), GuestAddress(i * 8))
            .map_err(|e| format!("write at {:#x}: {e}", i * 8))?;
    }
    Ok(())
}

/// Checks that the first `size` bytes of `mem` still hold the pattern of
/// `seed` after a move.
fn check_pattern(mem: &GuestMemoryMmap, seed: u64, size: u64) -> Result<(), CheckFailed> {
    for i in 0..size / 8 {
        let v: u64 = mem
            .read_obj(GuestAddress(i * 8))
            .map_err(|e| format!("read at {:#x}: {e}", i * 8))?;
        if v != pattern(seed, i) {
            return Err(failed!("pattern differs at {:#x} after the move", i * 8));
        }
    }
    Ok(())
}

/// Checks that STATS places every page of `region_id` on node `b`, and
/// names `b` as its bound node and its node.
fn check_stats_on(client: &mut Client, region_id: u64, b: u32) -> Result<(), CheckFailed> {
    let stats = client.stats().map_err(|e| chain(&e))?;
    let e = stats
        .region(region_id)
        .ok_or("STATS does not list the region")?;
    if e.placement
        .clone()
        .flatten()
        .and_then(|p| p.get(&b).copied())
        != Some(PAGES)
        || e.bound_node != Some(Some(b))
        || e.node != b
    {
        return Err(failed!("STATS after the move: {e:?}"));
    }
    Ok(())
}

/// The steps of [`check_rebalance_through_daemon`] from node `a` to node
/// `b`; with `a == b` (a one-node host) every step runs and nothing is
/// copied.
pub(crate) fn check_between(a: u32, b: u32) -> Result<String, CheckFailed> {
    for node in [a, b] {
        reserve_2m(node)?;
    }
    // Pages the moves must copy: none when the nodes are the same.
    let (want_moved, want_back) = if a == b { (0, 0) } else { (PAGES, PAGES / 2) };
    let dir = TempDir::new()?;
    let mut cfg = Config {
        socket: dir.0.join("hugemem.sock"),
        ..Config::default()
    };
    cfg.pool.recheck_ms = 50;
    let daemon = Daemon::start(cfg).map_err(|e| format!("daemon: {}", chain(&e)))?;
    let mut client = Client::connect(daemon.socket_path()).map_err(|e| chain(&e))?;
    if client.features() & crate::proto::FEATURE_REBALANCE == 0 {
        return Err("the daemon does not advertise FEATURE_REBALANCE".into());
    }
    let size = PAGES * PAGE;
    let alloc = client
        .alloc(AllocRequest {
            total_size: size,
            page_policy: PagePolicy::Huge2M,
            clear_mode: ClearMode::Eager,
            lock: false,
            parts: vec![AllocPart { node: a, size }],
            want_paths: false,
        })
        .map_err(|e| format!("ALLOC: {}", chain(&e)))?;
    let region_id = alloc
        .regions
        .first()
        .map(|r| r.region_id)
        .ok_or("ALLOC returned no region")?;
    let mem = alloc
        .guest_memory()
        .map_err(|e| format!("mapping the allocation: {}", chain(&e)))?;
    let seed = 0x7265_6261_6c61_6e63;
    write_pattern(&mem, seed, size)?;
    let addrs: Vec<usize> = (0..PAGES)
        .map(|p| {
            mem.get_host_address(GuestAddress(p * PAGE))
                .map(|h| h as usize)
                .map_err(|e| format!("host address of page {p}: {e}"))
        })
        .collect::<Result<_, _>>()?;
    let where_ = |what: &str| -> Result<Vec<PageLocation>, CheckFailed> {
        numa::move_pages_query(None, &addrs).map_err(|e| failed!("{what}: {}", chain(&e)))
    };
    let count_on = |locs: &[PageLocation], n: u32| {
        locs.iter()
            .filter(|l| matches!(l, PageLocation::Node(x) if *x == n))
            .count()
    };
    let before = where_("placement before")?;
    if count_on(&before, a) != before.len() {
        return Err(failed!(
            "before the move, pages are at {before:?}, not all on node {a}"
        ));
    }
    let start = Instant::now();
    let (moved, failed) = client
        .rebalance(region_id, 0, 0, b)
        .map_err(|e| format!("REBALANCE to node {b}: {}", chain(&e)))?;
    let secs = start.elapsed().as_secs_f64();
    let after = where_("placement after")?;
    if failed != 0 || moved != want_moved || count_on(&after, b) != after.len() {
        return Err(failed!(
            "REBALANCE to node {b}: {moved} moved, {failed} failed; client sees {after:?}"
        ));
    }
    check_pattern(&mem, seed, size)?;
    let entry = |stats: &Stats| stats.region(region_id).cloned();
    check_stats_on(&mut client, region_id, b)?;
    // Half back: the region is split.
    let half = PAGES / 2 * PAGE;
    let (back, back_failed) = client
        .rebalance(region_id, 0, half, a)
        .map_err(|e| format!("REBALANCE of 0..{half:#x} to node {a}: {}", chain(&e)))?;
    let split = where_("placement after the range move")?;
    let stats = client.stats().map_err(|e| chain(&e))?;
    let e = entry(&stats).ok_or("STATS does not list the region")?;
    let want_on_a = if a == b { split.len() } else { split.len() / 2 };
    if back != want_back
        || back_failed != 0
        || count_on(&split, a) != want_on_a
        || e.split != Some(a != b)
    {
        return Err(failed!(
            "range move back: {back} moved, {back_failed} failed; client sees {split:?}; STATS {e:?}"
        ));
    }
    client
        .free(alloc.id)
        .map_err(|e| format!("FREE: {}", chain(&e)))?;
    drop(mem);
    daemon
        .shutdown()
        .map_err(|e| format!("shutdown: {}", chain(&e)))?;
    Ok(format!(
            "REBALANCE through the daemon: {PAGES} 2M pages node {a} -> {b}: {moved} moved, 0 failed in {:.3} s, every page on node {b} through the client's mapping, pattern intact; range 0..{half:#x} back to node {a}: {back} moved, region split {}/{}",
            secs,
            count_on(&split, a),
            count_on(&split, b),
        ))
}
