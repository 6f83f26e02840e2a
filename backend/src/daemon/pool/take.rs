//! The pool's choice of the regions that serve an ALLOC: **the one place
//! that decides which region serves a request** ([`Pool::take`]). The
//! daemon's ALLOC path (`crate::daemon::requests::alloc`) validates a request into
//! [`Part`]s and hands them here; [`super::supply`] only knows how to get a
//! region from each source.
//!
//! # The rule, per part
//!
//! Page size first: for each page size the policy allows, largest first
//! (`best`: 1G, 2M, 4K; a strict policy: its own size only), the part is
//! served in that size if the pages exist anywhere — free in the kernel or
//! in the daemon's hands in any state — and only when they truly do not is
//! the next size tried. Within one page size, the cheapest source first:
//!
//! 1. A **clean pooled** region of exactly the size, node and backing: no
//!    memory is touched. Hugetlbfs files (which can be opened by path) and,
//!    with `pool.recheck_on_reuse`, memfds are scanned for holders once more.
//! 2. A **smaller clean pooled** region, grown in place (`Region::grow`, only
//!    the new pages populated; see `supply::grow_pooled`). A pooled region
//!    *larger* than the request is never taken: the seal forbids truncating
//!    it and a larger file would give the VMM memory it did not ask for. Not
//!    in lazy mode, where fresh demand-faulted memory is faster.
//! 3. A **dirty pooled** region of exactly the size: cleared right here with
//!    [`guest_mem::Region::prepare_eager`] on all of the node's CPUs.
//! 4. A **fresh** region, when the kernel has the pages free.
//! 5. **Pages the daemon holds under another pool key** (the other backing,
//!    memfd vs hugetlbfs path, or another region size), idle: given back to
//!    the kernel, and the ALLOC waits for them to be free, then creates a
//!    fresh region of the preferred size (4).
//! 6. **Pages on their way** (a region in quarantine, one a scrubber is
//!    clearing): the ALLOC kicks the holder scan and waits on the pool. The
//!    quarantine watches each holder's pidfd, so a holder's exit re-scans at
//!    once and the region's leaving quarantine wakes the ALLOC, which then
//!    starts over at 1.
//!
//! Every wait ends at the ALLOC's deadline (its `wait_ms`, else
//! `pool.alloc_wait_ms`, capped at `pool.max_alloc_wait_ms`): the ALLOC then
//! fails with `NoMemory` and a message naming what it waited for (which
//! region, quarantined by which pid, being scrubbed, pages not back in the
//! kernel); it never downgrades on a timeout, and loses nothing (every
//! region taken goes back to the pool).
//!
//! A page size is **missing** only when the kernel's free pages and every
//! page of that size the daemon holds outside allocations together fall
//! short. `best` then moves to the next size and the reply's message and the
//! log say which pages were missing (e.g. `2G on 2M pages: 2 x 1G pages
//! missing on node 0 (0 free, 0 in the pool)`), and STATS counts a
//! `downgrades`. A strict policy fails with that message instead.
//!
//! Lazy mode first tries a previous tenant's dirty pooled region (for uids
//! in `pool.lazy_dirty_uids`), a clean pooled one, and fresh unpopulated
//! memfd memory; then the rule above.
//!
//! A part for any node (`ANY_NODE`) is placed first: on a node with a clean
//! pooled region of its size, else on the node with the most free pages of
//! the largest allowed size.
//!
//! Everything here blocks (clearing, populating, `/proc` scans, `mmap`):
//! the session calls it through `spawn_blocking`, whose thread only waits
//! for the pinned workers of [`clearing::run_jobs`]. A cancel token stops a
//! long prepare at daemon shutdown.

use std::time::{Duration, Instant};

use clearing::{CancelToken, RunOptions};
use guest_mem::size::format_size;
use guest_mem::{PagePolicy as RegionPolicy, PageSize, PoolCounts};
use numa::NodeId;
use tracing::{debug, info, warn};

use super::reclaimable::{Held, Why};
use super::reserve::Taken;
use super::supply::{self, free_pages, Refusal};
use super::table::Pool;
use crate::daemon::counters::metrics::Metrics;
use crate::daemon::ids::PoolKey;
use crate::diag::chain;
use crate::proto::Status;

/// One validated part: where, how much, which page sizes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// The node; `None` for `ANY_NODE`: [`Pool::take`] chooses.
    pub node: Option<NodeId>,
    /// Bytes.
    pub size: u64,
    /// The policy for fresh creation.
    pub policy: RegionPolicy,
    /// Page sizes allowed, largest first, each dividing `size` (and, for
    /// path-backed parts, each with a hugetlbfs mount).
    pub candidates: Vec<PageSize>,
    /// Create hugetlbfs files with paths instead of memfds.
    pub paths: bool,
    /// Lazy mode asked for: a dirty pooled region is handed out uncleared
    /// (`backend::fault` clears on demand) when `dirty_ok`, else clean
    /// pooled or fresh unpopulated memory.
    pub lazy: bool,
    /// The client's uid is in `pool.lazy_dirty_uids`: it may be handed a
    /// previous tenant's uncleared pages in lazy mode (it could read them
    /// through any second mapping before the fault service clears them).
    pub dirty_ok: bool,
}

/// Where a region came from (for counters and logs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The clean pool.
    Pooled,
    /// A dirty pooled region, cleared on the ALLOC path.
    Recleared,
    /// A smaller clean pooled region, grown to the size.
    Grown,
    /// Fresh from the kernel.
    Fresh,
    /// Lazy mode: a dirty pooled region, uncleared (cleared on demand).
    Lazy,
    /// Lazy mode without dirty pooled memory: fresh and unpopulated, zeroed
    /// by the kernel at the VMM's first touch.
    Demand,
}

/// What one part got.
#[derive(Debug)]
pub struct Obtained {
    /// The region, `Reserved`.
    pub taken: Taken,
    /// Where it came from.
    pub source: Source,
    /// Set when `best` served a smaller page size than the largest allowed:
    /// which pages were missing (for the reply's message).
    pub downgrade: Option<String>,
}

/// Pages of one size that do not exist for a part: neither free in the
/// kernel nor in the daemon's hands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Missing {
    /// The page size.
    pub page_size: PageSize,
    /// The node.
    pub node: NodeId,
    /// Pages short.
    pub pages: u64,
    /// Free pages of that size on the node.
    pub free: u64,
    /// Pages of that size pooled on the node (idle, quarantined, being
    /// scrubbed).
    pub pooled: u64,
}

impl std::fmt::Display for Missing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} x {} pages missing on node {} ({} free, {} in the pool)",
            self.pages, self.page_size, self.node, self.free, self.pooled
        )
    }
}

/// `2G on 2M pages: 2 x 1G pages missing on node 0 (0 free, 0 in the pool)`.
pub fn shortage_note(size: u64, served: Option<PageSize>, missing: &[Missing]) -> String {
    let what: Vec<String> = missing.iter().map(ToString::to_string).collect();
    match served {
        Some(p) => format!("{} on {p} pages: {}", format_size(size), what.join("; ")),
        None => format!("cannot serve {}: {}", format_size(size), what.join("; ")),
    }
}

// Called by the ALLOC path (`crate::daemon::requests::alloc`): the one place that picks.
impl Pool {
    /// Takes a region for every part (blocking), each by the rule of the
    /// module docs, waiting at most until `deadline`. On success all are
    /// `Reserved` for the caller to [`Pool::commit`] (or [`Pool::put_back`]);
    /// on error every region taken so far is back in the pool.
    ///
    /// # Errors
    ///
    /// The first part's refusal.
    pub fn take(
        &self,
        parts: &[Part],
        deadline: Instant,
        cancel: &CancelToken,
    ) -> Result<Vec<Obtained>, Refusal> {
        let mut taken: Vec<Obtained> = Vec::with_capacity(parts.len());
        for part in parts {
            match self.obtain(part, deadline, cancel) {
                Ok(t) => taken.push(t),
                Err(e) => {
                    let ids: Vec<_> = taken.iter().map(|o| o.taken.id).collect();
                    self.put_back(&ids);
                    return Err(e);
                }
            }
        }
        Ok(taken)
    }

    /// For `ANY_NODE`: a node with a clean pooled region of the size, else
    /// the node with the most free pages of the largest allowed size, else
    /// the first.
    fn choose_node(&self, size: u64, candidates: &[PageSize], paths: bool) -> NodeId {
        let available: Vec<NodeId> = self
            .sources
            .topology
            .nodes()
            .iter()
            .filter(|n| !n.is_memoryless())
            .map(|n| n.id)
            .collect();
        let first = available.first().copied().unwrap_or(0);
        if available.len() <= 1 {
            return first;
        }
        for &p in candidates {
            let key = |node| PoolKey {
                node,
                page_size: p,
                paths,
            };
            if let Some(&n) = available.iter().find(|&&n| self.has_clean(key(n), size)) {
                return n;
            }
        }
        let Some(&p) = candidates.iter().find(|p| p.is_huge()) else {
            return first;
        };
        available
            .iter()
            .copied()
            .max_by_key(|&n| {
                PoolCounts::read(p, Some(n))
                    .ok()
                    .flatten()
                    .map_or(0, |c| c.free)
            })
            .unwrap_or(first)
    }

    fn obtain(
        &self,
        part: &Part,
        deadline: Instant,
        cancel: &CancelToken,
    ) -> Result<Obtained, Refusal> {
        let node = match part.node {
            Some(n) => n,
            None => self.choose_node(part.size, &part.candidates, part.paths),
        };
        let got = |taken, source| Obtained {
            taken,
            source,
            downgrade: None,
        };
        if part.lazy {
            if let Some((t, s)) = self.obtain_lazy(part, node) {
                return Ok(got(t, s));
            }
        }
        let mut missing = Vec::new();
        for &page_size in &part.candidates {
            match self.obtain_size(part, node, page_size, deadline, cancel)? {
                Ok((taken, source)) => {
                    let downgrade = (!missing.is_empty())
                        .then(|| shortage_note(part.size, Some(page_size), &missing));
                    if let Some(note) = &downgrade {
                        Metrics::add(&self.metrics.downgrades, 1);
                        warn!(region = taken.id, node, %note, "ALLOC served on a smaller page size");
                    }
                    return Ok(Obtained {
                        taken,
                        source,
                        downgrade,
                    });
                }
                Err(m) => missing.push(m),
            }
        }
        let mut msg = shortage_note(part.size, None, &missing);
        if part.policy != RegionPolicy::Best {
            msg.push_str(" (a strict page policy never falls back to another size)");
        }
        Err((Status::NoMemory, msg))
    }

    /// Lazy mode's own sources (module docs), before the rule.
    fn obtain_lazy(&self, part: &Part, node: NodeId) -> Option<(Taken, Source)> {
        if part.dirty_ok {
            if let Some(t) =
                supply::take_lazy_dirty(self, node, part.size, &part.candidates, part.paths)
            {
                return Some((t, Source::Lazy));
            }
        }
        for &page_size in &part.candidates {
            let key = PoolKey {
                node,
                page_size,
                paths: part.paths,
            };
            if let Some(t) = supply::take_clean_checked(self, key, part.size) {
                return Some((t, Source::Pooled));
            }
        }
        if part.paths {
            return None;
        }
        let t = supply::fresh_demand(self, node, part.size, &part.candidates)?;
        Metrics::add(&self.metrics.regions_fresh, 1);
        Some((t, Source::Demand))
    }

    /// The rule (module docs) for one page size: `Ok(Ok(_))` served,
    /// `Ok(Err(_))` the pages do not exist, `Err` a refusal (a deadline passed,
    /// an error that is not a shortage).
    fn obtain_size(
        &self,
        part: &Part,
        node: NodeId,
        page_size: PageSize,
        deadline: Instant,
        cancel: &CancelToken,
    ) -> Result<Result<(Taken, Source), Missing>, Refusal> {
        let key = PoolKey {
            node,
            page_size,
            paths: part.paths,
        };
        let pages = part.size / page_size.bytes();
        let started = Instant::now();
        let mut kicked = false;
        let mut raced = 0;
        loop {
            if cancel.is_cancelled() {
                return Err((Status::Internal, "the daemon is shutting down".into()));
            }
            if let Some(t) = supply::take_clean_checked(self, key, part.size) {
                return Ok(Ok((t, Source::Pooled)));
            }
            if !part.lazy {
                if let Some(t) = supply::grow_pooled(self, key, part.size, cancel) {
                    return Ok(Ok((t, Source::Grown)));
                }
            }
            if let Some(t) = supply::reclear_dirty(self, key, part.size, cancel)? {
                return Ok(Ok((t, Source::Recleared)));
            }
            let mut free = free_pages(page_size, node);
            if free >= pages {
                let policy = RegionPolicy::Strict(page_size);
                let opts = RunOptions {
                    cancel: Some(cancel),
                    ..RunOptions::default()
                };
                match supply::create(self, node, part.size, part.paths, policy, &opts) {
                    Ok(t) => return Ok(Ok((t, Source::Fresh))),
                    // Another ALLOC (or process) took the pages between the
                    // count and the creation: look again, twice at most.
                    Err(e) if supply::is_shortage(&e) && page_size.is_huge() && raced < 2 => {
                        raced += 1;
                        info!(node, page_size = %page_size, error = %chain(&e), "fresh region failed although the pages looked free; looking again");
                        continue;
                    }
                    // Raced again: other ALLOCs take the free pages as
                    // fast as they appear. Count none free and go on with
                    // the pool: pages on their way are waited for, as
                    // when none looked free (a busy host's churn).
                    Err(e) if supply::is_shortage(&e) && page_size.is_huge() => {
                        debug!(node, page_size = %page_size, error = %chain(&e), "fresh pages keep being taken; waiting on the pool");
                        free = 0;
                    }
                    Err(e) => return Err(supply::region_refusal(&e)),
                }
            }
            let held = self.held(node, page_size);
            let short = pages.saturating_sub(free) * page_size.bytes();
            if held.total() < short {
                return Ok(Err(Missing {
                    page_size,
                    node,
                    pages: (short - held.total()).div_ceil(page_size.bytes()),
                    free,
                    pooled: held.total() / page_size.bytes(),
                }));
            }
            if held.idle >= short {
                // A region of exactly this part may have become idle since
                // the first look: take it rather than give it back. Or the
                // idle regions went to other ALLOCs meanwhile: look again
                // rather than wait for pages nobody gave back.
                let Some(victims) = self.evict_idle(key, part.size, short) else {
                    continue;
                };
                drop(victims);
                // The pages go back to the kernel when the last reference to an
                // evicted region goes (a holder scan or a scrubber may hold one
                // for a moment): wait until they are free.
                while free_pages(page_size, node) < pages {
                    if Instant::now() >= deadline || cancel.is_cancelled() {
                        return Err((
                        Status::NoMemory,
                        format!(
                            "waited {:.1} s for {} x {page_size} pages on node {} that the pool gave back to reach the kernel; {} free",
                            started.elapsed().as_secs_f64(),
                            pages,
                            node,
                            free_pages(page_size, node)
                        ),
                    ));
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                continue;
            }
            // Pages on their way: wake the holder scan now, then wait for the
            // pool to change (a holder's exit re-scans at once: pidfd).
            if !kicked {
                kicked = true;
                self.sources.quarantine_kick.notify_one();
                info!(node, page_size = %page_size, size = part.size, "ALLOC waits for pooled pages to settle");
            }
            if Instant::now() >= deadline {
                return Err((
                    Status::NoMemory,
                    waited_message(part, node, page_size, started, &held),
                ));
            }
            self.wait_change(deadline);
        }
    }
}

/// The message of an ALLOC whose deadline passed while pages were settling.
/// The regions it waited for may be other tenants' (released, quarantined
/// because their VMM still maps them): the client is told how much it
/// waited for and why in general, the log names regions and holder pids for
/// the operator.
fn waited_message(
    part: &Part,
    node: NodeId,
    page_size: PageSize,
    started: Instant,
    held: &Held,
) -> String {
    let what: Vec<String> = held
        .settling
        .iter()
        .map(|r| format!("region {} ({}) {}", r.id, format_size(r.bytes), r.why))
        .collect();
    warn!(
        node,
        page_size = %page_size,
        size = part.size,
        waited_s = started.elapsed().as_secs_f64(),
        regions = %what.join(", "),
        "ALLOC deadline passed while pooled pages were settling"
    );
    let quarantined = held
        .settling
        .iter()
        .filter(|r| matches!(r.why, Why::Quarantined(_)))
        .count();
    format!(
        "waited {:.1} s for {} on {page_size} pages on node {}, which the daemon holds but cannot hand out yet: \
         {} region(s), {} in all ({quarantined} still held by the process that had them, the others being scrubbed; \
         the daemon's log names them); nothing was allocated (give the ALLOC a longer wait, or end the holder)",
        started.elapsed().as_secs_f64(),
        format_size(part.size),
        node,
        held.settling.len(),
        format_size(held.settling_bytes()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shortage_names_the_missing_pages_per_size_and_node() {
        let m = |page_size, pages, free, pooled| Missing {
            page_size,
            node: 0,
            pages,
            free,
            pooled,
        };
        assert_eq!(
            shortage_note(
                2 << 30,
                Some(PageSize::Huge2M),
                &[m(PageSize::Huge1G, 2, 0, 0)]
            ),
            "2G on 2M pages: 2 x 1G pages missing on node 0 (0 free, 0 in the pool)"
        );
        assert_eq!(
            shortage_note(
                3 << 30,
                Some(PageSize::Base4K),
                &[
                    m(PageSize::Huge1G, 1, 1, 1),
                    m(PageSize::Huge2M, 1472, 64, 0)
                ]
            ),
            "3G on 4K pages: 1 x 1G pages missing on node 0 (1 free, 1 in the pool); \
             1472 x 2M pages missing on node 0 (64 free, 0 in the pool)"
        );
        assert_eq!(
            shortage_note(8 << 30, None, &[m(PageSize::Huge1G, 5, 3, 0)]),
            "cannot serve 8G: 5 x 1G pages missing on node 0 (3 free, 0 in the pool)"
        );
    }
}
