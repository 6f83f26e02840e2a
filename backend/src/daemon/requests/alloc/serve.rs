//! Serving one ALLOC whole: plan, obtain (off the executor, yielding the
//! refill), commit, and hand out ([`crate::daemon::requests::delivery`]: each
//! region reopened for the tenant, the region table, the re-attach token),
//! with the note. Beside REATTACH ([`crate::daemon::requests::reattach::serve`]) and
//! HANDOFF ([`crate::daemon::requests::handoff::serve`]), the first way an allocation
//! is handed out; what it hands out is fresh or pooled regions.

use std::sync::Arc;
use std::time::Instant;

use tracing::{error, info, warn};

use super::plan::{join_error, obtain_all, plan};
use super::room::Alloc;
use crate::daemon::counters::metrics::Metrics;
use crate::daemon::peers::peer_log::{ALLOC_REFUSED, ALLOC_SERVED};
use crate::daemon::pool::{Obtained, SessionId, Source};
use crate::daemon::requests::delivery::{
    Delivery, HandOut, HandOutError, LazyHandedOut, Row, Served,
};
use crate::daemon::requests::outcome::Outcome;
use crate::proto::messages::{AllocRequest, RegionInfo};
use crate::proto::{ClearMode, Status};

/// The daemon's view of the connection that asks for an ALLOC (not the
/// client library's `Client`, which is the VMM's side).
#[derive(Debug, Clone, Copy)]
pub struct Requester {
    /// The session (connection) that will own the allocation.
    pub session: SessionId,
    /// The peer's uid (the tenant).
    pub uid: u32,
    /// The peer's gid.
    pub gid: u32,
    /// The session negotiated re-attach tokens.
    pub reattach: bool,
    /// The daemon itself writes every byte before anyone maps the memory
    /// (PARK's copy fills it from a file and zeroes the rest): pooled
    /// memory that is not clean may be taken, and is not cleared first.
    pub fills_every_byte: bool,
}

/// Serves `req` for `requester` (see the module docs).
pub async fn serve(
    room: &Arc<Alloc>,
    requester: Requester,
    req: &AllocRequest,
    wait_ms: Option<u32>,
) -> Served {
    let mut parts = match plan(room, req) {
        Ok(p) => p,
        Err((status, msg)) => {
            Metrics::add(&room.metrics.allocs_failed, 1);
            if let Some(suppressed) = ALLOC_REFUSED.check(requester.uid) {
                info!(session = requester.session, uid = requester.uid, ?status, reason = %msg, suppressed, "ALLOC refused");
            }
            return Outcome::error(status, msg).into();
        }
    };
    // Dirty memory in lazy mode only for uids the operator named, or for
    // the daemon's own fills.
    let dirty_ok = requester.fills_every_byte || room.cfg.lazy_dirty_uids.contains(&requester.uid);
    for p in &mut parts {
        p.dirty_ok = dirty_ok;
    }
    let cancel = clearing::CancelToken::new();
    let (job_room, job_cancel, lock) = (Arc::clone(room), cancel.clone(), req.lock);
    let owner = (requester.uid, requester.gid);
    let deadline = Instant::now() + room.cfg.alloc_wait(wait_ms);
    // The blocking thread only waits for the runner's pinned workers (or
    // scans /proc); no clearing runs on it or on the executor.
    let mut job = tokio::task::spawn_blocking(move || {
        // A pool refill in progress yields: its pages are given back
        // before this ALLOC counts what exists.
        let _refill = job_room.refill.alloc_started();
        job_room.refill.wait_yielded(deadline);
        obtain_all(&job_room, &parts, lock, owner, deadline, &job_cancel)
    });
    let joined = tokio::select! {
        r = &mut job => r,
        () = room.lifecycle.cancel().cancelled() => {
            cancel.cancel();
            job.await
        }
    };
    let taken = match joined {
        Ok(Ok(t)) => t,
        Ok(Err((status, msg))) => {
            Metrics::add(&room.metrics.allocs_failed, 1);
            if let Some(suppressed) = ALLOC_REFUSED.check(requester.uid) {
                warn!(session = requester.session, uid = requester.uid, ?status, reason = %msg, suppressed, "ALLOC failed");
            }
            return Outcome::error(status, msg).into();
        }
        Err(e) => {
            Metrics::add(&room.metrics.allocs_failed, 1);
            return Outcome::error(Status::Internal, join_error(&e).to_string()).into();
        }
    };
    commit_and_hand_out(room, requester, req, &taken)
}

/// Hands what was taken to the requester: its own file descriptions and the
/// region table ([`HandOut::open`], before the commit, so a failure puts
/// the regions back), the commit, the note and the token.
fn commit_and_hand_out(
    room: &Alloc,
    requester: Requester,
    req: &AllocRequest,
    taken: &[Obtained],
) -> Served {
    let ids: Vec<u64> = taken.iter().map(|o| o.taken.id).collect();
    let delivery = Delivery::Alloc {
        want_paths: req.want_paths,
    };
    let hand_out = match HandOut::open(delivery, rows(req, taken)) {
        Ok(h) => h,
        Err(e) => {
            if let HandOutError::NoPath(region) = e {
                // Cannot happen: path parts only take path-backed regions.
                error!(region, "a path-backed ALLOC got a memfd region");
            }
            room.pool.put_back(&ids);
            Metrics::add(&room.metrics.allocs_failed, 1);
            return Outcome::error(Status::Internal, e.to_string()).into();
        }
    };
    let lazy_mode = req.clear_mode == ClearMode::Lazy;
    let committed = room
        .pool
        .commit(requester.session, requester.uid, &ids, lazy_mode, req.lock);
    let alloc_id = match committed {
        Ok(a) => a,
        Err(msg) => {
            room.pool.put_back(&ids);
            Metrics::add(&room.metrics.allocs_failed, 1);
            error!(session = requester.session, reason = %msg, "clean-before-map invariant refused an ALLOC");
            return Outcome::error(Status::Internal, msg.to_string()).into();
        }
    };
    count_holes(room, taken);
    Metrics::add(&room.metrics.allocs_ok, 1);
    let note = note(lazy_mode, taken);
    let lazy = lazy_mode.then(|| LazyHandedOut {
        alloc: alloc_id,
        infos: hand_out.table().to_vec(),
        regions: taken.iter().map(|o| Arc::clone(&o.taken.region)).collect(),
    });
    let sources: Vec<&str> = taken.iter().map(|o| source_name(o.source)).collect();
    // ALLOC and FREE in a loop: a few lines a second per uid, and the note
    // (an ALLOC served otherwise than asked) rides on the same line.
    if let Some(suppressed) = ALLOC_SERVED.check(requester.uid) {
        info!(
            session = requester.session,
            uid = requester.uid,
            alloc = alloc_id,
            bytes = req.total_size,
            ?sources,
            %note,
            suppressed,
            "ALLOC served"
        );
    }
    // Only to a requester that negotiated it: the others see the old bytes.
    let token = if requester.reattach {
        room.pool.owners().token_of(alloc_id)
    } else {
        None
    };
    let mut outcome = hand_out.reply(alloc_id, token);
    if !note.is_empty() {
        outcome.reply.message = note;
    }
    Served { outcome, lazy }
}

/// The rows of the reply's region table, with the flags of each region's
/// source.
fn rows<'a>(req: &'a AllocRequest, taken: &'a [Obtained]) -> impl Iterator<Item = Row<'a>> {
    taken.iter().map(move |o| {
        let t = &o.taken;
        // Lazy: uncleared, the VMM must hand over a uffd. Demand: fresh,
        // the kernel zeroes each page at first touch, so it is clean.
        let mut flags = if o.source == Source::Lazy {
            RegionInfo::FLAG_LAZY
        } else {
            RegionInfo::FLAG_CLEAN
        };
        if req.lock {
            flags |= RegionInfo::FLAG_LOCKED;
        }
        Row {
            id: t.id,
            region: &t.region,
            flags,
        }
    })
}

/// Counts the holes the detached pooled regions of an ALLOC hand out: each
/// faults in a page the kernel zeroes (see the pool's fill).
fn count_holes(room: &Alloc, taken: &[Obtained]) {
    for o in taken {
        let region = &o.taken.region;
        if o.source == Source::Pooled && region.page_size().is_huge() {
            if let Ok(resident) = crate::sys::file_allocated_bytes(region.fd()) {
                Metrics::add(
                    &room.metrics.hole_bytes_handed_out,
                    region.len().saturating_sub(resident),
                );
            }
        }
    }
}

/// How a region was obtained, for the log.
fn source_name(source: Source) -> &'static str {
    match source {
        Source::Pooled => "pooled",
        Source::Recleared => "recleared",
        Source::Grown => "grown",
        Source::Fresh => "fresh",
        Source::Lazy => "lazy",
        Source::Demand => "demand",
    }
}

/// The reply's note: a lazy request that got no dirty pooled memory, and
/// a `best` one served on a smaller page size, say so (the reply's
/// message, on success, is a note).
fn note(lazy_mode: bool, taken: &[Obtained]) -> String {
    let demand = taken.iter().filter(|o| o.source == Source::Demand).count();
    let mut notes: Vec<String> = taken.iter().filter_map(|o| o.downgrade.clone()).collect();
    if lazy_mode && demand > 0 {
        notes.push(format!(
            "lazy: {demand} of {} regions had no dirty pooled memory of their size and node; they are fresh, \
             zeroed by the kernel at first touch (kernel demand faults, no uffd needed)",
            taken.len()
        ));
    }
    let mut note = notes.join("; ");
    if note.len() > crate::proto::MAX_MESSAGE {
        let mut cut = crate::proto::MAX_MESSAGE;
        while !note.is_char_boundary(cut) {
            cut -= 1;
        }
        note.truncate(cut);
    }
    note
}
