//! Errors and reports of region creation, preparation and placement.

use std::io;
use std::path::PathBuf;

use clearing::{RunError, RunReport};
use numa::{NodeId, PageLocation, PolicyError};

use crate::mapping::PageSize;
use crate::pools::{Choice, PoolError, PoolSnapshot};

use super::spec::PagePolicy;

/// Errors creating a region.
#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    /// The size is zero or does not fit this process's address space.
    #[error("region size {0} is invalid")]
    BadSize(u64),
    /// The name contains a NUL byte or a `/`.
    #[error("region name {0:?} is invalid")]
    BadName(String),
    /// The node does not exist in the topology.
    #[error("NUMA node {node} does not exist (this host has nodes {available:?})")]
    UnknownNode {
        /// The node asked for.
        node: NodeId,
        /// Nodes that exist.
        available: Vec<NodeId>,
    },
    /// The node has no memory of its own.
    #[error("NUMA node {0} has no memory")]
    MemorylessNode(NodeId),
    /// No allowed page size can serve the request; nothing was allocated.
    #[error("cannot back {size} bytes on {} with page policy {policy}: {}; free pages: {snapshot}", where_(*node), choice.reasons())]
    Unavailable {
        /// Bytes asked for.
        size: u64,
        /// Node asked for.
        node: Option<NodeId>,
        /// The policy.
        policy: PagePolicy,
        /// What was tried and why it did not fit.
        choice: Box<Choice>,
        /// Pool counts at the time of the decision.
        snapshot: Box<PoolSnapshot>,
    },
    /// Pool counts could not be read.
    #[error("cannot read huge-page pool counts")]
    Pools(#[source] PoolError),
    /// The hugetlbfs directory is not on hugetlbfs.
    #[error("{0} is not on a hugetlbfs mount")]
    NotHugetlbfs(PathBuf),
    /// The hugetlbfs mount has a page size we do not manage.
    #[error("{path} is a hugetlbfs mount of {bytes}-byte pages")]
    UnknownMountPageSize {
        /// The directory.
        path: PathBuf,
        /// Its page size.
        bytes: u64,
    },
    /// Creating the memfd or file failed.
    #[error("cannot create the backing file of region {name}")]
    Create {
        /// Region name.
        name: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// `ftruncate` or sealing failed.
    #[error("cannot size the backing file of region {name}")]
    Size {
        /// Region name.
        name: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// `mmap` failed; `ENOMEM` on hugetlb means the host pool could not reserve the pages.
    #[error("cannot map {size} bytes of {page_size} pages (host pool: {snapshot})")]
    Map {
        /// Bytes.
        size: u64,
        /// Page size.
        page_size: PageSize,
        /// Pool counts after the failure.
        snapshot: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// `mbind` failed.
    #[error("cannot bind region {name} to node {node}")]
    Bind {
        /// Region name.
        name: String,
        /// The node.
        node: NodeId,
        /// The cause.
        #[source]
        source: PolicyError,
    },
    /// A [`Region::grow`](crate::Region::grow) request that can never succeed; nothing changed.
    #[error("cannot grow region {name} from {len} to {new_len} bytes: {why}")]
    BadGrow {
        /// Region name.
        name: String,
        /// Current length.
        len: u64,
        /// Length asked for.
        new_len: u64,
        /// Why.
        why: &'static str,
    },
    /// The region's node (or the host) cannot provide the pages a
    /// [`Region::grow`](crate::Region::grow) needs; nothing changed.
    #[error("cannot grow region {name} by {extra} bytes of {page_size} pages on {}: {reason}; free pages: {snapshot}", where_(*node))]
    GrowUnavailable {
        /// Region name.
        name: String,
        /// Bytes to add.
        extra: u64,
        /// The region's page size.
        page_size: PageSize,
        /// The region's node.
        node: Option<NodeId>,
        /// What the pools said.
        reason: String,
        /// Pool counts at the time of the decision.
        snapshot: Box<PoolSnapshot>,
    },
    /// Populating at allocation time failed (see [`Region::allocate`](crate::Region::allocate)).
    #[error("cannot populate region {name}; nothing was kept")]
    Prepare {
        /// Region name.
        name: String,
        /// The cause.
        #[source]
        source: PrepareError,
    },
}

fn where_(node: Option<NodeId>) -> String {
    node.map_or_else(|| "any node".to_string(), |n| format!("node {n}"))
}

/// A page that could not be populated or cleared.
#[derive(Debug, thiserror::Error)]
#[error("cannot populate page {page} ({len} bytes at offset {offset:#x})")]
pub struct PageFailure {
    /// Page index.
    pub page: usize,
    /// Byte offset in the region.
    pub offset: u64,
    /// Bytes of the page.
    pub len: u64,
    /// `EFAULT`/`ENOMEM`: the node (or host) had no page to give.
    #[source]
    pub source: io::Error,
}

/// Errors preparing a region.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// The job runner failed: a page could not be populated, a worker could
    /// not be pinned, the run was cancelled.
    #[error("preparing pages failed")]
    Run(#[source] RunError<PageFailure>),
}

/// What [`Region::prepare_eager`](crate::Region::prepare_eager) did.
#[derive(Debug, Clone, PartialEq)]
pub struct PrepareReport {
    /// Pages populated (fresh; the kernel zeroed them).
    pub populated: usize,
    /// Pages cleared with a clearing kernel (reused).
    pub cleared: usize,
    /// Pages left alone (already clean or mapped, or held by another thread).
    pub skipped: usize,
    /// Bytes populated or cleared.
    pub bytes: u64,
    /// Wall time of the whole call.
    pub seconds: f64,
    /// The runner's per-node report.
    pub run: RunReport,
}

impl PrepareReport {
    /// Bytes populated or cleared per second, in GB/s (10^9).
    pub fn gb_per_s(&self) -> f64 {
        crate::size::gb_per_s(self.bytes, self.seconds)
    }
}

/// Where a region's pages are.
#[derive(Debug, Clone, PartialEq)]
pub struct PlacementReport {
    /// The node the region is bound to (`None`: unbound, any node is fine).
    pub node: Option<NodeId>,
    /// Pages queried: one per huge page, every 4 KiB page of a base-page region.
    pub pages: usize,
    /// Pages on the node (any node, for an unbound region).
    pub on_node: usize,
    /// Pages not present, in granules still `Unpopulated` (expected).
    pub not_present: usize,
    /// Pages elsewhere, or with an unexpected status: (page index in units of
    /// the region's page size, where the kernel says it is).
    pub misplaced: Vec<(usize, PageLocation)>,
    /// Time the `move_pages` queries took.
    pub seconds: f64,
}

/// Why an inherited region was refused.
#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    /// The file is not what the predecessor described.
    #[error("inherited region {name}: {why}")]
    Mismatch {
        /// The region.
        name: String,
        /// What differs.
        why: String,
    },
    /// A syscall on the fd failed.
    #[error("inherited region {name}: {what}")]
    Io {
        /// The region.
        name: String,
        /// The call.
        what: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}
