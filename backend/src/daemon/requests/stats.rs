//! The STATS document: the pool's table, the scrubbers' and the daemon's
//! counters, as `hugemem status` and a client's STATS read them.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use guest_mem::PageSize;

use crate::proto::messages::{Reply, ReplyBody};
use crate::proto::{Status, MAX_PAYLOAD};
use hugemem_client::stats::{Counters, ScrubNode, ScrubStats, Sessions, Stats, Totals};

use crate::daemon::background::refill::Refill;
use crate::daemon::counters::metrics::{self, Metrics, ScrubCounters};
use crate::daemon::pool::{Pool, RegionId};
use crate::daemon::requests::outcome::Outcome;
use crate::daemon::requests::rebalance::Rebalancer;

/// Where the STATS document's figures come from (and the Prometheus
/// endpoint's, `crate::daemon::process::exporter`).
#[derive(Debug)]
pub struct StatsSource {
    /// The pool's table.
    pub pool: Arc<Pool>,
    /// The counters.
    pub metrics: Arc<Metrics>,
    /// Every lazy fault service's counters.
    pub fault_totals: Arc<crate::fault::FaultTotals>,
    /// The scrubbers' counters, per node.
    pub scrub: Vec<Arc<ScrubCounters>>,
    /// When the daemon started.
    pub started: Instant,
    /// The socket clients connect to.
    pub socket: PathBuf,
    /// The hugetlbfs directory per page size.
    pub hugetlbfs: Vec<(PageSize, PathBuf)>,
    /// The refill's counters.
    pub refill: Arc<Refill>,
    /// `pool.refill`.
    pub refill_enabled: bool,
    /// The rebalancer's counters.
    pub rebalance: Arc<Rebalancer>,
    /// The parked VMs a start found lost.
    pub park_record: Arc<crate::daemon::requests::parked::note::ParkRecord>,
    /// The shared clones of parked VMs.
    pub clones: Arc<crate::daemon::requests::parked::clones::Clones>,
    /// The copy clones being filled from parked VMs.
    pub copy_fills: Arc<crate::daemon::requests::parked::copy_fills::CopyFills>,
}

impl StatsSource {
    /// The parked VMs, each with its shared clones and what they wrote,
    /// and the copy clones still being filled from it.
    pub fn parked(&self) -> Vec<hugemem_client::stats::ParkedVmStats> {
        let mut parked = self.pool.parking().parked_list();
        for p in &mut parked {
            p.copy_clones_filling = self.copy_fills.of(p.alloc) as u64;
            p.shared_clones = self.clones.of(p.alloc).0 as u64;
            if p.shared_clones > 0 {
                p.shared_clone_written_bytes = self.clones.written(p.alloc);
            }
        }
        parked
    }

    /// The STATS document (see `docs/protocol.md` and `hugemem status`),
    /// without the per-connection parts (`lazy`, placement), which the
    /// session adds.
    pub fn stats(&self) -> Stats {
        let (pool, pending) = self.pool.stats();
        let m = &self.metrics;
        let g = Metrics::get;
        let mut total_bytes = 0;
        let mut total_nanos = 0;
        let nodes: Vec<ScrubNode> = self
            .scrub
            .iter()
            .map(|c| {
                let (b, n) = (g(&c.bytes), g(&c.nanos));
                total_bytes += b;
                total_nanos += n;
                ScrubNode {
                    node: c.node,
                    threads: c.threads as u64,
                    bytes: b,
                    // Nanoseconds to seconds: precision is irrelevant here.
                    seconds: Duration::from_nanos(n).as_secs_f64(),
                    gb_per_s: c.gb_per_s(),
                    batches: g(&c.batches),
                    refault_bytes: g(&c.refault_bytes),
                    refault_seconds: Duration::from_nanos(g(&c.refault_nanos)).as_secs_f64(),
                    refault_gb_per_s: metrics::gb_per_s(g(&c.refault_bytes), g(&c.refault_nanos)),
                    pending_bytes: pending.get(&c.node).copied().unwrap_or(0),
                }
            })
            .collect();
        let held: u64 = pool
            .pools
            .iter()
            .map(|p| p.clean_bytes + p.dirty_bytes + p.quarantined_bytes + p.in_use_bytes)
            .sum();
        Stats {
            version: env!("CARGO_PKG_VERSION").into(),
            pid: std::process::id(),
            uptime_s: self.started.elapsed().as_secs_f64(),
            socket: Some(self.socket.display().to_string()),
            hugetlbfs: Some(
                self.hugetlbfs
                    .iter()
                    .map(|(p, d)| (p.to_string(), d.display().to_string()))
                    .collect(),
            ),
            sessions: Sessions {
                active: g(&m.sessions_active),
                total: g(&m.sessions_total),
                refused: g(&m.peers_refused),
            },
            lazy: None,
            allocations: pool.allocations,
            pools: pool.pools,
            quarantine: Some(pool.quarantine),
            regions: Some(pool.regions),
            regions_omitted: false,
            given_back: Some(pool.given_back),
            refill: Some(self.refill.stats(self.refill_enabled)),
            rebalance: Some(self.rebalance.stats()),
            scrub: ScrubStats {
                kernel: clearing::ClearKernel::default_kernel().name().into(),
                bytes: total_bytes,
                seconds: Duration::from_nanos(total_nanos).as_secs_f64(),
                gb_per_s: metrics::gb_per_s(total_bytes, total_nanos),
                pending_bytes: pending.values().sum::<u64>(),
                nodes,
            },
            totals: Totals {
                created_bytes: g(&m.bytes_created),
                released_bytes: g(&m.bytes_released),
                held_bytes: held,
            },
            counters: Counters {
                sessions_total: g(&m.sessions_total),
                sessions_active: g(&m.sessions_active),
                peers_refused: g(&m.peers_refused),
                connection_errors: g(&m.connection_errors),
                allocs_ok: g(&m.allocs_ok),
                allocs_failed: g(&m.allocs_failed),
                regions_pooled: g(&m.regions_pooled),
                regions_recleared: g(&m.regions_recleared),
                regions_grown: g(&m.regions_grown),
                downgrades: g(&m.downgrades),
                regions_discarded: g(&m.regions_discarded),
                hole_bytes_handed_out: g(&m.hole_bytes_handed_out),
                regions_pinned: g(&m.regions_pinned),
                regions_short: g(&m.regions_short),
                pages_detached: g(&m.pages_detached),
                regions_withheld: g(&m.regions_withheld),
                leftover_files_released: g(&m.leftover_files_released),
                leftover_bytes_released: g(&m.leftover_bytes_released),
                regions_fresh: g(&m.regions_fresh),
                frees: g(&m.frees),
                bytes_created: g(&m.bytes_created),
                bytes_released: g(&m.bytes_released),
                quarantine_scans: g(&m.quarantine_scans),
                reattach_ok: g(&m.reattach_ok),
                reattach_refused: g(&m.reattach_refused),
                allocs_released: g(&m.allocs_released),
                takeovers: g(&m.takeovers),
                fd_store_restores: g(&m.fd_store_restores),
                handoff_ok: g(&m.handoff_ok),
                handoff_refused: g(&m.handoff_refused),
                parks: g(&m.parks),
                parks_refused: g(&m.parks_refused),
                restores: g(&m.restores),
                restores_refused: g(&m.restores_refused),
                park_copied_bytes: g(&m.park_copied_bytes),
                park_zeroed_bytes: g(&m.park_zeroed_bytes),
                park_verified_bytes: g(&m.park_verified_bytes),
                exports: g(&m.exports),
                exports_refused: g(&m.exports_refused),
                clones: g(&m.clones),
                clones_refused: g(&m.clones_refused),
            },
            parked: self.parked(),
            lost_parked: self.park_record.lost(None),
        }
    }
}

/// What a tenant that is not an operator sees of `stats`: aggregates and
/// its `own` regions only: no other tenant's regions, inodes, paths, holder
/// pids, sessions or placement (and no socket, hugetlbfs, quarantine,
/// given_back, refill or rebalance). An allowlist: a part added to `Stats`
/// later stays at its default for tenants until it is named here.
pub fn tenant_view(stats: Stats, own: &[RegionId], uid: u32) -> Stats {
    Stats {
        parked: stats.parked.into_iter().filter(|p| p.uid == uid).collect(),
        lost_parked: stats
            .lost_parked
            .into_iter()
            .filter(|p| p.uid == uid)
            .collect(),
        version: stats.version,
        pid: stats.pid,
        uptime_s: stats.uptime_s,
        sessions: stats.sessions,
        lazy: stats.lazy,
        allocations: stats.allocations,
        pools: stats.pools,
        regions: stats.regions.map(|mut regions| {
            regions.retain(|r| own.contains(&r.id));
            regions
        }),
        scrub: stats.scrub,
        totals: stats.totals,
        counters: stats.counters,
        ..Stats::default()
    }
}

/// The STATS reply of `stats`, which must fit one frame: status (8) +
/// length (4) + JSON. The per-region list is the only part that grows
/// with use; it is dropped first.
pub fn reply(mut stats: Stats) -> Outcome {
    let to_json = |s: &Stats| serde_json::to_string(s).map_err(|e| format!("STATS: {e}"));
    let mut json = match to_json(&stats) {
        Ok(j) => j,
        Err(e) => return Outcome::error(Status::Internal, e),
    };
    if json.len() + 12 > MAX_PAYLOAD {
        stats.regions = None;
        stats.regions_omitted = true;
        json = match to_json(&stats) {
            Ok(j) => j,
            Err(e) => return Outcome::error(Status::Internal, e),
        };
    }
    if json.len() + 12 > MAX_PAYLOAD {
        return Outcome::error(Status::Internal, "STATS does not fit one reply");
    }
    Outcome::reply(Reply::ok(ReplyBody::Stats { json }))
}
