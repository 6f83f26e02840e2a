//! End-to-end checks of `migrate` to **run inside a multi-node guest** (the
//! QEMU-TCG harness, `tests/numa_guest*.rs`), where pages can really move
//! between nodes; `tests/migrate_checks.rs` runs their one-node form on the
//! host.
//!
//! Each check allocates real regions, moves them, and returns one report
//! line (`Ok`) or says what went wrong (`Err`), so a harness test is
//! `assert!(check(...).map(|l| println!("{l}")).is_ok())`-simple and its
//! log says what happened. Throughput in the lines is labelled
//! `(TCG emulation)`: under TCG it measures the emulator, not the memory
//! system, and only ratios from one run mean anything.
//!
//! # How "the VMM maps it too" is modelled
//!
//! In-process: a second `MAP_SHARED` mapping of the region's fd, made by the
//! `vm-memory` adapter exactly as a rust-vmm VMM maps guest RAM
//! ([`guest_mem::guest_region`]). The pattern is written through that
//! mapping (as a guest would) and checked through both. Two mappings give
//! each page a map count of two, which is what makes `move_pages` without
//! `MPOL_MF_MOVE_ALL` refuse it (`EACCES`); the kernel does not tell a second
//! process from a second mapping here (`folio_maybe_mapped_shared` counts
//! mappings for hugetlb and page-cache pages). No child process is spawned.
//!
//! On a one-node host the `*_between_nodes` checks return `Err` naming the
//! nodes; [`check_move_region`] with `from == to` runs everything except
//! the actual copy (every page is already there).

use std::time::Instant;

use clearing::RunOptions;
use guest_mem::vm_memory::{Bytes, GuestAddress, GuestRegionMmap, MemoryRegionAddress};
use guest_mem::{PagePolicy, PageSize, PoolCounts, Region, RegionSpec};
use numa::{NodeId, Topology};

use hugemem_bench::migrate::{run_bench, BenchOptions};
use hugemem_client::diag::chain as error_chain;
use migrate::{
    memory_nodes, move_region, pattern, placement, FailReason, MigrateError, MoveOptions,
    MoveReport, MoveSpan,
};

/// Label for throughput measured in an emulated guest.
pub const TCG_LABEL: &str = "(TCG emulation)";

type Check = Result<String, String>;

fn detect() -> Result<Topology, String> {
    Topology::detect().map_err(|e| error_chain(&e))
}

/// The first two nodes with memory, or why there are none.
fn two_nodes(topology: &Topology) -> Result<(NodeId, NodeId), String> {
    match memory_nodes(topology)[..] {
        [a, b, ..] => Ok((a, b)),
        ref nodes => Err(format!(
            "needs two NUMA nodes with memory; this machine has {nodes:?}"
        )),
    }
}

/// Makes `pages` free pages of `page_size` available on `node` (huge sizes).
fn reserve(page_size: PageSize, pages: u64, node: NodeId) -> Result<(), String> {
    if !page_size.is_huge() {
        return Ok(());
    }
    let free = PoolCounts::read(page_size, Some(node))
        .map_err(|e| error_chain(&e))?
        .map_or(0, |p| p.free);
    if free >= pages {
        return Ok(());
    }
    let r = guest_mem::ensure_free(page_size, pages, Some(node)).map_err(|e| error_chain(&e))?;
    if r.met {
        Ok(())
    } else {
        Err(format!(
            "node {node}: only {} free {page_size} pages after growing the pool, {pages} needed",
            r.free
        ))
    }
}

fn allocate(
    topology: &Topology,
    name: &str,
    page: PageSize,
    size: u64,
    node: NodeId,
) -> Result<Region, String> {
    let spec = RegionSpec::new(name, size, Some(node)).with_policy(PagePolicy::Strict(page));
    Region::allocate(topology, &spec, &RunOptions::default())
        .map(|(r, _)| r)
        .map_err(|e| {
            format!(
                "allocating {size} bytes of {page} pages on node {node}: {}",
                error_chain(&e)
            )
        })
}

/// The VMM's view: a second shared mapping of the region's fd.
fn vmm_mapping(region: &Region) -> Result<GuestRegionMmap, String> {
    guest_mem::guest_region(region, GuestAddress(0)).map_err(|e| error_chain(&e))
}

fn stamp_through(vmm: &GuestRegionMmap, len: u64, seed: u64) -> Result<(), String> {
    pattern::write(len, seed, |off, s| {
        vmm.write_slice(s, MemoryRegionAddress(off))
            .map_err(|e| format!("write at {off:#x}: {e}"))
    })
}

/// Checks the stamps through the VMM mapping and through hugemem's own.
fn check_both(region: &Region, vmm: &GuestRegionMmap, seed: u64, when: &str) -> Result<(), String> {
    let bad = pattern::check(region.len(), seed, |off, buf| {
        vmm.read_slice(buf, MemoryRegionAddress(off))
            .map_err(|e| format!("read at {off:#x}: {e}"))
    })?;
    if let Some(off) = bad {
        return Err(format!(
            "{when}: stamp at {off:#x} differs through the VMM mapping"
        ));
    }
    // SAFETY: nothing writes the region while this slice lives: the only
    // other mapping is `vmm`, which this thread does not write during the
    // check, and no guest, preparer or scrubber runs on a test region.
    if let Some(off) = pattern::check_slice(unsafe { region.as_slice() }, seed) {
        return Err(format!(
            "{when}: stamp at {off:#x} differs through hugemem's mapping"
        ));
    }
    Ok(())
}

/// Requires a move that left every present page on the target.
fn require_complete(report: &MoveReport, what: &str) -> Result<(), String> {
    if report.complete() {
        Ok(())
    } else {
        Err(format!(
            "{what}: {report}; failed {:?}; not on target {:?}",
            report.failed, report.not_on_target
        ))
    }
}

fn moved(
    topology: &Topology,
    region: &Region,
    to: NodeId,
    opts: &MoveOptions,
    what: &str,
) -> Result<MoveReport, String> {
    move_region(topology, region, to, opts, None, None)
        .map_err(|e| format!("{what}: {}", error_chain(&e)))
}

/// Creates a region of `size` bytes of `page` pages on the first node with
/// memory, maps it a second time as a VMM would, writes a pattern through
/// that mapping, moves it to the second node (first without `MOVE_ALL`,
/// which must be refused for every page, then with it), checks placement
/// and the pattern through both mappings, moves it back and checks again.
///
/// Run inside a multi-node guest. Needs root (`CAP_SYS_NICE` for
/// `MOVE_ALL`, and growing the pools through `numa::hugepages`).
///
/// # Errors
///
/// A message saying which step failed and why, or that the machine has
/// fewer than two nodes with memory.
pub fn check_move_region_between_nodes(page: PageSize, size: u64) -> Check {
    let topology = detect()?;
    let (a, b) = two_nodes(&topology)?;
    check_move_region(page, size, a, b)
}

/// [`check_move_region_between_nodes`] between two given nodes. With
/// `from == to` nothing is copied and every page must be reported as
/// already there (runs on a one-node host).
///
/// # Errors
///
/// As [`check_move_region_between_nodes`].
pub fn check_move_region(page: PageSize, size: u64, from: NodeId, to: NodeId) -> Check {
    let topology = detect()?;
    let pages = size / page.bytes();
    reserve(page, pages, from)?;
    if to != from {
        reserve(page, pages, to)?;
    }
    let region = allocate(&topology, "check-move", page, size, from)?;
    let vmm = vmm_mapping(&region)?;
    let seed = 0x5eed_0000 ^ size ^ page.bytes();
    stamp_through(&vmm, size, seed)?;
    let span = MoveSpan::of_region(&region);
    let before = placement(&span).map_err(|e| error_chain(&e))?;
    if before.per_node.get(&from) != Some(&(pages as usize)) {
        return Err(format!(
            "before the move: expected {pages} pages on node {from}, found {before}"
        ));
    }

    let mut notes = Vec::new();
    if to != from {
        // Without MOVE_ALL every page must be refused: both mappings map it.
        let plain = MoveOptions {
            move_all: false,
            ..MoveOptions::default()
        };
        let refused = moved(&topology, &region, to, &plain, "move without MOVE_ALL")?;
        let all_refused = refused.pages_moved == 0
            && refused.failed.len() == pages as usize
            && refused
                .failed
                .iter()
                .all(|f| f.reason == FailReason::NeedsMoveAll);
        if !all_refused {
            return Err(format!(
                "move without MOVE_ALL: expected all {pages} pages refused with EACCES, got {refused}"
            ));
        }
        notes.push(format!(
            "without MOVE_ALL {} of {pages} refused ({})",
            refused.failed.len(),
            FailReason::NeedsMoveAll
        ));
    }

    let there = moved(
        &topology,
        &region,
        to,
        &MoveOptions::default(),
        "move there",
    )?;
    require_complete(&there, "move there")?;
    let expect_moved = if to == from { 0 } else { pages as usize };
    if there.pages_moved != expect_moved {
        return Err(format!(
            "move there: {expect_moved} pages should have moved: {there}"
        ));
    }
    let after = placement(&span).map_err(|e| error_chain(&e))?;
    if after.per_node.get(&to) != Some(&(pages as usize)) {
        return Err(format!(
            "after the move: expected {pages} pages on node {to}, found {after}"
        ));
    }
    check_both(&region, &vmm, seed, "after the move")?;

    let back = moved(
        &topology,
        &region,
        from,
        &MoveOptions::default(),
        "move back",
    )?;
    require_complete(&back, "move back")?;
    check_both(&region, &vmm, seed, "after moving back")?;

    let mut line = format!(
        "move {page} x {pages} ({} MiB) node {from} -> {to}: {there}; back: {back} {TCG_LABEL}; data intact through both mappings",
        size >> 20
    );
    for n in notes {
        line.push_str("; ");
        line.push_str(&n);
    }
    Ok(line)
}

/// Fills the second node's free pool of `page` pages with another region,
/// then moves a region of `size` bytes there: the plan must say how many
/// pages can move, a strict move (`allow_partial: false`) must be refused
/// with nothing changed, and a partial move must report every page that
/// stayed with "no free page on the target" and leave data intact. With
/// 2 MiB pages the kernel may still move pages by allocating fresh huge
/// pages on the target; the line says how many did.
///
/// Run inside a multi-node guest, as root.
///
/// # Errors
///
/// A message saying which expectation failed.
pub fn check_move_to_full_node(page: PageSize, size: u64) -> Check {
    let topology = detect()?;
    let (a, b) = two_nodes(&topology)?;
    let pages = size / page.bytes();
    reserve(page, pages, a)?;
    let region = allocate(&topology, "check-full-src", page, size, a)?;
    let vmm = vmm_mapping(&region)?;
    let seed = 0xf011_0000 ^ size;
    stamp_through(&vmm, size, seed)?;

    // Take every free page of the target's pool.
    let free = PoolCounts::read(page, Some(b))
        .map_err(|e| error_chain(&e))?
        .map_or(0, |p| p.free);
    let _hog = if free > 0 {
        Some(allocate(
            &topology,
            "check-full-hog",
            page,
            free * page.bytes(),
            b,
        )?)
    } else {
        None
    };

    let strict = MoveOptions {
        allow_partial: false,
        ..MoveOptions::default()
    };
    let refused = match move_region(&topology, &region, b, &strict, None, None) {
        Err(MigrateError::Insufficient { plan }) => plan.summary(),
        Ok(r) => return Err(format!("strict move to a full node was not refused: {r}")),
        Err(e) => {
            return Err(format!(
                "strict move: unexpected error: {}",
                error_chain(&e)
            ))
        }
    };
    let still = placement(&MoveSpan::of_region(&region)).map_err(|e| error_chain(&e))?;
    if still.per_node.get(&a) != Some(&(pages as usize)) {
        return Err(format!("a refused move changed placement: {still}"));
    }

    let partial = moved(
        &topology,
        &region,
        b,
        &MoveOptions::default(),
        "partial move",
    )?;
    let wrong_reason = partial
        .failed
        .iter()
        .find(|f| f.reason != FailReason::NoFreeTargetPage);
    if let Some(f) = wrong_reason {
        return Err(format!(
            "page {} failed with {} instead of no free page: {partial}",
            f.page, f.reason
        ));
    }
    if partial.pages_moved + partial.failed.len() != pages as usize {
        return Err(format!("moved + failed != {pages}: {partial}"));
    }
    if page == PageSize::Huge1G && partial.pages_moved != 0 {
        return Err(format!(
            "1 GiB pages moved to a node with no free 1 GiB page: {partial}"
        ));
    }
    check_both(&region, &vmm, seed, "after the partial move")?;
    Ok(format!(
        "full node {b}: strict move refused ({refused}); partial move: {partial} {TCG_LABEL}; data intact"
    ))
}

/// Moves a region of `size` bytes to the second node with a rate limit of
/// `bytes_per_s` and checks that the move took at least as long as the
/// limit allows (less one batch: the first batch starts at once).
///
/// Run inside a multi-node guest, as root.
///
/// # Errors
///
/// A message saying which expectation failed.
pub fn check_rate_limited_move(page: PageSize, size: u64, bytes_per_s: u64) -> Check {
    let topology = detect()?;
    let (a, b) = two_nodes(&topology)?;
    let pages = size / page.bytes();
    reserve(page, pages, a)?;
    reserve(page, pages, b)?;
    let region = allocate(&topology, "check-rate", page, size, a)?;
    let opts = MoveOptions {
        rate_limit_bytes_per_s: Some(bytes_per_s),
        ..MoveOptions::default()
    };
    let started = Instant::now();
    let report = moved(&topology, &region, b, &opts, "rate-limited move")?;
    let elapsed = started.elapsed().as_secs_f64();
    require_complete(&report, "rate-limited move")?;
    let batch_bytes = opts.batch_for(page) as u64 * page.bytes();
    // Byte counts are far below 2^53.
    #[allow(clippy::cast_precision_loss)]
    let floor = size.saturating_sub(batch_bytes) as f64 / bytes_per_s as f64;
    if elapsed < floor {
        return Err(format!(
            "moved {size} bytes in {elapsed:.3} s, under the {floor:.3} s the limit allows"
        ));
    }
    Ok(format!(
        "rate-limited move of {} MiB at {} MiB/s: {elapsed:.3} s (at least {floor:.3} s expected), {report} {TCG_LABEL}",
        size >> 20,
        bytes_per_s >> 20
    ))
}

/// The whole `bench migrate` run ([`run_bench`] with reserving and warm-up
/// on): 4 KiB, 2 MiB and 1 GiB pages, `size` bytes each, first node → second
/// → first, plus per-node locality of the clearing runner. Returns the
/// report's lines (throughput labelled `(TCG emulation)`) followed by one
/// line of JSON. 1 GiB pages need `size` rounded up to whole 1 GiB pages
/// free on both nodes; when they cannot be had the line says so.
///
/// Run inside a multi-node guest, as root.
///
/// # Errors
///
/// The report's lines when a page size failed or data changed, or fewer
/// than two nodes with memory.
pub fn bench_migrate(size: u64) -> Check {
    let topology = detect()?;
    two_nodes(&topology)?;
    let report = run_bench(&topology, &BenchOptions::new(size));
    let mut lines = report.lines(TCG_LABEL);
    lines.push(serde_json::to_string(&report).unwrap_or_else(|e| format!("(json: {e})")));
    let text = lines.join("\n");
    if report.failures().is_empty() {
        Ok(text)
    } else {
        Err(text)
    }
}
