//! RESTORE: a parked VM sent to a cloud-hypervisor's `receive-migration`
//! and its allocation handed to the requesting connection. See the room's
//! docs ([`super`]).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use tokio::sync::OwnedMutexGuard;

use ch_migration::peer::send_snapshot;
use tracing::{info, warn};

use super::error::StepError;
use super::refusal::{refuse, Asker};
use super::socket::migration_socket;
use crate::daemon::counters::metrics::Metrics;
use crate::daemon::pool::{set_access_all, Access, FoundParked, SessionId};
use crate::daemon::requests::delivery::{rows_now, Delivery, HandOut};
use crate::daemon::requests::outcome::Outcome;
use crate::daemon::requests::rooms::Rooms;
use crate::proto::Status;

/// A RESTORE request.
#[derive(Debug, Clone)]
pub struct RestoreRequest {
    /// The requesting connection (it owns the allocation afterwards).
    pub session: SessionId,
    /// Its uid.
    pub uid: u32,
    /// Its gid.
    pub gid: u32,
    /// The parked VM's name.
    pub name: String,
    /// End with `CompletePaused`.
    pub paused: bool,
    /// A postcopy restore (the request's second fd is the fault connection).
    pub postcopy: bool,
}

fn refused(
    rooms: &Rooms,
    req: &RestoreRequest,
    status: Status,
    msg: impl std::fmt::Display,
) -> Outcome {
    let asker = Asker {
        what: "RESTORE",
        session: req.session,
        uid: req.uid,
        name: &req.name,
    };
    refuse(
        &rooms.metrics.restores_refused,
        asker,
        status,
        msg.to_string(),
    )
}

/// The VM `uid` parked under `name`, with its change gate held (the
/// guard comes back with it), and not held by a connection other than
/// `session` that saves it. Found again under the gate: an UNPARK or a
/// RESTORE may have won it.
///
/// # Errors
///
/// `NotFound` for no such VM; `Invalid` for one another connection saves.
pub async fn gated(
    rooms: &Rooms,
    session: SessionId,
    uid: u32,
    name: &str,
) -> Result<(OwnedMutexGuard<()>, FoundParked), (Status, String)> {
    let gone = || (Status::NotFound, not_parked(rooms, uid, name));
    let first = rooms
        .pool
        .parking()
        .find_parked(uid, name)
        .ok_or_else(gone)?;
    let held = first.gate.lock_owned().await;
    let found = match rooms.pool.parking().find_parked(uid, name) {
        Some(f) if f.alloc == first.alloc => f,
        _ => return Err(gone()),
    };
    if let Some(other) = rooms.saving.held_by_other(found.alloc, session) {
        return Err((Status::Invalid, being_saved(name, other)));
    }
    Ok((held, found))
}

/// Why a VM parked on demand cannot be sent (restored or saved), if so:
/// its memory was never filled and no file is left to fill it from
/// (`has_files` false: a daemon before this one did not pass them on).
pub fn files_gone(has_files: bool, found: &FoundParked) -> Option<StepError> {
    let unfilled = found
        .regions
        .iter()
        .any(|(_, r)| !super::ondemand::all_filled(r));
    (!has_files && unfilled).then(|| StepError::FilesGone(found.vm.name.clone()))
}

/// Why `request` (RESTORE, UNPARK) of the parked VM `alloc` (its
/// `regions`) is refused while shared clones use it, if so: clones
/// counted against it, or (a marked template, `parked::clones`)
/// processes that map its files.
pub async fn template_in_use(
    rooms: &Rooms,
    (alloc, regions): (
        crate::daemon::pool::AllocId,
        &[(crate::daemon::pool::RegionId, Arc<guest_mem::Region>)],
    ),
    name: &str,
    request: &str,
) -> Option<String> {
    use crate::daemon::requests::parked::clones;
    let counted = rooms.clones.of(alloc);
    if counted.0 > 0 {
        return Some(clones::has_clones(name, request, counted));
    }
    if !rooms.clones.is_marked(alloc) {
        return None;
    }
    let regions: Vec<Arc<guest_mem::Region>> = regions.iter().map(|(_, r)| Arc::clone(r)).collect();
    let scan = std::time::Instant::now();
    let pids = clones::mapped_by(&regions, rooms.lifecycle.predecessor().get()).await;
    let scan_ms = scan.elapsed().as_secs_f64() * 1e3;
    if pids.is_empty() {
        info!(
            name,
            alloc, scan_ms, "{request}: no process maps the template any more; its mark is cleared"
        );
        rooms.clones.clear_mark(alloc);
        return None;
    }
    Some(clones::still_mapped(name, request, &pids))
}

/// Why a request on a parked VM that connection `holder` is saving is
/// refused.
pub fn being_saved(name: &str, holder: SessionId) -> String {
    format!(
        "{name:?} is being saved by connection {holder} (hugemem unpark --save): \
         try again once that save ends"
    )
}

/// RESTORE (see the module docs). The allocation's change gate is held
/// from the lookup to the move, so an UNPARK or a second RESTORE of the
/// same VM waits and then finds it gone.
pub async fn restore(rooms: &Arc<Rooms>, req: RestoreRequest, fds: Vec<OwnedFd>) -> Outcome {
    let (stream, fault) = match sockets(fds, req.uid, req.postcopy) {
        Ok(s) => s,
        Err(msg) => return refused(rooms, &req, Status::Invalid, msg),
    };
    let (_held, found) = match gated(rooms, req.session, req.uid, &req.name).await {
        Ok(g) => g,
        Err((status, msg)) => return refused(rooms, &req, status, msg),
    };
    // Copy clones still reading it finish first (they read within moments).
    rooms.copy_fills.wait_ended(found.alloc).await;
    if let Some(msg) =
        template_in_use(rooms, (found.alloc, &found.regions), &req.name, "RESTORE").await
    {
        return refused(rooms, &req, Status::Invalid, msg);
    }
    // The files are the tenant's again before its VMM opens them (QEMU
    // opens `/proc/self/fd/N` for writing); a template's again unless the
    // restore completes.
    let handed = match HandedBack::hand(&found.regions, req.uid, req.gid) {
        Ok(h) => h,
        Err(msg) => return refused(rooms, &req, Status::Internal, msg),
    };
    let slot_fds = match slot_fds(&found, crate::sys::reopen) {
        Ok(f) => f,
        Err(msg) => return refused(rooms, &req, Status::Internal, msg),
    };
    let hand_out = match HandOut::open(
        Delivery::Alloc { want_paths: false },
        rows_now(&found.regions, found.locked),
    ) {
        Ok(h) => h,
        Err(e) => return refused(rooms, &req, Status::Internal, e.to_string()),
    };
    let pending = rooms.fills.get(found.alloc);
    if let Some(msg) = files_gone(pending.is_some(), &found) {
        return refused(rooms, &req, Status::Invalid, msg);
    }
    // While it runs, a document saved for the fd store says so (a crash
    // then has the successor read every unit again).
    let _restoring = pending.as_ref().map(|_| rooms.fills.restoring(found.alloc));
    let refill = pending.is_some();
    let vm = Arc::clone(&found.vm);
    let paused = req.paused;
    let regions: Vec<Arc<guest_mem::Region>> =
        found.regions.iter().map(|(_, r)| Arc::clone(r)).collect();
    let topology = Arc::clone(&rooms.topology);
    let sent = tokio::task::spawn_blocking(move || {
        let memory: Vec<(u32, std::os::fd::BorrowedFd<'_>)> =
            slot_fds.iter().map(|(s, fd)| (*s, fd.as_fd())).collect();
        if regions.is_empty() {
            return Err(StepError::NoMemory);
        }
        match fault {
            Some(fault) => send_postcopy(
                (&stream, &fault),
                &vm,
                &memory,
                (&regions, pending.as_deref()),
                (&topology, paused),
            ),
            None => {
                let verified = match &pending {
                    Some(p) => super::ondemand::fill_all(&topology, &regions, p)?,
                    None => 0,
                };
                send_snapshot(
                    &stream,
                    &memory,
                    vm.config.as_bytes(),
                    vm.state.as_bytes(),
                    paused,
                )
                .map_err(StepError::not_taken)?;
                Ok(verified)
            }
        }
    })
    .await;
    let failed = match sent {
        Ok(Ok(verified)) => {
            Metrics::add(&rooms.metrics.park_verified_bytes, verified);
            None
        }
        Ok(Err(e)) => Some((Status::Invalid, e)),
        Err(_) => Some((Status::Internal, StepError::Panicked("restore"))),
    };
    if let Some((status, e)) = failed {
        if refill {
            refill_after_failure(rooms, &found);
        }
        return refused(rooms, &req, status, e);
    }
    // Every unit holds the VM's bytes now: not zero, never to be pooled as clean.
    for (_, r) in &found.regions {
        if let Err(e) = r.mark_mapped() {
            return refused(rooms, &req, Status::Internal, format!("page states: {e}"));
        }
    }
    rooms.fills.remove(found.alloc);
    rooms.saving.release(found.alloc);
    let token = match rooms
        .pool
        .parking()
        .unpark_to(found.alloc, req.uid, &req.name, req.session)
    {
        Ok(t) => t,
        Err(e) => return refused(rooms, &req, Status::Internal, e.to_string()),
    };
    handed.keep();
    // The fd store's document no longer has it parked (a crash after the
    // receiver took it would otherwise bring it back parked while it runs).
    rooms.sync_now("RESTORE").await;
    rooms.note_parked().await;
    Metrics::add(&rooms.metrics.restores, 1);
    info!(session = req.session, uid = req.uid, name = %req.name, alloc = found.alloc, slots = found.vm.slots.len(), paused, "RESTORE: parked VM handed to its new cloud-hypervisor");
    hand_out.reply(found.alloc, Some(token))
}

/// A parked VM's files handed to the tenant that restores it
/// ([`Access::Tenant`]), made a template's again ([`Access::Template`])
/// when dropped before [`HandedBack::keep`]: a refused restore leaves the
/// VM parked, read-only to all but root.
struct HandedBack<'a> {
    regions: &'a [(crate::daemon::pool::RegionId, Arc<guest_mem::Region>)],
    kept: bool,
}

impl<'a> HandedBack<'a> {
    /// Hands `regions` to `uid`:`gid`.
    fn hand(
        regions: &'a [(crate::daemon::pool::RegionId, Arc<guest_mem::Region>)],
        uid: u32,
        gid: u32,
    ) -> Result<Self, String> {
        set_access_all(
            regions.iter().map(|(_, r)| &**r),
            Access::Tenant { uid, gid },
            Access::Template,
        )
        .map_err(|(i, e)| format!("cannot hand the parked region {i} to uid {uid}: {e}"))?;
        Ok(Self {
            regions,
            kept: false,
        })
    }

    /// The restore completed: the files stay the tenant's.
    fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for HandedBack<'_> {
    fn drop(&mut self) {
        if self.kept {
            return;
        }
        let all = self.regions.iter().map(|(_, r)| &**r);
        if let Err((i, e)) = set_access_all(all, Access::Template, Access::Template) {
            warn!(region = i, error = %e, "a parked VM's region stays its tenant's after a refused RESTORE; its next CLONE makes it read-only first");
        }
    }
}

/// A postcopy RESTORE's sending and filling (`ondemand::send`) of the
/// parked `vm` on its `regions`, filled from `pending` where it has one.
fn send_postcopy(
    (main, fault): (
        &std::os::unix::net::UnixStream,
        &std::os::unix::net::UnixStream,
    ),
    vm: &crate::daemon::pool::ParkedVm,
    memory: &[(u32, BorrowedFd<'_>)],
    (regions, pending): (
        &[Arc<guest_mem::Region>],
        Option<&crate::daemon::requests::parked::loads::PendingLoad>,
    ),
    (topology, paused): (&numa::Topology, bool),
) -> Result<u64, StepError> {
    let targets = postcopy_targets(regions, pending)?;
    let slot_targets: Vec<(u32, usize)> = vm.slots.iter().map(|s| (s.slot, s.region)).collect();
    super::ondemand::send(super::ondemand::Postcopy {
        main,
        fault,
        memory,
        config: vm.config.as_bytes(),
        state: vm.state.as_bytes(),
        paused,
        targets: &targets,
        slot_targets: &slot_targets,
        to_fill: pending.is_some(),
        broken_fault_fails: false,
        dest_is_zero: pending.is_some_and(|p| p.dest_is_zero),
        pending,
        topology,
        what: "RESTORE on demand",
        on_filled: &|| {},
    })
}

/// The regions a postcopy restore sends, each filled from `pending` (a VM
/// parked on demand: its sources name their regions), or, without
/// `pending`, holding the VM's bytes already.
fn postcopy_targets<'a>(
    regions: &'a [Arc<guest_mem::Region>],
    pending: Option<&'a crate::daemon::requests::parked::loads::PendingLoad>,
) -> Result<Vec<super::ondemand::FillTarget<'a>>, StepError> {
    if let Some(p) = pending.filter(|p| p.regions() > regions.len()) {
        return Err(StepError::FillRegions {
            files: p.regions(),
            holds: regions.len(),
        });
    }
    let mut targets = Vec::with_capacity(regions.len());
    for (i, region) in regions.iter().enumerate() {
        let plan = match pending {
            Some(p) => p.plan(i, region).map_err(StepError::Fill)?,
            _ => {
                guest_mem::FillPlan::new(region, &[]).map_err(StepError::failed("the fill plan"))?
            }
        };
        targets.push(super::ondemand::FillTarget { region, plan });
    }
    Ok(targets)
}

/// Why no VM `uid` parked under `name` is there: none is, or a daemon
/// start found it lost (what happened, and how to clear the note).
pub fn not_parked(rooms: &Rooms, uid: u32, name: &str) -> String {
    match rooms.park_record.find_lost(uid, name) {
        Some(lost) => format!(
            "no VM named {name:?} is parked: {}; `hugemem unpark {name}` clears this note",
            crate::daemon::requests::parked::note::describe(&lost),
        ),
        None => format!("no VM named {name:?} is parked"),
    }
}

/// A restore of a VM parked on demand that did not hand it out: units it
/// filled may have been mapped and written by the receiver's guest (a
/// postcopy receiver runs it from `Complete`, cloud-hypervisor resumes it
/// before it answers `Complete`), and only the files hold the parked VM.
/// So every unit is filled from them again at the next restore.
fn refill_after_failure(rooms: &Rooms, found: &FoundParked) {
    for (_, region) in &found.regions {
        region.mark_all_dirty();
    }
    if let Err(e) = rooms.fills.reload_all(found.alloc) {
        warn!(alloc = found.alloc, name = %found.vm.name, error = %e, "a VM parked on demand lost its files after a failed restore; it can only be unparked");
    }
}

/// A RESTORE's migration connection and, for a postcopy restore, its
/// fault connection, each checked (connected, of the tenant `uid`).
pub(super) fn sockets(
    fds: Vec<OwnedFd>,
    uid: u32,
    postcopy: bool,
) -> Result<
    (
        std::os::unix::net::UnixStream,
        Option<std::os::unix::net::UnixStream>,
    ),
    StepError,
> {
    let want = if postcopy { 2 } else { 1 };
    if fds.len() != want {
        return Err(StepError::FdCount {
            want,
            got: fds.len(),
        });
    }
    let mut sockets = Vec::new();
    for fd in fds {
        sockets.push(
            migration_socket(vec![fd], uid).map_err(StepError::failed("the migration socket"))?,
        );
    }
    let fault = if postcopy { sockets.pop() } else { None };
    let stream = sockets.pop().ok_or(StepError::FdCount { want, got: 0 })?;
    Ok((stream, fault))
}

/// The receiver's own description of each slot's region, opened by
/// `reopen` (read-write for a VMM, read-only for a saver).
pub fn slot_fds(
    found: &FoundParked,
    reopen: fn(BorrowedFd<'_>) -> std::io::Result<OwnedFd>,
) -> Result<Vec<(u32, OwnedFd)>, StepError> {
    let mut out = Vec::new();
    for s in &found.vm.slots {
        let (_, region) = found
            .regions
            .get(s.region)
            .ok_or(StepError::NoRegionForSlot(s.slot))?;
        out.push((
            s.slot,
            reopen(region.fd()).map_err(StepError::failed("reopening a region"))?,
        ));
    }
    Ok(out)
}
