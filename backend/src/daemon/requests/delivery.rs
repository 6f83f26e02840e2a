//! Handing an allocation to the process that receives it: the one step
//! that ALLOC, REATTACH and HANDOFF end with. Each of them decides *what*
//! it hands out — ALLOC regions it just took and commits
//! ([`crate::daemon::requests::alloc::serve()`]), REATTACH an orphaned allocation its
//! VMM takes back ([`crate::daemon::requests::reattach::serve`]), HANDOFF a live
//! allocation moved to its VMM's successor
//! ([`crate::daemon::requests::handoff::serve`]) — and this step hands it out, in two
//! halves around the pool's move:
//!
//! * [`HandOut::open`], before the move, may fail and changes nothing: the
//!   region table in guest-physical order, the receiving process's own
//!   open file description of each region ([`crate::sys::reopen`]: the
//!   write-lease proof at release counts it; the daemon's own description
//!   never leaves the daemon), and the hugetlbfs paths when asked;
//! * [`HandOut::reply`], after it: the reply body with the token, its fds,
//!   and the allocation that an undelivered reply releases.
//!
//! REATTACH's receiver kept its fds and mappings across the daemon's
//! restart: it gets the table only, in REATTACH's own reply body.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use guest_mem::Region;

use crate::daemon::pool::{AllocId, AllocToken, RegionId};
use crate::daemon::requests::outcome::Outcome;
use crate::proto::messages::{RegionInfo, Reply, ReplyBody};

/// Which reply the receiving process gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// The body of an ALLOC reply (ALLOC, HANDOFF): one fd per region, the
    /// paths when `want_paths`, the token when there is one.
    Alloc {
        /// Send each region's hugetlbfs path.
        want_paths: bool,
    },
    /// The body of a REATTACH reply: the table only, no fds (the VMM kept
    /// its own), no token (it has it).
    Reattach,
}

/// One region to hand out, with the flags the reply reports for it.
#[derive(Debug, Clone, Copy)]
pub struct Row<'a> {
    /// The region's id.
    pub id: RegionId,
    /// The region.
    pub region: &'a Region,
    /// `RegionInfo::FLAG_*`.
    pub flags: u32,
}

/// Why the receiving process's view of a region could not be made.
#[derive(Debug, thiserror::Error)]
pub enum HandOutError {
    /// Paths were asked for and the region is a memfd.
    #[error("region {0} is not a hugetlbfs file: it has no path")]
    NoPath(RegionId),
    /// Its open file description could not be made.
    #[error("cannot open region {id} for the client: {source}")]
    Open {
        /// The region.
        id: RegionId,
        /// What the kernel said.
        source: std::io::Error,
    },
}

/// An allocation ready to hand out (see the module docs).
#[derive(Debug)]
pub struct HandOut {
    delivery: Delivery,
    table: Vec<RegionInfo>,
    fds: Vec<OwnedFd>,
    paths: Vec<String>,
}

impl HandOut {
    /// The table, fds and paths of `rows` (in guest-physical order) for
    /// `delivery`; nothing changes anywhere when it fails.
    ///
    /// # Errors
    ///
    /// [`HandOutError`], for the first region that fails.
    pub fn open<'a>(
        delivery: Delivery,
        rows: impl IntoIterator<Item = Row<'a>>,
    ) -> Result<Self, HandOutError> {
        let mut me = Self {
            delivery,
            table: Vec::new(),
            fds: Vec::new(),
            paths: Vec::new(),
        };
        let mut guest_phys = 0;
        for row in rows {
            if let Delivery::Alloc { want_paths } = delivery {
                if want_paths {
                    let path = row.region.path().ok_or(HandOutError::NoPath(row.id))?;
                    me.paths.push(path.display().to_string());
                }
                let fd = crate::sys::reopen(row.region.fd())
                    .map_err(|source| HandOutError::Open { id: row.id, source })?;
                me.fds.push(fd);
            }
            me.table.push(RegionInfo {
                region_id: row.id,
                guest_phys,
                size: row.region.len(),
                page_size: row.region.page_size().bytes(),
                node: row.region.node().unwrap_or(crate::proto::ANY_NODE),
                flags: row.flags,
            });
            guest_phys += row.region.len();
        }
        Ok(me)
    }

    /// The region table the reply carries.
    pub fn table(&self) -> &[RegionInfo] {
        &self.table
    }

    /// The reply that hands allocation `alloc_id` out, with `token` in an
    /// ALLOC body (a REATTACH body has none). An ALLOC body names the
    /// allocation in the outcome, so a reply that cannot be delivered
    /// releases it; a REATTACH body does not (its VMM keeps its mappings
    /// and reconnects).
    pub fn reply(self, alloc_id: AllocId, token: Option<AllocToken>) -> Outcome {
        match self.delivery {
            Delivery::Alloc { .. } => Outcome {
                reply: Reply::ok(ReplyBody::Alloc {
                    alloc_id,
                    regions: self.table,
                    paths: self.paths,
                    token,
                }),
                fds: self.fds,
                alloc: Some(alloc_id),
                close: false,
            },
            Delivery::Reattach => Outcome::reply(Reply::ok(ReplyBody::Reattach {
                alloc_id,
                regions: self.table,
            })),
        }
    }
}

/// The flags an ALLOC would report for `region` now: LAZY while pages are
/// still to be cleared (as far as the daemon knows), else CLEAN; LOCKED
/// when `locked`. REATTACH and HANDOFF answer with them.
pub fn flags_now(region: &Region, locked: bool) -> u32 {
    let counts = region.states().counts();
    let mut flags = if counts.dirty + counts.clearing > 0 {
        RegionInfo::FLAG_LAZY
    } else {
        RegionInfo::FLAG_CLEAN
    };
    if locked {
        flags |= RegionInfo::FLAG_LOCKED;
    }
    flags
}

/// The rows of an allocation's `regions` (in guest-physical order) with
/// the flags an ALLOC would report now ([`flags_now`]).
pub fn rows_now(
    regions: &[(RegionId, Arc<Region>)],
    locked: bool,
) -> impl Iterator<Item = Row<'_>> {
    regions.iter().map(move |(id, region)| Row {
        id: *id,
        region,
        flags: flags_now(region, locked),
    })
}

/// A lazy allocation just handed out (ALLOC, or REATTACH of one its VMM's
/// fallback served), for the session to record: its UFFD request then
/// starts (or resumes) the fault service.
#[derive(Debug)]
pub struct LazyHandedOut {
    /// The allocation.
    pub alloc: AllocId,
    /// Its region table, as the fault service reads it.
    pub infos: Vec<RegionInfo>,
    /// Its regions.
    pub regions: Vec<Arc<Region>>,
}

/// What an ALLOC or a REATTACH produced.
#[derive(Debug)]
pub struct Served {
    /// The reply, its fds and the allocation it hands out.
    pub outcome: Outcome,
    /// A lazy allocation for the session to record.
    pub lazy: Option<LazyHandedOut>,
}

impl From<Outcome> for Served {
    fn from(outcome: Outcome) -> Self {
        Self {
            outcome,
            lazy: None,
        }
    }
}
