//! REBALANCE: checks, the move on a blocking thread, bookkeeping, and the
//! placement STATS reports.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use clearing::CancelToken;
use hugemem_client::stats::{MovedRange, Stats};
use migrate::{ByteRange, MoveOptions, MoveSpan, Placement};
use numa::NodeId;
use tracing::{info, warn};

use crate::daemon::pool::{InUseRegion, RegionId, SessionId};
use crate::proto::messages::{Reply, ReplyBody};

use super::rebalancer::*;

/// Looks the region up and applies the operator model and the checks that
/// need no syscall: ownership, target node, range, not moving already.
fn check(
    rb: &Rebalancer,
    req: MoveRequest,
    who: Initiator,
) -> Result<(InUseRegion, ByteRange), RebalanceError> {
    let Some(region) = rb.pool.placement().in_use(req.region_id) else {
        // A non-operator learns nothing about regions that are not its own:
        // a missing or pooled id reads exactly like another tenant's.
        if let Initiator::Client { uid, .. } = who {
            if !rb.operators().contains(&uid) {
                return Err(RebalanceError::NotYours {
                    region: req.region_id,
                    uid,
                });
            }
        }
        return Err(if rb.pool.placement().contains(req.region_id) {
            RebalanceError::NotInUse(req.region_id)
        } else {
            RebalanceError::Unknown(req.region_id)
        });
    };
    if let Initiator::Client { session, uid } = who {
        let access = authorize(region.session, session, uid, rb.operators());
        match access {
            Access::Denied => {
                return Err(RebalanceError::NotYours {
                    region: req.region_id,
                    uid,
                })
            }
            Access::Operator => info!(
                region = req.region_id,
                session,
                uid,
                owner = region.session,
                "operator REBALANCE of another connection's region"
            ),
            Access::Owner => {}
        }
    }
    migrate::validate_target(&rb.topology, req.node)?;
    let len = region.region.len();
    let range = ByteRange::from_request(req.offset, req.len, len);
    migrate::validate_range(len, region.region.page_size(), range)?;
    Ok((region, range))
}

/// A move running on a blocking thread.
type MoveJob = tokio::task::JoinHandle<Result<MoveOutcome, RebalanceError>>;

/// Checks the request, claims the region, and starts the move on a blocking
/// thread. Returns the move's handle and its cancel token.
///
/// # Errors
///
/// The refusals of [`check`] and [`RebalanceError::Busy`].
fn start(
    rb: &Arc<Rebalancer>,
    req: MoveRequest,
    who: Initiator,
) -> Result<(MoveJob, CancelToken), RebalanceError> {
    let (target, range) = check(rb, req, who)?;
    let cancel = CancelToken::new();
    {
        let mut active = lock(&rb.active);
        if let Some(m) = active.get(&req.region_id) {
            return Err(RebalanceError::Busy {
                region: req.region_id,
                target: m.target,
                seconds: m.started.elapsed().as_secs_f64(),
            });
        }
        active.insert(
            req.region_id,
            ActiveMove {
                alloc: target.alloc,
                owner: target.session,
                target: req.node,
                range,
                started: Instant::now(),
                initiator: who,
                cancel: cancel.clone(),
            },
        );
    }
    // For the whole move the region counts as split: released now, it goes
    // back to the kernel rather than into a per-node pool (module docs).
    if !rb.pool.placement().mark_split(req.region_id, target.alloc) {
        // Released between the lookup and the claim.
        lock(&rb.active).remove(&req.region_id);
        return Err(RebalanceError::NotInUse(req.region_id));
    }
    // A client's moves count against its uid's lines (REBALANCE in a loop).
    let logged = match who {
        Initiator::Client { uid, .. } => crate::daemon::peers::peer_log::REBALANCE.check(uid),
        Initiator::Policy => Some(0),
    };
    if let Some(suppressed) = logged {
        info!(
            region = req.region_id,
            alloc = target.alloc,
            from = target.node,
            to = req.node,
            range = %range,
            by = who.name(),
            suppressed,
            "moving a region"
        );
    }
    let job_rb = Arc::clone(rb);
    let job_cancel = cancel.clone();
    let handle = rb
        .lifecycle
        .tracker()
        .spawn_blocking(move || run_move(&job_rb, &target, range, req.node, who, &job_cancel));
    Ok((handle, cancel))
}

/// The blocking part: move, look where the pages are, record it.
fn run_move(
    rb: &Rebalancer,
    target: &InUseRegion,
    range: ByteRange,
    node: NodeId,
    who: Initiator,
    cancel: &CancelToken,
) -> Result<MoveOutcome, RebalanceError> {
    let opts = MoveOptions {
        rate_limit_bytes_per_s: rb.cfg.rate_limit_bytes_per_s(),
        // A request moves what it can and says what did not move; the
        // policy moves a VM only when the target can take all of it.
        allow_partial: who != Initiator::Policy,
        ..MoveOptions::default()
    };
    let span = MoveSpan::of_region(&target.region);
    let result = migrate::move_range(&rb.topology, &span, range, node, &opts, Some(cancel), None);
    let placement = match migrate::placement(&span) {
        Ok(p) => Some(p),
        Err(e) => {
            warn!(region = target.id, error = %crate::diag::chain(&e), "cannot tell where a moved region's pages are");
            None
        }
    };
    let moved_any = match &result {
        Ok(r) => r.pages_moved > 0 || r.already_there > 0 || r.not_present > 0,
        Err(e) => e.report().is_some_and(|r| r.pages_moved > 0),
    };
    let whole_on = placement
        .as_ref()
        .and_then(|p| whole_node(p, node, result.is_ok()));
    record(rb, target, range, node, moved_any, whole_on);
    let counters = &rb.counters;
    let report = result.map_err(|source| {
        if let Some(r) = source.report() {
            counters
                .pages_moved
                .fetch_add(r.pages_moved as u64, Ordering::Relaxed);
            counters
                .bytes_moved
                .fetch_add(r.bytes_moved, Ordering::Relaxed);
        }
        counters.moves_failed.fetch_add(1, Ordering::Relaxed);
        RebalanceError::Move {
            region: target.id,
            node,
            source,
        }
    })?;
    counters.moves_ok.fetch_add(1, Ordering::Relaxed);
    counters
        .pages_moved
        .fetch_add(report.pages_moved as u64, Ordering::Relaxed);
    counters
        .pages_failed
        .fetch_add(report.pages_failed() as u64, Ordering::Relaxed);
    counters
        .bytes_moved
        .fetch_add(report.bytes_moved, Ordering::Relaxed);
    Ok(MoveOutcome {
        report,
        placement,
        whole_on,
    })
}

/// The node every present page is on, if there is one. A region with no
/// present page (never touched) is whole on the target when the move
/// succeeded: the binding decides where its pages will be.
pub(super) fn whole_node(p: &Placement, target: NodeId, succeeded: bool) -> Option<NodeId> {
    if p.unlocated > 0 {
        return None;
    }
    let mut nodes = p
        .per_node
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(id, _)| *id);
    match (nodes.next(), nodes.next()) {
        (Some(n), None) => Some(n),
        (None, None) if succeeded => Some(target),
        _ => None,
    }
}

/// Bookkeeping after a move (also after a failed or cancelled one): the
/// region's node and pool key, the split flag, the range record, the
/// owner's policy cool-down, and the end of the claim.
pub(super) fn record(
    rb: &Rebalancer,
    target: &InUseRegion,
    range: ByteRange,
    node: NodeId,
    moved_any: bool,
    whole_on: Option<NodeId>,
) {
    let rb = &rb;
    {
        let mut ranges = lock(&rb.ranges);
        match whole_on {
            Some(_) => {
                ranges.remove(&target.id);
            }
            None if moved_any => ranges.entry(target.id).or_default().insert(
                range.offset,
                range.offset.saturating_add(range.len),
                node,
            ),
            None => {}
        }
    }
    // Only while the region is still in use by the same allocation: after a
    // FREE it left the pool table already (it was marked split).
    match whole_on {
        Some(n) => {
            if rb
                .pool
                .placement()
                .set_whole_node(target.id, target.alloc, n)
            {
                info!(region = target.id, node = n, "region is whole on its node");
            }
        }
        None => {
            if rb.pool.placement().mark_split(target.id, target.alloc) {
                info!(region = target.id, "region's pages are on several nodes");
            }
        }
    }
    if let Some(p) = lock(&rb.clients).get_mut(&target.session) {
        p.watcher.moved();
    }
    lock(&rb.active).remove(&target.id);
}

/// Moves as asked and waits for the move (cancelling it on shutdown).
///
/// # Errors
///
/// See [`RebalanceError`]; [`RebalanceError::status`] gives the reply status.
pub async fn rebalance(
    rb: &Arc<Rebalancer>,
    req: MoveRequest,
    who: Initiator,
) -> Result<MoveOutcome, RebalanceError> {
    let (mut job, cancel) = match start(rb, req, who) {
        Ok(x) => x,
        Err(e) => {
            rb.counters.moves_refused.fetch_add(1, Ordering::Relaxed);
            return Err(e);
        }
    };
    let joined = tokio::select! {
        r = &mut job => r,
        () = rb.lifecycle.cancel().cancelled() => {
            cancel.cancel();
            job.await
        }
    };
    joined.map_err(|e| {
        // The move panicked: drop the claim so the region is not stuck.
        lock(&rb.active).remove(&req.region_id);
        RebalanceError::Join(e.to_string())
    })?
}

/// Serves REBALANCE for a session: the reply to send.
pub async fn serve(rb: &Arc<Rebalancer>, session: SessionId, uid: u32, req: MoveRequest) -> Reply {
    match rebalance(rb, req, Initiator::Client { session, uid }).await {
        Ok(out) => {
            let r = &out.report;
            if let Some(suppressed) = crate::daemon::peers::peer_log::REBALANCE.check(uid) {
                info!(
                    session,
                    uid,
                    region = req.region_id,
                    node = req.node,
                    moved = r.pages_moved,
                    failed = r.pages_failed(),
                    seconds = r.seconds,
                    whole_on = ?out.whole_on,
                    suppressed,
                    "REBALANCE done"
                );
            }
            if !r.failed.is_empty() {
                warn!(region = req.region_id, failures = ?r.failure_counts(), "some pages did not move");
            }
            Reply::ok(ReplyBody::Rebalance {
                pages_moved: r.pages_moved as u64,
                pages_failed: r.pages_failed() as u64,
            })
        }
        Err(e) => {
            let msg = crate::diag::chain(&e);
            if let Some(suppressed) = crate::daemon::peers::peer_log::REBALANCE.check(uid) {
                info!(session, uid, region = req.region_id, status = ?e.status(), reason = %msg, suppressed, "REBALANCE refused or failed");
            }
            Reply::error(e.status(), msg)
        }
    }
}

/// Adds placement to the in-use entries of the STATS `regions` list:
/// `alloc_id`, `session`, `size`, `bound_node` (the node recorded for the
/// region), `placement` (pages per node), `not_present`, `unlocated`,
/// `split`, `moving` and `rebalanced` (ranges asked for, while split). The
/// queries run on a blocking thread (one address per page).
pub async fn add_placement(rb: &Arc<Rebalancer>, stats: &mut Stats) {
    let regions = rb.pool.placement().in_use_regions();
    let ids: HashSet<RegionId> = regions.iter().map(|r| r.id).collect();
    rb.forget_except(&ids);
    if regions.is_empty() {
        return;
    }
    let job = tokio::task::spawn_blocking(move || {
        regions
            .into_iter()
            .map(|r| {
                let p = migrate::placement(&MoveSpan::of_region(&r.region))
                    .map_err(|e| crate::diag::chain(&e));
                (r, p)
            })
            .collect::<Vec<_>>()
    });
    let placed = match job.await {
        Ok(p) => p,
        Err(e) => {
            warn!(error = %e, "placement query failed");
            return;
        }
    };
    let Some(list) = stats.regions.as_mut() else {
        return;
    };
    for entry in list.iter_mut() {
        let Some((r, p)) = placed.iter().find(|(r, _)| r.id == entry.id) else {
            continue;
        };
        entry.alloc_id = Some(r.alloc);
        entry.session = Some(r.session);
        entry.size = Some(r.region.len());
        entry.bound_node = Some(r.region.node());
        entry.split = Some(r.split);
        entry.moving = Some(rb.is_moving(entry.id));
        match p {
            Ok(p) => {
                entry.placement = Some(Some(node_map(&p.per_node)));
                entry.not_present = Some(p.not_present as u64);
                entry.unlocated = Some(p.unlocated as u64);
            }
            Err(e) => {
                entry.placement = Some(None);
                entry.placement_error = Some(e.clone());
            }
        }
        entry.rebalanced = Some(
            rb.ranges_of(entry.id)
                .into_iter()
                .map(|(s, e, n)| MovedRange {
                    offset: s,
                    len: e - s,
                    node: n,
                })
                .collect(),
        );
    }
}

// ---------------------------------------------------------------------------
// The policy loop.
