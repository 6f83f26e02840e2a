//! What a region is asked to be: size, node, page policy, backing.

use std::fmt;
use std::path::PathBuf;

use numa::NodeId;

use crate::mapping::PageSize;
use crate::state::PageState;

/// Which page sizes a region may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PagePolicy {
    /// Exactly this size, or fail before allocating.
    Strict(PageSize),
    /// 1 GiB, then 2 MiB, then 4 KiB; the fallback is logged and reported.
    Best,
}

impl PagePolicy {
    /// Parses `1G`, `2M`, `4K` (strict) or `best`.
    pub fn parse(text: &str) -> Option<Self> {
        if text.eq_ignore_ascii_case("best") {
            return Some(Self::Best);
        }
        PageSize::parse(text).map(Self::Strict)
    }

    pub(super) fn candidates(self) -> Vec<PageSize> {
        match self {
            Self::Strict(p) => vec![p],
            Self::Best => PageSize::FALLBACK_ORDER.to_vec(),
        }
    }
}

impl fmt::Display for PagePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Strict(p) => write!(f, "{p}"),
            Self::Best => f.write_str("best"),
        }
    }
}

/// Where a region's memory lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backing {
    /// An anonymous memfd (`MFD_HUGETLB|MFD_HUGE_<size>` for huge pages,
    /// plain shmem for 4 KiB).
    Memfd,
    /// A new file in this hugetlbfs directory (its mount fixes the page size;
    /// `Best` then means "the mount's size"); unlinked when the region drops.
    /// For VMMs that take a path (cloud-hypervisor `file=`).
    HugetlbfsDir(PathBuf),
}

/// What to allocate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionSpec {
    /// Bytes; a multiple of the chosen page size.
    pub size: u64,
    /// NUMA node to bind to, or `None` for the default policy.
    pub node: Option<NodeId>,
    /// Page size policy.
    pub policy: PagePolicy,
    /// Memfd or hugetlbfs file.
    pub backing: Backing,
    /// Name for the memfd (`/proc/PID/fd` shows `memfd:NAME`) or file prefix.
    pub name: String,
}

impl RegionSpec {
    /// A memfd region with best-effort page size.
    pub fn new(name: impl Into<String>, size: u64, node: Option<NodeId>) -> Self {
        Self {
            size,
            node,
            policy: PagePolicy::Best,
            backing: Backing::Memfd,
            name: name.into(),
        }
    }

    /// The same spec with `policy`.
    pub fn with_policy(mut self, policy: PagePolicy) -> Self {
        self.policy = policy;
        self
    }

    /// The same spec with `backing`.
    pub fn with_backing(mut self, backing: Backing) -> Self {
        self.backing = backing;
        self
    }
}

/// What the predecessor said about a region, to be checked against its fd.
#[derive(Debug, Clone)]
pub struct AdoptSpec {
    /// The region's name.
    pub name: String,
    /// Its length in bytes.
    pub len: u64,
    /// Its page size.
    pub page_size: PageSize,
    /// The node it is bound to.
    pub node: Option<NodeId>,
    /// The hugetlbfs path of a path-backed region.
    pub path: Option<PathBuf>,
    /// One state per page ([`Region::states`](crate::Region::states)); `Clearing` is taken as
    /// `Dirty` (the clearer was stopped before the takeover).
    pub states: Vec<PageState>,
}
