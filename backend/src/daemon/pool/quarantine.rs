//! The pool's side of the quarantine (`crate::daemon::background::quarantine`): the
//! regions it is to check, and its verdicts applied to them. The checks
//! themselves (holder scan, proof before reuse) run outside the pool, on a
//! blocking thread, without its lock.

use std::sync::Arc;
use std::time::{Duration, Instant};

use guest_mem::{PageState, Region};
use tracing::{info, warn};

use super::refault::Refault;
use super::release::Loss;
use super::table::{EntryState, Pool};
use crate::daemon::counters::metrics::Metrics;
use crate::daemon::ids::RegionId;
use crate::daemon::peers::holders::{Holder, Owned};
use crate::daemon::peers::peer_log::{check_tenant, LEFT_QUARANTINE};

/// What a quarantine check decided for one region.
#[derive(Debug)]
pub enum Verdict {
    /// A process still holds or maps it: stays quarantined.
    Held(Holder),
    /// No process shows it, but another open description exists (in flight,
    /// or a mapping being torn down): stays quarantined, withheld, re-checked.
    Withheld(String),
    /// The tenant damaged the file (size, holes): back to the kernel, never
    /// scrubbed or served.
    Broken(String),
    /// Detaching found pages the punch could not take back: a pin the
    /// daemon cannot see (io_uring fixed buffer, VFIO, RDMA, `vmsplice`)
    /// still holds them, and the host has no page to spare for their holes.
    /// The tenant's doing: back to the kernel, like [`Verdict::Broken`].
    Pinned(String),
    /// Every page came back at the punch, but the host had too few pages to
    /// fill the holes again: another process took them in the moment
    /// between the punch and the re-reservation, or the operator shrank the
    /// pool. Not the tenant's doing: the region goes back to the kernel, and
    /// nobody is blamed.
    Short(String),
    /// Proved unreachable and whole. `detached` pages were punched out and
    /// their holes reserved again: every page the file gets is a fresh one
    /// the kernel zeroes. 0: detaching is off, every page is to be scrubbed.
    Free {
        /// Pages punched and refaulted; 0 when detaching is off.
        detached: u64,
    },
}

/// The quarantine's bookkeeping in the pool: which regions wait for a
/// holder scan, and the scan's verdicts applied. Borrowed from
/// [`Pool::quarantine`]; each method takes the pool's one lock for its step.
#[derive(Debug, Clone, Copy)]
pub struct QuarantineBook<'a> {
    pub(super) pool: &'a Pool,
}

impl Pool {
    /// The quarantine's bookkeeping: regions waiting for a scan, verdicts.
    pub fn quarantine(&self) -> QuarantineBook<'_> {
        QuarantineBook { pool: self }
    }
}

// Called by the quarantine loop (`crate::daemon::background::quarantine`).
impl QuarantineBook<'_> {
    /// The quarantined regions, for a holder scan and the proofs of
    /// [`crate::daemon::background::quarantine::reuse`].
    pub fn quarantined(&self) -> Vec<(RegionId, Owned, Arc<Region>)> {
        self.pool
            .lock()
            .entries
            .iter()
            .filter(|(_, e)| e.state == EntryState::Quarantined)
            .map(|(id, e)| (*id, e.owned.clone(), Arc::clone(&e.region)))
            .collect()
    }

    /// Applies the quarantine checks ([`crate::daemon::background::quarantine::reuse::judge`]): a
    /// region proved free becomes `Dirty` (scrubbers woken), or `Clean` at
    /// once when its pages were detached (punched, holes reserved again:
    /// every page the kernel hands it is zeroed), its holes then faulted in
    /// ahead by the node's scrubbers (`refault.rs`) unless `pool.refault_ahead`
    /// is off; a held or withheld one stays, with the reason
    /// noted; a broken one is discarded. Returns how many left quarantine,
    /// and the discarded regions, to drop off the lock.
    pub fn apply_scan(&self, results: Vec<(RegionId, Verdict)>) -> (usize, Vec<Arc<Region>>) {
        Metrics::add(&self.pool.metrics.quarantine_scans, 1);
        let mut left = 0;
        let mut dropped = Vec::new();
        let mut g = self.pool.lock();
        for (id, verdict) in results {
            let Some(e) = g.entries.get_mut(&id) else {
                continue;
            };
            if e.state != EntryState::Quarantined {
                continue;
            }
            match verdict {
                Verdict::Free { detached } => {
                    e.region.mark_all_dirty();
                    e.holder = None;
                    e.withheld = None;
                    e.since = Instant::now();
                    left += 1;
                    Metrics::add(&self.pool.metrics.pages_detached, detached);
                    let logged = check_tenant(&LEFT_QUARANTINE, e.tenant);
                    if detached > 0 && mark_zeroed_clean(&e.region) {
                        e.state = EntryState::Clean;
                        e.fill = self.pool.cfg.refault_ahead.then(Refault::new);
                        if let Some(suppressed) = logged {
                            info!(
                                region = id,
                                node = e.key.node,
                                bytes = e.region.len(),
                                uid = e.tenant,
                                suppressed,
                                "region left quarantine; its pages were detached (holes, reserved): clean"
                            );
                        }
                    } else {
                        e.state = EntryState::Dirty;
                        // The scrubbers clear every page now; a fill left
                        // from the region's fresh hand-out has no work left.
                        e.fill = None;
                        if let Some(suppressed) = logged {
                            info!(
                                region = id,
                                node = e.key.node,
                                bytes = e.region.len(),
                                uid = e.tenant,
                                suppressed,
                                "region left quarantine; scrubbing"
                            );
                        }
                    }
                }
                Verdict::Held(h) => {
                    if !e.warned && e.since.elapsed() > Duration::from_secs(60) {
                        e.warned = true;
                        warn!(region = id, pid = h.pid, hold = ?h.hold, "a released region is still held after 60 s");
                    }
                    e.holder = Some(h);
                }
                Verdict::Withheld(reason) => {
                    e.holder = None;
                    if e.withheld.is_none() {
                        Metrics::add(&self.pool.metrics.regions_withheld, 1);
                        warn!(
                            region = id,
                            uid = ?e.tenant,
                            bytes = e.region.len(),
                            reason,
                            "a released region is withheld: a reference no process shows exists; re-checking"
                        );
                        e.withheld = Some((reason, Instant::now()));
                    }
                }
                Verdict::Broken(reason) => {
                    dropped.extend(
                        self.pool
                            .give_back_locked(&mut g, id, Loss::Damaged, &reason),
                    );
                }
                Verdict::Pinned(reason) => {
                    dropped.extend(
                        self.pool
                            .give_back_locked(&mut g, id, Loss::Pinned, &reason),
                    );
                }
                Verdict::Short(reason) => {
                    dropped.extend(self.pool.give_back_locked(&mut g, id, Loss::Short, &reason));
                }
            }
        }
        drop(g);
        if left > 0 || !dropped.is_empty() {
            self.pool.changed.notify_all();
        }
        (left, dropped)
    }
}

/// Moves every page of a region just marked `Dirty`, whose contents are
/// known to be zero, to `Clean` (`Dirty → Clearing → Clean`, the scrubbers'
/// own path). Under the pool lock, so no scrubber claims a page meanwhile;
/// false (pages left `Dirty` for the scrubbers) if any page was not `Dirty`.
fn mark_zeroed_clean(region: &Region) -> bool {
    let states = region.states();
    for page in 0..states.len() {
        if states
            .try_transition(page, PageState::Dirty, PageState::Clearing)
            .is_err()
        {
            return false;
        }
        if states
            .try_transition(page, PageState::Clearing, PageState::Clean)
            .is_err()
        {
            return false;
        }
    }
    true
}
