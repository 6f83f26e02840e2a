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
    let stream = match migration_socket(fds, req.uid) {
        Ok(s) => s,
        Err(e) => return refused(rooms, &req, Status::Invalid, e.to_string()),
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
    let vm = Arc::clone(&found.vm);
    let paused = req.paused;
    let sent = tokio::task::spawn_blocking(move || {
        let memory: Vec<(u32, std::os::fd::BorrowedFd<'_>)> =
            slot_fds.iter().map(|(s, fd)| (*s, fd.as_fd())).collect();
        send_snapshot(
            &stream,
            &memory,
            vm.config.as_bytes(),
            vm.state.as_bytes(),
            paused,
        )
    })
    .await;
    match sent {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            return refused(
                rooms,
                &req,
                Status::Invalid,
                format!("the receiver did not take the VM (it stays parked): {e}"),
            );
        }
        Err(e) => return refused(rooms, &req, Status::Internal, e.to_string()),
    }
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
