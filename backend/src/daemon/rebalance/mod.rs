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
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use clearing::CancelToken;
use hugemem_client::stats::{
    ActiveMove as ActiveMoveStats, RebalanceClient, RebalanceCounters, RebalanceStats,
};
use migrate::{
    ByteRange, Decision, MigrateError, MoveReport, Placement, PlanError, PolicyConfig, Sample,
    Watcher,
};
use numa::NodeId;
use tracing::info;

use super::config::RebalanceConfig;
use super::pool::{AllocId, RegionId, SessionId};
use crate::proto::Status;

pub mod guest_check;
mod moves;
mod policy;
#[cfg(test)]
mod tests;

pub use moves::{add_placement, rebalance, serve};
pub use policy::{policy_loop, policy_step, RegionView, Step};

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

/// Pages (or vCPUs) per node, as STATS writes them (`{"0": n, "1": m}`).
fn node_map(per_node: &BTreeMap<NodeId, usize>) -> BTreeMap<u32, u64> {
    per_node.iter().map(|(n, c)| (*n, *c as u64)).collect()
}
