//! The scrubbers' side of the pool: claiming dirty pages, reporting them
//! clean, and waiting for a region's pages to be clean.

use std::sync::Arc;
use std::time::{Duration, Instant};

use guest_mem::{PageState, Region};
use numa::NodeId;
use tracing::{info, warn};

use super::refault::{Refault, RefaultError, RefaultTicket, RefaultWork};
use super::table::{EntryState, Pool};
use crate::daemon::ids::RegionId;

/// How a scrubber's batch ended (see [`Scrubbing::scrub_done`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scrubbed {
    /// Every claimed page is cleared.
    Cleared,
    /// The scrubber stopped before it cleared them: back to `Dirty`.
    Stopped,
    /// The tenant damaged the file (truncated it, punched a hole the host
    /// cannot fill): the region is discarded, never touched again.
    Damaged(String),
}

/// What a scrubber does next (see [`Scrubbing::next_scrub`]).
#[derive(Debug)]
pub enum Work {
    /// Clear dirty pages.
    Scrub(ScrubWork),
    /// Fault a detached region's holes in ahead of its guest.
    Refault(RefaultWork),
}

/// Pages a scrubber claimed: `pages` of region `id`, all in `Clearing`.
#[derive(Debug)]
pub struct ScrubWork {
    /// Region id.
    pub id: RegionId,
    /// The region (kept alive while the scrubber works).
    pub region: Arc<Region>,
    /// First page.
    pub first: usize,
    /// Number of contiguous pages.
    pub count: usize,
}

// Called by the scrubbers (`crate::daemon::background::scrub`) and the daemon's stop.
impl Pool {
    /// Stops the scrubbers and waiters; the pool keeps its regions until dropped.
    pub fn stop(&self) {
        self.lock().stopping = true;
        self.changed.notify_all();
    }

    /// A fresh region created unpopulated for lazy mode
    /// (`supply::fresh_demand`): with `pool.refault_ahead` its pages are
    /// faulted in ahead of the guest like a detached region's holes, lowest
    /// offset first, so the guest's first touches find them resident (or
    /// wait for the one page being faulted in) instead of each taking the
    /// kernel's zeroing through the VMM's fault path.
    pub(super) fn fill_fresh(&self, id: RegionId) {
        if !self.cfg.refault_ahead {
            return;
        }
        if let Some(e) = self.lock().entries.get_mut(&id) {
            e.fill = Some(Refault::new());
        }
        self.changed.notify_all();
    }

    /// Waits (blocking) until every page of `region` is `Clean`, or until
    /// `deadline`; returns whether it is.
    pub(super) fn wait_clean(&self, region: &Region, deadline: Instant) -> bool {
        let mut g = self.lock();
        loop {
            let states = region.states();
            if states.counts().clean == states.len() {
                return true;
            }
            let now = Instant::now();
            if now >= deadline || g.stopping {
                return false;
            }
            g = self
                .changed
                .wait_timeout(g, deadline - now)
                .map_or_else(|e| e.into_inner().0, |(g, _)| g);
        }
    }
}

/// The scrubbers' and the refault threads' side of the pool: the next work,
/// its outcome recorded. Borrowed from [`Pool::scrubbing`]; each method
/// takes the pool's one lock for its step.
#[derive(Debug, Clone, Copy)]
pub struct Scrubbing<'a> {
    pub(super) pool: &'a Pool,
}

impl Pool {
    /// The scrubbers' and refault threads' work.
    pub fn scrubbing(&self) -> Scrubbing<'_> {
        Scrubbing { pool: self }
    }
}

impl Scrubbing<'_> {
    /// Blocks until there is work on `node`, or the pool stops (`None`):
    /// with `fills`, holes of a detached region to fault in ahead of its
    /// guest first (`refault.rs`; without, the node's fault helpers take
    /// them, `crate::daemon::background::refault`), then up to `max_bytes` of
    /// contiguous dirty pages.
    pub fn next_scrub(
        &self,
        node: NodeId,
        max_bytes: u64,
        hint: usize,
        fills: bool,
    ) -> Option<Work> {
        let mut g = self.pool.lock();
        loop {
            if g.stopping {
                return None;
            }
            let fill = g
                .entries
                .iter_mut()
                .filter(|(_, e)| fills && e.key.node == node && e.state != EntryState::Quarantined)
                .find_map(|(id, e)| e.fill.as_mut()?.claim(*id, &e.region, max_bytes));
            if let Some(work) = fill {
                return Some(Work::Refault(work));
            }
            let mut finished = Vec::new();
            let mut found = None;
            for (id, e) in &g.entries {
                if e.key.node != node || e.state != EntryState::Dirty {
                    continue;
                }
                let states = e.region.states();
                let Some(first) = states.claim_dirty(hint % states.len().max(1)) else {
                    if states.counts().clean == states.len() {
                        finished.push(*id);
                    }
                    continue;
                };
                let unit = e.region.state_unit();
                let mut count = 1;
                while (count as u64 + 1) * unit <= max_bytes
                    && first + count < states.len()
                    && states
                        .try_transition(first + count, PageState::Dirty, PageState::Clearing)
                        .is_ok()
                {
                    count += 1;
                }
                found = Some(ScrubWork {
                    id: *id,
                    region: Arc::clone(&e.region),
                    first,
                    count,
                });
                break;
            }
            for id in finished {
                if let Some(e) = g.entries.get_mut(&id) {
                    e.state = EntryState::Clean;
                    e.since = Instant::now();
                }
            }
            if let Some(work) = found {
                return Some(Work::Scrub(work));
            }
            // The timeout is a safety net only; every change that creates
            // work notifies.
            g = self
                .pool
                .changed
                .wait_timeout(g, Duration::from_secs(1))
                .map_or_else(|e| e.into_inner().0, |(g, _)| g);
        }
    }

    /// Blocks until no page of `region` is in `Clearing`, or the pool
    /// stops. For a dirty region just taken from the pool to be filled by
    /// the daemon (a PARK's copy): a scrubber that claimed a batch before
    /// the take still clears it, and a filler that met those pages would
    /// skip them as someone else's, to find them zeroed afterwards. Once
    /// taken, no scrubber claims more (they claim only pooled `Dirty`
    /// regions), and each one's [`Scrubbing::scrub_done`] says when it let go.
    pub fn wait_scrubbed_batches(&self, region: &Region) {
        let mut g = self.pool.lock();
        while !g.stopping && region.states().counts().clearing > 0 {
            // The timeout is a safety net only: `scrub_done` notifies.
            g = self
                .pool
                .changed
                .wait_timeout(g, Duration::from_secs(1))
                .map_or_else(|e| e.into_inner().0, |(g, _)| g);
        }
    }

    /// A scrubber finished (or gave up on) its pages. A damaged region
    /// leaves the pool: it is returned, to be dropped off the lock (unmapped,
    /// closed, unlinked: its pages go back to the kernel, which zeroes them
    /// before their next user).
    pub fn scrub_done(&self, work: &ScrubWork, outcome: Scrubbed) -> Option<Arc<Region>> {
        let cleared = match outcome {
            Scrubbed::Cleared => true,
            Scrubbed::Stopped => false,
            Scrubbed::Damaged(reason) => {
                return self.pool.discard(work.id, EntryState::Dirty, &reason);
            }
        };
        let states = work.region.states();
        let to = if cleared {
            PageState::Clean
        } else {
            PageState::Dirty
        };
        for page in work.first..work.first + work.count {
            if let Err(e) = states.try_transition(page, PageState::Clearing, to) {
                warn!(region = work.id, page, error = %e, "scrubbed page left Clearing under its owner");
            }
        }
        let mut g = self.pool.lock();
        if let Some(e) = g.entries.get_mut(&work.id) {
            if e.state == EntryState::Dirty && states.counts().clean == states.len() {
                e.state = EntryState::Clean;
                e.since = Instant::now();
                let limit = &crate::daemon::peers::peer_log::SCRUBBED;
                if let Some(suppressed) =
                    crate::daemon::peers::peer_log::check_tenant(limit, e.tenant)
                {
                    info!(
                        region = work.id,
                        node = e.key.node,
                        bytes = e.region.len(),
                        uid = e.tenant,
                        suppressed,
                        "region scrubbed; clean in the pool"
                    );
                }
            }
        }
        drop(g);
        self.pool.changed.notify_all();
        None
    }

    /// A scrubber faulted `work` in (`Ok`) or could not (`Err`: the file no
    /// longer has the pages, e.g. a tenant truncated the region it was
    /// handed; the rest of the region faults at first touch instead).
    pub fn refault_done(&self, work: &RefaultTicket, result: Result<(), RefaultError>) {
        let mut g = self.pool.lock();
        let Some(e) = g.entries.get_mut(&work.id) else {
            return;
        };
        let len = e.region.len();
        let over = e.fill.as_mut().and_then(|f| f.finish(work, len, result));
        if over == Some(true) {
            e.fill = None;
            info!(
                region = work.id,
                node = e.key.node,
                bytes = len,
                "region faulted in ahead: every page resident"
            );
        }
    }

    /// Blocks until a region of `node` has holes to fault in ahead of its
    /// guest, and claims its first chunk of at most `max_bytes` (lowest
    /// offset first; of the pooled ones, the region released longest ago first), or the pool
    /// stops (`None`). A region already handed out goes first: its guest
    /// is running. A region another refault thread works on is skipped
    /// until it leaves it ([`Scrubbing::fill_left`]). For the node's fault
    /// helpers (`crate::daemon::background::refault`).
    pub fn next_refault(&self, node: NodeId, max_bytes: u64) -> Option<RefaultWork> {
        let mut g = self.pool.lock();
        loop {
            if g.stopping {
                return None;
            }
            let mut ready: Vec<_> = g
                .entries
                .iter_mut()
                .filter(|(_, e)| {
                    e.key.node == node
                        && e.state != EntryState::Quarantined
                        && e.fill.as_ref().is_some_and(|f| !f.is_worked())
                })
                .collect();
            ready.sort_by_key(|(_, e)| (!matches!(e.state, EntryState::InUse(_)), e.since));
            let work = ready
                .into_iter()
                .find_map(|(id, e)| e.fill.as_mut()?.claim_to_work(*id, &e.region, max_bytes));
            if work.is_some() {
                return work;
            }
            // The timeout is a safety net only; every change that creates
            // work notifies.
            g = self
                .pool
                .changed
                .wait_timeout(g, Duration::from_secs(1))
                .map_or_else(|e| e.into_inner().0, |(g, _)| g);
        }
    }

    /// The next chunk of region `id`'s holes, without waiting: `None` when
    /// every chunk is claimed, the region was released again (quarantined:
    /// its pages are punched anew, and a new fill follows) or left the pool.
    pub fn claim_refault(&self, id: RegionId, max_bytes: u64) -> Option<RefaultWork> {
        let mut g = self.pool.lock();
        if g.stopping {
            return None;
        }
        let e = g.entries.get_mut(&id)?;
        if e.state == EntryState::Quarantined {
            return None;
        }
        e.fill.as_mut()?.claim(id, &e.region, max_bytes)
    }

    /// The refault thread whose first claim on a fill was `first` has left
    /// that fill (done, stopped, or its helpers gone): the node's other
    /// thread may take what is left of it.
    pub fn fill_left(&self, first: &RefaultTicket) {
        let mut g = self.pool.lock();
        if let Some(f) = g.entries.get_mut(&first.id).and_then(|e| e.fill.as_mut()) {
            f.left(first);
        }
        drop(g);
        self.pool.changed.notify_all();
    }

    /// Whether region `id` was released (quarantined) or left the pool.
    pub fn is_released(&self, id: RegionId) -> bool {
        self.pool
            .lock()
            .entries
            .get(&id)
            .is_none_or(|e| e.state == EntryState::Quarantined)
    }

    /// A fault helper was stopped before it answered for `work`: the chunk
    /// is claimed again later, before the rest of its region.
    pub fn fill_abandoned(&self, work: &RefaultTicket) {
        let mut g = self.pool.lock();
        if let Some(f) = g.entries.get_mut(&work.id).and_then(|e| e.fill.as_mut()) {
            f.abandon(work);
        }
    }
}
