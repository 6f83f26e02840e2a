//! RESTORE: a parked VM sent to a cloud-hypervisor's `receive-migration`
//! and its allocation handed to the requesting connection. See the room's
//! docs ([`super`]).

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use hugemem_client::ch_migration::peer::send_snapshot;
use tracing::{info, warn};

use super::socket::migration_socket;
use crate::daemon::hand_out::{rows_now, Delivery, HandOut};
use crate::daemon::metrics::Metrics;
use crate::daemon::outcome::Outcome;
use crate::daemon::pool::{FoundParked, SessionId};
use crate::daemon::rooms::Rooms;
use crate::proto::Status;

/// A RESTORE request.
#[derive(Debug, Clone)]
pub struct RestoreRequest {
    /// The requesting connection (it owns the allocation afterwards).
    pub session: SessionId,
    /// Its uid.
    pub uid: u32,
    /// The parked VM's name.
    pub name: String,
    /// End with `CompletePaused`.
    pub paused: bool,
    /// A postcopy restore (the request's second fd is the fault connection).
    pub postcopy: bool,
}

fn refused(rooms: &Rooms, req: &RestoreRequest, status: Status, msg: String) -> Outcome {
    Metrics::add(&rooms.metrics.restores_refused, 1);
    if let Some(suppressed) = crate::daemon::peer_log::REQUEST_REFUSED.check(req.uid) {
        info!(session = req.session, uid = req.uid, name = %req.name, reason = %msg, suppressed, "RESTORE refused");
    }
    Outcome::error(status, msg)
}

/// RESTORE (see the module docs). The allocation's change gate is held
/// from the lookup to the move, so an UNPARK or a second RESTORE of the
/// same VM waits and then finds it gone.
pub async fn restore(rooms: &Arc<Rooms>, req: RestoreRequest, fds: Vec<OwnedFd>) -> Outcome {
    let (stream, fault) = match sockets(fds, &req) {
        Ok(s) => s,
        Err(msg) => return refused(rooms, &req, Status::Invalid, msg),
    };
    let not_parked = || not_parked(rooms, &req);
    let Some(first) = rooms.pool.owners().find_parked(req.uid, &req.name) else {
        return refused(rooms, &req, Status::NotFound, not_parked());
    };
    let _held = first.gate.lock_owned().await;
    // Again under the gate: an UNPARK or RESTORE may have won it.
    let found = match rooms.pool.owners().find_parked(req.uid, &req.name) {
        Some(f) if f.alloc == first.alloc => f,
        _ => return refused(rooms, &req, Status::NotFound, not_parked()),
    };
    let slot_fds = match slot_fds(&found) {
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
    let unfilled = found
        .regions
        .iter()
        .any(|(_, r)| !super::ondemand::all_filled(r));
    if pending.is_none() && unfilled {
        let msg = format!(
            "{:?} was parked on demand and its files are gone (a daemon before this one did not pass them on): \
             its memory was never filled; UNPARK it and park it again from its directory",
            req.name
        );
        return refused(rooms, &req, Status::Invalid, msg);
    }
    // While it runs, a document saved for the fd store says so (a crash
    // then has the successor read every unit again).
    let _restoring = pending.as_ref().map(|_| rooms.fills.restoring(found.alloc));
    let refill = pending.is_some();
    let vm = Arc::clone(&found.vm);
    let paused = req.paused;
    let region = found.regions.first().map(|(_, r)| Arc::clone(r));
    let topology = Arc::clone(&rooms.topology);
    let sent = tokio::task::spawn_blocking(move || {
        let memory: Vec<(u32, std::os::fd::BorrowedFd<'_>)> =
            slot_fds.iter().map(|(s, fd)| (*s, fd.as_fd())).collect();
        let Some(region) = region else {
            return Err("the parked VM has no memory".to_string());
        };
        match fault {
            Some(fault) => super::ondemand::send(super::ondemand::Postcopy {
                main: &stream,
                fault: &fault,
                memory: &memory,
                config: vm.config.as_bytes(),
                state: vm.state.as_bytes(),
                paused,
                region: &region,
                pending: pending.as_deref(),
                topology: &topology,
            }),
            None => {
                if let Some(p) = &pending {
                    super::ondemand::fill_all(&topology, &region, p)?;
                }
                send_snapshot(
                    &stream,
                    &memory,
                    vm.config.as_bytes(),
                    vm.state.as_bytes(),
                    paused,
                )
                .map_err(|e| format!("the receiver did not take the VM (it stays parked): {e}"))
            }
        }
    })
    .await;
    let failed = match sent {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some((Status::Invalid, e)),
        Err(e) => Some((Status::Internal, e.to_string())),
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
    let token = match rooms
        .pool
        .owners()
        .unpark_to(found.alloc, req.uid, &req.name, req.session)
    {
        Ok(t) => t,
        Err(e) => return refused(rooms, &req, Status::Internal, e.to_string()),
    };
    // The fd store's document no longer has it parked (a crash after the
    // receiver took it would otherwise bring it back parked while it runs).
    rooms.sync_now("RESTORE").await;
    rooms.note_parked().await;
    Metrics::add(&rooms.metrics.restores, 1);
    info!(session = req.session, uid = req.uid, name = %req.name, alloc = found.alloc, slots = found.vm.slots.len(), paused, "RESTORE: parked VM handed to its new cloud-hypervisor");
    hand_out.reply(found.alloc, Some(token))
}

/// Why no VM named as `req` asks is parked: none is, or a daemon start
/// found it lost (what happened, and how to clear the note).
fn not_parked(rooms: &Rooms, req: &RestoreRequest) -> String {
    match rooms.park_record.find_lost(req.uid, &req.name) {
        Some(lost) => format!(
            "no VM named {:?} is parked: {}; `hugemem unpark {}` clears this note",
            req.name,
            crate::daemon::park_record::describe(&lost),
            req.name
        ),
        None => format!("no VM named {:?} is parked", req.name),
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
    if let Err(e) = rooms.fills.refill_all(found.alloc) {
        warn!(alloc = found.alloc, name = %found.vm.name, error = %e, "a VM parked on demand lost its files after a failed restore; it can only be unparked");
    }
}

/// The request's migration connection and, for a postcopy restore, its
/// fault connection, each checked.
fn sockets(
    fds: Vec<OwnedFd>,
    req: &RestoreRequest,
) -> Result<
    (
        std::os::unix::net::UnixStream,
        Option<std::os::unix::net::UnixStream>,
    ),
    String,
> {
    let want = if req.postcopy { 2 } else { 1 };
    if fds.len() != want {
        return Err(format!(
            "this RESTORE carries {want} fd(s), not {}",
            fds.len()
        ));
    }
    let mut sockets = Vec::new();
    for fd in fds {
        sockets.push(migration_socket(vec![fd], req.uid).map_err(|e| e.to_string())?);
    }
    let fault = if req.postcopy { sockets.pop() } else { None };
    let stream = sockets.pop().ok_or("no migration socket")?;
    Ok((stream, fault))
}

/// The receiver's own description of each slot's region.
fn slot_fds(found: &FoundParked) -> Result<Vec<(u32, OwnedFd)>, String> {
    let mut out = Vec::new();
    for s in &found.vm.slots {
        let (_, region) = found
            .regions
            .get(s.region)
            .ok_or_else(|| format!("slot {} names no region", s.slot))?;
        out.push((
            s.slot,
            crate::sys::reopen(region.fd()).map_err(|e| e.to_string())?,
        ));
    }
    Ok(out)
}
