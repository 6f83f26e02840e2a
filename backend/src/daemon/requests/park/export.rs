//! EXPORT: a parked VM sent to a saver (`hugemem unpark --save`, which
//! plays the receiving cloud-hypervisor), while it stays parked. See the
//! room's docs ([`super`]).
//!
//! The saver gets what RESTORE with PAUSED would send, but each memory fd
//! is a new read-only description of its region, and the allocation stays
//! in the parked record. The VM is then held for the saver's connection
//! (`crate::daemon::requests::parked::saving`): another connection's RESTORE, EXPORT or
//! UNPARK of it is refused until the saver UNPARKs it (its save is in
//! place) or its connection ends (the save failed or was abandoned: the VM
//! stays parked, nothing lost). A VM parked on demand is filled first, so
//! the saver reads its bytes, never unfilled memory.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use ch_migration::peer::send_snapshot;
use tracing::info;

use super::error::StepError;
use super::refusal::{refuse, Asker};
use super::send::{gated, slot_fds};
use super::socket::migration_socket;
use crate::daemon::counters::metrics::Metrics;
use crate::daemon::pool::{FoundParked, SessionId};
use crate::daemon::requests::outcome::Outcome;
use crate::daemon::requests::rooms::Rooms;
use crate::proto::messages::{Reply, ReplyBody};
use crate::proto::Status;

/// An EXPORT request.
#[derive(Debug, Clone)]
pub struct ExportRequest {
    /// The saver's connection (it holds the VM afterwards).
    pub session: SessionId,
    /// Its uid.
    pub uid: u32,
    /// The parked VM's name.
    pub name: String,
}

fn refused(
    rooms: &Rooms,
    req: &ExportRequest,
    status: Status,
    msg: impl std::fmt::Display,
) -> Outcome {
    let asker = Asker {
        what: "EXPORT",
        session: req.session,
        uid: req.uid,
        name: &req.name,
    };
    refuse(
        &rooms.metrics.exports_refused,
        asker,
        status,
        msg.to_string(),
    )
}

/// EXPORT (see the module docs).
pub async fn export(rooms: &Arc<Rooms>, req: ExportRequest, fds: Vec<OwnedFd>) -> Outcome {
    let stream = match migration_socket(fds, req.uid) {
        Ok(s) => s,
        Err(e) => return refused(rooms, &req, Status::Invalid, e.to_string()),
    };
    let (_held, found) = match gated(rooms, req.session, req.uid, &req.name).await {
        Ok(g) => g,
        Err((status, msg)) => return refused(rooms, &req, status, msg),
    };
    if let Err(msg) = fill_pending(rooms, &found).await {
        return refused(rooms, &req, Status::Invalid, msg);
    }
    let slot_fds = match slot_fds(&found, crate::sys::reopen_read_only) {
        Ok(f) => f,
        Err(msg) => return refused(rooms, &req, Status::Internal, msg),
    };
    let vm = Arc::clone(&found.vm);
    let sent = tokio::task::spawn_blocking(move || {
        let memory: Vec<(u32, BorrowedFd<'_>)> =
            slot_fds.iter().map(|(s, fd)| (*s, fd.as_fd())).collect();
        send_snapshot(
            &stream,
            &memory,
            vm.config.as_bytes(),
            vm.state.as_bytes(),
            true,
        )
    })
    .await;
    match sent {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            let msg = format!("the saver did not take the VM (it stays parked): {e}");
            return refused(rooms, &req, Status::Invalid, msg);
        }
        Err(e) => return refused(rooms, &req, Status::Internal, e.to_string()),
    }
    rooms.saving.hold(found.alloc, req.session);
    Metrics::add(&rooms.metrics.exports, 1);
    let bytes: u64 = found.regions.iter().map(|(_, r)| r.len()).sum();
    let page_size = found
        .regions
        .first()
        .map_or(0, |(_, r)| r.page_size().bytes());
    info!(session = req.session, uid = req.uid, name = %req.name, alloc = found.alloc, bytes, "EXPORT: parked VM sent to a saver; held for it");
    Outcome::reply(Reply::ok(ReplyBody::Exported {
        alloc_id: found.alloc,
        bytes,
        page_size,
        parked_at: found.vm.parked_at,
        slots: u32::try_from(found.vm.slots.len()).unwrap_or(u32::MAX),
    }))
}

/// A VM parked on demand is filled from its files first (the saver must
/// read its bytes), and becomes an ordinary parked VM: its units hold the
/// VM's bytes (`Mapped`: never taken for zero), its files are let go.
pub(super) async fn fill_pending(rooms: &Arc<Rooms>, found: &FoundParked) -> Result<(), StepError> {
    let pending = rooms.fills.get(found.alloc);
    if let Some(msg) = super::send::files_gone(pending.is_some(), found) {
        return Err(msg);
    }
    let Some(pending) = pending else {
        return Ok(());
    };
    if found.regions.is_empty() {
        return Err(StepError::NoMemory);
    }
    let regions: Vec<Arc<guest_mem::Region>> =
        found.regions.iter().map(|(_, r)| Arc::clone(r)).collect();
    let topology = Arc::clone(&rooms.topology);
    let filled = tokio::task::spawn_blocking(move || {
        let verified = super::ondemand::fill_all(&topology, &regions, &pending)?;
        for region in &regions {
            region
                .mark_mapped()
                .map_err(StepError::failed("page states"))?;
        }
        Ok::<_, StepError>(verified)
    })
    .await
    .map_err(|_| StepError::Panicked("fill before the export"))?;
    Metrics::add(&rooms.metrics.park_verified_bytes, filled?);
    rooms.fills.remove(found.alloc);
    Ok(())
}
