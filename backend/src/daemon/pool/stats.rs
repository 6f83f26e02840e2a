//! The pool part of STATS.

use std::collections::{BTreeMap, HashMap};

use hugemem_client::stats::{
    Allocations, GivenBack, PoolStats, QuarantinedRegion, RegionCounts, RegionStats, Withheld,
};
use numa::NodeId;

use super::reclaimable::Why;
use super::table::{pooled_bytes, Entry, EntryState, Inner, Pool};
use crate::daemon::ids::PoolKey;

/// The pool's part of STATS, read under one lock.
#[derive(Debug, Clone, Default)]
pub struct PoolPart {
    /// `pools`.
    pub pools: Vec<PoolStats>,
    /// `quarantine`.
    pub quarantine: Vec<QuarantinedRegion>,
    /// `regions` (without placement).
    pub regions: Vec<RegionStats>,
    /// `given_back`.
    pub given_back: Vec<GivenBack>,
    /// `allocations`.
    pub allocations: Allocations,
}

// Called by STATS and the metrics endpoint (`crate::daemon`, `crate::daemon::process::exporter`).
impl Pool {
    /// The pool part of STATS: one entry per (node, page size) with bytes and
    /// region counts per state, plus scrub backlog per node.
    pub fn stats(&self) -> (PoolPart, HashMap<NodeId, u64>) {
        let g = self.lock();
        let mut by_key: BTreeMap<PoolKey, [(u64, u64); 4]> = BTreeMap::new();
        let mut pending: HashMap<NodeId, u64> = HashMap::new();
        let mut withheld: BTreeMap<PoolKey, u64> = BTreeMap::new();
        let mut allocs_bytes = 0;
        for e in g.entries.values() {
            if e.state == EntryState::Quarantined && e.withheld.is_some() {
                *withheld.entry(e.key).or_default() += e.region.len();
            }
            let slot = match e.state.name() {
                "clean" => 0,
                "dirty" => 1,
                "quarantined" => 2,
                _ => 3,
            };
            let v = by_key.entry(e.key).or_default();
            v[slot].0 += e.region.len();
            v[slot].1 += 1;
            if slot == 3 {
                allocs_bytes += e.region.len();
            }
            if e.state == EntryState::Dirty {
                let c = e.region.states().counts();
                let unit = e.region.state_unit();
                *pending.entry(e.key.node).or_default() += (c.dirty + c.clearing) as u64 * unit;
            }
        }
        let pools = by_key
            .iter()
            .map(|(k, v)| {
                let (target, limit) = self.cfg.limits(k.node);
                PoolStats {
                    node: k.node,
                    page_size: k.page_size.to_string(),
                    backing: if k.paths { "hugetlbfs" } else { "memfd" }.into(),
                    clean_bytes: v[0].0,
                    dirty_bytes: v[1].0,
                    quarantined_bytes: v[2].0,
                    withheld_bytes: withheld.get(k).copied().unwrap_or(0),
                    in_use_bytes: v[3].0,
                    regions: RegionCounts {
                        clean: v[0].1,
                        dirty: v[1].1,
                        quarantined: v[2].1,
                        in_use: v[3].1,
                    },
                    target_bytes: target,
                    limit_bytes: limit,
                    size_limit_bytes: self.cfg.size_limit(k.page_size),
                }
            })
            .collect();
        let quarantine = g
            .entries
            .iter()
            .filter(|(_, e)| e.state == EntryState::Quarantined)
            .map(|(id, e)| QuarantinedRegion {
                region: *id,
                bytes: e.region.len(),
                seconds: e.since.elapsed().as_secs_f64(),
                holder_pid: e.holder.as_ref().map(|h| h.pid),
                withheld: e.withheld.as_ref().map(|(reason, since)| Withheld {
                    reason: reason.clone(),
                    seconds: since.elapsed().as_secs_f64(),
                    uid: e.tenant,
                }),
            })
            .collect();
        let regions = g
            .entries
            .iter()
            .map(|(id, e)| RegionStats {
                id: *id,
                node: e.key.node,
                page_size: e.key.page_size.to_string(),
                bytes: e.region.len(),
                state: e.state.name().into(),
                inode: e.owned.id.ino,
                path: e.region.path().map(|p| p.display().to_string()),
                why: self.why(&g, e),
                ..RegionStats::default()
            })
            .collect();
        let part = PoolPart {
            pools,
            quarantine,
            regions,
            given_back: g.given_back.stats(),
            allocations: Allocations {
                active: g.allocs.len() as u64,
                bytes: allocs_bytes,
            },
        };
        (part, pending)
    }

    /// Why a region is where it is, in words (STATS `regions[].why`).
    fn why(&self, g: &Inner, e: &Entry) -> String {
        match e.state {
            EntryState::InUse(alloc) => format!("in use: allocation {alloc}"),
            EntryState::Reserved => "reserved: an ALLOC is preparing it".into(),
            EntryState::Quarantined => match &e.withheld {
                Some((reason, since)) => format!(
                    "quarantined, withheld for {:.0} s: {reason}; re-checked every {} ms",
                    since.elapsed().as_secs_f64(),
                    self.cfg.recheck_ms
                ),
                None => Why::Quarantined(e.holder.clone()).to_string(),
            },
            EntryState::Dirty => {
                let c = e.region.states().counts();
                if c.clearing > 0 {
                    format!(
                        "dirty: being scrubbed ({} of {} pages clean)",
                        c.clean,
                        e.region.states().len()
                    )
                } else {
                    "dirty: waiting for a scrubber".into()
                }
            }
            EntryState::Clean => {
                let (target, _) = self.cfg.limits(e.key.node);
                if pooled_bytes(g, e.key.node) <= target {
                    "pooled: clean, within target".into()
                } else {
                    format!(
                        "pooled: clean, node above its target (given back after {} s above it)",
                        self.cfg.trim_after_secs
                    )
                }
            }
        }
    }
}
