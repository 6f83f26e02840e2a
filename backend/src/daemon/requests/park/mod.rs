//! The park room: hugemem as cloud-hypervisor's offload daemon. A VM's
//! memory, configuration and state are kept under a name while no process
//! runs the VM (PARK), and handed to a new cloud-hypervisor without a copy
//! (RESTORE), or dropped (UNPARK).
//!
//! The daemon speaks cloud-hypervisor's local migration
//! (`ch_migration`) on a stream socket the tenant brings
//! in the request (`SCM_RIGHTS` over the daemon's own, checked socket):
//! the daemon never binds or connects a path a tenant names, and the
//! socket's peer must run as the tenant's uid ([`socket::migration_socket`]).
//!
//! * [`receive`]: PARK. The snapshot is taken up to the sender's
//!   `CompletePaused`, checked (sizes, the configuration's memory
//!   mappings, each fd a regular file large enough), and each memory fd
//!   recognised by its file's identity: memory of one of the tenant's
//!   allocations is **moved** into the parked record in one step under the
//!   pool's lock (nothing copied or cleared); memory from elsewhere is
//!   **copied** into a fresh allocation ([`copy`]). Only then is
//!   `CompletePaused` answered, so the sender retires its VM only once the
//!   daemon holds everything.
//! * [`send`]: RESTORE. The parked memory's fds (a new description of each
//!   region), the configuration and the state go to the receiver; when it
//!   answers the last step, the allocation moves to the requesting
//!   connection as an ALLOC would hand it out. A refused restore leaves the
//!   VM parked.
//! * [`export`]: EXPORT. The parked VM is sent as RESTORE with PAUSED
//!   would send it, with read-only memory fds, to a saver (`hugemem unpark
//!   --save`), and stays parked, held for the saver's connection
//!   (`crate::daemon::requests::parked::saving`) until it UNPARKs the VM or ends.
//! * [`clone`]: CLONE. A parked VM (the template) sent to a clone's
//!   launcher, read-only in SHARED mode, and counted against the template
//!   while the launcher's connection lasts
//!   (`crate::daemon::requests::parked::clones`): RESTORE and UNPARK of a
//!   template with clones are refused.
//! * UNPARK releases the parked allocation into quarantine: its memory is
//!   scrubbed before anyone else gets it, and not before every process
//!   that still maps it let go.

pub mod clone;
pub mod clone_copy;
pub mod copy;
pub mod error;
pub mod export;
pub mod ondemand;
pub mod receive;
mod refusal;
pub mod send;
pub mod snapshot;
pub mod socket;
pub mod verify;

use std::os::fd::OwnedFd;
use std::sync::Arc;

use tracing::info;

use crate::daemon::peers::peer::PeerCred;
use crate::daemon::pool::SessionId;
use crate::daemon::requests::outcome::Outcome;
use crate::daemon::requests::rooms::{settle_released, Rooms};
use crate::proto::messages::{Reply, ReplyBody, Request};
use crate::proto::Status;

/// Serves PARK, RESTORE (with the migration socket in `fds`) and UNPARK
/// for connection `session` of `peer`.
pub async fn serve(
    rooms: &Arc<Rooms>,
    session: SessionId,
    peer: &PeerCred,
    req: Request,
    fds: Vec<OwnedFd>,
) -> Outcome {
    match req {
        Request::Park {
            name,
            on_demand,
            verify,
        } => {
            let req = snapshot::ParkRequest {
                session,
                uid: peer.uid,
                gid: peer.gid,
                name,
                on_demand,
                verify,
            };
            receive::park(rooms, req, fds).await
        }
        Request::Restore {
            name,
            paused,
            postcopy,
            copy: true,
        } => {
            let req = clone_copy::CopyRequest {
                session,
                uid: peer.uid,
                gid: peer.gid,
                pid: peer.pid.and_then(|p| u32::try_from(p).ok()),
                name,
                paused,
                postcopy,
            };
            clone_copy::restore_copy(rooms, req, fds).await
        }
        Request::Restore {
            name,
            paused,
            postcopy,
            copy: false,
        } => {
            let req = send::RestoreRequest {
                session,
                uid: peer.uid,
                gid: peer.gid,
                name,
                paused,
                postcopy,
            };
            send::restore(rooms, req, fds).await
        }
        Request::Unpark { name } => unpark(rooms, session, peer.uid, &name).await,
        Request::Export { name } => {
            let req = export::ExportRequest {
                session,
                uid: peer.uid,
                name,
            };
            export::export(rooms, req, fds).await
        }
        Request::Clone { name, mode } => {
            let req = clone::CloneRequest {
                session,
                uid: peer.uid,
                pid: peer.pid.and_then(|p| u32::try_from(p).ok()),
                name,
                mode,
            };
            clone::clone(rooms, req, fds).await
        }
        other => Outcome::error(
            Status::Internal,
            format!("{:?} is not served by the park room", other.code()),
        ),
    }
}

/// Whether `req` is one of the park room's requests that carry fds (PARK,
/// RESTORE, EXPORT, CLONE: their sockets, and PARK's manifest).
pub fn takes_fds(req: &Request) -> bool {
    matches!(
        req,
        Request::Park { .. }
            | Request::Restore { .. }
            | Request::Export { .. }
            | Request::Clone { .. }
    )
}

/// The features a request of the park room needs negotiated, each with
/// the requests it names in a refusal.
pub fn features_needed(req: &Request) -> Vec<(&'static str, u64)> {
    let mut needs = vec![("PARK, RESTORE and UNPARK", crate::proto::FEATURE_PARK)];
    if matches!(req, Request::Clone { .. }) {
        needs.push(("CLONE", crate::proto::FEATURE_CLONE));
    }
    needs
}

/// UNPARK: the VM `uid` parked under `name` is dropped; its memory goes
/// to quarantine. Waits on the allocation's change gate, so a RESTORE in
/// progress finishes (or fails) first. A VM another connection holds
/// while it saves it is refused.
pub async fn unpark(rooms: &Arc<Rooms>, session: SessionId, uid: u32, name: &str) -> Outcome {
    let Some(found) = rooms.pool.parking().find_parked(uid, name) else {
        return match rooms.park_record.acknowledge(uid, name) {
            Some(lost) => {
                rooms.note_parked().await;
                let said = crate::daemon::requests::parked::note::describe(&lost);
                info!(
                    uid,
                    name, "UNPARK of a VM a start found lost: its note is cleared"
                );
                Outcome::error(
                    Status::NotFound,
                    format!("no VM named {name:?} is parked: {said}; this note is now cleared"),
                )
            }
            None => Outcome::error(Status::NotFound, format!("no VM named {name:?} is parked")),
        };
    };
    let _held = found.gate.lock_owned().await;
    // Copy clones still reading it finish first (they read within moments).
    rooms.copy_fills.wait_ended(found.alloc).await;
    if let Some(other) = rooms.saving.held_by_other(found.alloc, session) {
        return Outcome::error(Status::Invalid, send::being_saved(name, other));
    }
    if let Some(msg) =
        send::template_in_use(rooms, (found.alloc, &found.regions), name, "UNPARK").await
    {
        return Outcome::error(Status::Invalid, msg);
    }
    match rooms.pool.release_parked(uid, name) {
        Ok(released) => {
            rooms.fills.remove(found.alloc);
            rooms.saving.release(found.alloc);
            info!(
                uid,
                name,
                alloc = found.alloc,
                "UNPARK: parked VM dropped; its memory goes to quarantine"
            );
            rooms.rebalance.alloc_released(found.alloc);
            // Out of the fd store's document before the memory can serve
            // anyone else: a crash must not bring the VM back on it.
            rooms.sync_now("UNPARK").await;
            settle_released(rooms, vec![released]);
            rooms.note_parked().await;
            Outcome::reply(Reply::ok(ReplyBody::Empty))
        }
        Err(e) => Outcome::error(Status::NotFound, e.to_string()),
    }
}

/// The answer to a refused FREE: the launcher of a VM that was parked
/// learns where its memory went ("allocation N was parked as NAME");
/// anyone else gets `refusal`'s text.
pub fn free_refused(
    rooms: &Rooms,
    alloc: crate::daemon::pool::AllocId,
    uid: u32,
    refusal: &crate::daemon::pool::OwnershipError,
) -> Outcome {
    let message = match rooms.pool.parking().parked_name(alloc, uid) {
        Some(name) => format!("allocation {alloc} was parked as {name}"),
        None => refusal.to_string(),
    };
    Outcome::error(Status::NotFound, message)
}
