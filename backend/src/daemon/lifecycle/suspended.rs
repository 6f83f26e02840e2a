//! A connection's lazy allocations while a takeover has their fault
//! services stopped: what restarts each (here, when the takeover is given
//! up, or in the successor), and its record in the state document. The
//! lazy room (`crate::daemon::requests::lazy_allocs`) suspends and resumes
//! them; the lifecycle keeps them with their connection meanwhile.

use std::os::fd::{AsFd, OwnedFd};

use serde::{Deserialize, Serialize};

use crate::daemon::persist::{Persist, RestoreContext, SaveContext, SaveError};
use crate::proto::{RegionInfo, UffdRange};

/// A lazy allocation whose fault service was stopped for a takeover, with
/// what restarts it (here, when the takeover is given up, or in the
/// successor).
#[derive(Debug)]
pub struct Suspended {
    /// Allocation id.
    pub alloc: u64,
    /// The ALLOC reply's region table.
    pub infos: Vec<RegionInfo>,
    /// The UFFD request's mappings.
    pub ranges: Vec<UffdRange>,
    /// The VMM's userfaultfd (a duplicate of the service's), if it had one.
    pub uffd: Option<OwnedFd>,
}

/// A suspended lazy allocation in the state document: its region table,
/// its mappings and its userfaultfd's index in the fd list.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LazyRecord {
    /// Allocation id.
    pub alloc: u64,
    /// The ALLOC reply's region table.
    pub infos: Vec<SavedRegionInfo>,
    /// The UFFD request's mappings, when the VMM handed one over.
    pub ranges: Vec<SavedUffdRange>,
    /// Index of the userfaultfd in the fd list.
    pub uffd: Option<usize>,
}

/// One row of an ALLOC reply's region table ([`RegionInfo`]). Written as
/// version 1 of the document writes it, the array `[region_id, guest_phys,
/// size, page_size, node, flags]`; read from that array or from an object
/// with these names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "[u64; 6]")]
pub struct SavedRegionInfo {
    /// See [`RegionInfo::region_id`].
    pub region_id: u64,
    /// See [`RegionInfo::guest_phys`].
    pub guest_phys: u64,
    /// See [`RegionInfo::size`].
    pub size: u64,
    /// See [`RegionInfo::page_size`].
    pub page_size: u64,
    /// See [`RegionInfo::node`].
    pub node: u64,
    /// See [`RegionInfo::flags`].
    pub flags: u64,
}

impl From<SavedRegionInfo> for [u64; 6] {
    fn from(i: SavedRegionInfo) -> Self {
        [
            i.region_id,
            i.guest_phys,
            i.size,
            i.page_size,
            i.node,
            i.flags,
        ]
    }
}

impl From<&RegionInfo> for SavedRegionInfo {
    fn from(i: &RegionInfo) -> Self {
        Self {
            region_id: i.region_id,
            guest_phys: i.guest_phys,
            size: i.size,
            page_size: i.page_size,
            node: u64::from(i.node),
            flags: u64::from(i.flags),
        }
    }
}

impl From<SavedRegionInfo> for RegionInfo {
    fn from(i: SavedRegionInfo) -> Self {
        Self {
            region_id: i.region_id,
            guest_phys: i.guest_phys,
            size: i.size,
            page_size: i.page_size,
            node: u32::try_from(i.node).unwrap_or(u32::MAX),
            flags: u32::try_from(i.flags).unwrap_or(0),
        }
    }
}

/// One mapping of a UFFD request ([`UffdRange`]). Written as version 1 of
/// the document writes it, the array `[region_id, offset, vmm_addr, len]`;
/// read from that array or from an object with these names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "[u64; 4]")]
pub struct SavedUffdRange {
    /// See [`UffdRange::region_id`].
    pub region_id: u64,
    /// See [`UffdRange::offset`].
    pub offset: u64,
    /// See [`UffdRange::vmm_addr`].
    pub vmm_addr: u64,
    /// See [`UffdRange::len`].
    pub len: u64,
}

impl From<SavedUffdRange> for [u64; 4] {
    fn from(r: SavedUffdRange) -> Self {
        [r.region_id, r.offset, r.vmm_addr, r.len]
    }
}

impl From<&UffdRange> for SavedUffdRange {
    fn from(r: &UffdRange) -> Self {
        Self {
            region_id: r.region_id,
            offset: r.offset,
            vmm_addr: r.vmm_addr,
            len: r.len,
        }
    }
}

impl From<SavedUffdRange> for UffdRange {
    fn from(r: SavedUffdRange) -> Self {
        Self {
            region_id: r.region_id,
            offset: r.offset,
            vmm_addr: r.vmm_addr,
            len: r.len,
        }
    }
}

impl Persist for Suspended {
    type State = LazyRecord;
    type Restored = Suspended;
    type RestoreError = std::convert::Infallible;

    /// Its record, its userfaultfd numbered in the document.
    fn save(&self, ctx: &mut SaveContext<'_>) -> Result<LazyRecord, SaveError> {
        Ok(LazyRecord {
            alloc: self.alloc,
            infos: self.infos.iter().map(SavedRegionInfo::from).collect(),
            ranges: self.ranges.iter().map(SavedUffdRange::from).collect(),
            uffd: self
                .uffd
                .as_ref()
                .map(|u| ctx.fds.add(u.as_fd()))
                .transpose()?,
        })
    }

    /// The suspended allocation the record describes, its userfaultfd
    /// taken from the document's fds.
    fn restore(
        state: LazyRecord,
        ctx: &mut RestoreContext<'_>,
    ) -> Result<Suspended, std::convert::Infallible> {
        Ok(Suspended {
            alloc: state.alloc,
            infos: state.infos.into_iter().map(RegionInfo::from).collect(),
            ranges: state.ranges.into_iter().map(UffdRange::from).collect(),
            uffd: state.uffd.and_then(|i| ctx.fds.take(i)),
        })
    }
}
