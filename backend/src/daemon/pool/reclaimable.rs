//! What the daemon holds of one page size on one node outside any
//! allocation, for the ALLOC rule of [`super::take`]: pages it can
//! give back to the kernel now (idle regions of any size and backing), and
//! pages on their way there (quarantined, being scrubbed), with the reason.

use std::sync::Arc;
use std::time::{Duration, Instant};

use guest_mem::{PageSize, Region};
use numa::NodeId;
use tracing::info;

use super::table::{pooled_bytes_of, Entry, EntryState, Pool};
use crate::daemon::counters::metrics::Metrics;
use crate::daemon::ids::{PoolKey, RegionId};
use crate::daemon::peers::holders::{Hold, Holder};

/// Why a pooled region cannot be handed out or given back right now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Why {
    /// Released, and not yet proved free of other holders: the holder the
    /// last scan found, if any (none yet: not scanned since the release).
    Quarantined(Option<Holder>),
    /// A scrubber is clearing pages of it.
    Scrubbing,
}

impl std::fmt::Display for Why {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Why::Quarantined(Some(h)) => {
                write!(f, "quarantined: pid {} ", h.pid)?;
                match &h.hold {
                    Hold::Fd(fd) => write!(f, "has it open (fd {fd})"),
                    Hold::Map(r) => write!(f, "maps it (at {:#x})", r.start),
                    Hold::Unknown => f.write_str("could not be inspected"),
                }
            }
            Why::Quarantined(None) => f.write_str("quarantined, holder scan pending"),
            Why::Scrubbing => f.write_str("being scrubbed"),
        }
    }
}

/// A pooled region on its way to being usable.
#[derive(Debug, Clone)]
pub struct HeldRegion {
    /// Its id.
    pub id: RegionId,
    /// Its size.
    pub bytes: u64,
    /// Why it is not usable yet.
    pub why: Why,
}

/// Pooled regions of one page size on one node (any size, either backing).
#[derive(Debug, Clone, Default)]
pub struct Held {
    /// Bytes of idle regions (clean, or dirty with no scrubber on them):
    /// they can go back to the kernel at once.
    pub idle: u64,
    /// Regions that will be idle once their holder goes or their scrub
    /// batch ends.
    pub settling: Vec<HeldRegion>,
}

impl Held {
    /// Bytes of [`Held::settling`].
    pub fn settling_bytes(&self) -> u64 {
        self.settling.iter().map(|r| r.bytes).sum()
    }

    /// Every byte the daemon holds outside allocations.
    pub fn total(&self) -> u64 {
        self.idle + self.settling_bytes()
    }
}

fn idle(e: &Entry) -> bool {
    e.state == EntryState::Clean
        || (e.state == EntryState::Dirty && e.region.states().counts().clearing == 0)
}

// For the ALLOC rule of `take.rs`; `pooled` for the refill
// (`crate::daemon::background::refill`).
impl Pool {
    /// What is pooled of `page_size` on `node` (see [`Held`]).
    pub(super) fn held(&self, node: NodeId, page_size: PageSize) -> Held {
        let g = self.lock();
        let mut out = Held::default();
        for (id, e) in &g.entries {
            if e.key.node != node || e.key.page_size != page_size {
                continue;
            }
            let why = match e.state {
                _ if idle(e) => {
                    out.idle += e.region.len();
                    continue;
                }
                EntryState::Dirty => Why::Scrubbing,
                // Withheld: the tenant still reaches the file (an fd in
                // flight); its pages are the tenant's until it lets go, not
                // pages on their way back. The ALLOC rule counts them as
                // missing rather than waiting for them.
                EntryState::Quarantined if e.withheld.is_some() => continue,
                EntryState::Quarantined => Why::Quarantined(e.holder.clone()),
                _ => continue,
            };
            out.settling.push(HeldRegion {
                id: *id,
                bytes: e.region.len(),
                why,
            });
        }
        out
    }

    /// Pooled (clean, dirty, quarantined) bytes on `node`, of one page size
    /// or of all.
    pub fn pooled(&self, node: NodeId, page_size: Option<PageSize>) -> u64 {
        pooled_bytes_of(&self.lock(), node, page_size)
    }

    /// Gives idle regions of `key`'s page size on its node (any size, either
    /// backing; the oldest first) back to the kernel until `bytes` are
    /// freed, so that a fresh region of that page size can be created.
    /// Returns the regions to drop (off the lock: the pages go back when the
    /// last reference goes); `None`, evicting nothing, when an idle region
    /// of exactly `key` and `size` is there (it left quarantine or its scrub
    /// since the caller looked): the caller takes that one instead; `None`
    /// too when the idle regions no longer add up to `bytes` (other ALLOCs
    /// took them since the caller's [`Pool::held`]): giving back less would
    /// leave the caller waiting for pages that never reach the kernel, so it
    /// looks again instead.
    pub(super) fn evict_idle(
        &self,
        key: PoolKey,
        size: u64,
        bytes: u64,
    ) -> Option<Vec<Arc<Region>>> {
        let (node, page_size) = (key.node, key.page_size);
        let mut g = self.lock();
        if g.entries
            .values()
            .any(|e| e.key == key && e.region.len() == size && idle(e))
        {
            return None;
        }
        let mut victims: Vec<(Instant, RegionId)> = g
            .entries
            .iter()
            .filter(|(_, e)| e.key.node == node && e.key.page_size == page_size && idle(e))
            .map(|(id, e)| (e.since, *id))
            .collect();
        let idle_bytes: u64 = victims
            .iter()
            .filter_map(|(_, id)| g.entries.get(id))
            .map(|e| e.region.len())
            .sum();
        if idle_bytes < bytes {
            info!(
                node,
                page_size = %page_size,
                idle_bytes,
                bytes,
                "fewer idle pooled pages than a moment ago; the ALLOC looks again"
            );
            return None;
        }
        victims.sort();
        let mut freed = 0;
        let mut out = Vec::new();
        for (_, id) in victims {
            if freed >= bytes {
                break;
            }
            if let Some(e) = g.entries.remove(&id) {
                freed += e.region.len();
                Metrics::add(&self.metrics.bytes_released, e.region.len());
                info!(
                    region = id,
                    node,
                    page_size = %page_size,
                    backing = if e.key.paths { "hugetlbfs" } else { "memfd" },
                    bytes = e.region.len(),
                    "giving an idle pooled region back to the kernel for a fresh one of the preferred page size"
                );
                g.given_back.push(
                    id,
                    e.key,
                    e.region.len(),
                    format!("its {page_size} pages were wanted for a fresh region of another size or backing"),
                );
                out.push(e.region);
            }
        }
        Some(out)
    }

    /// Blocks until the pool changes (a region left quarantine, a scrub
    /// batch ended, a region came back) or `deadline`, at most 20 ms (a
    /// change signalled just before the wait is seen on the next look).
    pub(super) fn wait_change(&self, deadline: Instant) {
        let g = self.lock();
        let now = Instant::now();
        if now >= deadline || g.stopping {
            return;
        }
        let wait = (deadline - now).min(Duration::from_millis(20));
        drop(
            self.changed
                .wait_timeout(g, wait)
                .map_or_else(|e| e.into_inner().0, |(g, _)| g),
        );
    }
}
