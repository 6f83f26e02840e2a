//! The way out of use and out of the pool, for the session (FREE,
//! disconnect) and the quarantine loop (trim): release into quarantine (or
//! straight back to the kernel over a limit), discarding damaged regions,
//! and trimming above the target. What the quarantine's checks decide is
//! applied in `quarantine.rs`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use guest_mem::Region;
use numa::NodeId;
use tracing::{info, warn};

use super::allocation::{Allocation, OwnershipError};
use super::files::{set_access, Access};
use super::table::{pooled_bytes, pooled_bytes_of, EntryState, Inner, Pool};
use crate::daemon::counters::metrics::Metrics;
use crate::daemon::ids::{AllocId, RegionId, SessionId};

/// An allocation being given back: its regions and whether they were locked.
#[derive(Debug)]
pub struct Released {
    /// Regions now in quarantine (to unlock, if `locked`).
    pub quarantined: Vec<Arc<Region>>,
    /// Regions given back to the kernel (to drop off the executor).
    pub dropped: Vec<Arc<Region>>,
    /// The allocation was locked.
    pub locked: bool,
}

// FREE and disconnect (`crate::daemon::connections::session`), the quarantine loop
// (`trim`), and the pool's own discards.
impl Pool {
    /// Releases `alloc` (FREE): its regions go to quarantine, or back to the
    /// kernel when the node's pool is at its limit.
    ///
    /// # Errors
    ///
    /// [`OwnershipError`]; nothing changes then.
    pub fn release(&self, alloc: AllocId, session: SessionId) -> Result<Released, OwnershipError> {
        let mut g = self.lock();
        let a = g.allocs.remove_owned(alloc, session)?;
        Ok(self.release_locked(&mut g, alloc, a))
    }

    /// Releases every allocation of a session (disconnect, shutdown).
    pub fn release_session(&self, session: SessionId) -> Vec<Released> {
        let mut g = self.lock();
        let owned = g.allocs.remove_owned_by(session);
        owned
            .into_iter()
            .map(|(id, a)| self.release_locked(&mut g, id, a))
            .collect()
    }

    pub(super) fn release_locked(&self, g: &mut Inner, alloc: AllocId, a: Allocation) -> Released {
        let mut out = Released {
            quarantined: Vec::new(),
            dropped: Vec::new(),
            locked: a.locked,
        };
        for id in &a.regions {
            let Some(e) = g.entries.get(id) else { continue };
            let node = e.key.node;
            let len = e.region.len();
            let region = Arc::clone(&e.region);
            let (_, limit) = self.cfg.limits(node);
            let pooled = pooled_bytes(g, node);
            if e.split {
                if let Some(e) = g.entries.remove(id) {
                    info!(
                        region = id,
                        alloc,
                        bytes = len,
                        "region has pages on several nodes (moving, or moved in part); it goes back to the kernel"
                    );
                    g.given_back
                        .push(*id, e.key, e.region.len(), "its pages are on several nodes");
                    Metrics::add(&self.metrics.bytes_released, len);
                    out.dropped.push(e.region);
                }
                continue;
            }
            let page_size = e.key.page_size;
            let size_limit = self.cfg.size_limit(page_size);
            if pooled + len > limit || pooled_bytes_of(g, node, Some(page_size)) + len > size_limit
            {
                if let Some(e) = g.entries.remove(id) {
                    let which = if pooled + len > limit {
                        format!("node {node}'s limit ({} bytes)", limit)
                    } else {
                        format!("the {page_size} limit ({size_limit} bytes)")
                    };
                    g.given_back
                        .push(*id, e.key, e.region.len(), format!("over {which}"));
                    info!(
                        region = id,
                        alloc,
                        node,
                        bytes = len,
                        "pool at {which}; region goes back to the kernel"
                    );
                    Metrics::add(&self.metrics.bytes_released, len);
                    out.dropped.push(e.region);
                }
                continue;
            }
            // The file was handed to the client's uid so it could open it
            // (or was a template's); take it back before quarantine starts,
            // so the client cannot open the file again once the scan has
            // cleared it.
            if let Err(err) = set_access(&region, Access::Daemon) {
                if let Some(e) = g.entries.remove(id) {
                    warn!(region = id, error = %err, "cannot take a region's file back; region goes back to the kernel");
                    g.given_back.push(
                        *id,
                        e.key,
                        e.region.len(),
                        format!("its file could not be taken back: {err}"),
                    );
                    Metrics::add(&self.metrics.bytes_released, len);
                    out.dropped.push(e.region);
                }
                continue;
            }
            if let Some(e) = g.entries.get_mut(id) {
                e.state = EntryState::Quarantined;
                e.since = Instant::now();
                e.holder = None;
                e.withheld = None;
                e.warned = false;
                out.quarantined.push(Arc::clone(&e.region));
            }
        }
        if let Some(suppressed) = crate::daemon::peers::peer_log::RELEASED.check(a.tenant) {
            info!(
                alloc,
                session = a.owner().session(),
                uid = a.tenant,
                regions = a.regions.len(),
                suppressed,
                "allocation released into quarantine"
            );
        }
        out
    }

    /// Takes a region that a tenant damaged (a scrub batch could not be
    /// populated: the tenant truncated its file or punched a hole the host
    /// cannot fill) out of the pool if it is still in `state`, counts it as given back to the kernel, and returns it to be
    /// dropped off the lock (unmapped, closed, unlinked: its pages go back
    /// to the kernel, which zeroes them before their next user). It is never
    /// scrubbed or served again.
    pub(super) fn discard(
        &self,
        id: RegionId,
        state: EntryState,
        reason: &str,
    ) -> Option<Arc<Region>> {
        let mut g = self.lock();
        if g.entries.get(&id).map(|e| e.state) != Some(state) {
            return None;
        }
        let region = self.give_back_locked(&mut g, id, Loss::Damaged, reason);
        drop(g);
        self.changed.notify_all();
        region
    }

    /// Removes a released region that cannot be reused, whatever its entry
    /// state, records it in `given_back` and the counters of its `loss`, and
    /// logs it; returned to be dropped off the lock.
    pub(super) fn give_back_locked(
        &self,
        g: &mut Inner,
        id: RegionId,
        loss: Loss,
        reason: &str,
    ) -> Option<Arc<Region>> {
        let e = g.entries.remove(&id)?;
        let (node, bytes) = (e.key.node, e.region.len());
        Metrics::add(&self.metrics.bytes_released, bytes);
        match loss {
            Loss::Damaged | Loss::Pinned => {
                Metrics::add(&self.metrics.regions_discarded, 1);
                let what = if loss == Loss::Pinned {
                    Metrics::add(&self.metrics.regions_pinned, 1);
                    "pages held by a pin the daemon cannot see"
                } else {
                    "damaged by its tenant"
                };
                g.given_back
                    .push(id, e.key, e.region.len(), format!("{what}: {reason}"));
                warn!(
                    region = id,
                    node,
                    bytes,
                    uid = ?e.tenant,
                    reason,
                    "a released region was {what}; it goes back to the kernel unscrubbed"
                );
            }
            Loss::Short => {
                Metrics::add(&self.metrics.regions_short, 1);
                g.given_back.push(
                    id,
                    e.key,
                    e.region.len(),
                    format!("the host had no pages for its holes after the detach (no tenant at fault): {reason}"),
                );
                warn!(
                    region = id,
                    node,
                    bytes,
                    reason,
                    "the host had no pages to refill a released region after its detach; it goes back to the kernel (its tenant did nothing wrong)"
                );
            }
        }
        Some(e.region)
    }

    /// Gives back clean regions on nodes that stayed above their target for
    /// `trim_after_secs` (and anything above the limit). Returns regions to drop.
    pub fn trim(&self, now: Instant) -> Vec<Arc<Region>> {
        let mut g = self.lock();
        let nodes: Vec<NodeId> = {
            let mut n: Vec<NodeId> = g.entries.values().map(|e| e.key.node).collect();
            n.sort_unstable();
            n.dedup();
            n
        };
        let mut out = Vec::new();
        for node in nodes {
            let (target, limit) = self.cfg.limits(node);
            let pooled = pooled_bytes(&g, node);
            let since = if pooled > target {
                *g.above_target_since.entry(node).or_insert(now)
            } else {
                g.above_target_since.remove(&node);
                continue;
            };
            let goal = if pooled > limit {
                limit
            } else if now.duration_since(since) >= Duration::from_secs(self.cfg.trim_after_secs) {
                target
            } else {
                continue;
            };
            let mut clean: Vec<(Instant, RegionId)> = g
                .entries
                .iter()
                .filter(|(_, e)| e.key.node == node && e.state == EntryState::Clean)
                .map(|(id, e)| (e.since, *id))
                .collect();
            clean.sort();
            let mut pooled = pooled;
            for (_, id) in clean {
                if pooled <= goal {
                    break;
                }
                if let Some(e) = g.entries.remove(&id) {
                    pooled -= e.region.len();
                    Metrics::add(&self.metrics.bytes_released, e.region.len());
                    info!(
                        region = id,
                        node,
                        bytes = e.region.len(),
                        target = goal,
                        "trimming the pool; region goes back to the kernel"
                    );
                    let why = if goal == target {
                        format!(
                            "trimmed, node {node} above its target for {} s",
                            self.cfg.trim_after_secs
                        )
                    } else {
                        format!("trimmed, node {node} above its limit")
                    };
                    g.given_back.push(id, e.key, e.region.len(), why);
                    out.push(e.region);
                }
            }
            if pooled <= target {
                g.above_target_since.remove(&node);
            }
        }
        out
    }
}

/// Why a released region that cannot be reused goes back to the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Loss {
    /// Its tenant changed the file (size, holes the host cannot fill).
    Damaged,
    /// A pin the daemon cannot see kept pages the host needed back.
    Pinned,
    /// The host had no pages for its holes; nobody's fault.
    Short,
}
