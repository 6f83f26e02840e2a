//! The rebalancer's state: moves in flight, moved ranges, the policy's
//! per-client watchers and the counters, with the pool, the topology and
//! the lifecycle it works on (see [`crate::daemon::requests::rebalance`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use clearing::CancelToken;
use hugemem_client::stats::{
    ActiveMove as ActiveMoveStats, RebalanceClient, RebalanceCounters, RebalanceStats,
};
use migrate::{
    ByteRange, Decision, MigrateError, MoveReport, Placement, PlanError, PolicyConfig, Sample,
    Watcher,
};
use numa::{NodeId, Topology};
use tracing::info;

use crate::daemon::config::RebalanceConfig;
use crate::daemon::lifecycle::Lifecycle;
use crate::daemon::pool::{AllocId, Pool, RegionId, SessionId};
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
    pub(super) fn name(self) -> &'static str {
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
pub(super) struct ActiveMove {
    pub(super) alloc: AllocId,
    pub(super) owner: SessionId,
    pub(super) target: NodeId,
    pub(super) range: ByteRange,
    pub(super) started: Instant,
    pub(super) initiator: Initiator,
    pub(super) cancel: CancelToken,
}

/// Byte ranges of one region and the node each was last moved to, kept
/// sorted, disjoint, and merged where neighbours share a node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RangeMap {
    /// start → (end, node).
    pub(super) map: BTreeMap<u64, (u64, NodeId)>,
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
pub(super) struct Counters {
    pub(super) moves_ok: AtomicU64,
    pub(super) moves_failed: AtomicU64,
    pub(super) moves_refused: AtomicU64,
    pub(super) policy_moves: AtomicU64,
    pub(super) pages_moved: AtomicU64,
    pub(super) pages_failed: AtomicU64,
    pub(super) bytes_moved: AtomicU64,
}

/// The policy's view of one client.
#[derive(Debug)]
pub(super) struct ClientPolicy {
    pub(super) pid: Option<i32>,
    pub(super) watcher: Watcher,
    pub(super) last: Option<Decision>,
    pub(super) sample: Option<Sample>,
    pub(super) watched_pids: usize,
    pub(super) note: Option<String>,
}

/// Rebalancing state shared by the sessions, the move threads and the policy loop.
#[derive(Debug)]
pub struct Rebalancer {
    pub(super) cfg: RebalanceConfig,
    pub(super) operators: Vec<u32>,
    pub(super) active: Mutex<HashMap<RegionId, ActiveMove>>,
    pub(super) ranges: Mutex<HashMap<RegionId, RangeMap>>,
    pub(super) clients: Mutex<BTreeMap<SessionId, ClientPolicy>>,
    pub(super) counters: Counters,
    /// The pool whose in-use regions it moves.
    pub(super) pool: Arc<Pool>,
    /// The host's nodes.
    pub(super) topology: Arc<Topology>,
    /// Moves and the policy loop stop at shutdown and pause for a takeover.
    pub(super) lifecycle: Arc<Lifecycle>,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section here is a map update; a panic in one leaves
    // the maps usable.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Rebalancer {
    /// State for a daemon configured with `cfg`.
    pub fn new(
        cfg: &RebalanceConfig,
        pool: Arc<Pool>,
        topology: Arc<Topology>,
        lifecycle: Arc<Lifecycle>,
    ) -> Self {
        Self {
            pool,
            topology,
            lifecycle,
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

    /// A HANDOFF of `alloc` from `predecessor` is about to wait for the
    /// allocation's change gate: moves that connection asked for stop
    /// before their next batch, so the successor waits one batch, not a
    /// whole move, and gets memory no request of its predecessor still
    /// moves.
    pub fn cancel_client_moves(&self, alloc: AllocId, predecessor: SessionId) {
        self.cancel_where(
            |m| {
                m.alloc == alloc
                    && matches!(m.initiator, Initiator::Client { session, .. } if session == predecessor)
            },
            "its allocation is being handed off",
        );
    }

    /// HANDOFF moved `alloc` to `successor`: moves of its regions that an
    /// operator or the policy runs go on, now on the successor's behalf (its
    /// disconnect cancels them, its predecessor's no longer does).
    pub fn alloc_handed_off(&self, alloc: AllocId, successor: SessionId) {
        for m in lock(&self.active).values_mut() {
            if m.alloc == alloc {
                m.owner = successor;
            }
        }
    }

    pub(super) fn cancel_where(&self, pred: impl Fn(&ActiveMove) -> bool, why: &str) {
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
    pub fn stats(&self) -> RebalanceStats {
        let c = &self.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let active = lock(&self.active)
            .iter()
            .map(|(id, m)| ActiveMoveStats {
                region: *id,
                alloc_id: m.alloc,
                target: m.target,
                offset: m.range.offset,
                len: m.range.len,
                seconds: m.started.elapsed().as_secs_f64(),
                by: m.initiator.name().into(),
                cancelled: m.cancel.is_cancelled(),
            })
            .collect();
        let clients = if self.cfg.policy {
            lock(&self.clients)
                .iter()
                .map(|(session, p)| RebalanceClient {
                    session: *session,
                    pid: p.pid,
                    watched_pids: p.watched_pids as u64,
                    vcpus: p.sample.as_ref().map(|s| node_map(&s.per_node)),
                    decision: p
                        .last
                        .map(|d| serde_json::to_value(d).unwrap_or(serde_json::Value::Null)),
                    note: p.note.clone(),
                })
                .collect()
        } else {
            Vec::new()
        };
        RebalanceStats {
            policy: self.cfg.policy,
            interval_ms: self.cfg.interval_ms,
            threshold_pct: self.cfg.threshold_pct,
            persist: self.cfg.persist,
            cooldown: self.cfg.cooldown,
            rate_limit_mib_s: self.cfg.rate_limit_mib_s,
            operator_uids: self.operators.clone(),
            active,
            clients,
            counters: RebalanceCounters {
                moves_ok: g(&c.moves_ok),
                moves_failed: g(&c.moves_failed),
                moves_refused: g(&c.moves_refused),
                policy_moves: g(&c.policy_moves),
                pages_moved: g(&c.pages_moved),
                pages_failed: g(&c.pages_failed),
                bytes_moved: g(&c.bytes_moved),
            },
        }
    }

    pub(super) fn ranges_of(&self, region: RegionId) -> Vec<(u64, u64, NodeId)> {
        lock(&self.ranges)
            .get(&region)
            .map(RangeMap::ranges)
            .unwrap_or_default()
    }

    /// Drops the range records of regions no longer in use.
    pub(super) fn forget_except(&self, in_use: &HashSet<RegionId>) {
        lock(&self.ranges).retain(|id, _| in_use.contains(id));
    }
}

/// Pages (or vCPUs) per node, as STATS writes them (`{"0": n, "1": m}`).
pub(super) fn node_map(per_node: &BTreeMap<NodeId, usize>) -> BTreeMap<u32, u64> {
    per_node.iter().map(|(n, c)| (*n, *c as u64)).collect()
}
