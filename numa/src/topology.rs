//! NUMA topology read from sysfs.
//!
//! [`Topology::detect`] reads `/sys/devices/system/node/nodeN/*` and
//! `/sys/devices/system/cpu/online` once and keeps a plain snapshot: node ids,
//! online CPUs, memory, the distance row and the per-node huge-page pools.
//! [`Topology::from_sysfs`] reads the same layout under any root, which is how
//! the tests feed it fixture trees.
//!
//! # Design
//!
//! sysfs is the kernel's own description and needs no library. libnuma does
//! not build here and the hwloc crates return wrong data (see the crate docs),
//! so this module parses the handful of files it needs itself. The snapshot is
//! not refreshed: huge-page counts in it are a hint at start-up, and code that
//! needs the current pool size reads it again.
//!
//! Nodes are the kernel's *online* nodes (`node/online`, or the `nodeN`
//! directories when that file is absent). The kernel prints each node's
//! `distance` row over the same online nodes in the same order, so
//! `Node::distances[i]` is the distance to `Topology::nodes()[i]`; a row of a
//! different length is refused as a parse error rather than mis-indexed.
//!
//! # Limitations
//!
//! On a kernel built without NUMA there is no `node/` directory. The topology
//! is then a single node 0 holding every online CPU, with distance row `[10]`
//! and no huge-page pools (the global pools under `/sys/kernel/mm/hugepages`
//! are not read). [`Topology::detect`] fills its memory from `/proc/meminfo`;
//! [`Topology::from_sysfs`] leaves it 0.

use std::collections::BTreeSet;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use tracing::debug;

/// A NUMA node id as the kernel numbers it.
pub type NodeId = u32;

/// Errors reading the topology.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    /// A sysfs file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A sysfs file did not have the expected format.
    #[error("cannot parse {path}: {reason}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        reason: String,
    },
    /// A cpulist string was malformed.
    #[error("malformed cpulist {0:?}")]
    Cpulist(String),
    /// A node id that the topology does not have.
    #[error("no NUMA node {node}; this host has nodes {available:?}")]
    UnknownNode {
        /// The id asked for.
        node: NodeId,
        /// The ids that exist.
        available: Vec<NodeId>,
    },
}

/// One huge-page pool of one node: `/sys/devices/system/node/nodeN/hugepages/hugepages-<size>kB`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HugePagePool {
    /// Page size in bytes.
    pub page_size: u64,
    /// `nr_hugepages`.
    pub total: u64,
    /// `free_hugepages`.
    pub free: u64,
    /// `surplus_hugepages`.
    pub surplus: u64,
}

/// One NUMA node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    /// Kernel node id.
    pub id: NodeId,
    /// Online CPUs of the node, ascending.
    pub cpus: Vec<usize>,
    /// CPUs listed for the node that are offline.
    pub offline_cpus: Vec<usize>,
    /// `MemTotal` of the node, bytes.
    pub mem_total: u64,
    /// `MemFree` of the node, bytes.
    pub mem_free: u64,
    /// Distances to every node, indexed like `Topology::nodes` (the `distance` file).
    pub distances: Vec<u32>,
    /// Huge-page pools of the node, ascending by page size.
    pub huge_pages: Vec<HugePagePool>,
}

impl Node {
    /// True when the node has no memory (CPUs only).
    pub fn is_memoryless(&self) -> bool {
        self.mem_total == 0
    }
    /// The pool for `page_size` bytes, if the kernel has one.
    pub fn huge_pool(&self, page_size: u64) -> Option<&HugePagePool> {
        self.huge_pages.iter().find(|p| p.page_size == page_size)
    }
}

/// The host's NUMA topology.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    nodes: Vec<Node>,
}

/// The kernel's distance of a node to itself (`LOCAL_DISTANCE`).
const LOCAL_DISTANCE: u32 = 10;

/// Largest CPU or node id `parse_cpulist` accepts. Far above any kernel's
/// `NR_CPUS` (8192 at most) or `MAX_NUMNODES` (1024), and it bounds what a
/// malformed range like `0-4294967295` could make us allocate.
const MAX_CPULIST_ID: usize = (1 << 20) - 1;

impl Topology {
    /// Reads the live topology from `/sys/devices/system`.
    ///
    /// On a kernel without NUMA support, node 0's memory comes from
    /// `/proc/meminfo` (see the module docs).
    ///
    /// # Errors
    ///
    /// As [`Topology::from_sysfs`], plus reading `/proc/meminfo` in that case.
    pub fn detect() -> Result<Self, TopologyError> {
        Self::read(
            Path::new("/sys/devices/system"),
            Some(Path::new("/proc/meminfo")),
        )
    }
    /// Reads a topology from a tree laid out like `/sys/devices/system`
    /// (`node/nodeN/...` and `cpu/online`); used with fixture trees in tests.
    ///
    /// # Errors
    ///
    /// [`TopologyError::Read`] when a required file is missing or unreadable
    /// (`cpu/online`, and each node's `cpulist`, `meminfo` and `distance`;
    /// `node/online` and `hugepages/` are optional), [`TopologyError::Parse`]
    /// when one is malformed or a distance row does not match the node count.
    pub fn from_sysfs(root: &Path) -> Result<Self, TopologyError> {
        Self::read(root, None)
    }
    /// All nodes, ascending by id.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }
    /// Node `id`, or `UnknownNode` naming the ids that exist.
    ///
    /// # Errors
    ///
    /// [`TopologyError::UnknownNode`] when there is no node `id`.
    pub fn node(&self, id: NodeId) -> Result<&Node, TopologyError> {
        self.nodes
            .iter()
            .find(|n| n.id == id)
            .ok_or_else(|| TopologyError::UnknownNode {
                node: id,
                available: self.nodes.iter().map(|n| n.id).collect(),
            })
    }
    /// Distance from `a` to `b` as the kernel reports it.
    ///
    /// `None` when either node is unknown.
    pub fn distance(&self, a: NodeId, b: NodeId) -> Option<u32> {
        let b_index = self.index_of(b)?;
        self.node(a).ok()?.distances.get(b_index).copied()
    }
    /// The node that owns `cpu`.
    ///
    /// Offline CPUs count too: they still belong to the node whose `cpulist`
    /// names them (they are in [`Node::offline_cpus`]).
    pub fn node_of_cpu(&self, cpu: usize) -> Option<NodeId> {
        self.nodes
            .iter()
            .find(|n| n.cpus.contains(&cpu))
            .or_else(|| self.nodes.iter().find(|n| n.offline_cpus.contains(&cpu)))
            .map(|n| n.id)
    }

    /// Position of node `id` in `nodes` (and in every distance row).
    fn index_of(&self, id: NodeId) -> Option<usize> {
        self.nodes.iter().position(|n| n.id == id)
    }

    /// Reads the tree under `root`; `proc_meminfo` feeds the no-NUMA fallback.
    fn read(root: &Path, proc_meminfo: Option<&Path>) -> Result<Self, TopologyError> {
        let cpu_online_path = root.join("cpu/online");
        let online: BTreeSet<usize> = read_cpulist_file(&cpu_online_path)?.into_iter().collect();

        let node_root = root.join("node");
        if !node_root.is_dir() {
            debug!(root = %root.display(), "no node/ directory: kernel without NUMA, one node 0");
            let (mem_total, mem_free) = match proc_meminfo {
                Some(path) => parse_meminfo(path, &read_to_string(path)?, None)?,
                None => (0, 0),
            };
            return Ok(Self {
                nodes: vec![Node {
                    id: 0,
                    cpus: online.into_iter().collect(),
                    offline_cpus: Vec::new(),
                    mem_total,
                    mem_free,
                    distances: vec![LOCAL_DISTANCE],
                    huge_pages: Vec::new(),
                }],
            });
        }

        let ids = node_ids(&node_root)?;
        let mut nodes = Vec::with_capacity(ids.len());
        for &id in &ids {
            let dir = node_root.join(format!("node{id}"));
            let listed = read_cpulist_file(&dir.join("cpulist"))?;
            let (cpus, offline_cpus) = listed.into_iter().partition(|c| online.contains(c));

            let meminfo_path = dir.join("meminfo");
            let (mem_total, mem_free) =
                parse_meminfo(&meminfo_path, &read_to_string(&meminfo_path)?, Some(id))?;

            let distance_path = dir.join("distance");
            let distances = parse_distances(&distance_path, &read_to_string(&distance_path)?)?;
            if distances.len() != ids.len() {
                return Err(TopologyError::Parse {
                    path: distance_path,
                    reason: format!(
                        "{} distances for {} online nodes",
                        distances.len(),
                        ids.len()
                    ),
                });
            }

            nodes.push(Node {
                id,
                cpus,
                offline_cpus,
                mem_total,
                mem_free,
                distances,
                huge_pages: read_huge_pools(&dir.join("hugepages"))?,
            });
        }
        Ok(Self { nodes })
    }
}

/// Parses a kernel cpulist such as `0-3,8,10-11` (empty string = no CPUs).
///
/// Accepts what the kernel prints (`%*pbl`): comma-separated single ids and
/// `a-b` ranges with `a <= b`, optionally followed by a newline. The result is
/// ascending without duplicates. Anything else is refused, including empty
/// elements (`1,,2`), reversed ranges (`3-1`), signs, spaces and the stride
/// syntax `0-7:2` that sysfs never prints.
///
/// # Errors
///
/// [`TopologyError::Cpulist`] with the input when it is malformed or names an
/// id above 2^20 - 1.
pub fn parse_cpulist(list: &str) -> Result<Vec<usize>, TopologyError> {
    let bad = || TopologyError::Cpulist(list.to_owned());
    let body = list.strip_suffix('\n').unwrap_or(list);
    if body.is_empty() {
        return Ok(Vec::new());
    }
    let id = |s: &str| -> Result<usize, TopologyError> {
        // `str::parse` would also take a leading `+`; sysfs prints digits only.
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let n: usize = s.parse().map_err(|_| bad())?;
        if n > MAX_CPULIST_ID {
            return Err(bad());
        }
        Ok(n)
    };
    let mut out = BTreeSet::new();
    for part in body.split(',') {
        match part.split_once('-') {
            Some((lo, hi)) => {
                let (lo, hi) = (id(lo)?, id(hi)?);
                if lo > hi {
                    return Err(bad());
                }
                out.extend(lo..=hi);
            }
            None => {
                out.insert(id(part)?);
            }
        }
    }
    Ok(out.into_iter().collect())
}

/// Reads a file to a string, as [`TopologyError::Read`] on failure.
fn read_to_string(path: &Path) -> Result<String, TopologyError> {
    fs::read_to_string(path).map_err(|source| TopologyError::Read {
        path: path.to_owned(),
        source,
    })
}

/// Reads and parses a cpulist-format file (`cpu/online`, `nodeN/cpulist`, `node/online`).
fn read_cpulist_file(path: &Path) -> Result<Vec<usize>, TopologyError> {
    let text = read_to_string(path)?;
    parse_cpulist(&text).map_err(|_| TopologyError::Parse {
        path: path.to_owned(),
        reason: format!("malformed list {:?}", text.trim_end()),
    })
}

/// The online node ids under `node_root`: `node/online` when present, else
/// every `nodeN` directory. Ascending.
fn node_ids(node_root: &Path) -> Result<Vec<NodeId>, TopologyError> {
    let online_path = node_root.join("online");
    if online_path.exists() {
        return read_cpulist_file(&online_path)?
            .into_iter()
            .map(|id| {
                NodeId::try_from(id).map_err(|_| TopologyError::Parse {
                    path: online_path.clone(),
                    reason: format!("node id {id} out of range"),
                })
            })
            .collect();
    }
    let read_err = |source| TopologyError::Read {
        path: node_root.to_owned(),
        source,
    };
    let mut ids = Vec::new();
    for entry in fs::read_dir(node_root).map_err(read_err)? {
        let entry = entry.map_err(read_err)?;
        let name = entry.file_name();
        let Some(digits) = name.to_str().and_then(|n| n.strip_prefix("node")) else {
            continue;
        };
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        if let Ok(id) = digits.parse::<NodeId>() {
            ids.push(id);
        }
    }
    ids.sort_unstable();
    Ok(ids)
}

/// `MemTotal` and `MemFree` in bytes from a node `meminfo`
/// (`Node 0 MemTotal:  24570000 kB`, with `node = Some(0)`) or from
/// `/proc/meminfo` (`MemTotal:  24570000 kB`, with `node = None`).
fn parse_meminfo(
    path: &Path,
    text: &str,
    node: Option<NodeId>,
) -> Result<(u64, u64), TopologyError> {
    let parse_err = |reason: String| TopologyError::Parse {
        path: path.to_owned(),
        reason,
    };
    let (mut total, mut free) = (None, None);
    for line in text.lines() {
        let mut fields = line.split_whitespace();
        if let Some(id) = node {
            // Lines of a node file start with `Node <id>`.
            let (Some("Node"), Some(n)) = (fields.next(), fields.next()) else {
                continue;
            };
            if n.parse::<NodeId>().ok() != Some(id) {
                return Err(parse_err(format!("line {line:?} is not about node {id}")));
            }
        }
        let slot = match fields.next() {
            Some("MemTotal:") => &mut total,
            Some("MemFree:") => &mut free,
            _ => continue,
        };
        let (Some(value), Some("kB"), None) = (fields.next(), fields.next(), fields.next()) else {
            return Err(parse_err(format!("expected `<number> kB` in {line:?}")));
        };
        let kb: u64 = value
            .parse()
            .map_err(|_| parse_err(format!("bad number in {line:?}")))?;
        let bytes = kb
            .checked_mul(1024)
            .ok_or_else(|| parse_err(format!("{kb} kB overflows")))?;
        *slot = Some(bytes);
    }
    match (total, free) {
        (Some(t), Some(f)) => Ok((t, f)),
        (None, _) => Err(parse_err("no MemTotal line".to_owned())),
        (_, None) => Err(parse_err("no MemFree line".to_owned())),
    }
}

/// The space-separated numbers of a node's `distance` file.
fn parse_distances(path: &Path, text: &str) -> Result<Vec<u32>, TopologyError> {
    text.split_whitespace()
        .map(|d| {
            d.parse::<u32>().map_err(|_| TopologyError::Parse {
                path: path.to_owned(),
                reason: format!("bad distance {d:?}"),
            })
        })
        .collect()
}

/// The pools under a node's `hugepages/` directory, ascending by page size;
/// empty when the directory does not exist (kernel without hugetlb).
/// Entries not named `hugepages-<n>kB` are skipped.
fn read_huge_pools(dir: &Path) -> Result<Vec<HugePagePool>, TopologyError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(TopologyError::Read {
                path: dir.to_owned(),
                source,
            })
        }
    };
    let mut pools = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| TopologyError::Read {
            path: dir.to_owned(),
            source,
        })?;
        let name = entry.file_name();
        let Some(kb) = name
            .to_str()
            .and_then(|n| n.strip_prefix("hugepages-"))
            .and_then(|n| n.strip_suffix("kB"))
            .and_then(|n| n.parse::<u64>().ok())
        else {
            debug!(entry = ?name, "skipping unexpected entry in hugepages/");
            continue;
        };
        let pool_dir = entry.path();
        let page_size = kb.checked_mul(1024).ok_or_else(|| TopologyError::Parse {
            path: pool_dir.clone(),
            reason: format!("page size {kb} kB overflows"),
        })?;
        pools.push(HugePagePool {
            page_size,
            total: read_count(&pool_dir.join("nr_hugepages"))?,
            free: read_count(&pool_dir.join("free_hugepages"))?,
            surplus: read_count(&pool_dir.join("surplus_hugepages"))?,
        });
    }
    pools.sort_unstable_by_key(|p| p.page_size);
    Ok(pools)
}

/// A file holding one decimal number.
fn read_count(path: &Path) -> Result<u64, TopologyError> {
    let text = read_to_string(path)?;
    text.trim().parse().map_err(|_| TopologyError::Parse {
        path: path.to_owned(),
        reason: format!("expected a number, got {:?}", text.trim_end()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_support::fixture::SysTree as Tree;

    const KB: u64 = 1024;

    #[test]
    fn cpulist_valid() {
        assert_eq!(parse_cpulist("").expect("empty"), Vec::<usize>::new());
        assert_eq!(
            parse_cpulist("\n").expect("newline only"),
            Vec::<usize>::new()
        );
        assert_eq!(parse_cpulist("0").expect("single"), vec![0]);
        assert_eq!(parse_cpulist("0-3").expect("range"), vec![0, 1, 2, 3]);
        assert_eq!(parse_cpulist("5-5").expect("unit range"), vec![5]);
        assert_eq!(
            parse_cpulist("0-3,8,10-11\n").expect("mixed"),
            vec![0, 1, 2, 3, 8, 10, 11]
        );
        assert_eq!(parse_cpulist("8,0-1").expect("unordered"), vec![0, 1, 8]);
        assert_eq!(parse_cpulist("1,1,0-1").expect("dup"), vec![0, 1]);
        assert_eq!(parse_cpulist("1048575").expect("max id"), vec![1_048_575]);
    }

    #[test]
    fn cpulist_invalid() {
        for bad in [
            "3-1",
            "a",
            "1,,2",
            ",",
            "1,",
            ",1",
            "-",
            "1-",
            "-1",
            "0-3-5",
            " 1",
            "1 ",
            "+1",
            "0-7:2",
            "1\n\n",
            "0x1",
            "1048576",
            "0-4294967295",
            "99999999999999999999999",
        ] {
            match parse_cpulist(bad) {
                Err(TopologyError::Cpulist(s)) => assert_eq!(s, bad),
                other => panic!("{bad:?} gave {other:?}"),
            }
        }
    }

    #[test]
    fn one_node() {
        let tree = Tree::new().cpu_online("0-1").node(
            0,
            "0-1",
            24_570_000,
            &[10],
            &[(2048, 8, 6, 1), (1_048_576, 4, 3, 0)],
        );
        let topo = tree.parse(Topology::from_sysfs);
        assert_eq!(topo.nodes().len(), 1);
        let n = topo.node(0).expect("node 0");
        assert_eq!(n.id, 0);
        assert_eq!(n.cpus, vec![0, 1]);
        assert!(n.offline_cpus.is_empty());
        assert_eq!(n.mem_total, 24_570_000 * KB);
        assert_eq!(n.mem_free, Tree::mem_free_kb(24_570_000) * KB);
        assert!(!n.is_memoryless());
        assert_eq!(n.distances, vec![10]);
        assert_eq!(
            n.huge_pages,
            vec![
                HugePagePool {
                    page_size: 2 << 20,
                    total: 8,
                    free: 6,
                    surplus: 1
                },
                HugePagePool {
                    page_size: 1 << 30,
                    total: 4,
                    free: 3,
                    surplus: 0
                },
            ]
        );
        assert_eq!(n.huge_pool(crate::HUGE_PAGE_1G).map(|p| p.free), Some(3));
        assert_eq!(n.huge_pool(crate::HUGE_PAGE_2M).map(|p| p.total), Some(8));
        assert_eq!(n.huge_pool(64 * KB), None);
        assert_eq!(topo.distance(0, 0), Some(10));
        assert_eq!(topo.distance(0, 1), None);
        assert_eq!(topo.node_of_cpu(1), Some(0));
        assert_eq!(topo.node_of_cpu(2), None);
    }

    #[test]
    fn two_nodes() {
        let tree = Tree::new()
            .cpu_online("0-7")
            .node_online("0-1")
            .node(0, "0-3", 1000, &[10, 21], &[(2048, 2, 2, 0)])
            .node(1, "4-7", 2000, &[21, 10], &[(2048, 0, 0, 0)]);
        let topo = tree.parse(Topology::from_sysfs);
        let ids: Vec<_> = topo.nodes().iter().map(|n| n.id).collect();
        assert_eq!(ids, vec![0, 1]);
        assert_eq!(topo.node(1).expect("node 1").cpus, vec![4, 5, 6, 7]);
        assert_eq!(topo.node(1).expect("node 1").mem_total, 2000 * KB);
        assert_eq!(topo.distance(0, 1), Some(21));
        assert_eq!(topo.distance(1, 0), Some(21));
        assert_eq!(topo.distance(1, 1), Some(10));
        assert_eq!(topo.node_of_cpu(3), Some(0));
        assert_eq!(topo.node_of_cpu(4), Some(1));
        assert_eq!(topo.node_of_cpu(8), None);
        let pool = topo
            .node(1)
            .expect("node 1")
            .huge_pool(crate::HUGE_PAGE_2M)
            .copied();
        assert_eq!(
            pool,
            Some(HugePagePool {
                page_size: 2 << 20,
                total: 0,
                free: 0,
                surplus: 0
            })
        );
    }

    #[test]
    fn four_nodes_without_online_file_sorted_by_id() {
        // Written out of order, and node 10 > node 2 numerically but not lexically.
        let d = |i: u32| -> Vec<u32> {
            (0..4)
                .map(|j| if i == j { 10 } else { 20 + i + j })
                .collect()
        };
        let tree = Tree::new()
            .cpu_online("0-15")
            .node(10, "12-15", 4000, &d(3), &[])
            .node(2, "8-11", 3000, &d(2), &[])
            .node(0, "0-3", 1000, &d(0), &[])
            .node(1, "4-7", 2000, &d(1), &[]);
        let topo = tree.parse(Topology::from_sysfs);
        let ids: Vec<_> = topo.nodes().iter().map(|n| n.id).collect();
        assert_eq!(ids, vec![0, 1, 2, 10]);
        assert_eq!(topo.distance(0, 10), Some(23));
        assert_eq!(topo.distance(10, 2), Some(25));
        assert_eq!(topo.distance(2, 2), Some(10));
        assert_eq!(topo.distance(1, 2), Some(23));
        assert_eq!(topo.distance(3, 0), None);
        assert_eq!(topo.node_of_cpu(13), Some(10));
        assert_eq!(topo.node_of_cpu(9), Some(2));
        for n in topo.nodes() {
            assert_eq!(n.distances.len(), 4);
            assert!(n.huge_pages.is_empty());
        }
    }

    #[test]
    fn offline_cpu_is_split_out() {
        let tree = Tree::new()
            .cpu_online("0,2-3")
            .node(0, "0-1", 1000, &[10, 20], &[])
            .node(1, "2-3", 1000, &[20, 10], &[]);
        let topo = tree.parse(Topology::from_sysfs);
        let n0 = topo.node(0).expect("node 0");
        assert_eq!(n0.cpus, vec![0]);
        assert_eq!(n0.offline_cpus, vec![1]);
        assert_eq!(topo.node(1).expect("node 1").cpus, vec![2, 3]);
        assert!(topo.node(1).expect("node 1").offline_cpus.is_empty());
        // An offline CPU still belongs to its node.
        assert_eq!(topo.node_of_cpu(1), Some(0));
    }

    #[test]
    fn memoryless_cpuless_node_and_missing_hugepages_dir() {
        let tree = Tree::new()
            .cpu_online("0-1")
            .node(0, "0-1", 8000, &[10, 17], &[(2048, 1, 1, 0)])
            .node(1, "", 0, &[17, 10], &[]);
        let topo = tree.parse(Topology::from_sysfs);
        let n1 = topo.node(1).expect("node 1");
        assert!(n1.is_memoryless());
        assert_eq!(n1.mem_total, 0);
        assert_eq!(n1.mem_free, 0);
        assert!(n1.cpus.is_empty() && n1.offline_cpus.is_empty());
        assert!(n1.huge_pages.is_empty(), "no hugepages/ dir means no pools");
        assert_eq!(n1.huge_pool(crate::HUGE_PAGE_2M), None);
        assert_eq!(topo.node(0).expect("node 0").huge_pages.len(), 1);
        assert_eq!(topo.distance(1, 0), Some(17));
    }

    #[test]
    fn unknown_node_lists_available() {
        let tree = Tree::new()
            .cpu_online("0-3")
            .node(0, "0-1", 1, &[10, 20], &[])
            .node(1, "2-3", 1, &[20, 10], &[]);
        let topo = tree.parse(Topology::from_sysfs);
        let err = topo.node(7).expect_err("no node 7");
        match &err {
            TopologyError::UnknownNode { node, available } => {
                assert_eq!(*node, 7);
                assert_eq!(available, &vec![0, 1]);
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(
            err.to_string(),
            "no NUMA node 7; this host has nodes [0, 1]"
        );
    }

    #[test]
    fn no_numa_kernel_gives_single_node() {
        let tree = Tree::new().cpu_online("0-3");
        let topo = tree.parse(Topology::from_sysfs);
        assert_eq!(topo.nodes().len(), 1);
        let n = &topo.nodes()[0];
        assert_eq!(n.id, 0);
        assert_eq!(n.cpus, vec![0, 1, 2, 3]);
        assert_eq!(n.mem_total, 0);
        assert_eq!(n.distances, vec![10]);
        assert!(n.huge_pages.is_empty());
        // `detect()` fills memory from /proc/meminfo in this case.
        let meminfo = tree.path().join("meminfo");
        fs::write(
            &meminfo,
            "MemTotal:       16000 kB\nMemFree:         4000 kB\nMemAvailable:  8000 kB\n",
        )
        .expect("write meminfo");
        let topo = Topology::read(tree.path(), Some(&meminfo)).expect("fallback with meminfo");
        assert_eq!(topo.nodes()[0].mem_total, 16000 * KB);
        assert_eq!(topo.nodes()[0].mem_free, 4000 * KB);
    }

    #[test]
    fn node_online_file_decides_the_nodes() {
        // node2/ exists on disk but is not online: it is ignored.
        let tree = Tree::new()
            .cpu_online("0-1")
            .node(0, "0-1", 1, &[10], &[])
            .node(2, "", 1, &[10], &[])
            .node_online("0");
        let ids: Vec<_> = tree
            .parse(Topology::from_sysfs)
            .nodes()
            .iter()
            .map(|n| n.id)
            .collect();
        assert_eq!(ids, vec![0]);
    }

    #[test]
    fn malformed_files_are_errors() {
        // Distance row shorter than the node count.
        let tree = Tree::new()
            .cpu_online("0-1")
            .node(0, "0", 1, &[10], &[])
            .node(1, "1", 1, &[10, 20], &[]);
        let err = Topology::from_sysfs(tree.path()).expect_err("short row");
        assert!(
            matches!(&err, TopologyError::Parse { path, .. } if path.ends_with("node0/distance")),
            "{err:?}"
        );

        // Missing cpu/online.
        let tree = Tree::new().node(0, "0", 1, &[10], &[]);
        let err = Topology::from_sysfs(tree.path()).expect_err("no cpu/online");
        assert!(
            matches!(&err, TopologyError::Read { path, .. } if path.ends_with("cpu/online")),
            "{err:?}"
        );

        // Garbage cpulist.
        let tree = Tree::new().cpu_online("0-1").node(0, "1-0", 1, &[10], &[]);
        let err = Topology::from_sysfs(tree.path()).expect_err("bad cpulist");
        assert!(
            matches!(&err, TopologyError::Parse { path, .. } if path.ends_with("node0/cpulist")),
            "{err:?}"
        );

        // meminfo without MemFree, then a non-number, then a line about another node.
        let tree = Tree::new().cpu_online("0").node(0, "0", 1, &[10], &[]);
        let meminfo = tree.path().join("node/node0/meminfo");
        for (text, want) in [
            ("Node 0 MemTotal: 5 kB\n", "no MemFree"),
            (
                "Node 0 MemTotal: x kB\nNode 0 MemFree: 1 kB\n",
                "bad number",
            ),
            ("Node 0 MemTotal: 5\nNode 0 MemFree: 1 kB\n", "<number> kB"),
            (
                "Node 1 MemTotal: 5 kB\nNode 1 MemFree: 1 kB\n",
                "not about node 0",
            ),
        ] {
            fs::write(&meminfo, text).expect("write meminfo");
            let err = Topology::from_sysfs(tree.path()).expect_err(text);
            assert!(err.to_string().contains(want), "{text:?}: {err}");
        }

        // A non-number in a hugepage counter.
        let tree = Tree::new()
            .cpu_online("0")
            .node(0, "0", 1, &[10], &[(2048, 1, 1, 0)]);
        fs::write(
            tree.path()
                .join("node/node0/hugepages/hugepages-2048kB/free_hugepages"),
            "many\n",
        )
        .expect("write");
        let err = Topology::from_sysfs(tree.path()).expect_err("bad count");
        assert!(
            matches!(&err, TopologyError::Parse { path, .. } if path.ends_with("free_hugepages")),
            "{err:?}"
        );
    }

    #[test]
    fn unexpected_hugepages_entries_are_skipped() {
        let tree = Tree::new()
            .cpu_online("0")
            .node(0, "0", 1, &[10], &[(2048, 1, 1, 0)]);
        fs::create_dir_all(tree.path().join("node/node0/hugepages/README")).expect("mkdir");
        let topo = tree.parse(Topology::from_sysfs);
        assert_eq!(topo.nodes()[0].huge_pages.len(), 1);
    }
}
