//! Live huge-page pool counts, read from sysfs at the moment a region is
//! sized, and the page-size choice made from them.
//!
//! # Why read sysfs here and not use `numa::Topology`
//!
//! A [`numa::Topology`] is a snapshot taken whenever its owner detected it;
//! free page counts change with every VM started or stopped. The decision
//! "can this region be backed by 1 GiB pages on node 1" must be made with the
//! counts of *now*, so [`PoolSnapshot::read`] reads the few files it needs
//! each time (a handful of small sysfs reads, microseconds). The topology is
//! still what says which nodes exist.
//!
//! # Why both per-node and host-wide counts
//!
//! hugetlb reservations are global, not per node: a `MAP_SHARED` hugetlb
//! `mmap` reserves from the host pool (`resv_hugepages`) even when `mbind`
//! later restricts allocation to a node whose own pool is empty; the fault
//! then finds no page on the node and the process gets SIGBUS. So a request
//! for `n` pages on node `k` needs `n` free pages in node `k`'s pool *and* `n`
//! unreserved pages host-wide (`free - resv`), or the `mmap` itself fails.
//! Per-node reservations are not visible in sysfs: pages that another mapping
//! reserved but has not faulted in yet are still counted as free on their
//! node. That race is caught one step later, when the region is populated at
//! allocation time (see [`crate::region`]): a shortage is then an error of the
//! allocation, never a SIGBUS in a guest.

use std::fmt;
use std::path::{Path, PathBuf};

use numa::NodeId;

use crate::mapping::PageSize;

/// Errors reading pool counts.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// A sysfs or procfs file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A file did not hold what we expect.
    #[error("cannot parse {path}")]
    Parse {
        /// The file.
        path: PathBuf,
    },
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, PoolError>;

const SYSFS_HOST: &str = "/sys/kernel/mm/hugepages";
const SYSFS_NODES: &str = "/sys/devices/system/node";

/// Counts of one huge-page pool, host-wide or of one node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolCounts {
    /// Page size of the pool.
    pub page_size: PageSize,
    /// `None` for the host-wide pool.
    pub node: Option<NodeId>,
    /// `nr_hugepages`.
    pub total: u64,
    /// `free_hugepages` (reserved but not yet faulted pages count as free).
    pub free: u64,
    /// `resv_hugepages`; host-wide only (the kernel does not keep it per node).
    pub resv: u64,
    /// `surplus_hugepages`.
    pub surplus: u64,
}

impl PoolCounts {
    /// Pages a new reservation can still get: `free - resv`.
    pub fn available(&self) -> u64 {
        self.free.saturating_sub(self.resv)
    }

    /// Reads the pool of `page_size` (a huge size) host-wide or of `node`;
    /// `Ok(None)` when the kernel has no such pool.
    pub fn read(page_size: PageSize, node: Option<NodeId>) -> Result<Option<Self>> {
        let kb = page_size.bytes() / 1024;
        let dir = match node {
            None => PathBuf::from(format!("{SYSFS_HOST}/hugepages-{kb}kB")),
            Some(n) => PathBuf::from(format!("{SYSFS_NODES}/node{n}/hugepages/hugepages-{kb}kB")),
        };
        if !page_size.is_huge() || !dir.is_dir() {
            return Ok(None);
        }
        Ok(Some(Self {
            page_size,
            node,
            total: read_u64(&dir.join("nr_hugepages"))?,
            free: read_u64(&dir.join("free_hugepages"))?,
            resv: if node.is_none() {
                read_u64(&dir.join("resv_hugepages"))?
            } else {
                0
            },
            surplus: read_u64(&dir.join("surplus_hugepages"))?,
        }))
    }
}

fn read_u64(path: &Path) -> Result<u64> {
    let text = std::fs::read_to_string(path).map_err(|source| PoolError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    text.trim().parse().map_err(|_| PoolError::Parse {
        path: path.to_path_buf(),
    })
}

/// Bytes of `field` (in kB) from a meminfo file; per-node files prefix each
/// line with `Node N `.
fn read_meminfo_kb(path: &Path, field: &str) -> Result<u64> {
    let text = std::fs::read_to_string(path).map_err(|source| PoolError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    for line in text.lines() {
        let mut words = line.split_whitespace().skip_while(|w| !w.ends_with(':'));
        if words
            .next()
            .is_some_and(|w| w.trim_end_matches(':') == field)
        {
            if let Some(kb) = words.next().and_then(|v| v.parse::<u64>().ok()) {
                return Ok(kb * 1024);
            }
        }
    }
    Err(PoolError::Parse {
        path: path.to_path_buf(),
    })
}

/// Every pool of the host and of the given nodes, plus free base-page memory,
/// read at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSnapshot {
    /// Host-wide pools (1 GiB, 2 MiB where the kernel has them).
    pub host: Vec<PoolCounts>,
    /// Per-node pools, ascending by node then page size.
    pub nodes: Vec<PoolCounts>,
    /// Bytes of base-page memory free: `MemAvailable` host-wide.
    pub host_mem_available: u64,
    /// Base-page memory each node can give, by node: `MemFree` plus the
    /// page cache and slab the kernel can reclaim (`Active(file)`,
    /// `Inactive(file)`, `SReclaimable`), capped at the host's `MemAvailable`.
    /// `MemFree` alone is far too low on any host with a warm page cache.
    pub node_mem_free: Vec<(NodeId, u64)>,
}

impl PoolSnapshot {
    /// Reads the pools of the host and of `nodes`.
    ///
    /// # Errors
    ///
    /// A sysfs/procfs file that exists but cannot be read or parsed.
    pub fn read(nodes: &[NodeId]) -> Result<Self> {
        let mut snap = Self {
            host: Vec::new(),
            nodes: Vec::new(),
            host_mem_available: 0,
            node_mem_free: Vec::new(),
        };
        for size in [PageSize::Huge1G, PageSize::Huge2M] {
            snap.host.extend(PoolCounts::read(size, None)?);
        }
        for &node in nodes {
            for size in [PageSize::Huge1G, PageSize::Huge2M] {
                snap.nodes.extend(PoolCounts::read(size, Some(node))?);
            }
            let meminfo = PathBuf::from(format!("{SYSFS_NODES}/node{node}/meminfo"));
            // A kernel without NUMA support has no node directories; its one
            // node is the whole host.
            let meminfo = if meminfo.exists() {
                meminfo
            } else {
                PathBuf::from("/proc/meminfo")
            };
            let mut available = read_meminfo_kb(&meminfo, "MemFree")?;
            for reclaimable in ["Active(file)", "Inactive(file)", "SReclaimable"] {
                // Optional: older kernels lack some fields; they only add.
                available =
                    available.saturating_add(read_meminfo_kb(&meminfo, reclaimable).unwrap_or(0));
            }
            snap.node_mem_free.push((node, available));
        }
        snap.host_mem_available = read_meminfo_kb(Path::new("/proc/meminfo"), "MemAvailable")?;
        for (_, available) in &mut snap.node_mem_free {
            *available = (*available).min(snap.host_mem_available);
        }
        Ok(snap)
    }

    /// The pool of `page_size` on `node` (`None` = host-wide).
    pub fn pool(&self, page_size: PageSize, node: Option<NodeId>) -> Option<&PoolCounts> {
        let list = if node.is_none() {
            &self.host
        } else {
            &self.nodes
        };
        list.iter()
            .find(|p| p.page_size == page_size && p.node == node)
    }

    /// Whether `pages` pages of `page_size` can be had on `node` (host-wide
    /// for `None`), and if not, why. Base pages are judged by free memory.
    pub fn availability(
        &self,
        page_size: PageSize,
        pages: u64,
        node: Option<NodeId>,
    ) -> Availability {
        if !page_size.is_huge() {
            let free = match node {
                None => self.host_mem_available,
                Some(n) => self
                    .node_mem_free
                    .iter()
                    .find(|(id, _)| *id == n)
                    .map_or(0, |(_, b)| *b),
            };
            let needed = pages.saturating_mul(page_size.bytes());
            return if free >= needed {
                Availability::Yes
            } else {
                Availability::ShortMemory { needed, free }
            };
        }
        let Some(host) = self.pool(page_size, None) else {
            return Availability::NoPool;
        };
        if host.available() < pages {
            return Availability::ShortHost {
                needed: pages,
                available: host.available(),
            };
        }
        if let Some(n) = node {
            let free = self.pool(page_size, Some(n)).map_or(0, |p| p.free);
            if free < pages {
                return Availability::ShortNode {
                    needed: pages,
                    free,
                };
            }
        }
        Availability::Yes
    }
}

impl fmt::Display for PoolSnapshot {
    /// `host 1G 0 free (0 reserved) of 0, 2M 2 free (0 reserved) of 2; node 0 1G 0 free of 0, 2M 2 free of 2`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("host")?;
        for (i, p) in self.host.iter().enumerate() {
            let sep = if i == 0 { " " } else { ", " };
            write!(
                f,
                "{sep}{} {} free ({} reserved) of {}",
                p.page_size, p.free, p.resv, p.total
            )?;
        }
        let mut last = None;
        for p in &self.nodes {
            if last != p.node {
                write!(f, "; node {}", p.node.unwrap_or_default())?;
            } else {
                f.write_str(",")?;
            }
            write!(f, " {} {} free of {}", p.page_size, p.free, p.total)?;
            last = p.node;
        }
        Ok(())
    }
}

/// Whether a pool can serve a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Availability {
    /// Yes.
    Yes,
    /// The kernel has no pool of this size (no `hugepages-<size>kB`).
    NoPool,
    /// Too few unreserved pages host-wide (`free - resv`).
    ShortHost {
        /// Pages needed.
        needed: u64,
        /// `free - resv`.
        available: u64,
    },
    /// Too few free pages in the node's pool.
    ShortNode {
        /// Pages needed.
        needed: u64,
        /// Free pages of the node.
        free: u64,
    },
    /// Too little free memory for base pages.
    ShortMemory {
        /// Bytes needed.
        needed: u64,
        /// Bytes the node can give (free plus reclaimable), or `MemAvailable`.
        free: u64,
    },
}

/// Why a page size was passed over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skipped {
    /// The region size is not a multiple of the page size.
    NotMultiple,
    /// The page size is fixed by a hugetlbfs mount of another size.
    MountSize,
    /// The pool cannot serve the request.
    Unavailable(Availability),
}

impl fmt::Display for Skipped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Skipped::NotMultiple => f.write_str("the size is not a multiple of it"),
            Skipped::MountSize => f.write_str("the hugetlbfs mount has another page size"),
            Skipped::Unavailable(Availability::Yes) => f.write_str("available"),
            Skipped::Unavailable(Availability::NoPool) => {
                f.write_str("the kernel has no pool of that size")
            }
            Skipped::Unavailable(Availability::ShortHost { needed, available }) => {
                write!(f, "{needed} pages needed, {available} unreserved host-wide")
            }
            Skipped::Unavailable(Availability::ShortNode { needed, free }) => {
                write!(f, "{needed} pages needed, {free} free on the node")
            }
            Skipped::Unavailable(Availability::ShortMemory { needed, free }) => {
                write!(f, "{needed} bytes needed, {free} free")
            }
        }
    }
}

/// The page-size choice: what was picked and what was passed over, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    /// The page size picked, `None` when no candidate could serve.
    pub page_size: Option<PageSize>,
    /// Candidates passed over, largest first.
    pub skipped: Vec<(PageSize, Skipped)>,
}

impl Choice {
    /// "1G: 1 pages needed, 0 unreserved host-wide; 2M: ..." for messages.
    pub fn reasons(&self) -> String {
        self.skipped
            .iter()
            .map(|(p, why)| format!("{p}: {why}"))
            .collect::<Vec<_>>()
            .join("; ")
    }
}

/// Picks the first of `candidates` (largest first) that divides `size`, that
/// `fixed` (the page size of a hugetlbfs mount) allows, and that `available`
/// says can serve it. Pure, so the fallback chain is testable without pools.
pub fn choose(
    candidates: &[PageSize],
    size: u64,
    fixed: Option<PageSize>,
    mut available: impl FnMut(PageSize, u64) -> Availability,
) -> Choice {
    let mut skipped = Vec::new();
    for &page_size in candidates {
        let why = if fixed.is_some_and(|m| m != page_size) {
            Skipped::MountSize
        } else if !size.is_multiple_of(page_size.bytes()) {
            Skipped::NotMultiple
        } else {
            match available(page_size, size / page_size.bytes()) {
                Availability::Yes => {
                    return Choice {
                        page_size: Some(page_size),
                        skipped,
                    }
                }
                other => Skipped::Unavailable(other),
            }
        };
        skipped.push((page_size, why));
    }
    Choice {
        page_size: None,
        skipped,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn snapshot(
        host_1g: (u64, u64),
        node_1g: u64,
        host_2m: (u64, u64),
        node_2m: u64,
    ) -> PoolSnapshot {
        let pool = |page_size, node, free, resv| PoolCounts {
            page_size,
            node,
            total: free,
            free,
            resv,
            surplus: 0,
        };
        PoolSnapshot {
            host: vec![
                pool(PageSize::Huge1G, None, host_1g.0, host_1g.1),
                pool(PageSize::Huge2M, None, host_2m.0, host_2m.1),
            ],
            nodes: vec![
                pool(PageSize::Huge1G, Some(0), node_1g, 0),
                pool(PageSize::Huge2M, Some(0), node_2m, 0),
            ],
            host_mem_available: 8 * GIB,
            node_mem_free: vec![(0, 4 * GIB)],
        }
    }

    #[test]
    fn fallback_chain_from_counts() {
        let all = PageSize::FALLBACK_ORDER;
        // Plenty of everything: 1G.
        let s = snapshot((4, 0), 4, (2048, 0), 2048);
        let c = choose(&all, 2 * GIB, None, |p, n| s.availability(p, n, Some(0)));
        assert_eq!(c.page_size, Some(PageSize::Huge1G));
        assert!(c.skipped.is_empty());
        // 1G pages free but reserved by someone else: fall back to 2M.
        let s = snapshot((2, 2), 2, (2048, 0), 2048);
        let c = choose(&all, 2 * GIB, None, |p, n| s.availability(p, n, Some(0)));
        assert_eq!(c.page_size, Some(PageSize::Huge2M));
        assert_eq!(
            c.skipped,
            vec![(
                PageSize::Huge1G,
                Skipped::Unavailable(Availability::ShortHost {
                    needed: 2,
                    available: 0
                })
            )]
        );
        // Free host-wide but not on the node: fall back twice, to 4K.
        let s = snapshot((4, 0), 0, (2048, 0), 10);
        let c = choose(&all, 2 * GIB, None, |p, n| s.availability(p, n, Some(0)));
        assert_eq!(c.page_size, Some(PageSize::Base4K));
        assert_eq!(c.skipped.len(), 2);
        assert_eq!(
            c.reasons(),
            "1G: 2 pages needed, 0 free on the node; 2M: 1024 pages needed, 10 free on the node"
        );
        // Too big even for base pages on the node.
        let c = choose(&all, 6 * GIB, None, |p, n| s.availability(p, n, Some(0)));
        assert_eq!(c.page_size, None);
        assert_eq!(c.skipped.len(), 3);
        // Not a multiple of 1G.
        let s = snapshot((4, 0), 4, (2048, 0), 2048);
        let c = choose(&all, 6 << 20, None, |p, n| s.availability(p, n, None));
        assert_eq!(c.page_size, Some(PageSize::Huge2M));
        assert_eq!(c.skipped, vec![(PageSize::Huge1G, Skipped::NotMultiple)]);
        // A 2M mount fixes the size.
        let c = choose(&all, 2 * GIB, Some(PageSize::Huge2M), |p, n| {
            s.availability(p, n, None)
        });
        assert_eq!(c.page_size, Some(PageSize::Huge2M));
        assert_eq!(c.skipped, vec![(PageSize::Huge1G, Skipped::MountSize)]);
    }

    #[test]
    fn snapshot_display_names_every_pool() {
        let s = snapshot((1, 1), 1, (4, 0), 4);
        assert_eq!(
            s.to_string(),
            "host 1G 1 free (1 reserved) of 1, 2M 4 free (0 reserved) of 4; node 0 1G 1 free of 1, 2M 4 free of 4"
        );
    }

    #[test]
    fn reads_live_pools() {
        let s = PoolSnapshot::read(&[0]).expect("read pools");
        assert!(s.host_mem_available > 0);
        assert_eq!(s.node_mem_free.len(), 1);
        if let Some(p) = s.pool(PageSize::Huge2M, None) {
            assert!(p.free <= p.total + p.surplus);
        }
        assert_eq!(
            PoolCounts::read(PageSize::Base4K, None).expect("base"),
            None
        );
    }

    #[test]
    fn meminfo_parsing() {
        let dir = std::env::temp_dir().join(format!("guest-mem-meminfo-{}", std::process::id()));
        std::fs::write(
            &dir,
            "Node 0 MemTotal:       24000000 kB\nNode 0 MemFree:        100 kB\n",
        )
        .expect("write");
        assert_eq!(read_meminfo_kb(&dir, "MemFree").expect("parse"), 100 * 1024);
        assert!(read_meminfo_kb(&dir, "MemAvailable").is_err());
        std::fs::remove_file(&dir).expect("rm");
    }
}
