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
mod tests;
