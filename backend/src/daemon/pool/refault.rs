//! Refaulting detached regions ahead of their guests, so a guest's first
//! touch of a hole does not wait for the kernel to zero a huge page.
//!
//! A released region whose pages were detached (`crate::daemon::background::quarantine::reuse::
//! detach_pages`: every page punched out of its file, and the holes
//! reserved again at once) is clean the moment it leaves quarantine: a
//! hole can only ever fault in a page the kernel zeroes for it, and the
//! file's reservation guarantees that page (see `docs/security.md`). So the
//! region joins the clean pool, and an ALLOC may take it at once, holes and
//! all. Filling the holes — the kernel allocating and zeroing each page at
//! fault time — is work done *ahead* of the guest: the node's scrubber
//! threads (pinned to the node's CPUs) claim the region in chunks and fault
//! them in through the daemon's own mapping (`MADV_POPULATE_WRITE`, so the
//! region's NUMA policy places them), whether the region is still pooled
//! or already handed out (a page the guest faulted first is skipped: the
//! populate writes no data). A guest touching a hole before the workers
//! reach it gets its page zeroed by the kernel at that fault, as with any
//! fresh memory.
//!
//! Claims happen under the pool lock, so the bookkeeping here is plain
//! fields of the entry; a new detach of the same region starts a new fill
//! (its `generation` tells late reports of the old one apart).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use guest_mem::Region;
use tracing::warn;

use crate::daemon::ids::RegionId;

static GENERATION: AtomicU64 = AtomicU64::new(1);
/// Why a chunk of a detached region's holes was not faulted in ahead (the
/// rest fault at first touch).
#[derive(Debug, thiserror::Error)]
pub enum RefaultError {
    /// A page of the chunk cannot be faulted in.
    #[error("bytes {start}..{end} cannot be populated: {source}")]
    Populate {
        /// The chunk's first byte.
        start: u64,
        /// The byte after it.
        end: u64,
        /// The fault's error.
        #[source]
        source: std::io::Error,
    },
    /// The node's fault helpers did not start.
    #[error("cannot start fault helpers: {0}")]
    HelpersStart(#[source] std::io::Error),
    /// The fault helpers took no more work.
    #[error("the fault helpers are gone: {0}")]
    HelpersGone(#[source] std::io::Error),
    /// The fault helpers exited with the chunk unanswered.
    #[error("the fault helpers exited before they answered")]
    HelpersExited,
}

/// The holes of one region still to be faulted in (see the module docs).
#[derive(Debug)]
pub(super) struct Refault {
    generation: u64,
    /// Next offset to claim.
    next: u64,
    /// Claims not yet reported back.
    in_flight: usize,
    /// Bytes faulted in so far.
    done: u64,
    /// Claims given back unfinished (their helpers were stopped), claimed
    /// again before `next`, lowest first.
    retry: Vec<(u64, u64)>,
    /// A refault thread has its helpers on this fill: the node's other
    /// thread leaves it alone (one set of helpers, as many as the node has
    /// CPUs, already keeps every CPU busy; a second set on the same region
    /// would only compete with the tenant for them and for memory
    /// bandwidth).
    worked: bool,
}

impl Refault {
    /// Bytes of a region of `len` bytes not faulted in yet (a chunk a
    /// scrubber is faulting in still counts: a guest touching it waits).
    pub(super) fn holes(&self, len: u64) -> u64 {
        len.saturating_sub(self.done)
    }

    /// A fill of a whole region.
    pub(super) fn new() -> Self {
        Self {
            generation: GENERATION.fetch_add(1, Ordering::Relaxed),
            next: 0,
            in_flight: 0,
            done: 0,
            retry: Vec::new(),
            worked: false,
        }
    }
}

/// A chunk of holes claimed, without the region: what the fault helpers'
/// refault thread keeps while they work (a region with no other reference
/// can still be grown in place; the helpers keep its file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefaultTicket {
    /// The region.
    pub id: RegionId,
    /// First byte.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    generation: u64,
}

/// A chunk of holes a scrubber faults in.
#[derive(Debug)]
pub struct RefaultWork {
    /// The region.
    pub id: RegionId,
    /// The region itself (kept alive while the scrubber works).
    pub region: Arc<Region>,
    /// First byte.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    generation: u64,
}

impl RefaultWork {
    /// The claim without the region.
    pub fn ticket(&self) -> RefaultTicket {
        RefaultTicket {
            id: self.id,
            offset: self.offset,
            len: self.len,
            generation: self.generation,
        }
    }
}

impl Refault {
    /// Claims the next chunk of region `id` (`region`) to fault in: up to
    /// `max_bytes`, at least one of its pages; `None` when every chunk is
    /// claimed.
    pub(super) fn claim(
        &mut self,
        id: RegionId,
        region: &Arc<Region>,
        max_bytes: u64,
    ) -> Option<RefaultWork> {
        let len = region.len();
        if let Some((offset, n)) = self.retry.pop() {
            self.in_flight += 1;
            return Some(RefaultWork {
                id,
                region: Arc::clone(region),
                offset,
                len: n,
                generation: self.generation,
            });
        }
        if self.next >= len {
            return None;
        }
        let offset = self.next;
        let page = region.page_size().bytes();
        let n = ((max_bytes / page).max(1) * page).min(len - offset);
        self.next += n;
        self.in_flight += 1;
        Some(RefaultWork {
            id,
            region: Arc::clone(region),
            offset,
            len: n,
            generation: self.generation,
        })
    }

    /// Whether a refault thread already works on this fill.
    pub(super) fn is_worked(&self) -> bool {
        self.worked
    }

    /// [`Refault::claim`] by a refault thread that takes this fill on as a
    /// whole (see `worked`).
    pub(super) fn claim_to_work(
        &mut self,
        id: RegionId,
        region: &Arc<Region>,
        max_bytes: u64,
    ) -> Option<RefaultWork> {
        let work = self.claim(id, region, max_bytes)?;
        self.worked = true;
        Some(work)
    }

    /// The refault thread that took this fill on (`ticket`: its first
    /// claim) has left it; a ticket of an older fill of the region changes
    /// nothing.
    pub(super) fn left(&mut self, ticket: &RefaultTicket) {
        if ticket.generation == self.generation {
            self.worked = false;
        }
    }

    /// Takes `work` back unfinished (its helper was stopped): it is claimed
    /// again, before anything above it.
    pub(super) fn abandon(&mut self, work: &RefaultTicket) {
        if work.generation != self.generation {
            return;
        }
        self.in_flight = self.in_flight.saturating_sub(1);
        self.retry.push((work.offset, work.len));
        // Highest first, so `pop` gives the lowest.
        self.retry.sort_unstable_by_key(|r| std::cmp::Reverse(r.0));
    }

    /// Records how a scrubber's `work` on a region of `len` bytes ended:
    /// faulted in (`Ok`) or not (`Err`: the file no longer has the pages,
    /// e.g. a tenant truncated the region it was handed; the rest of the
    /// region faults at first touch instead). `None` when `work` belongs to
    /// an older fill of the region (a new detach started over), else
    /// whether this fill is over.
    pub(super) fn finish(
        &mut self,
        work: &RefaultTicket,
        len: u64,
        result: Result<(), RefaultError>,
    ) -> Option<bool> {
        if work.generation != self.generation {
            return None;
        }
        self.in_flight = self.in_flight.saturating_sub(1);
        match result {
            Ok(()) => self.done += work.len,
            Err(reason) => {
                warn!(
                    region = work.id,
                    offset = work.offset,
                    reason = %reason,
                    "cannot fault a detached region's holes in ahead; the rest fault at first touch"
                );
                self.next = len;
                self.retry.clear();
            }
        }
        Some(self.next >= len && self.in_flight == 0 && self.retry.is_empty())
    }
}
