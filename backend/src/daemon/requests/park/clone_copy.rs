//! RESTORE with COPY: a copy clone. The parked VM (its template) stays
//! parked; the receiver gets a fresh allocation of pool memory, on the
//! template's page size, filled from the template before anything is sent
//! (the fill engine: `pread` from the template's region into the daemon's
//! mapping of the new one), and the allocation is handed to the
//! requesting connection as RESTORE hands a parked VM's out. The clone's
//! memory is mapped shared as any launch's is, so VFIO and vhost-user
//! work; no page is seen unfilled, since the receiver gets its fds only
//! once every byte was written.
//!
//! A VM that holds what a second process cannot (a named tap, a vsock)
//! is refused (`ch_migration::clone::identity_refusal`). Not built yet: the postcopy flavour (the guest running at once, each
//! page filled as it faults, `ondemand.rs`-style, from memory), and
//! templates of more than one region. Both are refused with a message.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use ch_migration::peer::send_snapshot;
use guest_mem::{fill_region_planned, FillOptions, FillSource, PageSize, Region};
use tracing::info;

use super::error::StepError;
use super::refusal::{refuse, Asker};
use super::send::gated;
use super::socket::migration_socket;
use crate::daemon::counters::metrics::Metrics;
use crate::daemon::pool::{FoundParked, SessionId};
use crate::daemon::requests::delivery::{rows_now, Delivery, HandOut};
use crate::daemon::requests::outcome::Outcome;
use crate::daemon::requests::rooms::{settle_released, Rooms};
use crate::proto::{PagePolicy, Status};

/// A RESTORE with COPY.
#[derive(Debug, Clone)]
pub struct CopyRequest {
    /// The requesting connection (it owns the copy afterwards).
    pub session: SessionId,
    /// Its uid: only the template's uid finds it.
    pub uid: u32,
    /// Its gid.
    pub gid: u32,
    /// The template's name.
    pub name: String,
    /// End with `CompletePaused`.
    pub paused: bool,
    /// A postcopy restore (not built for copies yet).
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

/// Fills `to` with every byte of `from` (the fill engine, NUMA-local); the
/// pages of `to` end `Mapped`.
fn copy_template(topology: &numa::Topology, from: &Region, to: &Region) -> Result<u64, StepError> {
    let sources = [FillSource {
        file: from.fd(),
        file_offset: 0,
        dest_offset: 0,
        len: from.len(),
    }];
    let opts = FillOptions {
        dest_is_zero: super::copy::mark_taken_for_fill(to),
        ..FillOptions::default()
    };
    let report = crate::daemon::requests::parked::loads::plan(to, &sources, &[])
        .and_then(|plan| fill_region_planned(topology, to, &plan, &opts))
        .map_err(|e| {
            to.mark_all_dirty();
            StepError::failed("copying the template")(e)
        })?;
    to.mark_mapped()
        .map_err(StepError::failed("the copy's page states"))?;
    Ok(report.counts.bytes_read)
}

/// The one region of a template a copy is made of, or why not.
fn one_region(found: &FoundParked) -> Result<Arc<Region>, String> {
    match found.regions.as_slice() {
        [(_, region)] => Ok(Arc::clone(region)),
        more => Err(format!(
            "a copy clone of a VM on {} regions is not built yet (one region only)",
            more.len()
        )),
    }
}

/// RESTORE with COPY (see the module docs).
pub async fn restore_copy(rooms: &Arc<Rooms>, req: CopyRequest, fds: Vec<OwnedFd>) -> Outcome {
    if req.postcopy {
        return refused(
            rooms,
            &req,
            Status::Unsupported,
            "a postcopy copy clone is not built yet: restore the copy without --on-demand",
        );
    }
    let stream = match migration_socket(fds, req.uid) {
        Ok(s) => s,
        Err(e) => return refused(rooms, &req, Status::Invalid, e.to_string()),
    };
    let (_held, found) = match gated(rooms, req.session, req.uid, &req.name).await {
        Ok(g) => g,
        Err((status, msg)) => return refused(rooms, &req, status, msg),
    };
    if let Err(e) = ch_migration::clone::identity_refusal(found.vm.config.as_bytes()) {
        return refused(rooms, &req, Status::Invalid, e);
    }
    if let Err(msg) = super::export::fill_pending(rooms, &found).await {
        return refused(rooms, &req, Status::Invalid, msg);
    }
    let template = match one_region(&found) {
        Ok(r) => r,
        Err(msg) => return refused(rooms, &req, Status::Unsupported, msg),
    };
    let who = (req.session, req.uid, req.gid);
    let policy = policy_of(template.page_size());
    let (alloc, region) = match super::copy::take_memory(rooms, who, template.len(), policy).await {
        Ok(t) => t,
        Err((status, msg)) => return refused(rooms, &req, status, msg),
    };
    let release = |rooms: &Arc<Rooms>| {
        if let Ok(r) = rooms.pool.release(alloc, req.session) {
            settle_released(rooms, vec![r]);
        }
    };
    let started = std::time::Instant::now();
    let sent = send_copy(rooms, &req, &found, (&template, &region), stream).await;
    let copied = match sent {
        Ok(copied) => copied,
        Err((status, msg)) => {
            release(rooms);
            return refused(rooms, &req, status, msg);
        }
    };
    // The copy's one region, by its id in the pool.
    let owners = rooms.pool.owners();
    let regions: Vec<_> = owners
        .region_ids_of(req.session)
        .into_iter()
        .filter(|id| owners.region(*id).is_some_and(|r| Arc::ptr_eq(&r, &region)))
        .map(|id| (id, Arc::clone(&region)))
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
    info!(session = req.session, uid = req.uid, name = %req.name, template = found.alloc, alloc, copied, ms, "copy clone: fresh memory filled from the template and handed to its cloud-hypervisor; the template stays parked");
    hand_out.reply(alloc, rooms.pool.owners().token_of(alloc))
}

/// Fills the copy from the template and sends it to the receiver: the
/// bytes copied, or the refusal.
async fn send_copy(
    rooms: &Arc<Rooms>,
    req: &CopyRequest,
    found: &FoundParked,
    (template, copy): (&Arc<Region>, &Arc<Region>),
    stream: std::os::unix::net::UnixStream,
) -> Result<u64, (Status, String)> {
    let slots: Vec<u32> = found.vm.slots.iter().map(|s| s.slot).collect();
    let mut slot_fds = Vec::new();
    for slot in slots {
        let fd = crate::sys::reopen(copy.fd()).map_err(|e| (Status::Internal, e.to_string()))?;
        slot_fds.push((slot, fd));
    }
    let (vm, topology) = (Arc::clone(&found.vm), Arc::clone(&rooms.topology));
    let (template, copy) = (Arc::clone(template), Arc::clone(copy));
    let paused = req.paused;
    let sent = tokio::task::spawn_blocking(move || {
        let copied = copy_template(&topology, &template, &copy)?;
        let memory: Vec<(u32, BorrowedFd<'_>)> =
            slot_fds.iter().map(|(s, fd)| (*s, fd.as_fd())).collect();
        send_snapshot(
            &stream,
            &memory,
            vm.config.as_bytes(),
            vm.state.as_bytes(),
            paused,
        )
        .map_err(StepError::not_taken)?;
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
