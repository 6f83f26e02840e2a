//! RESTORE: a parked VM sent to a cloud-hypervisor's `receive-migration`
//! and its allocation handed to the requesting connection. See the room's
//! docs ([`super`]).

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use hugemem_client::ch_migration::peer::send_snapshot;
use tracing::info;

use super::socket::migration_socket;
use crate::daemon::hand_out::{rows_now, Delivery, HandOut};
use crate::daemon::metrics::Metrics;
use crate::daemon::outcome::Outcome;
use crate::daemon::pool::SessionId;
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
    let want = if req.postcopy { 2 } else { 1 };
    if fds.len() != want {
        let msg = format!("this RESTORE carries {want} fd(s), not {}", fds.len());
        return refused(rooms, &req, Status::Invalid, msg);
    }
    let mut sockets = Vec::new();
    for fd in fds {
        match migration_socket(vec![fd], req.uid) {
            Ok(s) => sockets.push(s),
            Err(e) => return refused(rooms, &req, Status::Invalid, e.to_string()),
        }
    }
    let fault = if req.postcopy { sockets.pop() } else { None };
    let Some(stream) = sockets.pop() else {
        return refused(rooms, &req, Status::Invalid, "no migration socket".into());
    };
    let not_parked = || format!("no VM named {:?} is parked", req.name);
    let Some(first) = rooms.pool.owners().find_parked(req.uid, &req.name) else {
        return refused(rooms, &req, Status::NotFound, not_parked());
    };
    let _held = first.gate.lock_owned().await;
    // Again under the gate: an UNPARK or RESTORE may have won it.
    let found = match rooms.pool.owners().find_parked(req.uid, &req.name) {
        Some(f) if f.alloc == first.alloc => f,
        _ => return refused(rooms, &req, Status::NotFound, not_parked()),
    };
    // The receiver's own description of each slot's region.
    let mut slot_fds: Vec<(u32, OwnedFd)> = Vec::new();
    for s in &found.vm.slots {
        let Some((_, region)) = found.regions.get(s.region) else {
            return refused(
                rooms,
                &req,
                Status::Internal,
                format!("slot {} names no region", s.slot),
            );
        };
        match crate::sys::reopen(region.fd()) {
            Ok(fd) => slot_fds.push((s.slot, fd)),
            Err(e) => return refused(rooms, &req, Status::Internal, e.to_string()),
        }
    }
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
    match sent {
        Ok(Ok(())) => {}
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
