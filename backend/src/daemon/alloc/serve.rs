//! Serving one ALLOC whole: plan, obtain (off the executor, yielding the
//! refill), reopen each region for the tenant, commit, build the region
//! table and the note, and issue the re-attach token.

use std::sync::Arc;
use std::time::Instant;

use guest_mem::Region;
use tracing::{error, info, warn};

use super::plan::{join_error, obtain_all, plan};
use super::room::Alloc;
use crate::daemon::metrics::Metrics;
use crate::daemon::outcome::Outcome;
use crate::daemon::peer_log::{ALLOC_REFUSED, ALLOC_SERVED};
use crate::daemon::pool::{AllocId, Obtained, SessionId, Source};
use crate::proto::messages::{AllocRequest, RegionInfo, Reply, ReplyBody};
use crate::proto::{ClearMode, Status};

/// Who asks for an ALLOC.
#[derive(Debug, Clone, Copy)]
pub struct Client {
    /// The session (connection) that will own the allocation.
    pub session: SessionId,
    /// The peer's uid (the tenant).
    pub uid: u32,
    /// The peer's gid.
    pub gid: u32,
    /// The session negotiated re-attach tokens.
    pub reattach: bool,
}

/// A lazy allocation just handed out, for the session to record (its UFFD
/// request then starts the fault service).
#[derive(Debug)]
pub struct LazyHandedOut {
    /// The allocation.
    pub alloc: AllocId,
    /// Its region table, as replied.
    pub infos: Vec<RegionInfo>,
    /// Its regions.
    pub regions: Vec<Arc<Region>>,
}

/// What serving an ALLOC produced.
#[derive(Debug)]
pub struct Served {
    /// The reply, its fds and the allocation it hands out.
    pub outcome: Outcome,
    /// A lazy allocation for the session to record.
    pub lazy: Option<LazyHandedOut>,
}

impl From<Outcome> for Served {
    fn from(outcome: Outcome) -> Self {
        Self {
            outcome,
            lazy: None,
        }
    }
}

/// Serves `req` for `client` (see the module docs).
pub async fn serve(
    room: &Arc<Alloc>,
    client: Client,
    req: &AllocRequest,
    wait_ms: Option<u32>,
) -> Served {
    let mut parts = match plan(room, req) {
        Ok(p) => p,
        Err((status, msg)) => {
            Metrics::add(&room.metrics.allocs_failed, 1);
            if let Some(suppressed) = ALLOC_REFUSED.check(client.uid) {
                info!(session = client.session, uid = client.uid, ?status, reason = %msg, suppressed, "ALLOC refused");
            }
            return Outcome::error(status, msg).into();
        }
    };
    // Dirty memory in lazy mode only for uids the operator named.
    let dirty_ok = room.cfg.lazy_dirty_uids.contains(&client.uid);
    for p in &mut parts {
        p.dirty_ok = dirty_ok;
    }
    let cancel = clearing::CancelToken::new();
    let (job_room, job_cancel, lock) = (Arc::clone(room), cancel.clone(), req.lock);
    let owner = (client.uid, client.gid);
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
            if let Some(suppressed) = ALLOC_REFUSED.check(client.uid) {
                warn!(session = client.session, uid = client.uid, ?status, reason = %msg, suppressed, "ALLOC failed");
            }
            return Outcome::error(status, msg).into();
        }
        Err(e) => {
            Metrics::add(&room.metrics.allocs_failed, 1);
            return Outcome::error(Status::Internal, join_error(&e).to_string()).into();
        }
    };
    hand_out(room, client, req, &taken)
}

/// Hands what was taken to the client: its own file descriptions, the
/// commit, the region table, the note and the token.
fn hand_out(room: &Alloc, client: Client, req: &AllocRequest, taken: &[Obtained]) -> Served {
    let ids: Vec<u64> = taken.iter().map(|o| o.taken.id).collect();
    // This tenant's own open file descriptions: the write-lease proof at
    // release counts them (and any copy in flight or behind a mapping);
    // the daemon's own description, and a memfd's original one (which
    // the kernel does not count), never leave the daemon.
    let mut fds = Vec::with_capacity(taken.len());
    for t in taken.iter().map(|o| &o.taken) {
        match crate::sys::reopen(t.region.fd()) {
            Ok(fd) => fds.push(fd),
            Err(e) => {
                room.pool.put_back(&ids);
                Metrics::add(&room.metrics.allocs_failed, 1);
                return Outcome::error(
                    Status::Internal,
                    format!("cannot open region {} for the client: {e}", t.id),
                )
                .into();
            }
        }
    }
    let lazy_mode = req.clear_mode == ClearMode::Lazy;
    let committed = room
        .pool
        .commit(client.session, client.uid, &ids, lazy_mode, req.lock);
    let alloc_id = match committed {
        Ok(a) => a,
        Err(msg) => {
            room.pool.put_back(&ids);
            Metrics::add(&room.metrics.allocs_failed, 1);
            error!(session = client.session, reason = %msg, "clean-before-map invariant refused an ALLOC");
            return Outcome::error(Status::Internal, msg).into();
        }
    };
    let (regions, paths) = region_table(room, req, taken);
    Metrics::add(&room.metrics.allocs_ok, 1);
    let note = note(lazy_mode, taken);
    let lazy = lazy_mode.then(|| LazyHandedOut {
        alloc: alloc_id,
        infos: regions.clone(),
        regions: taken.iter().map(|o| Arc::clone(&o.taken.region)).collect(),
    });
    let sources: Vec<&str> = taken.iter().map(|o| source_name(o.source)).collect();
    // ALLOC and FREE in a loop: a few lines a second per uid, and the note
    // (an ALLOC served otherwise than asked) rides on the same line.
    if let Some(suppressed) = ALLOC_SERVED.check(client.uid) {
        info!(
            session = client.session,
            uid = client.uid,
            alloc = alloc_id,
            bytes = req.total_size,
            ?sources,
            %note,
            suppressed,
            "ALLOC served"
        );
    }
    // Only to a client that negotiated it: the others see the old bytes.
    let token = if client.reattach {
        room.pool.token_of(alloc_id)
    } else {
        None
    };
    // `paths`: filled only for ALLOC with want_paths (hugetlbfs mode, see `hugemem launch --hugetlbfs`).
    let mut reply = Reply::ok(ReplyBody::Alloc {
        alloc_id,
        regions,
        paths,
        token,
    });
    if !note.is_empty() {
        reply.message = note;
    }
    Served {
        outcome: Outcome {
            reply,
            fds,
            alloc: Some(alloc_id),
            close: false,
        },
        lazy,
    }
}

/// The reply's region table (and the hugetlbfs paths, when asked for).
fn region_table(
    room: &Alloc,
    req: &AllocRequest,
    taken: &[Obtained],
) -> (Vec<RegionInfo>, Vec<String>) {
    let mut guest_phys = 0;
    let mut regions = Vec::with_capacity(taken.len());
    let mut paths = Vec::new();
    for (t, source) in taken.iter().map(|o| (&o.taken, &o.source)) {
        if req.want_paths {
            match t.region.path() {
                Some(p) => paths.push(p.display().to_string()),
                None => {
                    // Cannot happen: path parts only take path-backed regions.
                    error!(region = t.id, "a path-backed ALLOC got a memfd region");
                }
            }
        }
        // Lazy: uncleared, the VMM must hand over a uffd. Demand: fresh,
        // the kernel zeroes each page at first touch, so it is clean.
        let mut flags = if *source == Source::Lazy {
            RegionInfo::FLAG_LAZY
        } else {
            RegionInfo::FLAG_CLEAN
        };
        if req.lock {
            flags |= RegionInfo::FLAG_LOCKED;
        }
        if *source == Source::Pooled && t.region.page_size().is_huge() {
            // A detached region may still have holes (see the pool's
            // fill): each faults in a page the kernel zeroes.
            if let Ok(resident) = crate::sys::file_allocated_bytes(t.region.fd()) {
                Metrics::add(
                    &room.metrics.hole_bytes_handed_out,
                    t.region.len().saturating_sub(resident),
                );
            }
        }
        regions.push(RegionInfo {
            region_id: t.id,
            guest_phys,
            size: t.region.len(),
            page_size: t.region.page_size().bytes(),
            node: t.region.node().unwrap_or(crate::proto::ANY_NODE),
            flags,
        });
        guest_phys += t.region.len();
    }
    (regions, paths)
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
