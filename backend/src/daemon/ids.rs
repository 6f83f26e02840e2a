//! The names the pool gives: region, allocation and connection ids, and
//! the key regions are pooled by.

use guest_mem::PageSize;
use numa::NodeId;

/// A region's id (in ALLOC replies, for REBALANCE).
pub type RegionId = u64;
/// An allocation's id.
pub type AllocId = u64;
/// A connection's id.
pub type SessionId = u64;

/// What regions are pooled by: node and page size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolKey {
    /// NUMA node the region is bound to.
    pub node: NodeId,
    /// Page size.
    pub page_size: PageSize,
    /// A hugetlbfs file with a path (ALLOC with paths) rather than a memfd.
    pub paths: bool,
}
