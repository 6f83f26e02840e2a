//! RESTORE with COPY: a copy clone. The parked VM (its template) stays
//! parked; the receiver gets a fresh allocation of pool memory, one region
//! per template region, each on its template region's page size and node,
//! and the allocation is handed to the requesting connection as RESTORE
//! hands a parked VM's out. The clone's memory is mapped shared as any
//! launch's is, so VFIO and vhost-user work.
//!
//! * **Postcopy** (with POSTCOPY, `hugemem launch --clone-of`'s default):
//!   the snapshot goes out at once and the guest runs from `Complete`;
//!   each page is filled from the template's region (`pread` from its fd
//!   into the daemon's mapping of the copy) when the receiver asks for it
//!   on its fault connection, and the fill engine fills the rest in the
//!   background (`ondemand.rs`, as an on-demand restore does, with the
//!   template's memory as the source). The receiver's guest never sees a
//!   page before it is filled (cloud-hypervisor's postcopy maps a page
//!   only once the daemon answered its fault). The memory is taken clean
//!   (pooled memory scrubbed, or fresh memory the kernel zeroes): its
//!   fds are sent before it is filled, so a read of an unfilled page
//!   through them returns zeros, never another tenant's bytes.
//! * **Eager** (without POSTCOPY): every byte is filled before anything
//!   is sent; the memory may be dirty pooled memory (it is overwritten
//!   before any fd leaves the daemon).
//!
//! The template's change gate is held only to find it and take the copy's
//! memory; its reads are held in `parked/copy_fills.rs` until every unit
//! of the copy is filled, so that copy clones of one template fill at
//! once, while a RESTORE or UNPARK of the template waits for them.
//!
//! What a second process cannot hold (a tap, a vsock's socket) gets the
//! copy's own in the configuration the daemon sends, as a shared clone's
//! launcher does (`ch_migration::clone::clone_identity`, tagged with the
//! requesting launcher's pid): a new tap per net, a vsock socket of its
//! own. The reply's message says each replacement. A net on fds passed to
//! the template's process cannot be replaced and is refused, and so is a
//! template whose regions are on different page sizes.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, PoisonError};

use ch_migration::peer::send_snapshot;
use guest_mem::{fill_region_planned, FillOptions, FillPlan, FillSource, PageSize, Region};
use tracing::info;

use super::error::StepError;
use super::ondemand::{FillTarget, Postcopy};
use super::refusal::{refuse, Asker};
use super::send::{gated, sockets};
use crate::daemon::counters::metrics::Metrics;
use crate::daemon::pool::{FoundParked, SessionId};
use crate::daemon::requests::delivery::{rows_now, Delivery, HandOut};
use crate::daemon::requests::outcome::Outcome;
use crate::daemon::requests::parked::copy_fills::Reading;
use crate::daemon::requests::rooms::{settle_released, Rooms};
use crate::proto::messages::AllocPart;
use crate::proto::{PagePolicy, Status, ANY_NODE};

/// A RESTORE with COPY.
#[derive(Debug, Clone)]
pub struct CopyRequest {
    /// The requesting connection (it owns the copy afterwards).
    pub session: SessionId,
    /// Its uid: only the template's uid finds it.
    pub uid: u32,
    /// Its gid.
    pub gid: u32,
    /// Its pid (the launcher's), which names the copy's taps and vsock
    /// socket apart from other clones'; the session's id without one.
    pub pid: Option<u32>,
    /// The template's name.
    pub name: String,
    /// End with `CompletePaused`.
    pub paused: bool,
    /// Postcopy: the guest runs at once, its pages filled as it asks (the
    /// request's second fd is the fault connection).
    pub postcopy: bool,
}

fn refused(
    rooms: &Rooms,
    req: &CopyRequest,
    status: Status,
    msg: impl std::fmt::Display,
) -> Outcome {
    let asker = Asker {
        what: "copy clone",
        session: req.session,
        uid: req.uid,
        name: &req.name,
    };
    refuse(
        &rooms.metrics.clones_refused,
        asker,
        status,
        msg.to_string(),
    )
}

fn policy_of(page_size: PageSize) -> PagePolicy {
    match page_size {
        PageSize::Huge1G => PagePolicy::Huge1G,
        PageSize::Huge2M => PagePolicy::Huge2M,
        PageSize::Base4K => PagePolicy::Base4K,
    }
}

/// The plan that fills `copy` with every byte of `template` (the same
/// length: the copy's region was taken for it).
fn plan_from<'a>(template: &'a Region, copy: &Region) -> Result<FillPlan<'a>, StepError> {
    let source = FillSource {
        file: template.fd(),
        file_offset: 0,
        dest_offset: 0,
        len: template.len(),
    };
    FillPlan::new(copy, &[source]).map_err(StepError::failed("the copy's fill plan"))
}

/// The copy's parts (one per template region: its node and size) and its
/// page size, or why not: every region must be on one page size (an
/// allocation takes one policy).
fn parts_of(found: &FoundParked) -> Result<(Vec<AllocPart>, PageSize), String> {
    let first = found
        .regions
        .first()
        .map(|(_, r)| r.page_size())
        .ok_or("the template holds no memory")?;
    if found.regions.iter().any(|(_, r)| r.page_size() != first) {
        return Err(
            "a copy clone of a VM whose regions are on different page sizes is not built: \
             use a shared clone"
                .into(),
        );
    }
    let parts = found
        .regions
        .iter()
        .map(|(_, r)| AllocPart {
            node: r.node().unwrap_or(ANY_NODE),
            size: r.len(),
        })
        .collect();
    Ok((parts, first))
}

/// RESTORE with COPY (see the module docs).
pub async fn restore_copy(rooms: &Arc<Rooms>, req: CopyRequest, fds: Vec<OwnedFd>) -> Outcome {
    let connections = match sockets(fds, req.uid, req.postcopy) {
        Ok(s) => s,
        Err(e) => return refused(rooms, &req, Status::Invalid, e),
    };
    let (held, found) = match gated(rooms, req.session, req.uid, &req.name).await {
        Ok(g) => g,
        Err((status, msg)) => return refused(rooms, &req, status, msg),
    };
    // The session id is unique too, where the peer's pid is unknown.
    let tag = req.pid.unwrap_or(req.session as u32);
    let identity = ch_migration::clone::clone_identity(
        found.vm.config.as_bytes(),
        tag,
        &ch_migration::clone::ThisHost,
    );
    let (config, replaced) = match identity {
        Ok(c) => c,
        Err(e) => return refused(rooms, &req, Status::Invalid, e),
    };
    if let Err(msg) = super::export::fill_pending(rooms, &found).await {
        return refused(rooms, &req, Status::Invalid, msg);
    }
    let (parts, page_size) = match parts_of(&found) {
        Ok(p) => p,
        Err(msg) => return refused(rooms, &req, Status::Unsupported, msg),
    };
    let who = (req.session, req.uid, req.gid);
    let taken = super::copy::take_regions(rooms, who, &parts, policy_of(page_size), !req.postcopy);
    let (alloc, copies) = match taken.await {
        Ok(t) => t,
        Err((status, msg)) => return refused(rooms, &req, status, msg),
    };
    // From here the template is held by this copy's reads, not by its gate.
    let reading = rooms.copy_fills.start(found.alloc);
    drop(held);
    let release = |rooms: &Arc<Rooms>| {
        // Filled units hold the template's bytes: never pooled as clean.
        for r in &copies {
            r.mark_all_dirty();
        }
        if let Ok(r) = rooms.pool.release(alloc, req.session) {
            settle_released(rooms, vec![r]);
        }
    };
    let started = std::time::Instant::now();
    let sent = send_copy(
        rooms,
        &req,
        (&found, config),
        &copies,
        (connections, reading),
    )
    .await;
    let copied = match sent {
        Ok(copied) => copied,
        Err((status, msg)) => {
            release(rooms);
            return refused(rooms, &req, status, msg);
        }
    };
    for r in &copies {
        if let Err(e) = r.mark_mapped() {
            release(rooms);
            return refused(rooms, &req, Status::Internal, format!("page states: {e}"));
        }
    }
    // The copy's regions, by their ids in the pool, in order.
    let owners = rooms.pool.owners();
    let ids = owners.region_ids_of(req.session);
    let regions: Vec<_> = copies
        .iter()
        .filter_map(|c| {
            let id = ids
                .iter()
                .find(|id| owners.region(**id).is_some_and(|r| Arc::ptr_eq(&r, c)))?;
            Some((*id, Arc::clone(c)))
        })
        .collect();
    let hand_out = match HandOut::open(
        Delivery::Alloc { want_paths: false },
        rows_now(&regions, false),
    ) {
        Ok(h) => h,
        Err(e) => {
            release(rooms);
            return refused(rooms, &req, Status::Internal, e);
        }
    };
    Metrics::add(&rooms.metrics.clones, 1);
    let ms = started.elapsed().as_secs_f64() * 1e3;
    let (postcopy, n) = (req.postcopy, copies.len());
    info!(session = req.session, uid = req.uid, name = %req.name, template = found.alloc, alloc, regions = n, postcopy, copied, ms, "copy clone: fresh memory filled from the template, handed to its cloud-hypervisor; the template stays parked");
    let mut outcome = hand_out.reply(alloc, rooms.pool.owners().token_of(alloc));
    outcome.reply.message = replaced
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n");
    outcome
}

/// Sends the copy to the receiver and fills it from the template (first,
/// or as the receiver asks and in the background): the bytes read from
/// the template, or the refusal. `reading` holds the template until every
/// unit is filled.
async fn send_copy(
    rooms: &Arc<Rooms>,
    req: &CopyRequest,
    (found, config): (&FoundParked, Vec<u8>),
    copies: &[Arc<Region>],
    ((stream, fault), reading): ((UnixStream, Option<UnixStream>), Reading),
) -> Result<u64, (Status, String)> {
    let mut slot_fds = Vec::new();
    let mut slot_targets = Vec::new();
    for s in &found.vm.slots {
        let copy = copies.get(s.region).ok_or_else(|| {
            (
                Status::Internal,
                StepError::NoRegionForSlot(s.slot).to_string(),
            )
        })?;
        let fd = crate::sys::reopen(copy.fd()).map_err(|e| (Status::Internal, e.to_string()))?;
        slot_fds.push((s.slot, fd));
        slot_targets.push((s.slot, s.region));
    }
    let templates: Vec<Arc<Region>> = found.regions.iter().map(|(_, r)| Arc::clone(r)).collect();
    let (vm, topology) = (Arc::clone(&found.vm), Arc::clone(&rooms.topology));
    let copies = copies.to_vec();
    let paused = req.paused;
    let sent = tokio::task::spawn_blocking(move || {
        let memory: Vec<(u32, BorrowedFd<'_>)> =
            slot_fds.iter().map(|(s, fd)| (*s, fd.as_fd())).collect();
        let mut targets = Vec::with_capacity(copies.len());
        for (copy, template) in copies.iter().zip(&templates) {
            targets.push(FillTarget {
                region: copy,
                plan: plan_from(template, copy)?,
            });
        }
        // Each copy's pages become `Dirty` (or stay `Unpopulated`) for the fill.
        // Every region is marked (no short cut): each one's states change.
        let zero: Vec<bool> = copies
            .iter()
            .map(|c| super::copy::mark_taken_for_fill(c))
            .collect();
        let dest_is_zero = zero.iter().all(|z| *z);
        let copied: u64 = templates.iter().map(|t| t.len()).sum();
        let Some(fault) = fault else {
            let opts = FillOptions {
                dest_is_zero,
                ..FillOptions::default()
            };
            for t in &targets {
                fill_region_planned(&topology, t.region, &t.plan, &opts)
                    .map_err(StepError::failed("copying the template"))?;
            }
            drop(reading);
            let send =
                |cfg: &[u8]| send_snapshot(&stream, &memory, cfg, vm.state.as_bytes(), paused);
            send(&config).map_err(StepError::not_taken)?;
            return Ok(copied);
        };
        let reading = Mutex::new(Some(reading));
        let let_go = || {
            drop(
                reading
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .take(),
            )
        };
        super::ondemand::send(Postcopy {
            main: &stream,
            fault: &fault,
            memory: &memory,
            config: &config,
            state: vm.state.as_bytes(),
            paused,
            targets: &targets,
            slot_targets: &slot_targets,
            to_fill: true,
            broken_fault_fails: true,
            dest_is_zero,
            pending: None,
            topology: &topology,
            what: "copy clone (postcopy)",
            on_filled: &let_go,
        })?;
        Ok::<_, StepError>(copied)
    })
    .await;
    match sent {
        Ok(Ok(copied)) => Ok(copied),
        Ok(Err(e)) => Err((Status::Invalid, e.to_string())),
        Err(_) => Err((
            Status::Internal,
            StepError::Panicked("copy clone").to_string(),
        )),
    }
}
