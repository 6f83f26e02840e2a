//! NUMA rebalancing in the daemon: the REBALANCE request, per-region
//! placement for STATS and `hugemem status`, the vCPU-affinity policy loop,
//! and the `hugemem rebalance` client side.
//!
//! The moving itself is `migrate` ([`migrate::move_range`]); this module
//! decides who may move what, runs the move off the executor, and keeps the
//! pool's idea of where a region is in step with where its pages are.
//!
//! # Who may move what (operator model)
//!
//! A VMM client may REBALANCE only regions of allocations its own
//! connection was given, as with FREE/LOCK/UNLOCK: anything else is
//! `NOT_FOUND`. `hugemem rebalance` is a different connection from the
//! VMM's, so a second rule admits **operators**: a peer whose `SO_PEERCRED`
//! uid is in `[rebalance] operator_uids` (default: root and the daemon's
//! own uid) may REBALANCE any *in-use* region. A process with those uids
//! could move the VMM's pages itself (`move_pages` on its pid with
//! `CAP_SYS_NICE`), so this grants nothing new; a VMM running under another
//! allowed uid cannot touch other clients' memory. Regions in the pool (not
//! in use) belong to the daemon and are never moved on request: `NOT_FOUND`
//! for everyone. The alternative — a per-allocation token the VMM would have
//! to pass to the operator — needs a protocol change and a secret to leak.
//!
//! # Off the executor
//!
//! A move of GiBs takes seconds. It runs on a blocking thread of the
//! daemon's task tracker (`spawn_blocking`); the connection's task waits for
//! it, so that connection's next request waits too, and other connections
//! are served meanwhile. Daemon shutdown cancels the move between batches.
//! Moves of different regions may run at once; a second move of a region
//! that is moving is refused (`INVALID`, "being moved already"). The
//! requesting connection is not read while it waits, so a requester that
//! goes away does not stop its move (an owner's allocations are released,
//! and the move cancelled, once its connection is found closed).
//!
//! # FREE and disconnect during a move
//!
//! FREE (or the owner's disconnect) of an allocation whose region is being
//! moved is **accepted at once and cancels the move** (it stops before its
//! next batch: at most 64 MiB, or one 1 GiB page, is still copied). A region
//! is marked "on several nodes" in the pool for the whole of a move, and
//! such a region is given back to the kernel when released instead of being
//! quarantined for reuse; the move thread holds the last reference and the
//! memory goes when it stops. So the scrubbers never see a page that is
//! being moved, and no per-node pool ever holds a region with pages on
//! another node. Refusing FREE instead would leave a VMM that is shutting
//! down with an error it cannot act on; waiting would stall its connection
//! for up to a whole move.
//!
//! # Whole regions and ranges
//!
//! After every move the daemon asks where the region's pages are
//! ([`migrate::placement`], one address per page). When every present page
//! is on one node, that node is recorded: [`guest_mem::Region::set_node`]
//! and the region's pool key, so on release it returns to that node's pool
//! and that node's scrubbers clear it. A range move that leaves the region
//! split keeps the old node and marks the region as on several nodes; the
//! ranges asked for are kept per region (last target wins where ranges
//! overlap) and shown in STATS as `rebalanced`. Moving the rest, or moving
//! it all back, makes the region whole again. A split region is given back
//! to the kernel when released (see above).
//!
//! # The policy loop
//!
//! Off by default (`[rebalance] policy`). Every `interval_ms` one task takes
//! a snapshot of the clients that hold memory and, on a blocking thread,
//! samples the vCPU threads ([`migrate::policy::sample`], thread names of
//! QEMU, cloud-hypervisor, Firecracker, crosvm) of each client's process
//! (`SO_PEERCRED` pid) **and its descendants**: `hugemem launch` holds the
//! connection and runs the VMM as its child, so the launcher itself has no
//! vCPU threads. One [`migrate::Watcher`] per client applies the hysteresis;
//! on [`migrate::Decision::Move`] each of the client's regions is moved
//! through the same path as REBALANCE, all or nothing (`allow_partial:
//! false`: a target that cannot take every page refuses before anything
//! moves). A client whose regions are on different nodes (a guest NUMA
//! layout), split, or moving is left alone. A manual REBALANCE starts the
//! owner's cool-down as well.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use clearing::CancelToken;
use migrate::{
    ByteRange, CpuNodes, Decision, MigrateError, MoveOptions, MoveReport, MoveSpan, Placement,
    PlanError, PolicyConfig, Sample, VcpuFilter, Watcher,
};
use numa::NodeId;
use serde_json::{json, Map, Value};
use tracing::{debug, info, warn};

use super::config::RebalanceConfig;
use super::pool::{AllocId, InUseRegion, RegionId, SessionId};
use super::Shared;
use crate::proto::messages::{Reply, ReplyBody};
use crate::proto::Status;

/// Who asks for a move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Initiator {
    /// A client connection (a VMM, or an operator's `hugemem rebalance`).
    Client {
        /// Its session.
        session: SessionId,
        /// Its `SO_PEERCRED` uid.
        uid: u32,
    },
    /// The vCPU-affinity policy loop.
    Policy,
}

impl Initiator {
    fn name(self) -> &'static str {
        match self {
            Self::Client { .. } => "request",
            Self::Policy => "policy",
        }
    }
}

/// What [`authorize`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// The requesting connection owns the region.
    Owner,
    /// Another connection whose uid is an operator's.
    Operator,
    /// Neither.
    Denied,
}

/// The operator model (see the module docs): the owning connection, or an
/// operator uid on any connection.
pub fn authorize(owner: SessionId, session: SessionId, uid: u32, operator_uids: &[u32]) -> Access {
    if owner == session {
        Access::Owner
    } else if operator_uids.contains(&uid) {
        Access::Operator
    } else {
        Access::Denied
    }
}

/// A REBALANCE request, as the protocol carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoveRequest {
    /// The region.
    pub region_id: RegionId,
    /// First byte of the range.
    pub offset: u64,
    /// Bytes; 0 = to the end of the region.
    pub len: u64,
    /// Target node.
    pub node: NodeId,
}

/// Why a REBALANCE was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum RebalanceError {
    /// No region has this id.
    #[error("region {0} does not exist")]
    Unknown(RegionId),
    /// The region is in the pool (or being handed out), not in use.
    #[error("region {0} is not in use by a client; pooled regions are the daemon's")]
    NotInUse(RegionId),
    /// Another connection's region, and the peer is not an operator.
    #[error("region {region} does not belong to this connection (uid {uid} is not an operator)")]
    NotYours {
        /// The region.
        region: RegionId,
        /// The peer's uid.
        uid: u32,
    },
    /// The target node or the range is invalid; nothing was done.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The region is being moved already.
    #[error("region {region} is being moved already (to node {target}, for {seconds:.1} s)")]
    Busy {
        /// The region.
        region: RegionId,
        /// Where the running move goes.
        target: NodeId,
        /// How long it has been running.
        seconds: f64,
    },
    /// The move failed or was cancelled (FREE, disconnect, shutdown).
    #[error("moving region {region} to node {node} failed")]
    Move {
        /// The region.
        region: RegionId,
        /// The target.
        node: NodeId,
        /// The cause (carries what was moved before it).
        #[source]
        source: MigrateError,
    },
    /// The move's thread ended without a result.
    #[error("the move's thread failed: {0}")]
    Join(String),
}

impl RebalanceError {
    /// The reply status for this error.
    pub fn status(&self) -> Status {
        match self {
            Self::Unknown(_) | Self::NotInUse(_) | Self::NotYours { .. } => Status::NotFound,
            Self::Plan(PlanError::UnknownNode { .. } | PlanError::MemorylessNode { .. }) => {
                Status::BadNode
            }
            Self::Plan(_) | Self::Busy { .. } => Status::Invalid,
            Self::Move { .. } | Self::Join(_) => Status::Internal,
        }
    }
}

/// What a finished move did.
#[derive(Debug, Clone)]
pub struct MoveOutcome {
    /// The mover's report.
    pub report: MoveReport,
    /// Where the region's pages are afterwards (`None`: the query failed).
    pub placement: Option<Placement>,
    /// The node every present page is on now, when there is one.
    pub whole_on: Option<NodeId>,
}

/// A move in progress.
#[derive(Debug)]
struct ActiveMove {
    alloc: AllocId,
    owner: SessionId,
    target: NodeId,
    range: ByteRange,
    started: Instant,
    initiator: Initiator,
    cancel: CancelToken,
}

/// Byte ranges of one region and the node each was last moved to, kept
/// sorted, disjoint, and merged where neighbours share a node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RangeMap {
    /// start → (end, node).
    map: BTreeMap<u64, (u64, NodeId)>,
}

impl RangeMap {
    /// Records that `start..end` was moved to `node` (overrides overlaps).
    pub fn insert(&mut self, start: u64, end: u64, node: NodeId) {
        if start >= end {
            return;
        }
        let overlapping: Vec<(u64, u64, NodeId)> = self
            .map
            .range(..end)
            .filter(|(_, (e, _))| *e > start)
            .map(|(s, (e, n))| (*s, *e, *n))
            .collect();
        for (s, e, n) in overlapping {
            self.map.remove(&s);
            if s < start {
                self.map.insert(s, (start, n));
            }
            if e > end {
                self.map.insert(end, (e, n));
            }
        }
        let (mut start, mut end) = (start, end);
        // Merge with a neighbour on the same node, left and right.
        if let Some((&s, &(e, n))) = self.map.range(..start).next_back() {
            if e == start && n == node {
                self.map.remove(&s);
                start = s;
            }
        }
        if let Some(&(e, n)) = self.map.get(&end) {
            if n == node {
                self.map.remove(&end);
                end = e;
            }
        }
        self.map.insert(start, (end, node));
    }

    /// The ranges, ascending: (start, end, node).
    pub fn ranges(&self) -> Vec<(u64, u64, NodeId)> {
        self.map.iter().map(|(s, (e, n))| (*s, *e, *n)).collect()
    }
}

/// Counters of the rebalancing part (monotonic).
#[derive(Debug, Default)]
struct Counters {
    moves_ok: AtomicU64,
    moves_failed: AtomicU64,
    moves_refused: AtomicU64,
    policy_moves: AtomicU64,
    pages_moved: AtomicU64,
    pages_failed: AtomicU64,
    bytes_moved: AtomicU64,
}

/// The policy's view of one client.
#[derive(Debug)]
struct ClientPolicy {
    pid: Option<i32>,
    watcher: Watcher,
    last: Option<Decision>,
    sample: Option<Sample>,
    watched_pids: usize,
    note: Option<String>,
}

/// Rebalancing state shared by the sessions, the move threads and the policy loop.
#[derive(Debug)]
pub struct Rebalancer {
    cfg: RebalanceConfig,
    operators: Vec<u32>,
    active: Mutex<HashMap<RegionId, ActiveMove>>,
    ranges: Mutex<HashMap<RegionId, RangeMap>>,
    clients: Mutex<BTreeMap<SessionId, ClientPolicy>>,
    counters: Counters,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section here is a map update; a panic in one leaves
    // the maps usable.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Rebalancer {
    /// State for a daemon configured with `cfg`.
    pub fn new(cfg: &RebalanceConfig) -> Self {
        Self {
            operators: cfg.effective_operators(),
            cfg: cfg.clone(),
            active: Mutex::new(HashMap::new()),
            ranges: Mutex::new(HashMap::new()),
            clients: Mutex::new(BTreeMap::new()),
            counters: Counters::default(),
        }
    }

    /// The policy settings for `migrate::Watcher`.
    pub fn policy_config(&self) -> PolicyConfig {
        PolicyConfig {
            enabled: self.cfg.policy,
            threshold: f64::from(self.cfg.threshold_pct) / 100.0,
            persist: self.cfg.persist,
            cooldown: self.cfg.cooldown,
            min_vcpus: self.cfg.min_vcpus,
        }
    }

    /// The uids acting as operators.
    pub fn operators(&self) -> &[u32] {
        &self.operators
    }

    /// A session started; `pid` is its peer's (`SO_PEERCRED`).
    pub fn client_started(&self, session: SessionId, pid: Option<i32>) {
        lock(&self.clients).insert(
            session,
            ClientPolicy {
                pid,
                watcher: Watcher::new(self.policy_config()),
                last: None,
                sample: None,
                watched_pids: 0,
                note: None,
            },
        );
    }

    /// A session ended: forget it and cancel moves of its regions (its
    /// allocations were released; see the module docs).
    pub fn client_ended(&self, session: SessionId) {
        lock(&self.clients).remove(&session);
        self.cancel_where(|m| m.owner == session, "its client disconnected");
    }

    /// FREE of `alloc` succeeded: cancel moves of its regions.
    pub fn alloc_released(&self, alloc: AllocId) {
        self.cancel_where(|m| m.alloc == alloc, "its allocation was freed");
    }

    fn cancel_where(&self, pred: impl Fn(&ActiveMove) -> bool, why: &str) {
        for (region, m) in lock(&self.active).iter() {
            if pred(m) && !m.cancel.is_cancelled() {
                info!(
                    region,
                    target = m.target,
                    reason = why,
                    "cancelling a region move"
                );
                m.cancel.cancel();
            }
        }
    }

    /// True while `region` is being moved.
    pub fn is_moving(&self, region: RegionId) -> bool {
        lock(&self.active).contains_key(&region)
    }

    /// The `rebalance` object of STATS: settings, counters, moves in
    /// progress, and the policy's last look at every client.
    pub fn stats_json(&self) -> Value {
        let c = &self.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let active: Vec<Value> = lock(&self.active)
            .iter()
            .map(|(id, m)| {
                json!({
                    "region": id,
                    "alloc_id": m.alloc,
                    "target": m.target,
                    "offset": m.range.offset,
                    "len": m.range.len,
                    "seconds": m.started.elapsed().as_secs_f64(),
                    "by": m.initiator.name(),
                    "cancelled": m.cancel.is_cancelled(),
                })
            })
            .collect();
        let clients: Vec<Value> = if self.cfg.policy {
            lock(&self.clients)
                .iter()
                .map(|(session, p)| {
                    json!({
                        "session": session,
                        "pid": p.pid,
                        "watched_pids": p.watched_pids,
                        "vcpus": p.sample.as_ref().map(|s| node_map(&s.per_node)),
                        "decision": p.last.map(|d| serde_json::to_value(d).unwrap_or(Value::Null)),
                        "note": p.note,
                    })
                })
                .collect()
        } else {
            Vec::new()
        };
        json!({
            "policy": self.cfg.policy,
            "interval_ms": self.cfg.interval_ms,
            "threshold_pct": self.cfg.threshold_pct,
            "persist": self.cfg.persist,
            "cooldown": self.cfg.cooldown,
            "rate_limit_mib_s": self.cfg.rate_limit_mib_s,
            "operator_uids": self.operators,
            "active": active,
            "clients": clients,
            "counters": {
                "moves_ok": g(&c.moves_ok),
                "moves_failed": g(&c.moves_failed),
                "moves_refused": g(&c.moves_refused),
                "policy_moves": g(&c.policy_moves),
                "pages_moved": g(&c.pages_moved),
                "pages_failed": g(&c.pages_failed),
                "bytes_moved": g(&c.bytes_moved),
            },
        })
    }

    fn ranges_of(&self, region: RegionId) -> Vec<(u64, u64, NodeId)> {
        lock(&self.ranges)
            .get(&region)
            .map(RangeMap::ranges)
            .unwrap_or_default()
    }

    /// Drops the range records of regions no longer in use.
    fn forget_except(&self, in_use: &HashSet<RegionId>) {
        lock(&self.ranges).retain(|id, _| in_use.contains(id));
    }
}

/// `{"0": n, "1": m}`: JSON objects need string keys.
fn node_map(per_node: &BTreeMap<NodeId, usize>) -> Value {
    Value::Object(
        per_node
            .iter()
            .map(|(n, c)| (n.to_string(), Value::from(*c)))
            .collect::<Map<_, _>>(),
    )
}

/// Looks the region up and applies the operator model and the checks that
/// need no syscall: ownership, target node, range, not moving already.
fn check(
    shared: &Shared,
    req: MoveRequest,
    who: Initiator,
) -> Result<(InUseRegion, ByteRange), RebalanceError> {
    let Some(region) = shared.pool.in_use(req.region_id) else {
        // A non-operator learns nothing about regions that are not its own:
        // a missing or pooled id reads exactly like another tenant's.
        if let Initiator::Client { uid, .. } = who {
            if !shared.rebalance.operators().contains(&uid) {
                return Err(RebalanceError::NotYours {
                    region: req.region_id,
                    uid,
                });
            }
        }
        return Err(if shared.pool.owned(req.region_id).is_some() {
            RebalanceError::NotInUse(req.region_id)
        } else {
            RebalanceError::Unknown(req.region_id)
        });
    };
    if let Initiator::Client { session, uid } = who {
        let access = authorize(region.session, session, uid, shared.rebalance.operators());
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
    migrate::validate_target(&shared.topology, req.node)?;
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
    shared: &Arc<Shared>,
    req: MoveRequest,
    who: Initiator,
) -> Result<(MoveJob, CancelToken), RebalanceError> {
    let (target, range) = check(shared, req, who)?;
    let cancel = CancelToken::new();
    {
        let mut active = lock(&shared.rebalance.active);
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
    if !shared.pool.mark_split(req.region_id, target.alloc) {
        // Released between the lookup and the claim.
        lock(&shared.rebalance.active).remove(&req.region_id);
        return Err(RebalanceError::NotInUse(req.region_id));
    }
    info!(
        region = req.region_id,
        alloc = target.alloc,
        from = target.node,
        to = req.node,
        range = %range,
        by = who.name(),
        "moving a region"
    );
    let job_shared = Arc::clone(shared);
    let job_cancel = cancel.clone();
    let handle = shared
        .tracker
        .spawn_blocking(move || run_move(&job_shared, &target, range, req.node, who, &job_cancel));
    Ok((handle, cancel))
}

/// The blocking part: move, look where the pages are, record it.
fn run_move(
    shared: &Shared,
    target: &InUseRegion,
    range: ByteRange,
    node: NodeId,
    who: Initiator,
    cancel: &CancelToken,
) -> Result<MoveOutcome, RebalanceError> {
    let opts = MoveOptions {
        rate_limit_bytes_per_s: shared.rebalance.cfg.rate_limit_bytes_per_s(),
        // A request moves what it can and says what did not move; the
        // policy moves a VM only when the target can take all of it.
        allow_partial: who != Initiator::Policy,
        ..MoveOptions::default()
    };
    let span = MoveSpan::of_region(&target.region);
    let result = migrate::move_range(
        &shared.topology,
        &span,
        range,
        node,
        &opts,
        Some(cancel),
        None,
    );
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
    record(shared, target, range, node, moved_any, whole_on);
    let counters = &shared.rebalance.counters;
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
fn whole_node(p: &Placement, target: NodeId, succeeded: bool) -> Option<NodeId> {
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
fn record(
    shared: &Shared,
    target: &InUseRegion,
    range: ByteRange,
    node: NodeId,
    moved_any: bool,
    whole_on: Option<NodeId>,
) {
    let rb = &shared.rebalance;
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
            if shared.pool.set_whole_node(target.id, target.alloc, n) {
                info!(region = target.id, node = n, "region is whole on its node");
            }
        }
        None => {
            if shared.pool.mark_split(target.id, target.alloc) {
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
    shared: &Arc<Shared>,
    req: MoveRequest,
    who: Initiator,
) -> Result<MoveOutcome, RebalanceError> {
    let (mut job, cancel) = match start(shared, req, who) {
        Ok(x) => x,
        Err(e) => {
            shared
                .rebalance
                .counters
                .moves_refused
                .fetch_add(1, Ordering::Relaxed);
            return Err(e);
        }
    };
    let joined = tokio::select! {
        r = &mut job => r,
        () = shared.cancel.cancelled() => {
            cancel.cancel();
            job.await
        }
    };
    joined.map_err(|e| {
        // The move panicked: drop the claim so the region is not stuck.
        lock(&shared.rebalance.active).remove(&req.region_id);
        RebalanceError::Join(e.to_string())
    })?
}

/// Serves REBALANCE for a session: the reply to send.
pub async fn serve(shared: &Arc<Shared>, session: SessionId, uid: u32, req: MoveRequest) -> Reply {
    match rebalance(shared, req, Initiator::Client { session, uid }).await {
        Ok(out) => {
            let r = &out.report;
            info!(
                session,
                region = req.region_id,
                node = req.node,
                moved = r.pages_moved,
                failed = r.pages_failed(),
                seconds = r.seconds,
                whole_on = ?out.whole_on,
                "REBALANCE done"
            );
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
            info!(session, region = req.region_id, status = ?e.status(), reason = %msg, "REBALANCE refused or failed");
            Reply::error(e.status(), msg)
        }
    }
}

/// Adds placement to the in-use entries of the STATS `regions` list:
/// `alloc_id`, `session`, `size`, `bound_node` (the node recorded for the
/// region), `placement` (pages per node), `not_present`, `unlocated`,
/// `split`, `moving` and `rebalanced` (ranges asked for, while split). The
/// queries run on a blocking thread (one address per page).
pub async fn add_placement(shared: &Arc<Shared>, stats: &mut Value) {
    let regions = shared.pool.in_use_regions();
    let ids: HashSet<RegionId> = regions.iter().map(|r| r.id).collect();
    shared.rebalance.forget_except(&ids);
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
    let Some(list) = stats.get_mut("regions").and_then(Value::as_array_mut) else {
        return;
    };
    for entry in list.iter_mut() {
        let Some(id) = entry.get("id").and_then(Value::as_u64) else {
            continue;
        };
        let Some((r, p)) = placed.iter().find(|(r, _)| r.id == id) else {
            continue;
        };
        let Some(obj) = entry.as_object_mut() else {
            continue;
        };
        obj.insert("alloc_id".into(), r.alloc.into());
        obj.insert("session".into(), r.session.into());
        obj.insert("size".into(), r.region.len().into());
        obj.insert("bound_node".into(), r.region.node().into());
        obj.insert("split".into(), r.split.into());
        obj.insert("moving".into(), shared.rebalance.is_moving(id).into());
        match p {
            Ok(p) => {
                obj.insert("placement".into(), node_map(&p.per_node));
                obj.insert("not_present".into(), p.not_present.into());
                obj.insert("unlocated".into(), p.unlocated.into());
            }
            Err(e) => {
                obj.insert("placement".into(), Value::Null);
                obj.insert("placement_error".into(), e.clone().into());
            }
        }
        let ranges: Vec<Value> = shared
            .rebalance
            .ranges_of(id)
            .into_iter()
            .map(|(s, e, n)| json!({"offset": s, "len": e - s, "node": n}))
            .collect();
        obj.insert("rebalanced".into(), ranges.into());
    }
}

// ---------------------------------------------------------------------------
// The policy loop.

/// What the policy makes of one client in one sample.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Not judged; why.
    Skip(&'static str),
    /// The watcher's decision.
    Decided(Decision),
}

/// A client's regions as the policy sees them: pool node, split, moving.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionView {
    /// The node the region is on (pool key).
    pub node: NodeId,
    /// Pages on several nodes.
    pub split: bool,
    /// A move is running.
    pub moving: bool,
}

/// One policy step for a client: where its memory is, then the watcher.
pub fn policy_step(watcher: &mut Watcher, sample: &Sample, regions: &[RegionView]) -> Step {
    let Some(first) = regions.first() else {
        return Step::Skip("no memory");
    };
    if regions.iter().any(|r| r.moving) {
        return Step::Skip("a move is in progress");
    }
    if regions.iter().any(|r| r.split) {
        return Step::Skip("a region is split across nodes");
    }
    if regions.iter().any(|r| r.node != first.node) {
        return Step::Skip("regions on several nodes (a guest NUMA layout)");
    }
    Step::Decided(watcher.observe(sample, first.node))
}

/// Parent pid of every process (`/proc/*/stat` field 4).
fn parent_map(proc_root: &Path) -> HashMap<i32, Vec<i32>> {
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    let Ok(dir) = std::fs::read_dir(proc_root) else {
        return children;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(text) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        if let Some(ppid) = parse_ppid(&text) {
            children.entry(ppid).or_default().push(pid);
        }
    }
    children
}

/// Field 4 of a `stat` line (after the name, which may hold `)`).
fn parse_ppid(stat: &str) -> Option<i32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// `pid` and its descendants, at most `limit` processes.
fn with_descendants(pid: i32, children: &HashMap<i32, Vec<i32>>, limit: usize) -> Vec<i32> {
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() && out.len() < limit {
        if let Some(kids) = children.get(&out[i]) {
            for &k in kids {
                if out.len() < limit && !out.contains(&k) {
                    out.push(k);
                }
            }
        }
        i += 1;
    }
    out
}

/// One client's summed sample and how many of its processes were read, or
/// why the client itself could not be read.
type ClientSample = Result<(Sample, usize), String>;

/// Samples the vCPU threads of every client and its descendants.
///
/// A vCPU thread that has not run yet still carries its spawner's name
/// (VMMs name their threads from inside them) and so is not counted in
/// this sample; it is in the next one, exactly as if it had started a
/// moment later (and the policy acts only on `persist` consecutive samples
/// that agree). Its last CPU is never missing: the kernel sets a task's CPU
/// when it forks and wakes it, before it first runs.
fn sample_clients(
    proc_root: &Path,
    cpus: &CpuNodes,
    clients: &[(SessionId, i32)],
) -> Vec<(SessionId, ClientSample)> {
    let children = parent_map(proc_root);
    let filter = VcpuFilter::KnownNames;
    clients
        .iter()
        .map(|&(session, pid)| {
            let pids = with_descendants(pid, &children, 256);
            let mut total = Sample::default();
            let mut watched = 0;
            for (i, p) in pids.iter().enumerate() {
                match migrate::sample(proc_root, *p, &filter, cpus) {
                    Ok(s) => {
                        watched += 1;
                        for (n, c) in s.per_node {
                            *total.per_node.entry(n).or_insert(0) += c;
                        }
                        total.unknown += s.unknown;
                    }
                    // The client itself must be readable; a descendant may
                    // have exited since the scan.
                    Err(e) if i == 0 => {
                        return (session, Err(crate::diag::chain(&e)));
                    }
                    Err(_) => {}
                }
            }
            (session, Ok((total, watched)))
        })
        .collect()
}

/// The policy loop (see the module docs); returns at once when the policy
/// is off, and at shutdown.
pub async fn policy_loop(shared: Arc<Shared>) {
    if !shared.rebalance.cfg.policy {
        return;
    }
    let period = Duration::from_millis(shared.rebalance.cfg.interval_ms);
    let cpus = Arc::new(CpuNodes::new(&shared.topology));
    info!(
        interval_ms = shared.rebalance.cfg.interval_ms,
        threshold_pct = shared.rebalance.cfg.threshold_pct,
        persist = shared.rebalance.cfg.persist,
        cooldown = shared.rebalance.cfg.cooldown,
        "vCPU-affinity policy on"
    );
    loop {
        tokio::select! {
            () = shared.cancel.cancelled() => break,
            () = tokio::time::sleep(period) => {}
        }
        policy_tick(&shared, &cpus).await;
    }
}

async fn policy_tick(shared: &Arc<Shared>, cpus: &Arc<CpuNodes>) {
    let regions = shared.pool.in_use_regions();
    let mut by_session: BTreeMap<SessionId, Vec<InUseRegion>> = BTreeMap::new();
    for r in regions {
        by_session.entry(r.session).or_default().push(r);
    }
    let clients: Vec<(SessionId, i32)> = lock(&shared.rebalance.clients)
        .iter()
        .filter(|(s, _)| by_session.contains_key(s))
        .filter_map(|(s, p)| p.pid.map(|pid| (*s, pid)))
        .collect();
    if clients.is_empty() {
        return;
    }
    let job_cpus = Arc::clone(cpus);
    let samples = match tokio::task::spawn_blocking(move || {
        sample_clients(Path::new("/proc"), &job_cpus, &clients)
    })
    .await
    {
        Ok(s) => s,
        Err(e) => {
            warn!(error = %e, "policy sampling failed");
            return;
        }
    };
    let mut moves: Vec<(SessionId, NodeId)> = Vec::new();
    {
        let mut policies = lock(&shared.rebalance.clients);
        for (session, result) in samples {
            let Some(p) = policies.get_mut(&session) else {
                continue;
            };
            let Some(regions) = by_session.get(&session) else {
                continue;
            };
            match result {
                Err(e) => {
                    debug!(session, error = %e, "cannot sample a client's threads");
                    p.note = Some(e);
                }
                Ok((sample, watched)) => {
                    let views: Vec<RegionView> = regions
                        .iter()
                        .map(|r| RegionView {
                            node: r.node,
                            split: r.split,
                            moving: shared.rebalance.is_moving(r.id),
                        })
                        .collect();
                    p.watched_pids = watched;
                    match policy_step(&mut p.watcher, &sample, &views) {
                        Step::Skip(why) => p.note = Some(why.to_string()),
                        Step::Decided(d) => {
                            p.note = None;
                            debug!(session, decision = ?d, sample = ?sample, "policy sample");
                            if let Decision::Move { from, to, share } = d {
                                info!(
                                    session,
                                    from,
                                    to,
                                    share,
                                    "vCPUs run on another node; moving the client's memory"
                                );
                                moves.push((session, to));
                            }
                            p.last = Some(d);
                        }
                    }
                    p.sample = Some(sample);
                }
            }
        }
    }
    for (session, to) in moves {
        shared
            .rebalance
            .counters
            .policy_moves
            .fetch_add(1, Ordering::Relaxed);
        for r in by_session.get(&session).into_iter().flatten() {
            let req = MoveRequest {
                region_id: r.id,
                offset: 0,
                len: 0,
                node: to,
            };
            let shared = Arc::clone(shared);
            shared.tracker.clone().spawn(async move {
                match rebalance(&shared, req, Initiator::Policy).await {
                    Ok(out) => info!(region = req.region_id, to, report = %out.report, "policy move done"),
                    Err(e) => warn!(region = req.region_id, to, error = %crate::diag::chain(&e), "policy move failed"),
                }
            });
        }
    }
}

// ---------------------------------------------------------------------------
// `hugemem rebalance` (client side).

/// Errors of `hugemem rebalance`.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Talking to the daemon failed, or it refused.
    #[error(transparent)]
    Client(#[from] crate::client::ClientError),
    /// `--range` does not parse.
    #[error("invalid --range")]
    Range(#[source] PlanError),
    /// `--range` is empty.
    #[error("--range {0:?} is empty")]
    EmptyRange(String),
}

/// Parses `--range` into the request's (offset, len); an open end (`A..`,
/// `..`) is len 0, "to the end", so the region's size need not be known.
///
/// # Errors
///
/// [`CliError::Range`] for bad syntax, [`CliError::EmptyRange`] for `A..A`.
pub fn parse_cli_range(text: &str) -> Result<(u64, u64), CliError> {
    let r = ByteRange::parse(text, u64::MAX).map_err(CliError::Range)?;
    if text.trim().ends_with("..") {
        return Ok((r.offset, 0));
    }
    if r.len == 0 {
        return Err(CliError::EmptyRange(text.to_string()));
    }
    Ok((r.offset, r.len))
}

/// What `hugemem rebalance` did.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CliReport {
    /// The region.
    pub region: RegionId,
    /// The target node.
    pub node: NodeId,
    /// Pages moved.
    pub pages_moved: u64,
    /// Pages that did not move.
    pub pages_failed: u64,
    /// Pages per node afterwards (from STATS), when the daemon listed the region.
    pub placement: Option<Value>,
}

impl std::fmt::Display for CliReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "region {} -> node {}: {} pages moved, {} failed",
            self.region, self.node, self.pages_moved, self.pages_failed
        )?;
        if let Some(p) = self.placement.as_ref().and_then(Value::as_object) {
            let parts: Vec<String> = p
                .iter()
                .map(|(n, c)| format!("node {n}: {}", c.as_u64().unwrap_or(0)))
                .collect();
            write!(f, "; placement now {}", parts.join(", "))?;
        }
        Ok(())
    }
}

/// `hugemem rebalance --region R --to-node N [--range A..B]`: sends
/// REBALANCE on a new connection (the operator model applies: see the
/// module docs) and reads the region's placement back from STATS.
///
/// # Errors
///
/// [`CliError`]; a refusal carries the daemon's status and reason.
pub fn run_cli(
    socket: &Path,
    region: RegionId,
    node: NodeId,
    range: Option<&str>,
) -> Result<CliReport, CliError> {
    let (offset, len) = match range {
        Some(r) => parse_cli_range(r)?,
        None => (0, 0),
    };
    let mut client = crate::client::Client::connect(socket)?;
    let (pages_moved, pages_failed) = client.rebalance(region, offset, len, node)?;
    let placement = client.stats().ok().and_then(|s| {
        s.get("regions")?
            .as_array()?
            .iter()
            .find(|r| r.get("id").and_then(Value::as_u64) == Some(region))?
            .get("placement")
            .cloned()
    });
    Ok(CliReport {
        region,
        node,
        pages_moved,
        pages_failed,
        placement,
    })
}

// ---------------------------------------------------------------------------

/// A check to run inside a multi-node guest (the QEMU-TCG harness).
pub mod testing {
    use std::time::Instant;

    use guest_mem::vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};
    use guest_mem::PageSize;
    use numa::{PageLocation, Topology};
    use serde_json::Value;

    use std::path::PathBuf;

    use crate::client::Client;
    use crate::daemon::{Config, Daemon};
    use crate::proto::{AllocPart, AllocRequest, ClearMode, PagePolicy};

    const PAGE: u64 = 2 << 20;
    const PAGES: u64 = 8;

    /// A private directory for the socket, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new() -> Result<Self, String> {
            use std::os::unix::fs::DirBuilderExt;
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos());
            let path = std::env::temp_dir().join(format!(
                "hugemem-rebalance-check-{}-{nanos}",
                std::process::id()
            ));
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&path)
                .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
            Ok(Self(path))
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// `PAGES` free 2 MiB pages on `node`: the pool as it is (the guest has
    /// them from its kernel command line), else grown through
    /// `guest_mem::ensure_free` (sysfs, no helper program).
    fn reserve_2m(node: u32) -> Result<(), String> {
        let free = guest_mem::PoolCounts::read(PageSize::Huge2M, Some(node))
            .map_err(|e| chain(&e))?
            .map_or(0, |p| p.free);
        if free >= PAGES {
            return Ok(());
        }
        let r = guest_mem::ensure_free(PageSize::Huge2M, PAGES, Some(node)).map_err(|e| {
            format!(
                "node {node} has {free} free 2M pages, {PAGES} needed: {}",
                chain(&e)
            )
        })?;
        if r.met {
            Ok(())
        } else {
            Err(format!(
                "node {node}: only {} free 2M pages, {PAGES} needed",
                r.free
            ))
        }
    }

    fn pattern(seed: u64, i: u64) -> u64 {
        (i ^ seed).wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }

    use crate::diag::chain;

    /// Starts a daemon on a temporary socket, ALLOCs 16 MiB of 2 MiB pages
    /// on the first node with memory through a client, writes a pattern
    /// through the client's own mapping (as a VMM's guest would), sends
    /// REBALANCE of the whole region to the second node, and checks with
    /// `move_pages` on the *client's* mapping that every page is there, that
    /// the pattern is intact, and that STATS reports the placement and the
    /// new node. Then moves the first half back (a range) and checks that
    /// STATS shows the region split 4/4. Returns one report line.
    ///
    /// Run inside a multi-node guest as root (`MOVE_ALL` needs
    /// `CAP_SYS_NICE`; the pools are grown through `numa::hugepages`).
    ///
    /// # Errors
    ///
    /// Which step failed and why, or that the machine has fewer than two
    /// nodes with memory.
    pub fn check_rebalance_through_daemon() -> Result<String, String> {
        let topology = Topology::detect().map_err(|e| chain(&e))?;
        let nodes = migrate::memory_nodes(&topology);
        match nodes[..] {
            [a, b, ..] => check_between(a, b),
            _ => Err(format!(
                "needs two NUMA nodes with memory; this machine has {nodes:?}"
            )),
        }
    }

    /// The steps of [`check_rebalance_through_daemon`] from node `a` to node
    /// `b`; with `a == b` (a one-node host) every step runs and nothing is
    /// copied.
    pub(crate) fn check_between(a: u32, b: u32) -> Result<String, String> {
        for node in [a, b] {
            reserve_2m(node)?;
        }
        // Pages the moves must copy: none when the nodes are the same.
        let (want_moved, want_back) = if a == b { (0, 0) } else { (PAGES, PAGES / 2) };
        let dir = TempDir::new()?;
        let mut cfg = Config {
            socket: dir.0.join("hugemem.sock"),
            ..Config::default()
        };
        cfg.pool.recheck_ms = 50;
        let daemon = Daemon::start(cfg).map_err(|e| format!("daemon: {}", chain(&e)))?;
        let mut client = Client::connect(daemon.socket_path()).map_err(|e| chain(&e))?;
        if client.features() & crate::proto::FEATURE_REBALANCE == 0 {
            return Err("the daemon does not advertise FEATURE_REBALANCE".into());
        }
        let size = PAGES * PAGE;
        let alloc = client
            .alloc(AllocRequest {
                total_size: size,
                page_policy: PagePolicy::Huge2M,
                clear_mode: ClearMode::Eager,
                lock: false,
                parts: vec![AllocPart { node: a, size }],
                want_paths: false,
            })
            .map_err(|e| format!("ALLOC: {}", chain(&e)))?;
        let region_id = alloc
            .regions
            .first()
            .map(|r| r.region_id)
            .ok_or("ALLOC returned no region")?;
        let mem = alloc
            .guest_memory()
            .map_err(|e| format!("mapping the allocation: {}", chain(&e)))?;
        let seed = 0x7265_6261_6c61_6e63;
        for i in 0..size / 8 {
            mem.write_obj(pattern(seed, i), GuestAddress(i * 8))
                .map_err(|e| format!("write at {:#x}: {e}", i * 8))?;
        }
        let addrs: Vec<usize> = (0..PAGES)
            .map(|p| {
                mem.get_host_address(GuestAddress(p * PAGE))
                    .map(|h| h as usize)
                    .map_err(|e| format!("host address of page {p}: {e}"))
            })
            .collect::<Result<_, _>>()?;
        let where_ = |what: &str| -> Result<Vec<PageLocation>, String> {
            numa::move_pages_query(None, &addrs).map_err(|e| format!("{what}: {}", chain(&e)))
        };
        let count_on = |locs: &[PageLocation], n: u32| {
            locs.iter()
                .filter(|l| matches!(l, PageLocation::Node(x) if *x == n))
                .count()
        };
        let before = where_("placement before")?;
        if count_on(&before, a) != before.len() {
            return Err(format!(
                "before the move, pages are at {before:?}, not all on node {a}"
            ));
        }
        let start = Instant::now();
        let (moved, failed) = client
            .rebalance(region_id, 0, 0, b)
            .map_err(|e| format!("REBALANCE to node {b}: {}", chain(&e)))?;
        let secs = start.elapsed().as_secs_f64();
        let after = where_("placement after")?;
        if failed != 0 || moved != want_moved || count_on(&after, b) != after.len() {
            return Err(format!(
                "REBALANCE to node {b}: {moved} moved, {failed} failed; client sees {after:?}"
            ));
        }
        for i in 0..size / 8 {
            let v: u64 = mem
                .read_obj(GuestAddress(i * 8))
                .map_err(|e| format!("read at {:#x}: {e}", i * 8))?;
            if v != pattern(seed, i) {
                return Err(format!("pattern differs at {:#x} after the move", i * 8));
            }
        }
        let stats = client.stats().map_err(|e| chain(&e))?;
        let entry = |stats: &Value| -> Option<Value> {
            stats["regions"]
                .as_array()?
                .iter()
                .find(|r| r["id"].as_u64() == Some(region_id))
                .cloned()
        };
        let e = entry(&stats).ok_or("STATS does not list the region")?;
        if e["placement"][b.to_string()].as_u64() != Some(PAGES)
            || e["bound_node"].as_u64() != Some(u64::from(b))
            || e["node"].as_u64() != Some(u64::from(b))
        {
            return Err(format!("STATS after the move: {e}"));
        }
        // Half back: the region is split.
        let half = PAGES / 2 * PAGE;
        let (back, back_failed) = client
            .rebalance(region_id, 0, half, a)
            .map_err(|e| format!("REBALANCE of 0..{half:#x} to node {a}: {}", chain(&e)))?;
        let split = where_("placement after the range move")?;
        let stats = client.stats().map_err(|e| chain(&e))?;
        let e = entry(&stats).ok_or("STATS does not list the region")?;
        let want_on_a = if a == b { split.len() } else { split.len() / 2 };
        if back != want_back
            || back_failed != 0
            || count_on(&split, a) != want_on_a
            || e["split"].as_bool() != Some(a != b)
        {
            return Err(format!(
                "range move back: {back} moved, {back_failed} failed; client sees {split:?}; STATS {e}"
            ));
        }
        client
            .free(alloc.id)
            .map_err(|e| format!("FREE: {}", chain(&e)))?;
        drop(mem);
        daemon
            .shutdown()
            .map_err(|e| format!("shutdown: {}", chain(&e)))?;
        Ok(format!(
            "REBALANCE through the daemon: {PAGES} 2M pages node {a} -> {b}: {moved} moved, 0 failed in {:.3} s, every page on node {b} through the client's mapping, pattern intact; range 0..{half:#x} back to node {a}: {back} moved, region split {}/{}",
            secs,
            count_on(&split, a),
            count_on(&split, b),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operator_model() {
        let ops = [0, 1000];
        assert_eq!(authorize(3, 3, 4242, &ops), Access::Owner);
        assert_eq!(authorize(3, 4, 0, &ops), Access::Operator);
        assert_eq!(authorize(3, 4, 1000, &ops), Access::Operator);
        assert_eq!(authorize(3, 4, 4242, &ops), Access::Denied);
        // An owner is an owner whatever its uid.
        assert_eq!(authorize(3, 3, 0, &[]), Access::Owner);
        assert_eq!(authorize(3, 4, 0, &[]), Access::Denied);
    }

    #[test]
    fn default_operators_are_root_and_the_daemon() {
        let ops = RebalanceConfig::default().effective_operators();
        assert!(ops.contains(&0));
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        assert!(ops.contains(&me));
        let c = RebalanceConfig {
            operator_uids: vec![7],
            ..RebalanceConfig::default()
        };
        assert_eq!(
            c.effective_operators(),
            vec![0, 7],
            "root is always an operator"
        );
        assert_eq!(c.rate_limit_bytes_per_s(), None);
        let c = RebalanceConfig {
            rate_limit_mib_s: 100,
            ..RebalanceConfig::default()
        };
        assert_eq!(c.rate_limit_bytes_per_s(), Some(100 << 20));
    }

    #[test]
    fn errors_map_to_statuses() {
        assert_eq!(RebalanceError::Unknown(1).status(), Status::NotFound);
        assert_eq!(RebalanceError::NotInUse(1).status(), Status::NotFound);
        assert_eq!(
            RebalanceError::NotYours { region: 1, uid: 5 }.status(),
            Status::NotFound
        );
        let bad = RebalanceError::Plan(PlanError::UnknownNode {
            node: 1,
            available: vec![0],
        });
        assert_eq!(bad.status(), Status::BadNode);
        assert_eq!(
            bad.to_string(),
            "NUMA node 1 does not exist (this host has nodes [0])"
        );
        assert_eq!(
            RebalanceError::Plan(PlanError::ZeroLength).status(),
            Status::Invalid
        );
        assert_eq!(
            RebalanceError::Busy {
                region: 1,
                target: 0,
                seconds: 0.0
            }
            .status(),
            Status::Invalid
        );
    }

    #[test]
    fn range_map_overrides_and_merges() {
        let mut m = RangeMap::default();
        m.insert(0, 100, 1);
        m.insert(100, 200, 1);
        assert_eq!(m.ranges(), vec![(0, 200, 1)]);
        m.insert(50, 150, 0);
        assert_eq!(m.ranges(), vec![(0, 50, 1), (50, 150, 0), (150, 200, 1)]);
        m.insert(150, 200, 0);
        assert_eq!(m.ranges(), vec![(0, 50, 1), (50, 200, 0)]);
        m.insert(0, 300, 2);
        assert_eq!(m.ranges(), vec![(0, 300, 2)]);
        m.insert(10, 10, 1);
        assert_eq!(m.ranges(), vec![(0, 300, 2)]);
        m.insert(100, 120, 1);
        assert_eq!(m.ranges(), vec![(0, 100, 2), (100, 120, 1), (120, 300, 2)]);
    }

    #[test]
    fn whole_node_needs_one_node() {
        let p = |per: &[(NodeId, usize)], unlocated| Placement {
            page_size: 2 << 20,
            pages: 8,
            per_node: per.iter().copied().collect(),
            not_present: 0,
            unlocated,
        };
        assert_eq!(whole_node(&p(&[(1, 8)], 0), 1, true), Some(1));
        assert_eq!(whole_node(&p(&[(0, 8)], 0), 1, false), Some(0));
        assert_eq!(whole_node(&p(&[(0, 4), (1, 4)], 0), 1, true), None);
        assert_eq!(whole_node(&p(&[(1, 7)], 1), 1, true), None);
        assert_eq!(whole_node(&p(&[], 0), 1, true), Some(1));
        assert_eq!(whole_node(&p(&[], 0), 1, false), None);
    }

    #[test]
    fn cli_ranges() {
        assert_eq!(parse_cli_range("1G..3G").expect("ok"), (1 << 30, 2 << 30));
        assert_eq!(parse_cli_range("2M..").expect("ok"), (2 << 20, 0));
        assert_eq!(parse_cli_range("..").expect("ok"), (0, 0));
        assert_eq!(parse_cli_range("..4M").expect("ok"), (0, 4 << 20));
        assert!(matches!(
            parse_cli_range("2M..2M"),
            Err(CliError::EmptyRange(_))
        ));
        assert!(matches!(parse_cli_range("3G..1G"), Err(CliError::Range(_))));
        assert!(matches!(parse_cli_range("lots"), Err(CliError::Range(_))));
    }

    #[test]
    fn ppid_parses_past_awkward_names() {
        assert_eq!(parse_ppid("42 (a) b (c) S 7 42 42 0"), Some(7));
        assert_eq!(parse_ppid("1 (init) S 0 1 1"), Some(0));
        assert_eq!(parse_ppid("garbage"), None);
    }

    #[test]
    fn descendants_are_followed_with_a_limit() {
        let mut kids: HashMap<i32, Vec<i32>> = HashMap::new();
        kids.insert(10, vec![11, 12]);
        kids.insert(11, vec![13]);
        kids.insert(99, vec![100]);
        assert_eq!(with_descendants(10, &kids, 64), vec![10, 11, 12, 13]);
        assert_eq!(with_descendants(10, &kids, 2), vec![10, 11]);
        assert_eq!(with_descendants(5, &kids, 64), vec![5]);
    }

    #[test]
    fn policy_step_moves_after_persisting_and_skips_what_it_must() {
        let cfg = PolicyConfig {
            enabled: true,
            threshold: 0.75,
            persist: 3,
            cooldown: 2,
            min_vcpus: 1,
        };
        let mut w = Watcher::new(cfg);
        let on1 = Sample::from_counts(&[(0, 0), (1, 4)]);
        let view = |node, split, moving| RegionView {
            node,
            split,
            moving,
        };
        let one = [view(0, false, false)];
        assert!(matches!(
            policy_step(&mut w, &on1, &one),
            Step::Decided(Decision::Pending {
                to: 1,
                streak: 1,
                ..
            })
        ));
        assert!(matches!(
            policy_step(&mut w, &on1, &one),
            Step::Decided(Decision::Pending { streak: 2, .. })
        ));
        assert!(matches!(
            policy_step(&mut w, &on1, &one),
            Step::Decided(Decision::Move { from: 0, to: 1, .. })
        ));
        assert!(matches!(
            policy_step(&mut w, &on1, &one),
            Step::Decided(Decision::CoolingDown { .. })
        ));
        let mut w = Watcher::new(cfg);
        assert_eq!(policy_step(&mut w, &on1, &[]), Step::Skip("no memory"));
        assert!(matches!(
            policy_step(
                &mut w,
                &on1,
                &[view(0, false, false), view(1, false, false)]
            ),
            Step::Skip(_)
        ));
        assert!(matches!(
            policy_step(&mut w, &on1, &[view(0, true, false)]),
            Step::Skip(_)
        ));
        assert!(matches!(
            policy_step(&mut w, &on1, &[view(0, false, true)]),
            Step::Skip(_)
        ));
        let local = Sample::from_counts(&[(0, 4)]);
        assert!(matches!(
            policy_step(&mut w, &local, &one),
            Step::Decided(Decision::Local { .. })
        ));
    }

    #[test]
    fn samples_this_process_and_its_children() {
        // A thread named like a cloud-hypervisor vCPU, in this process.
        // std names a thread from inside it, when it first runs: until then
        // /proc shows the spawner's name and the sampler rightly skips it
        // (issue 10: `Sample { per_node: {}, unknown: 0 }`). So sample only
        // once the thread itself says it runs, which is after its name is
        // set; it then stays alive, blocked on `rx`, until we have sampled.
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::Builder::new()
            .name("vcpu0".into())
            .spawn(move || {
                let _ = ready_tx.send(());
                let _ = rx.recv();
            })
            .expect("thread");
        ready_rx.recv().expect("vcpu0 thread runs");
        let topology = numa::Topology::detect().expect("topology");
        let cpus = CpuNodes::new(&topology);
        let pid = i32::try_from(std::process::id()).expect("pid");
        let out = sample_clients(Path::new("/proc"), &cpus, &[(1, pid)]);
        drop(tx);
        t.join().expect("join");
        let (sample, watched) = out[0].1.clone().expect("sampled");
        assert!(watched >= 1);
        // At least our `vcpu0` thread: other lib tests in this process may run
        // vCPU-named threads at the same moment, so an exact count would be flaky.
        assert!(sample.vcpus() + sample.unknown >= 1, "{sample:?}");
        let gone = sample_clients(Path::new("/proc"), &cpus, &[(2, i32::MAX)]);
        assert!(gone[0].1.is_err());
    }

    /// A daemon on a temporary socket, and a 4 KiB region (no huge pages
    /// needed) allocated by a client on node 0.
    fn daemon_with_region(
        dir: &Path,
    ) -> (
        super::super::DaemonHandle,
        crate::client::Client,
        crate::client::Allocation,
    ) {
        use crate::proto::{AllocPart, AllocRequest, ClearMode, PagePolicy};
        let mut cfg = super::super::Config {
            socket: dir.join("s.sock"),
            ..super::super::Config::default()
        };
        cfg.pool.recheck_ms = 20;
        let handle = super::super::Daemon::start(cfg).expect("daemon");
        let mut client = crate::client::Client::connect(handle.socket_path()).expect("connect");
        let size = 8 << 20;
        let alloc = client
            .alloc(AllocRequest {
                total_size: size,
                page_policy: PagePolicy::Base4K,
                clear_mode: ClearMode::Eager,
                lock: false,
                parts: vec![AllocPart { node: 0, size }],
                want_paths: false,
            })
            .expect("alloc");
        (handle, client, alloc)
    }

    /// What `start` does before the move thread runs: claim and mark split.
    fn pretend_moving(shared: &Shared, id: RegionId) -> (InUseRegion, CancelToken) {
        let r = shared.pool.in_use(id).expect("in use");
        let cancel = CancelToken::new();
        lock(&shared.rebalance.active).insert(
            id,
            ActiveMove {
                alloc: r.alloc,
                owner: r.session,
                target: 0,
                range: ByteRange::whole(r.region.len()),
                started: Instant::now(),
                initiator: Initiator::Policy,
                cancel: cancel.clone(),
            },
        );
        assert!(shared.pool.mark_split(id, r.alloc));
        (r, cancel)
    }

    #[test]
    fn a_4k_region_rebalances_in_place() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (handle, mut client, alloc) = daemon_with_region(dir.path());
        let id = alloc.regions[0].region_id;
        assert_eq!(client.rebalance(id, 0, 0, 0).expect("move"), (0, 0));
        assert_eq!(
            client.rebalance(id, 4096, 8192, 0).expect("4 KiB range"),
            (0, 0)
        );
        let stats = client.stats().expect("stats");
        let e = stats["regions"]
            .as_array()
            .and_then(|a| a.iter().find(|r| r["id"] == id))
            .cloned()
            .expect("listed");
        assert_eq!(e["placement"]["0"], 2048, "{e}");
        assert_eq!(e["split"], false, "{e}");
        client.free(alloc.id).expect("free");
        handle.shutdown().expect("shutdown");
    }

    #[test]
    fn free_or_disconnect_during_a_move_cancels_it_and_the_region_is_not_pooled() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (handle, mut client, alloc) = daemon_with_region(dir.path());
        let shared = Arc::clone(&handle.shared);
        let id = alloc.regions[0].region_id;
        let (r, cancel) = pretend_moving(&shared, id);

        // A second move of the same region is refused while one runs.
        match client.rebalance(id, 0, 0, 0) {
            Err(crate::client::ClientError::Refused { status, message }) => {
                assert_eq!(status, Status::Invalid);
                assert!(message.contains("is being moved already"), "{message}");
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        let stats = client.stats().expect("stats");
        assert_eq!(stats["rebalance"]["active"][0]["region"], id, "{stats}");
        let released = shared.metrics.bytes_released.load(Ordering::Relaxed);

        // FREE is accepted at once and cancels the move; the region goes
        // back to the kernel instead of quarantine and the pool.
        client.free(alloc.id).expect("FREE during a move");
        assert!(cancel.is_cancelled());
        assert!(shared.pool.owned(id).is_none(), "a split region was pooled");
        assert_eq!(
            shared.metrics.bytes_released.load(Ordering::Relaxed),
            released + r.region.len()
        );
        // The move thread's bookkeeping afterwards changes nothing in the pool.
        record(
            &shared,
            &r,
            ByteRange::whole(r.region.len()),
            0,
            true,
            Some(0),
        );
        assert!(shared.pool.owned(id).is_none());
        assert!(!shared.rebalance.is_moving(id));
        drop(alloc);

        // Disconnect does the same.
        let mut second = crate::client::Client::connect(handle.socket_path()).expect("connect");
        let size = 4 << 20;
        let a2 = second
            .alloc(crate::proto::AllocRequest {
                total_size: size,
                page_policy: crate::proto::PagePolicy::Base4K,
                clear_mode: crate::proto::ClearMode::Eager,
                lock: false,
                parts: vec![crate::proto::AllocPart { node: 0, size }],
                want_paths: false,
            })
            .expect("alloc");
        let id2 = a2.regions[0].region_id;
        let (_, cancel2) = pretend_moving(&shared, id2);
        drop(a2);
        drop(second);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !(cancel2.is_cancelled() && shared.pool.owned(id2).is_none()) {
            assert!(
                Instant::now() < deadline,
                "disconnect did not cancel the move"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        drop(client);
        handle.shutdown().expect("shutdown");
    }

    #[test]
    fn the_guest_check_runs_here_without_copying() {
        let topology = numa::Topology::detect().expect("topology");
        let Some(&node) = migrate::memory_nodes(&topology).first() else {
            return;
        };
        match testing::check_between(node, node) {
            Ok(line) => {
                assert!(line.contains("8 2M pages"), "{line}");
                assert!(line.contains(": 0 moved, 0 failed"), "{line}");
            }
            Err(e) if e.contains("free 2M pages") => test_support::skip!("{e}"),
            Err(e) => panic!("{e}"),
        }
    }
}
