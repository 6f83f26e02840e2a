//! The vCPU-affinity policy loop (see the module docs of `super`).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use migrate::{CpuNodes, Decision, Sample, VcpuFilter, Watcher};
use numa::NodeId;
use tracing::{debug, info, warn};

use crate::daemon::pool::{InUseRegion, SessionId};

use super::moves::rebalance;
use super::rebalancer::*;

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
pub(super) fn parse_ppid(stat: &str) -> Option<i32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// `pid` and its descendants, at most `limit` processes.
pub(super) fn with_descendants(
    pid: i32,
    children: &HashMap<i32, Vec<i32>>,
    limit: usize,
) -> Vec<i32> {
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
type ClientSample = Result<(Sample, usize), migrate::policy::WatchError>;

/// Samples the vCPU threads of every client and its descendants.
///
/// A vCPU thread that has not run yet still carries its spawner's name
/// (VMMs name their threads from inside them) and so is not counted in
/// this sample; it is in the next one, exactly as if it had started a
/// moment later (and the policy acts only on `persist` consecutive samples
/// that agree). Its last CPU is never missing: the kernel sets a task's CPU
/// when it forks and wakes it, before it first runs.
pub(super) fn sample_clients(
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
                        return (session, Err(e));
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
pub async fn policy_loop(rb: Arc<Rebalancer>) {
    if !rb.cfg.policy {
        return;
    }
    let period = Duration::from_millis(rb.cfg.interval_ms);
    let cpus = Arc::new(CpuNodes::new(&rb.topology));
    info!(
        interval_ms = rb.cfg.interval_ms,
        threshold_pct = rb.cfg.threshold_pct,
        persist = rb.cfg.persist,
        cooldown = rb.cfg.cooldown,
        "vCPU-affinity policy on"
    );
    let round = || {
        let (rb, cpus) = (Arc::clone(&rb), Arc::clone(&cpus));
        async move {
            policy_tick(&rb, &cpus).await;
            true
        }
    };
    rb.lifecycle.periodic(period, None, round).await;
}

async fn policy_tick(rb: &Arc<Rebalancer>, cpus: &Arc<CpuNodes>) {
    let regions = rb.pool.placement().in_use_regions();
    let mut by_session: BTreeMap<SessionId, Vec<InUseRegion>> = BTreeMap::new();
    for r in regions {
        by_session.entry(r.session).or_default().push(r);
    }
    let clients: Vec<(SessionId, i32)> = lock(&rb.clients)
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
        let mut policies = lock(&rb.clients);
        for (session, result) in samples {
            let Some(p) = policies.get_mut(&session) else {
                continue;
            };
            let Some(regions) = by_session.get(&session) else {
                continue;
            };
            match result {
                Err(e) => {
                    let e = crate::diag::chain(&e);
                    debug!(session, error = %e, "cannot sample a client's threads");
                    p.note = Some(e);
                }
                Ok((sample, watched)) => {
                    let views: Vec<RegionView> = regions
                        .iter()
                        .map(|r| RegionView {
                            node: r.node,
                            split: r.split,
                            moving: rb.is_moving(r.id),
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
        rb.counters.policy_moves.fetch_add(1, Ordering::Relaxed);
        for r in by_session.get(&session).into_iter().flatten() {
            let req = MoveRequest {
                region_id: r.id,
                offset: 0,
                len: 0,
                node: to,
            };
            let rb = Arc::clone(rb);
            rb.lifecycle.tracker().clone().spawn(async move {
                match rebalance(&rb, req, Initiator::Policy).await {
                    Ok(out) => info!(region = req.region_id, to, report = %out.report, "policy move done"),
                    Err(e) => warn!(region = req.region_id, to, error = %crate::diag::chain(&e), "policy move failed"),
                }
            });
        }
    }
}

// ---------------------------------------------------------------------------
// `hugemem rebalance` (client side).
