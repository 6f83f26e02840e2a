//! CLONE: a new VM started from a parked VM, its template, which stays
//! parked and unchanged. See the room's docs ([`super`]).
//!
//! SHARED mode: the template is sent to the clone's launcher as EXPORT
//! sends it to a saver (`Start → MemoryFd ×N → Config → State →
//! CompletePaused`, each memory fd a new **read-only** description of its
//! region). The launcher passes those fds to the clone's cloud-hypervisor
//! and has it map them privately (`ch_migration::clone`), so the clone
//! copies a page only when it writes it and can never write the
//! template. Before anything is sent, the clone is admitted against the
//! huge-page budget (`parked::clones`) and counted against the template
//! for the requesting connection; a VM with a device that needs shared
//! memory (VFIO, vhost-user) is refused, and so is a net on fds passed to
//! the template's process (`ch_migration::clone::unreplaceable_identity`);
//! a tap or a vsock socket the launcher replaces with the clone's own
//! (`ch_migration::clone::clone_identity`).
//!
//! The promise: until the launcher closes its end of the socket (it does
//! once its cloud-hypervisor has mapped the template) or its connection
//! ends, the clone's pages stay promised in the budget (`parked::clones`),
//! so that CLONEs at once are never admitted on the same pages.
//!
//! COPY mode (the clone's own pool memory, filled from the template) is
//! a RESTORE with COPY (`clone_copy.rs`): CLONE answers UNSUPPORTED.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use ch_migration::peer::send_snapshot;
use tracing::info;

use super::send::{gated, slot_fds};
use super::socket::migration_socket;
use crate::daemon::counters::metrics::Metrics;
use crate::daemon::peers::holders::FileId;
use crate::daemon::pool::{set_access_all, Access, FoundParked, SessionId};
use crate::daemon::requests::outcome::Outcome;
use crate::daemon::requests::rooms::Rooms;
use crate::proto::messages::{CloneMode, Reply, ReplyBody};
use crate::proto::Status;

/// A CLONE request.
#[derive(Debug, Clone)]
pub struct CloneRequest {
    /// The clone's launcher's connection (its clone counts while it lasts).
    pub session: SessionId,
    /// Its uid: only the template's uid may clone it.
    pub uid: u32,
    /// Its process (the clone's launcher), when the kernel said.
    pub pid: Option<u32>,
    /// The template's name.
    pub name: String,
    /// How the clone gets its memory.
    pub mode: CloneMode,
}

fn refused(
    rooms: &Rooms,
    req: &CloneRequest,
    status: Status,
    msg: impl std::fmt::Display,
) -> Outcome {
    let msg = msg.to_string();
    Metrics::add(&rooms.metrics.clones_refused, 1);
    if let Some(suppressed) = crate::daemon::peers::peer_log::REQUEST_REFUSED.check(req.uid) {
        info!(session = req.session, uid = req.uid, name = %req.name, mode = req.mode.name(), reason = %msg, suppressed, "CLONE refused");
    }
    Outcome::error(status, msg)
}

/// The template's bytes and page size.
fn size_of(found: &FoundParked) -> (u64, guest_mem::PageSize) {
    let bytes = found.regions.iter().map(|(_, r)| r.len()).sum();
    let page_size = found
        .regions
        .first()
        .map_or(guest_mem::PageSize::Base4K, |(_, r)| r.page_size());
    (bytes, page_size)
}

/// CLONE (see the module docs).
pub async fn clone(rooms: &Arc<Rooms>, req: CloneRequest, fds: Vec<OwnedFd>) -> Outcome {
    if req.mode == CloneMode::Copy {
        return refused(
            rooms,
            &req,
            Status::Unsupported,
            "a copy clone is a RESTORE with COPY (hugemem launch --clone-of NAME --clone-mode copy); CLONE serves shared clones",
        );
    }
    let stream = match migration_socket(fds, req.uid) {
        Ok(s) => s,
        Err(e) => return refused(rooms, &req, Status::Invalid, e.to_string()),
    };
    // Names are per uid: another uid's template is not found.
    let (_held, found) = match gated(rooms, req.session, req.uid, &req.name).await {
        Ok(g) => g,
        Err((status, msg)) => return refused(rooms, &req, status, msg),
    };
    let config = found.vm.config.as_bytes();
    if let Err(e) = ch_migration::clone::shared_clone_refusal(config)
        .and_then(|()| ch_migration::clone::unreplaceable_identity(config))
    {
        return refused(rooms, &req, Status::Invalid, e);
    }
    if let Err(msg) = super::export::fill_pending(rooms, &found).await {
        return refused(rooms, &req, Status::Invalid, msg);
    }
    // Parked means read-only to all but root (`Parking::park`, adoption);
    // made so again before any clone gets an fd, whatever happened since.
    if let Err((i, e)) = set_access_all(
        found.regions.iter().map(|(_, r)| &**r),
        Access::Template,
        Access::Template,
    ) {
        let msg = format!("cannot make the template's region {i} read-only to all: {e}");
        return refused(rooms, &req, Status::Internal, msg);
    }
    let (bytes, page_size) = size_of(&found);
    let files = found
        .regions
        .iter()
        .filter_map(|(_, r)| FileId::of(r.fd()).ok())
        .collect();
    let admitted = match rooms.clones.admit(
        (found.alloc, files),
        (req.session, req.pid),
        &req.name,
        (bytes, page_size),
    ) {
        Ok(a) => a,
        Err(e) => return refused(rooms, &req, Status::NoMemory, e),
    };
    let id = admitted.id;
    let slot_fds = match slot_fds(&found, crate::sys::reopen_read_only) {
        Ok(f) => f,
        Err(msg) => {
            rooms.clones.release(id);
            return refused(rooms, &req, Status::Internal, msg);
        }
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
        .map(|()| stream)
    })
    .await;
    let failed = match sent {
        Ok(Ok(stream)) => {
            if let Some(ended) = admitted.ended {
                keep_promise(rooms, id, stream, ended);
            }
            None
        }
        Ok(Err(e)) => Some((
            Status::Invalid,
            format!("the clone's launcher did not take the template: {e}"),
        )),
        Err(e) => Some((Status::Internal, e.to_string())),
    };
    if let Some((status, msg)) = failed {
        rooms.clones.release(id);
        return refused(rooms, &req, status, msg);
    }
    Metrics::add(&rooms.metrics.clones, 1);
    let running = rooms.clones.of(found.alloc).0;
    info!(session = req.session, uid = req.uid, name = %req.name, alloc = found.alloc, bytes, running, "CLONE: template sent read-only to a shared clone's launcher; it stays parked");
    Outcome::reply(Reply::ok(ReplyBody::Exported {
        alloc_id: found.alloc,
        bytes,
        page_size: page_size.bytes(),
        parked_at: found.vm.parked_at,
        slots: u32::try_from(found.vm.slots.len()).unwrap_or(u32::MAX),
    }))
}

/// Keeps clone `id`'s pages promised until its launcher closes its end of
/// the migration socket (it does once its cloud-hypervisor has mapped the
/// template, or dies) or sends anything on it, or until the clone's hold
/// ends (its connection closed). Events only: no timer. A launcher that
/// closes early only takes its own pages out of the promise: its mapping
/// may then fail, never another clone's.
fn keep_promise(
    rooms: &Arc<Rooms>,
    id: u64,
    stream: std::os::unix::net::UnixStream,
    ended: tokio::sync::oneshot::Receiver<()>,
) {
    let rooms = Arc::clone(rooms);
    let stream = stream
        .set_nonblocking(true)
        .and_then(|()| tokio::net::UnixStream::from_std(stream));
    let Ok(stream) = stream else {
        // Cannot watch it: no longer promise (the launcher maps at once).
        rooms.clones.mapped(id);
        return;
    };
    tokio::spawn(async move {
        tokio::select! {
            _ = stream.readable() => rooms.clones.mapped(id),
            _ = ended => {}
        }
    });
}
