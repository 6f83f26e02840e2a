//! RESTORE: a parked VM sent to a cloud-hypervisor's `receive-migration`
//! and its allocation handed to the requesting connection. See the room's
//! docs ([`super`]).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use tokio::sync::OwnedMutexGuard;

use hugemem_client::ch_migration::peer::send_snapshot;
use tracing::info;

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
    let not_parked = || (Status::NotFound, format!("no VM named {name:?} is parked"));
    let first = rooms
        .pool
        .owners()
        .find_parked(uid, name)
        .ok_or_else(not_parked)?;
    let held = first.gate.lock_owned().await;
    let found = match rooms.pool.owners().find_parked(uid, name) {
        Some(f) if f.alloc == first.alloc => f,
        _ => return Err(not_parked()),
    };
    if let Some(other) = rooms.saving.held_by_other(found.alloc, session) {
        return Err((Status::Invalid, super::being_saved(name, other)));
    }
    Ok((held, found))
}

/// RESTORE (see the module docs). The allocation's change gate is held
/// from the lookup to the move, so an UNPARK or a second RESTORE of the
/// same VM waits and then finds it gone.
pub async fn restore(rooms: &Arc<Rooms>, req: RestoreRequest, fds: Vec<OwnedFd>) -> Outcome {
    let (stream, fault) = match sockets(fds, &req) {
        Ok(s) => s,
        Err(msg) => return refused(rooms, &req, Status::Invalid, msg),
    };
    let (_held, found) = match gated(rooms, req.session, req.uid, &req.name).await {
        Ok(g) => g,
        Err((status, msg)) => return refused(rooms, &req, status, msg),
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
    let unfilled = found
        .regions
        .iter()
        .any(|(_, r)| !super::ondemand::all_filled(r));
    if pending.is_none() && unfilled {
        let msg = format!(
            "{:?} was parked on demand and its files are gone (a takeover or restart does not keep them): \
             its memory was never filled; UNPARK it",
            req.name
        );
        return refused(rooms, &req, Status::Invalid, msg);
    }
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
                let verified = match &pending {
                    Some(p) => super::ondemand::fill_all(&topology, &region, p)?,
                    None => 0,
                };
                send_snapshot(
                    &stream,
                    &memory,
                    vm.config.as_bytes(),
                    vm.state.as_bytes(),
                    paused,
                )
                .map_err(|e| format!("the receiver did not take the VM (it stays parked): {e}"))?;
                Ok(verified)
            }
        }
    })
    .await;
    match sent {
        Ok(Ok(verified)) => Metrics::add(&rooms.metrics.park_verified_bytes, verified),
        Ok(Err(e)) => return refused(rooms, &req, Status::Invalid, e),
        Err(e) => return refused(rooms, &req, Status::Internal, e.to_string()),
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
        .owners()
        .unpark_to(found.alloc, req.uid, &req.name, req.session)
    {
        Ok(t) => t,
        Err(e) => return refused(rooms, &req, Status::Internal, e.to_string()),
    };
    Metrics::add(&rooms.metrics.restores, 1);
    info!(session = req.session, uid = req.uid, name = %req.name, alloc = found.alloc, slots = found.vm.slots.len(), paused, "RESTORE: parked VM handed to its new cloud-hypervisor");
    hand_out.reply(found.alloc, Some(token))
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

/// The receiver's own description of each slot's region, opened by
/// `reopen` (read-write for a VMM, read-only for a saver).
pub fn slot_fds(
    found: &FoundParked,
    reopen: fn(BorrowedFd<'_>) -> std::io::Result<OwnedFd>,
) -> Result<Vec<(u32, OwnedFd)>, String> {
    let mut out = Vec::new();
    for s in &found.vm.slots {
        let (_, region) = found
            .regions
            .get(s.region)
            .ok_or_else(|| format!("slot {} names no region", s.slot))?;
        out.push((s.slot, reopen(region.fd()).map_err(|e| e.to_string())?));
    }
    Ok(out)
}
