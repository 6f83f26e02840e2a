//! PARK of memory that did not come from this daemon (a cloud-hypervisor
//! started on its own with `shared=on`, a snapshot read from disk): its
//! bytes are copied into a fresh allocation of pool memory, on the
//! largest pages its size allows (1 GiB when it is a multiple of 1 GiB), so
//! a VM that lived on 4 KiB pages comes back on huge pages.
//!
//! The copy is the fill engine's (`guest_mem::fill_region`): each
//! mapping read with `pread` into the daemon's own mapping of the new
//! region, on workers pinned to the region's node, never through a mapping
//! of the peer's file (a peer can truncate its file at any moment: a read
//! then comes back short, an error here, where a mapping would fault the
//! daemon). A cloud-hypervisor VM's files go into one region, each from a
//! 1 GiB boundary; a QEMU VM's slots into one region each, from its start
//! (QEMU maps each region's file from its start: `Layout`). The
//! allocation is taken without clearing (the daemon writes every byte
//! before anyone maps it): bytes the file supplies are not zeroed first;
//! holes of the file (`SEEK_DATA`/`SEEK_HOLE`) and bytes no
//! mapping covers are zeroed, unless the pages were zero already.

use std::os::fd::AsFd;
use std::sync::Arc;

use guest_mem::{fill_region_planned, mark_for_fill, FillCounts, FillOptions};

use crate::daemon::requests::parked::loads::{
    self, LoadFailed, PendingLoad, SourceChecksums, SourceSpec,
};
use hugemem_client::saved_vm::manifest::Manifest;

use tracing::info;

use super::error::StepError;
use super::snapshot::{Checked, ParkRequest, ParkedOk, Refusal};
use crate::daemon::counters::metrics::Metrics;
use crate::daemon::pool::{AllocId, ParkedSlot, ParkedVm, ParkedVmm};
use crate::daemon::requests::alloc::{self, Requester};
use crate::daemon::requests::rooms::{settle_released, Rooms};
use crate::proto::messages::{AllocPart, AllocRequest, ReplyBody};
use crate::proto::{ClearMode, PagePolicy, Status};
use numa::Topology;

const GIB: u64 = 1 << 30;
const TWO_MIB: u64 = 2 << 20;

/// Where a memory file of the snapshot goes in the new allocation: its
/// region there, its base offset in that region, and the bytes it needs.
#[derive(Debug, Clone)]
struct Placed {
    /// The slots whose file it is.
    slots: Vec<u32>,
    identity: (u64, u64),
    region: usize,
    base: u64,
    need: u64,
}

/// The new allocation's layout: each file's place, each region's size.
///
/// * A cloud-hypervisor VM: one region; each distinct file at a base
///   (files after the first start on a 1 GiB boundary, valid for every
///   page size), its mappings' `file_offset`s moved by it
///   ([`rebase_config`]).
/// * A QEMU VM: one region per slot, its file at offset 0. QEMU maps each
///   region's file from its start (7.2's `memory-backend-file` has no
///   `offset`), so a slot at an offset of a shared region would run on
///   the first slot's memory; each slot must therefore be one mapping from
///   its file's start, as a save writes it.
#[derive(Debug, Clone)]
struct Layout {
    placed: Vec<Placed>,
    /// Bytes of each region, in the allocation's order.
    regions: Vec<u64>,
}

impl Layout {
    /// Where slot `slot`'s file went.
    fn of_slot(&self, slot: u32) -> Option<&Placed> {
        self.placed.iter().find(|p| p.slots.contains(&slot))
    }

    /// The region slot `slot` is in, and where its file starts there.
    fn region_and_base(&self, slot: u32) -> (usize, u64) {
        self.of_slot(slot).map_or((0, 0), |p| (p.region, p.base))
    }
}

fn too_large() -> Refusal {
    (
        Status::Invalid,
        "no pool memory to copy the VM into: its memory files together claim more bytes than a u64 counts"
            .to_string(),
    )
}

/// A region's size for `end` bytes: whole 1 GiB pages where `end` is a
/// multiple of 1 GiB, else whole 2 MiB pages.
fn region_size(end: u64) -> Result<u64, Refusal> {
    if end.is_multiple_of(GIB) {
        Ok(end)
    } else {
        end.checked_next_multiple_of(TWO_MIB).ok_or_else(too_large)
    }
}

/// The layout of `checked`'s memory in the new allocation (see
/// [`Layout`]); `per_slot` for a QEMU VM.
fn place(checked: &Checked, per_slot: bool) -> Result<Layout, Refusal> {
    let mut placed: Vec<Placed> = Vec::new();
    for f in &checked.memory {
        let of_slot = || checked.mappings.iter().filter(|m| m.slot == f.slot);
        if per_slot && (of_slot().count() != 1 || of_slot().any(|m| m.file_offset != 0)) {
            return Err((
                Status::Invalid,
                format!(
                    "slot {} of a QEMU VM is not one mapping from its file's start: QEMU maps \
                     each region's file from its start",
                    f.slot
                ),
            ));
        }
        let need = of_slot().map(|m| m.file_offset + m.size).max().unwrap_or(0);
        let shared = placed
            .iter_mut()
            .find(|p| !per_slot && p.identity == f.identity);
        match shared {
            Some(p) => {
                p.need = p.need.max(need);
                p.slots.push(f.slot);
            }
            None => placed.push(Placed {
                slots: vec![f.slot],
                identity: f.identity,
                region: if per_slot { placed.len() } else { 0 },
                base: 0,
                need,
            }),
        }
    }
    if per_slot {
        let regions = placed
            .iter()
            .map(|p| region_size(p.need))
            .collect::<Result<_, _>>()?;
        return Ok(Layout { placed, regions });
    }
    // Each file fits a u64 (its mappings were checked), but files of a
    // peer's making placed one after the other need not.
    let mut end = 0u64;
    for p in &mut placed {
        p.base = end.checked_next_multiple_of(GIB).ok_or_else(too_large)?;
        end = p.base.checked_add(p.need).ok_or_else(too_large)?;
    }
    let total = region_size(end)?;
    Ok(Layout {
        placed,
        regions: vec![total],
    })
}

/// What to read for each mapping: from its slot's file (an index in
/// `checked.memory`) at its offset, to its file's place in the new
/// allocation.
fn source_specs(checked: &Checked, layout: &Layout) -> Vec<SourceSpec> {
    checked
        .mappings
        .iter()
        .filter_map(|m| {
            let file = checked.memory.iter().position(|f| f.slot == m.slot)?;
            let (region, base) = layout.region_and_base(m.slot);
            Some(SourceSpec {
                file,
                region,
                file_offset: m.file_offset,
                dest_offset: base + m.file_offset,
                len: m.size,
            })
        })
        .collect()
}

/// The page size the copy may use: cloud-hypervisor maps each slot at its
/// `file_offset`, which must be a multiple of the page size, and every
/// region is whole pages; `Best` (1 GiB pages first) where every offset
/// and size allows it.
fn page_policy(checked: &Checked, layout: &Layout) -> PagePolicy {
    let aligned = |align: u64| {
        checked.mappings.iter().all(|m| {
            (layout.region_and_base(m.slot).1 + m.file_offset).is_multiple_of(align)
                && m.size.is_multiple_of(align)
        }) && layout.regions.iter().all(|r| r.is_multiple_of(align))
    };
    if aligned(GIB) {
        PagePolicy::Best
    } else if aligned(TWO_MIB) {
        PagePolicy::Huge2M
    } else {
        PagePolicy::Base4K
    }
}

/// A fresh allocation for a copy, one region per part of `parts`, in that
/// order, taken without clearing. With `fills_every_byte` the daemon writes
/// every byte before anyone maps the memory, so pooled memory that is not
/// clean (another tenant's bytes) may be taken; without it (the memory is
/// sent before it is filled: a postcopy copy clone) only clean pooled
/// memory or fresh memory, which reads as zeros until filled.
pub(super) async fn take_regions(
    rooms: &Arc<Rooms>,
    who: (crate::daemon::pool::SessionId, u32, u32),
    parts: &[AllocPart],
    page_policy: PagePolicy,
    fills_every_byte: bool,
) -> Result<(AllocId, Vec<Arc<guest_mem::Region>>), Refusal> {
    let (session, uid, gid) = who;
    let requester = Requester {
        session,
        uid,
        gid,
        reattach: true,
        fills_every_byte,
    };
    let alloc_req = AllocRequest {
        total_size: parts.iter().map(|p| p.size).sum(),
        page_policy,
        clear_mode: ClearMode::Lazy,
        lock: false,
        parts: if parts.len() > 1 {
            parts.to_vec()
        } else {
            Vec::new()
        },
        want_paths: false,
    };
    // The reply's fds are dropped here, never sent: nobody maps the
    // memory before the fill (see `mark_taken_for_fill`).
    let served = alloc::serve(&rooms.alloc, requester, &alloc_req, None).await;
    let reply = served.outcome.reply;
    let alloc = match reply.body {
        ReplyBody::Alloc { alloc_id, .. } => alloc_id,
        _ => {
            return Err((
                reply.status,
                format!("no pool memory to copy the VM into: {}", reply.message),
            ))
        }
    };
    let release = |rooms: &Arc<Rooms>| {
        if let Ok(r) = rooms.pool.release(alloc, session) {
            settle_released(rooms, vec![r]);
        }
    };
    let regions = match rooms.pool.owners().regions_of(alloc, session) {
        Ok((regions, _)) if regions.len() == parts.len().max(1) => regions,
        _ => {
            release(rooms);
            return Err((
                Status::Internal,
                "the copy's allocation does not have one region per part".into(),
            ));
        }
    };
    // Dirty pool memory may still have a scrubber's batch in flight: the
    // fill must find those pages after it let go (see
    // `Scrubbing::wait_scrubbed_batches`), or its zeros would land on
    // the VM's bytes.
    let (pool, taken) = (Arc::clone(&rooms.pool), regions.clone());
    let waited = tokio::task::spawn_blocking(move || {
        for region in &taken {
            pool.scrubbing().wait_scrubbed_batches(region);
        }
    })
    .await;
    if let Err(e) = waited {
        release(rooms);
        return Err((Status::Internal, e.to_string()));
    }
    Ok((alloc, regions))
}

/// Copies the snapshot's mapped bytes into a fresh allocation and parks
/// it (see the module docs); with a `manifest`, every piece is checked
/// against it as it is read (now, or on demand at restore).
pub async fn copy_in(
    rooms: &Arc<Rooms>,
    req: &ParkRequest,
    checked: Checked,
    manifest: Option<Manifest>,
    parked_at: u64,
) -> Result<ParkedOk, Refusal> {
    let qemu = ParkedVmm::of_config(&checked.config) == ParkedVmm::Qemu;
    let layout = place(&checked, qemu)?;
    let checksums = match &manifest {
        Some(m) => super::verify::source_checksums(m, &checked, &source_specs(&checked, &layout))?,
        None => Vec::new(),
    };
    let who = (req.session, req.uid, req.gid);
    let parts: Vec<AllocPart> = layout
        .regions
        .iter()
        .map(|size| AllocPart {
            node: crate::proto::ANY_NODE,
            size: *size,
        })
        .collect();
    // On demand, the memory is sent to the restoring cloud-hypervisor before
    // it is filled: clean or fresh memory only, never another tenant's bytes.
    let policy = page_policy(&checked, &layout);
    let (alloc, regions) = take_regions(rooms, who, &parts, policy, !req.on_demand).await?;
    let release = |rooms: &Arc<Rooms>| {
        if let Ok(r) = rooms.pool.release(alloc, req.session) {
            settle_released(rooms, vec![r]);
        }
    };
    let started = std::time::Instant::now();
    let (checked, pending) = if req.on_demand {
        match pend(checked, &layout, &regions, checksums.clone()) {
            Ok((c, p)) => (c, Some(p)),
            Err(e) => {
                release(rooms);
                return Err((Status::Invalid, e.to_string()));
            }
        }
    } else {
        (checked, None)
    };
    let checked = Arc::new(checked);
    let copied = match &pending {
        // Read at restore time: what the files hold for the mappings.
        Some(p) => p.sources.iter().map(|s| s.len).sum(),
        None => {
            let copied = copy_now(rooms, &checked, &layout, &regions, checksums).await;
            copied.inspect_err(|_| release(rooms))?
        }
    };
    let bytes: u64 = layout.regions.iter().sum();
    let page_size = regions.first().map_or(0, |r| r.page_size().bytes());
    info!(uid = req.uid, name = %req.name, alloc, bytes, regions = regions.len(), copied, page_size, secs = started.elapsed().as_secs_f64(), "PARK: memory from elsewhere copied into pool memory");
    let config = rebase_config(&checked, &layout).inspect_err(|_| release(rooms))?;
    let slots: Vec<ParkedSlot> = checked
        .memory
        .iter()
        .map(|f| ParkedSlot {
            slot: f.slot,
            region: layout.region_and_base(f.slot).0,
        })
        .collect();
    let n = u32::try_from(slots.len()).unwrap_or(u32::MAX);
    let vmm = Some(ParkedVmm::of_config(&config));
    let vm = ParkedVm {
        name: req.name.clone(),
        slots,
        config,
        state: checked.state.clone(),
        copied_bytes: copied,
        parked_at,
        vmm,
    };
    let on_demand = pending.is_some();
    if let Some(p) = pending {
        rooms.fills.insert(alloc, p);
    }
    let parked = rooms
        .pool
        .parking()
        .park(alloc, req.uid, Some(req.session), vm, on_demand);
    match parked {
        Ok(bytes) => Ok(ParkedOk {
            alloc,
            bytes,
            copied,
            slots: n,
        }),
        Err(e) => {
            rooms.fills.remove(alloc);
            release(rooms);
            Err((Status::Invalid, e.to_string()))
        }
    }
}

/// The eager copy ([`copy_all`], off the executor), counted in the
/// metrics; returns the bytes read.
async fn copy_now(
    rooms: &Arc<Rooms>,
    checked: &Arc<Checked>,
    layout: &Layout,
    regions: &[Arc<guest_mem::Region>],
    checksums: Vec<SourceChecksums>,
) -> Result<u64, Refusal> {
    let job = {
        let (checked, layout, regions) = (Arc::clone(checked), layout.clone(), regions.to_vec());
        let topology = Arc::clone(&rooms.topology);
        tokio::task::spawn_blocking(move || {
            copy_all(&topology, &checked, &layout, &regions, &checksums)
        })
    };
    match job.await {
        Ok(Ok(counts)) => {
            Metrics::add(&rooms.metrics.park_verified_bytes, counts.bytes_verified);
            Metrics::add(&rooms.metrics.park_copied_bytes, counts.bytes_read);
            Metrics::add(&rooms.metrics.park_zeroed_bytes, counts.bytes_zeroed);
            Ok(counts.bytes_read)
        }
        Ok(Err(e)) => Err((Status::Invalid, e.to_string())),
        Err(e) => Err((Status::Internal, e.to_string())),
    }
}

/// A park on demand: the sender's files kept to fill the regions at
/// restore time, checked now (a file too short or overlapping mappings are
/// refused before anything is parked). Returns the snapshot without its
/// files.
fn pend(
    checked: Checked,
    layout: &Layout,
    regions: &[Arc<guest_mem::Region>],
    checksums: Vec<SourceChecksums>,
) -> Result<(Checked, PendingLoad), StepError> {
    let files: Vec<std::os::fd::OwnedFd> = checked
        .memory
        .iter()
        .map(|f| f.fd.try_clone())
        .collect::<Result<_, _>>()
        .map_err(StepError::failed("the VM's memory files"))?;
    // Every region is marked for its fill; holes need no zeroing only
    // where every region read zero.
    let zero: Vec<bool> = regions.iter().map(|r| mark_taken_for_fill(r)).collect();
    let fill = PendingLoad {
        files,
        sources: source_specs(&checked, layout),
        dest_is_zero: zero.iter().all(|z| *z),
        checksums,
    };
    for (i, region) in regions.iter().enumerate() {
        fill.plan(i, region)
            .map_err(StepError::failed("the VM's memory files"))?;
    }
    Ok((checked, fill))
}

/// The configuration with each mapping's `file_offset` moved by its
/// file's base in its region (unchanged when every base is 0: one file, or
/// a QEMU VM's region per slot).
fn rebase_config(checked: &Checked, layout: &Layout) -> Result<String, Refusal> {
    if layout.placed.iter().all(|p| p.base == 0) {
        return Ok(checked.config.clone());
    }
    let mut v: serde_json::Value =
        serde_json::from_str(&checked.config).map_err(|e| (Status::Invalid, e.to_string()))?;
    if let Some(list) = v
        .pointer_mut("/memory_manager_data/guest_ram_mappings")
        .and_then(serde_json::Value::as_array_mut)
    {
        for m in list {
            let slot = m
                .get("slot")
                .and_then(serde_json::Value::as_u64)
                .unwrap_or(0);
            let offset = m
                .get("file_offset")
                .and_then(serde_json::Value::as_u64)
                .unwrap_or(0);
            let base = u32::try_from(slot).map_or(0, |slot| layout.region_and_base(slot).1);
            m["file_offset"] = (offset + base).into();
        }
    }
    serde_json::to_string(&v).map_err(|e| (Status::Internal, e.to_string()))
}

/// [`mark_for_fill`] for a region [`take_regions`] took; true when its
/// bytes are all zero, so the fill zeroes nothing.
///
/// The pool's commit moves a region whose pages are all `Clean` to
/// `Mapped` (`Pool::commit`), which [`mark_for_fill`] alone cannot tell
/// from a guest's pages. Here `Mapped` on every page can only be that
/// commit's doing: the handout's fds were dropped unsent, so no process
/// has mapped the region. Without this, a load onto clean pool memory
/// zeroed every hole of the files again (5 GiB of an 8 GiB guest that
/// wrote only its low 3 GiB).
pub(super) fn mark_taken_for_fill(region: &guest_mem::Region) -> bool {
    let states = region.states();
    let committed_clean = states.counts().mapped == states.len();
    mark_for_fill(region) || committed_clean
}

/// Fills each region from the mappings of the snapshot placed in it (the
/// fill engine, NUMA-local); returns what it read and zeroed. The regions'
/// pages end `Mapped`: they hold the VM's bytes, never to be taken for
/// zero. On a failure every region is marked dirty (none is clean).
fn copy_all(
    topology: &Topology,
    checked: &Checked,
    layout: &Layout,
    regions: &[Arc<guest_mem::Region>],
    checksums: &[SourceChecksums],
) -> Result<FillCounts, StepError> {
    let specs = source_specs(checked, layout);
    let file = |i: usize| checked.memory[i].fd.as_fd();
    // Each region is marked for its fill before any is filled.
    let zero: Vec<bool> = regions.iter().map(|r| mark_taken_for_fill(r)).collect();
    let mut counts = FillCounts::default();
    for (i, region) in regions.iter().enumerate() {
        let of_region = loads::sources_of(&specs, i);
        let opts = FillOptions {
            dest_is_zero: zero[i],
            ..FillOptions::default()
        };
        let report = loads::plan(region, (&specs, &of_region), file, checksums)
            .and_then(|plan| fill_region_planned(topology, region, &plan, &opts))
            .map_err(|e| {
                for r in regions {
                    r.mark_all_dirty();
                }
                let file_of = |i: usize| {
                    let spec = specs.get(i)?;
                    checked.memory.get(spec.file).map(|f| f.fd.as_fd())
                };
                StepError::failed("copying the VM's memory")(LoadFailed(loads::describe(
                    &e,
                    (checksums, &of_region),
                    file_of,
                )))
            })?;
        region
            .mark_mapped()
            .map_err(StepError::failed("the copied region's page states"))?;
        tracing::debug!(
            region = i,
            read = report.counts.bytes_read,
            zeroed = report.counts.bytes_zeroed,
            holes = report.counts.hole_bytes,
            threads = report.threads,
            gbps = report.read_gbps(),
            "PARK: fill done"
        );
        counts += report.counts;
    }
    Ok(counts)
}
