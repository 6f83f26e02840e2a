//! What a move would do, decided before anything changes: a pure
//! [`MovePlan`] from the region's page size, the byte range, where each page
//! is now (a `move_pages` query) and how many pages the target node can take.
//!
//! # Why plan first
//!
//! A hugetlb page migrates whole, and the kernel needs a page of the same
//! size on the target to copy it into. Asking "how many can move" before
//! moving lets the caller refuse a move that cannot finish
//! ([`crate::MoveOptions::allow_partial`] = false) instead of leaving a
//! region split across nodes, and lets the answer be exact: "3 of 4 pages can
//! move: node 1 has 3 free 1G pages". The alternative, trying and reading the
//! per-page statuses, says the same thing only after the region was split.
//!
//! # How the kernel finds a page on the target (kernel 6.x, `mm/hugetlb.c`)
//!
//! `move_pages` migrates with `__GFP_THISNODE`, so the new page always comes
//! from the target node:
//!
//! * first from the target's free pool (`dequeue_hugetlb_folio_nodemask`),
//!   but only while the host has more free than reserved huge pages
//!   (`available_huge_pages`); the source page goes back to the source pool
//!   right after its copy, so host `free - resv` does not change during a
//!   move, and one unreserved page host-wide is enough for the whole move;
//! * when the pool has none, a 2 MiB page can be allocated fresh from the
//!   buddy allocator as a "temporary" huge page
//!   (`alloc_migrate_hugetlb_folio`): the target's pool grows by one and the
//!   source's shrinks by one. 1 GiB (gigantic) pages never take this path,
//!   so a 1 GiB move needs a free 1 GiB page on the target per page.
//!
//! So the plan counts pages the pool *guarantees*, and for 2 MiB pages says
//! that the rest *may* still move. Base (4 KiB) pages are judged by the
//! node's free memory.
//!
//! Validation errors ([`PlanError`]) are a separate enum from the errors of
//! the move itself ([`crate::MigrateError`]), so a caller can tell "your
//! request was wrong" from "the kernel said no".

use std::collections::BTreeMap;
use std::fmt;

use guest_mem::PageSize;
use numa::{NodeId, PageLocation, Topology};
use serde::Serialize;

/// Errors in a move request, found before any syscall.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// The range has no bytes.
    #[error("the range is empty")]
    ZeroLength,
    /// The range does not start and end on page boundaries.
    #[error("range {offset:#x}+{len:#x} is not aligned to {page_size} pages")]
    Unaligned {
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// The region's page size.
        page_size: PageSize,
    },
    /// The range reaches past the end of the region.
    #[error("range {offset:#x}+{len:#x} is outside the {region_len:#x}-byte region")]
    OutOfRange {
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// The region's length.
        region_len: u64,
    },
    /// The mapping itself is not a whole number of aligned pages.
    #[error("mapping at {addr:#x} of {len:#x} bytes is not aligned to {page_size} pages")]
    BadSpan {
        /// Start address.
        addr: usize,
        /// Length.
        len: u64,
        /// Page size.
        page_size: PageSize,
    },
    /// The target node does not exist.
    #[error("NUMA node {node} does not exist (this host has nodes {available:?})")]
    UnknownNode {
        /// The node asked for.
        node: NodeId,
        /// Nodes that exist.
        available: Vec<NodeId>,
    },
    /// The target node has no memory of its own.
    #[error("NUMA node {node} has no memory (nodes with memory: {with_memory:?})")]
    MemorylessNode {
        /// The node asked for.
        node: NodeId,
        /// Nodes that have memory.
        with_memory: Vec<NodeId>,
    },
    /// A rate limit of zero bytes per second would never finish.
    #[error("a rate limit of 0 bytes per second is not allowed")]
    ZeroRate,
    /// A range string did not parse.
    #[error("cannot parse range {0:?} (expected START..END, START.. or .., with K/M/G suffixes)")]
    Syntax(String),
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, PlanError>;

/// A byte range of a region: `offset .. offset + len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ByteRange {
    /// First byte, from the start of the region.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

impl ByteRange {
    /// `offset .. offset + len`.
    pub const fn new(offset: u64, len: u64) -> Self {
        Self { offset, len }
    }

    /// The whole of a region of `region_len` bytes.
    pub const fn whole(region_len: u64) -> Self {
        Self {
            offset: 0,
            len: region_len,
        }
    }

    /// The REBALANCE request's convention: `len == 0` means "to the end".
    /// An offset past the end gives an empty range (refused by validation).
    pub fn from_request(offset: u64, len: u64, region_len: u64) -> Self {
        let len = if len == 0 {
            region_len.saturating_sub(offset)
        } else {
            len
        };
        Self { offset, len }
    }

    /// Parses the CLI's `--range`: `START..END` (end exclusive), `START..`
    /// (to the end) or `..` (everything); numbers in bytes, decimal or `0x`
    /// hex, with an optional `K`/`M`/`G`/`T` suffix (powers of 1024).
    ///
    /// # Errors
    ///
    /// [`PlanError::Syntax`] for anything else, or an end before the start.
    pub fn parse(text: &str, region_len: u64) -> Result<Self> {
        let bad = || PlanError::Syntax(text.to_string());
        let (start, end) = text.trim().split_once("..").ok_or_else(bad)?;
        let start = if start.is_empty() {
            0
        } else {
            guest_mem::size::parse_size(start).map_err(|_| bad())?
        };
        let end = if end.is_empty() {
            region_len
        } else {
            guest_mem::size::parse_size(end).map_err(|_| bad())?
        };
        let len = end.checked_sub(start).ok_or_else(bad)?;
        Ok(Self { offset: start, len })
    }

    /// One past the last byte, if it does not overflow.
    pub fn end(&self) -> Option<u64> {
        self.offset.checked_add(self.len)
    }
}

impl fmt::Display for ByteRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:#x}..{:#x}",
            self.offset,
            self.offset.saturating_add(self.len)
        )
    }
}

/// The pages a validated range covers, as indices into the mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageSpan {
    /// First page index (offset / page size).
    pub first: usize,
    /// Number of pages.
    pub count: usize,
}

/// Checks `range` against a mapping of `region_len` bytes of `page_size`
/// pages and returns the pages it covers.
///
/// # Errors
///
/// [`PlanError::ZeroLength`], [`PlanError::OutOfRange`],
/// [`PlanError::Unaligned`].
pub fn validate_range(region_len: u64, page_size: PageSize, range: ByteRange) -> Result<PageSpan> {
    if range.len == 0 {
        return Err(PlanError::ZeroLength);
    }
    let out_of_range = || PlanError::OutOfRange {
        offset: range.offset,
        len: range.len,
        region_len,
    };
    let end = range.end().ok_or_else(out_of_range)?;
    if end > region_len {
        return Err(out_of_range());
    }
    let ps = page_size.bytes();
    if !range.offset.is_multiple_of(ps) || !range.len.is_multiple_of(ps) {
        return Err(PlanError::Unaligned {
            offset: range.offset,
            len: range.len,
            page_size,
        });
    }
    let index = |bytes: u64| usize::try_from(bytes / ps).map_err(|_| out_of_range());
    Ok(PageSpan {
        first: index(range.offset)?,
        count: index(range.len)?,
    })
}

/// Checks that `node` exists in `topology` and has memory.
///
/// # Errors
///
/// [`PlanError::UnknownNode`] naming the nodes that exist,
/// [`PlanError::MemorylessNode`] naming the nodes with memory.
pub fn validate_target(topology: &Topology, node: NodeId) -> Result<()> {
    let Some(n) = topology.nodes().iter().find(|n| n.id == node) else {
        return Err(PlanError::UnknownNode {
            node,
            available: topology.nodes().iter().map(|n| n.id).collect(),
        });
    };
    if n.is_memoryless() {
        return Err(PlanError::MemorylessNode {
            node,
            with_memory: memory_nodes(topology),
        });
    }
    Ok(())
}

/// Nodes of `topology` that have memory, ascending.
pub fn memory_nodes(topology: &Topology) -> Vec<NodeId> {
    topology
        .nodes()
        .iter()
        .filter(|n| !n.is_memoryless())
        .map(|n| n.id)
        .collect()
}

/// What the target node can take, read just before planning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Capacity {
    /// A hugetlb pool.
    Pool {
        /// `free_hugepages` of the target node's pool of this size.
        free: u64,
        /// Host-wide `free - resv` of this size; the kernel takes pages from
        /// a pool only while it is above zero (see the module docs).
        host_available: u64,
        /// True for 2 MiB pages: when the pool is empty the kernel may
        /// allocate a fresh huge page on the target for the copy.
        fresh_fallback: bool,
    },
    /// Base pages: bytes free on the target node (`MemFree`).
    Memory {
        /// Bytes free.
        free_bytes: u64,
    },
}

/// The decision for one move, before anything changes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MovePlan {
    /// Page size of the mapping, in bytes.
    pub page_size: u64,
    /// The target node.
    pub target: NodeId,
    /// First page of the range (index into the mapping).
    pub first_page: usize,
    /// Pages in the range.
    pub pages_total: usize,
    /// Pages present on another node, to be moved (indices into the mapping, ascending).
    pub to_move: Vec<usize>,
    /// Pages to move, by the node they are on now.
    pub from_nodes: BTreeMap<NodeId, usize>,
    /// Pages already on the target.
    pub already_there: usize,
    /// Pages not present (never touched): nothing to copy; the new policy
    /// places them on the target when they are first touched.
    pub not_present: usize,
    /// Pages the query could not locate, with the (negative) errno it gave.
    pub unlocated: Vec<(usize, i32)>,
    /// What the target can take.
    pub capacity: Capacity,
    /// Pages of `to_move` the target is known to have room for.
    pub guaranteed: usize,
    /// Pages of `to_move` beyond that.
    pub uncovered: usize,
}

impl MovePlan {
    /// Builds the plan from the query result of pages `first_page ..
    /// first_page + locations.len()` of a mapping of `page_size` pages.
    pub fn build(
        page_size: PageSize,
        first_page: usize,
        locations: &[PageLocation],
        target: NodeId,
        capacity: Capacity,
    ) -> Self {
        let mut to_move = Vec::new();
        let mut from_nodes = BTreeMap::new();
        let mut already_there = 0;
        let mut not_present = 0;
        let mut unlocated = Vec::new();
        for (page, loc) in (first_page..).zip(locations) {
            match *loc {
                PageLocation::Node(n) if n == target => already_there += 1,
                PageLocation::Node(n) => {
                    to_move.push(page);
                    *from_nodes.entry(n).or_insert(0) += 1;
                }
                PageLocation::Error(e) if e == -libc::ENOENT => not_present += 1,
                PageLocation::Error(e) => unlocated.push((page, e)),
            }
        }
        let room = match capacity {
            Capacity::Pool {
                free,
                host_available,
                ..
            } => {
                if host_available == 0 {
                    0
                } else {
                    free
                }
            }
            Capacity::Memory { free_bytes } => free_bytes / page_size.bytes(),
        };
        let need = to_move.len();
        let guaranteed = usize::try_from(room).map_or(need, |r| r.min(need));
        Self {
            page_size: page_size.bytes(),
            target,
            first_page,
            pages_total: locations.len(),
            uncovered: need - guaranteed,
            to_move,
            from_nodes,
            already_there,
            not_present,
            unlocated,
            capacity,
            guaranteed,
        }
    }

    /// True when the target has room for every page that must move.
    pub fn fits(&self) -> bool {
        self.uncovered == 0
    }

    /// True when pages beyond the guaranteed ones may still move (2 MiB pages
    /// allocated fresh on the target).
    pub fn may_move_more(&self) -> bool {
        self.uncovered > 0
            && matches!(
                self.capacity,
                Capacity::Pool {
                    fresh_fallback: true,
                    ..
                }
            )
    }

    /// One line: "3 of 4 pages can move: node 1 has 3 free 1G pages (2
    /// already there, 0 not present)".
    pub fn summary(&self) -> String {
        let size = PageSize::from_bytes(self.page_size)
            .map_or_else(|| format!("{}-byte", self.page_size), |p| p.to_string());
        let node = self.target;
        let room = match self.capacity {
            Capacity::Pool {
                free,
                host_available: 0,
                ..
            } => {
                format!("node {node} has {free} free {size} pages but none is unreserved host-wide")
            }
            Capacity::Pool { free, .. } => format!("node {node} has {free} free {size} pages"),
            Capacity::Memory { free_bytes } => {
                format!("node {node} has {} MiB free", free_bytes >> 20)
            }
        };
        let mut line = if self.to_move.is_empty() {
            format!(
                "nothing to move: {} of {} pages already on node {node}",
                self.already_there, self.pages_total
            )
        } else {
            format!(
                "{} of {} pages can move: {room}",
                self.guaranteed,
                self.to_move.len()
            )
        };
        if self.may_move_more() {
            line.push_str(&format!(
                "; the other {} may move if the kernel can allocate fresh {size} pages on node {node}",
                self.uncovered
            ));
        }
        if !self.to_move.is_empty() {
            line.push_str(&format!(
                " ({} already there, {} not present",
                self.already_there, self.not_present
            ));
        } else {
            line.push_str(&format!(" ({} not present", self.not_present));
        }
        if !self.unlocated.is_empty() {
            line.push_str(&format!(", {} could not be located", self.unlocated.len()));
        }
        line.push(')');
        line
    }
}

impl fmt::Display for MovePlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.summary())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const M2: u64 = 2 << 20;
    const G1: u64 = 1 << 30;

    #[test]
    fn range_validation_errors() {
        let ps = PageSize::Huge2M;
        assert_eq!(
            validate_range(8 * M2, ps, ByteRange::new(0, 0)),
            Err(PlanError::ZeroLength)
        );
        assert!(matches!(
            validate_range(8 * M2, ps, ByteRange::new(4096, M2)),
            Err(PlanError::Unaligned { offset: 4096, .. })
        ));
        assert!(matches!(
            validate_range(8 * M2, ps, ByteRange::new(0, M2 + 4096)),
            Err(PlanError::Unaligned { .. })
        ));
        assert!(matches!(
            validate_range(8 * M2, ps, ByteRange::new(6 * M2, 4 * M2)),
            Err(PlanError::OutOfRange { region_len, .. }) if region_len == 8 * M2
        ));
        assert!(matches!(
            validate_range(8 * M2, ps, ByteRange::new(u64::MAX - M2 + 1, 2 * M2)),
            Err(PlanError::OutOfRange { .. })
        ));
        assert_eq!(
            validate_range(8 * M2, ps, ByteRange::new(2 * M2, 4 * M2)),
            Ok(PageSpan { first: 2, count: 4 })
        );
        assert_eq!(
            validate_range(2 * G1, PageSize::Huge1G, ByteRange::whole(2 * G1)),
            Ok(PageSpan { first: 0, count: 2 })
        );
        // Messages are sentences that name the numbers.
        let msg = validate_range(8 * M2, ps, ByteRange::new(4096, M2))
            .expect_err("unaligned")
            .to_string();
        assert_eq!(msg, "range 0x1000+0x200000 is not aligned to 2M pages");
    }

    #[test]
    fn range_parsing() {
        let len = 4 * G1;
        assert_eq!(ByteRange::parse("..", len), Ok(ByteRange::whole(len)));
        assert_eq!(
            ByteRange::parse("1G..3G", len),
            Ok(ByteRange::new(G1, 2 * G1))
        );
        assert_eq!(
            ByteRange::parse("2G..", len),
            Ok(ByteRange::new(2 * G1, 2 * G1))
        );
        assert_eq!(
            ByteRange::parse("0x200000..4M", len),
            Ok(ByteRange::new(M2, M2))
        );
        assert_eq!(
            ByteRange::parse("..512m", len),
            Ok(ByteRange::new(0, 512 << 20))
        );
        for bad in ["", "1G", "3G..1G", "x..", "1Q..2G", "..-1"] {
            assert!(
                matches!(ByteRange::parse(bad, len), Err(PlanError::Syntax(_))),
                "{bad:?} parsed"
            );
        }
        assert_eq!(ByteRange::new(M2, M2).to_string(), "0x200000..0x400000");
    }

    #[test]
    fn request_len_zero_means_to_end() {
        assert_eq!(
            ByteRange::from_request(M2, 0, 8 * M2),
            ByteRange::new(M2, 7 * M2)
        );
        assert_eq!(
            ByteRange::from_request(M2, M2, 8 * M2),
            ByteRange::new(M2, M2)
        );
        // Past the end: empty, which validation refuses.
        let r = ByteRange::from_request(9 * M2, 0, 8 * M2);
        assert_eq!(
            validate_range(8 * M2, PageSize::Huge2M, r),
            Err(PlanError::ZeroLength)
        );
    }

    fn pool(free: u64, fresh: bool) -> Capacity {
        Capacity::Pool {
            free,
            host_available: 8,
            fresh_fallback: fresh,
        }
    }

    #[test]
    fn plan_counts_pages_by_where_they_are() {
        use PageLocation::{Error, Node};
        let locs = [
            Node(0),
            Node(1),
            Node(0),
            Error(-libc::ENOENT),
            Node(2),
            Error(-libc::EFAULT),
        ];
        let plan = MovePlan::build(PageSize::Huge1G, 10, &locs, 1, pool(1, false));
        assert_eq!(plan.to_move, vec![10, 12, 14]);
        assert_eq!(plan.from_nodes, BTreeMap::from([(0, 2), (2, 1)]));
        assert_eq!(plan.already_there, 1);
        assert_eq!(plan.not_present, 1);
        assert_eq!(plan.unlocated, vec![(15, -libc::EFAULT)]);
        assert_eq!((plan.guaranteed, plan.uncovered), (1, 2));
        assert!(!plan.fits());
        assert!(!plan.may_move_more(), "1G pages have no fresh fallback");
        assert_eq!(
            plan.summary(),
            "1 of 3 pages can move: node 1 has 1 free 1G pages \
             (1 already there, 1 not present, 1 could not be located)"
        );
    }

    #[test]
    fn plan_for_2m_mentions_fresh_allocation() {
        let locs = [PageLocation::Node(0); 4];
        let plan = MovePlan::build(PageSize::Huge2M, 0, &locs, 1, pool(3, true));
        assert_eq!((plan.guaranteed, plan.uncovered), (3, 1));
        assert!(plan.may_move_more());
        assert_eq!(
            plan.summary(),
            "3 of 4 pages can move: node 1 has 3 free 2M pages; the other 1 may move \
             if the kernel can allocate fresh 2M pages on node 1 (0 already there, 0 not present)"
        );
    }

    #[test]
    fn plan_with_no_unreserved_pages_guarantees_nothing() {
        let locs = [PageLocation::Node(0); 2];
        let cap = Capacity::Pool {
            free: 5,
            host_available: 0,
            fresh_fallback: false,
        };
        let plan = MovePlan::build(PageSize::Huge1G, 0, &locs, 1, cap);
        assert_eq!((plan.guaranteed, plan.uncovered), (0, 2));
        assert!(plan.summary().contains("none is unreserved host-wide"));
    }

    #[test]
    fn plan_all_already_there() {
        let locs = [PageLocation::Node(0); 4];
        let plan = MovePlan::build(PageSize::Huge2M, 0, &locs, 0, pool(0, true));
        assert!(plan.fits());
        assert!(plan.to_move.is_empty());
        assert_eq!(
            plan.summary(),
            "nothing to move: 4 of 4 pages already on node 0 (0 not present)"
        );
    }

    #[test]
    fn plan_base_pages_by_free_memory() {
        let locs = [PageLocation::Node(0); 300];
        let cap = Capacity::Memory {
            free_bytes: (1 << 20) + 5,
        };
        let plan = MovePlan::build(PageSize::Base4K, 0, &locs, 1, cap);
        assert_eq!((plan.guaranteed, plan.uncovered), (256, 44));
        assert!(!plan.may_move_more());
        assert!(plan
            .summary()
            .starts_with("256 of 300 pages can move: node 1 has 1 MiB free"));
    }

    #[test]
    fn target_validation_names_nodes() {
        let tree = test_support::fixture::SysTree::two_nodes_one_memoryless();
        let topo = tree.parse(numa::Topology::from_sysfs);
        assert_eq!(validate_target(&topo, 0), Ok(()));
        assert_eq!(
            validate_target(&topo, 7),
            Err(PlanError::UnknownNode {
                node: 7,
                available: vec![0, 1]
            })
        );
        let err = validate_target(&topo, 1).expect_err("memoryless");
        assert_eq!(
            err.to_string(),
            "NUMA node 1 has no memory (nodes with memory: [0])"
        );
    }

    proptest! {
        /// Every page of the range lands in exactly one bucket, and the
        /// guarantee never exceeds what must move or what the pool holds.
        #[test]
        fn plan_partitions_pages(
            raw in proptest::collection::vec(-3i32..4, 0..200),
            free in 0u64..300,
            target in 0u32..3,
        ) {
            let locs: Vec<PageLocation> = raw
                .iter()
                .map(|&v| match v {
                    -3 => PageLocation::Error(-libc::ENOENT),
                    -2 => PageLocation::Error(-libc::EFAULT),
                    -1 => PageLocation::Error(-libc::EBUSY),
                    // 0..=3 as nodes
                    n => PageLocation::Node(n.unsigned_abs()),
                })
                .collect();
            let plan = MovePlan::build(PageSize::Huge2M, 5, &locs, target, pool(free, true));
            prop_assert_eq!(
                plan.to_move.len() + plan.already_there + plan.not_present + plan.unlocated.len(),
                locs.len()
            );
            prop_assert_eq!(plan.from_nodes.values().sum::<usize>(), plan.to_move.len());
            prop_assert!(!plan.from_nodes.contains_key(&target));
            prop_assert_eq!(plan.guaranteed + plan.uncovered, plan.to_move.len());
            prop_assert!(plan.guaranteed as u64 <= free);
            prop_assert!(plan.to_move.windows(2).all(|w| w[0] < w[1]));
        }

        /// Validated spans stay inside the region and are page aligned.
        #[test]
        fn validated_spans_are_inside(offset in 0u64..64, len in 0u64..64, pages in 1u64..48) {
            let ps = PageSize::Huge2M;
            let range = ByteRange::new(offset * M2 / 2, len * M2 / 2);
            match validate_range(pages * M2, ps, range) {
                Ok(span) => {
                    prop_assert!(span.count > 0);
                    prop_assert!((span.first + span.count) as u64 <= pages);
                    prop_assert_eq!(span.first as u64 * M2, range.offset);
                }
                Err(PlanError::ZeroLength) => prop_assert_eq!(range.len, 0),
                Err(PlanError::OutOfRange { .. }) => prop_assert!(range.offset + range.len > pages * M2),
                Err(PlanError::Unaligned { .. }) => prop_assert!(!range.offset.is_multiple_of(M2) || !range.len.is_multiple_of(M2)),
                Err(e) => prop_assert!(false, "unexpected {e}"),
            }
        }
    }
}
