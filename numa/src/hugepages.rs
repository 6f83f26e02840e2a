//! Huge-page pools: reading them, growing or shrinking them through sysfs,
//! and mounting hugetlbfs.
//!
//! This is the one code path that reserves huge pages: `hugemem hugepages`
//! (operators, CI, the systemd unit), `guest_mem::ensure_free` and
//! `guest_mem::Reservation` (the daemon's benches and the tests) all come
//! here. Nothing in it depends on the source tree.
//!
//! # What it writes
//!
//! A pool is `/sys/kernel/mm/hugepages/hugepages-<kB>kB` (host-wide) or
//! `/sys/devices/system/node/node<N>/hugepages/hugepages-<kB>kB` (one node).
//! Writing `nr_hugepages` asks the kernel for that many persistent pages; it
//! allocates what it can and `nr_hugepages` reads back what it got
//! (Documentation/admin-guide/mm/hugetlbpage.rst). A host-wide write spreads
//! the pages over the nodes the kernel picks; a node write takes them from that
//! node only. Shrinking never takes pages that are in use: the kernel keeps
//! them as surplus.
//!
//! # Modes
//!
//! * [`ReserveMode::Total`]: the count is a floor on the pool size; the pool
//!   is grown when smaller and never shrunk, so asking twice changes nothing.
//! * [`ReserveMode::Free`]: the count is a floor on *available* pages, free
//!   and not already reserved by a mapping that has not faulted them in yet
//!   (`free_hugepages - resv_hugepages`): what a caller about to map them needs.
//!   `resv_hugepages` exists only host-wide, so for a node the host-wide figure
//!   is subtracted, which can only err on the side of reserving more.
//! * [`ReserveMode::Exact`]: the pool is set to exactly the count (pages in use
//!   stay as surplus).
//!
//! When the kernel gives fewer pages than asked, caches are dropped
//! (`/proc/sys/vm/drop_caches`), memory is compacted
//! (`/proc/sys/vm/compact_memory`) and the write is tried once more; the
//! report then says what the kernel really gave, for the pool asked and for
//! each node. [`HugePages::reserve_all`] does 1 GiB pools before 2 MiB ones:
//! a 1 GiB page needs a physically contiguous, aligned 1 GiB block, and taking
//! 2 MiB pages first can break up the last such blocks.
//!
//! # Roots
//!
//! [`HugePages::host`] works on `/sys` and `/proc`; [`HugePages::with_roots`]
//! on any two directories laid out the same way, which is how the unit tests
//! run it on fixture trees.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use tracing::{debug, info, warn};

use crate::sys;
use crate::topology::NodeId;

/// Errors reading or changing huge-page pools.
#[derive(Debug, thiserror::Error)]
pub enum HugePagesError {
    /// The kernel refused a write for lack of privilege.
    #[error("cannot write {path}: reserving huge pages and mounting hugetlbfs need root")]
    NotRoot {
        /// The file (or mount point) written.
        path: PathBuf,
        /// EACCES or EPERM.
        #[source]
        source: io::Error,
    },
    /// A node id that this host does not have.
    #[error("no NUMA node {node}; this host has nodes {available:?}")]
    NoSuchNode {
        /// The id asked for.
        node: NodeId,
        /// The ids that exist.
        available: Vec<NodeId>,
    },
    /// The kernel has no pool of this page size (there, or at all).
    #[error("{} has no {} kB huge-page pool ({} is missing)", where_(*.node), .page_size / 1024, .path.display())]
    NoPool {
        /// Page size in bytes.
        page_size: u64,
        /// The node, `None` for host-wide.
        node: Option<NodeId>,
        /// The pool directory looked for.
        path: PathBuf,
    },
    /// A sysfs or procfs file could not be read or written.
    #[error("cannot access {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A sysfs file did not hold a number.
    #[error("cannot parse {path}: expected a number, got {text:?}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What it held.
        text: String,
    },
    /// Mounting hugetlbfs failed for another reason than privilege.
    #[error("cannot mount hugetlbfs (pagesize={}) at {}", size_label(*.page_size), .path.display())]
    Mount {
        /// Page size in bytes.
        page_size: u64,
        /// The mount point.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

fn where_(node: Option<NodeId>) -> String {
    node.map_or_else(|| "this host".to_owned(), |n| format!("NUMA node {n}"))
}

/// `1G`, `2M`, or `<n>K` for other sizes: how hugetlbfs's `pagesize=` and the
/// mount point names spell a page size.
pub fn size_label(page_size: u64) -> String {
    match page_size {
        s if s >= 1 << 30 && s % (1 << 30) == 0 => format!("{}G", s >> 30),
        s if s >= 1 << 20 && s % (1 << 20) == 0 => format!("{}M", s >> 20),
        s => format!("{}K", s >> 10),
    }
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, HugePagesError>;

/// What a requested count means; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReserveMode {
    /// At least this many pages in the pool (grow, never shrink).
    Total,
    /// At least this many available pages (free and not reserved).
    Free,
    /// Exactly this many pages in the pool.
    Exact,
}

impl ReserveMode {
    /// `total`, `free` or `exact`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Total => "total",
            Self::Free => "free",
            Self::Exact => "exact",
        }
    }
}

/// Counts of one pool at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolState {
    /// `nr_hugepages`.
    pub total: u64,
    /// `free_hugepages` (pages reserved but not yet faulted count as free).
    pub free: u64,
    /// Host-wide `resv_hugepages` (the kernel keeps no per-node figure).
    pub reserved: u64,
    /// `surplus_hugepages`.
    pub surplus: u64,
}

impl PoolState {
    /// Pages a new mapping can still get: `free - reserved`.
    pub fn available(&self) -> u64 {
        self.free.saturating_sub(self.reserved)
    }
}

/// One node's share of a pool after a reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodePool {
    /// The node.
    pub node: NodeId,
    /// `nr_hugepages` of the node.
    pub total: u64,
    /// `free_hugepages` of the node.
    pub free: u64,
    /// `surplus_hugepages` of the node.
    pub surplus: u64,
}

/// What the kernel gave for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolReport {
    /// Page size in bytes.
    pub page_size: u64,
    /// The node asked for, `None` for host-wide.
    pub node: Option<NodeId>,
    /// How `requested` was meant.
    pub mode: ReserveMode,
    /// Pages asked for.
    pub requested: u64,
    /// The pool's counts afterwards (the node's pool with `node`).
    pub after: PoolState,
    /// Pool size before.
    pub total_before: u64,
    /// Whether memory was compacted because the first write fell short.
    pub compacted: bool,
    /// True when the request was met in full.
    pub met: bool,
    /// Every node's share of this page size afterwards (nodes without such a
    /// pool are left out), so a shortfall can be traced to a node.
    pub nodes: Vec<NodePool>,
}

impl PoolReport {
    /// Pages missing to meet the request: what the kernel did not give
    /// (0 when met; for [`ReserveMode::Exact`] the pages above the count that
    /// are in use and could not be given back are not a shortfall).
    pub fn shortfall(&self) -> u64 {
        match self.mode {
            ReserveMode::Free => self.requested.saturating_sub(self.after.available()),
            ReserveMode::Total | ReserveMode::Exact => {
                self.requested.saturating_sub(self.after.total)
            }
        }
    }
}

/// Whether hugetlbfs was mounted by this call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MountState {
    /// A hugetlbfs was already mounted there.
    AlreadyMounted,
    /// This call mounted it.
    Mounted,
}

impl MountState {
    /// `already mounted` or `mounted`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::AlreadyMounted => "already mounted",
            Self::Mounted => "mounted",
        }
    }
}

/// One hugetlbfs mount point.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountReport {
    /// Page size in bytes.
    pub page_size: u64,
    /// The mount point.
    pub path: PathBuf,
    /// What this call did.
    pub state: MountState,
}

/// Test-only replacement for the kernel's side of a write.
#[cfg(test)]
pub(crate) type WriteHook = Box<dyn Fn(&Path, &str) -> io::Result<()> + Send + Sync>;

/// Huge-page pools under a sysfs and a procfs root.
pub struct HugePages {
    sys: PathBuf,
    proc: PathBuf,
    #[cfg(test)]
    write_hook: Option<WriteHook>,
}

impl std::fmt::Debug for HugePages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HugePages")
            .field("sys", &self.sys)
            .field("proc", &self.proc)
            .finish()
    }
}

impl HugePages {
    /// The host's pools: `/sys` and `/proc`.
    pub fn host() -> Self {
        Self::with_roots(Path::new("/sys"), Path::new("/proc"))
    }

    /// Pools under trees laid out like `/sys` (`kernel/mm/hugepages`,
    /// `devices/system/node`) and `/proc` (`sys/vm/compact_memory`,
    /// `sys/vm/drop_caches`, `mounts`).
    pub fn with_roots(sys: &Path, proc: &Path) -> Self {
        Self {
            sys: sys.to_owned(),
            proc: proc.to_owned(),
            #[cfg(test)]
            write_hook: None,
        }
    }

    /// Routes every write through `hook` instead of the file system (the
    /// fixture's model of what the kernel does with a write).
    #[cfg(test)]
    pub(crate) fn with_write_hook(mut self, hook: WriteHook) -> Self {
        self.write_hook = Some(hook);
        self
    }

    fn node_root(&self) -> PathBuf {
        self.sys.join("devices/system/node")
    }

    /// The node ids that have a `node<N>` directory, ascending (empty on a
    /// kernel without NUMA).
    ///
    /// # Errors
    ///
    /// [`HugePagesError::Io`] when the node directory exists but cannot be listed.
    pub fn node_ids(&self) -> Result<Vec<NodeId>> {
        let root = self.node_root();
        let io_err = |source| HugePagesError::Io {
            path: root.clone(),
            source,
        };
        let entries = match fs::read_dir(&root) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_err(e)),
        };
        let mut ids = Vec::new();
        for entry in entries {
            let entry = entry.map_err(io_err)?;
            let name = entry.file_name();
            if let Some(id) = name
                .to_str()
                .and_then(|n| n.strip_prefix("node"))
                .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|d| d.parse::<NodeId>().ok())
            {
                ids.push(id);
            }
        }
        ids.sort_unstable();
        Ok(ids)
    }

    /// The directory of a pool, checked to exist.
    fn pool_dir(&self, page_size: u64, node: Option<NodeId>) -> Result<PathBuf> {
        let name = format!("hugepages-{}kB", page_size / 1024);
        let dir = match node {
            None => self.sys.join("kernel/mm/hugepages").join(name),
            Some(id) => {
                let node_dir = self.node_root().join(format!("node{id}"));
                if !node_dir.is_dir() {
                    return Err(HugePagesError::NoSuchNode {
                        node: id,
                        available: self.node_ids()?,
                    });
                }
                node_dir.join("hugepages").join(name)
            }
        };
        if !dir.is_dir() {
            return Err(HugePagesError::NoPool {
                page_size,
                node,
                path: dir,
            });
        }
        Ok(dir)
    }

    /// Current counts of a pool (host-wide with `node == None`).
    ///
    /// # Errors
    ///
    /// [`HugePagesError::NoSuchNode`], [`HugePagesError::NoPool`], or
    /// [`HugePagesError::Io`]/[`HugePagesError::Parse`] on a bad file.
    pub fn pool(&self, page_size: u64, node: Option<NodeId>) -> Result<PoolState> {
        let dir = self.pool_dir(page_size, node)?;
        let host_resv = self
            .sys
            .join("kernel/mm/hugepages")
            .join(format!("hugepages-{}kB", page_size / 1024))
            .join("resv_hugepages");
        let reserved = if host_resv.exists() {
            read_count(&host_resv)?
        } else {
            0
        };
        Ok(PoolState {
            total: read_count(&dir.join("nr_hugepages"))?,
            free: read_count(&dir.join("free_hugepages"))?,
            reserved,
            surplus: read_count(&dir.join("surplus_hugepages"))?,
        })
    }

    /// Every node's share of the `page_size` pool; nodes without one are left out.
    ///
    /// # Errors
    ///
    /// As [`HugePages::pool`].
    pub fn node_pools(&self, page_size: u64) -> Result<Vec<NodePool>> {
        let mut out = Vec::new();
        for node in self.node_ids()? {
            match self.pool(page_size, Some(node)) {
                Ok(p) => out.push(NodePool {
                    node,
                    total: p.total,
                    free: p.free,
                    surplus: p.surplus,
                }),
                Err(HugePagesError::NoPool { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    fn write(&self, path: &Path, value: &str) -> io::Result<()> {
        #[cfg(test)]
        if let Some(hook) = &self.write_hook {
            return hook(path, value);
        }
        fs::write(path, value)
    }

    /// Writes `count` to a pool's `nr_hugepages`. A refusal for privilege is
    /// an error; ENOMEM/EINVAL (some kernels refuse instead of giving fewer)
    /// is logged, and the caller reads back what it got either way.
    fn write_total(&self, dir: &Path, count: u64) -> Result<()> {
        let path = dir.join("nr_hugepages");
        match self.write(&path, &count.to_string()) {
            Ok(()) => Ok(()),
            Err(e) if is_permission(&e) => Err(HugePagesError::NotRoot { path, source: e }),
            Err(e) => {
                warn!(path = %path.display(), count, error = %e, "the kernel refused the pool size");
                Ok(())
            }
        }
    }

    /// Gives the kernel its best chance at contiguous blocks: drop clean
    /// caches, then compact every zone. Failures are logged, not fatal.
    fn compact(&self) {
        for (rel, value) in [("sys/vm/drop_caches", "3"), ("sys/vm/compact_memory", "1")] {
            let path = self.proc.join(rel);
            if let Err(e) = self.write(&path, value) {
                debug!(path = %path.display(), error = %e, "cannot write");
            }
        }
    }

    /// Grows, shrinks or checks one pool as `mode` says (see the module docs)
    /// and reports what the kernel gave.
    ///
    /// # Errors
    ///
    /// [`HugePagesError::NotRoot`] when the pool must change and we may not
    /// write it; [`HugePagesError::NoSuchNode`], [`HugePagesError::NoPool`],
    /// [`HugePagesError::Io`], [`HugePagesError::Parse`]. Fewer pages than asked
    /// is not an error: the report has `met == false`.
    pub fn reserve(
        &self,
        page_size: u64,
        requested: u64,
        node: Option<NodeId>,
        mode: ReserveMode,
    ) -> Result<PoolReport> {
        let dir = self.pool_dir(page_size, node)?;
        let before = self.pool(page_size, node)?;
        let target = match mode {
            ReserveMode::Free => before.total.max(
                before
                    .total
                    .saturating_add(requested)
                    .saturating_sub(before.available()),
            ),
            ReserveMode::Exact => requested,
            ReserveMode::Total => before.total.max(requested),
        };
        let mut compacted = false;
        if target != before.total {
            self.write_total(&dir, target)?;
            if self.pool(page_size, node)?.total < target {
                info!(
                    page = %size_label(page_size),
                    node = ?node,
                    target,
                    "the kernel gave fewer pages; compacting memory and trying again"
                );
                self.compact();
                compacted = true;
                self.write_total(&dir, target)?;
            }
        }
        let after = self.pool(page_size, node)?;
        let met = match mode {
            ReserveMode::Free => after.available() >= requested,
            ReserveMode::Total => after.total >= requested,
            ReserveMode::Exact => after.total == requested,
        };
        Ok(PoolReport {
            page_size,
            node,
            mode,
            requested,
            after,
            total_before: before.total,
            compacted,
            met,
            nodes: self.node_pools(page_size)?,
        })
    }

    /// [`HugePages::reserve`] for each `(page_size, count)`, largest page size
    /// first (contiguous 1 GiB blocks are the scarce ones); the reports come
    /// back in that order.
    ///
    /// # Errors
    ///
    /// The first error of [`HugePages::reserve`].
    pub fn reserve_all(
        &self,
        requests: &[(u64, u64)],
        node: Option<NodeId>,
        mode: ReserveMode,
    ) -> Result<Vec<PoolReport>> {
        let mut ordered = requests.to_vec();
        ordered.sort_by_key(|&(size, _)| std::cmp::Reverse(size));
        ordered
            .into_iter()
            .map(|(size, count)| self.reserve(size, count, node, mode))
            .collect()
    }

    /// Mount points of hugetlbfs instances, from `mounts` under the procfs root.
    ///
    /// # Errors
    ///
    /// [`HugePagesError::Io`] when the file cannot be read.
    pub fn hugetlbfs_mounts(&self) -> Result<Vec<PathBuf>> {
        let path = self.proc.join("mounts");
        let text = fs::read_to_string(&path).map_err(|source| HugePagesError::Io {
            path: path.clone(),
            source,
        })?;
        Ok(text
            .lines()
            .filter_map(|line| {
                let mut f = line.split_whitespace();
                let (_, target, fstype) = (f.next()?, f.next()?, f.next()?);
                // /proc/mounts escapes space, tab, newline and backslash as octal.
                (fstype == "hugetlbfs").then(|| PathBuf::from(unescape_mount_path(target)))
            })
            .collect())
    }

    /// Mounts hugetlbfs for `page_size` at `<mount_root>/hugepages-<1G|2M>`
    /// (mode 1770) unless one is mounted there already; creates the directory.
    ///
    /// # Errors
    ///
    /// [`HugePagesError::NotRoot`] without the privilege to mount,
    /// [`HugePagesError::Mount`] or [`HugePagesError::Io`] otherwise.
    pub fn mount_hugetlbfs(&self, page_size: u64, mount_root: &Path) -> Result<MountReport> {
        let label = size_label(page_size);
        let path = mount_root.join(format!("hugepages-{label}"));
        if self.hugetlbfs_mounts()?.contains(&path) {
            return Ok(MountReport {
                page_size,
                path,
                state: MountState::AlreadyMounted,
            });
        }
        fs::create_dir_all(&path).map_err(|source| {
            if is_permission(&source) {
                HugePagesError::NotRoot {
                    path: path.clone(),
                    source,
                }
            } else {
                HugePagesError::Io {
                    path: path.clone(),
                    source,
                }
            }
        })?;
        match sys::mount_hugetlbfs(&path, &format!("pagesize={label},mode=1770")) {
            Ok(()) => Ok(MountReport {
                page_size,
                path,
                state: MountState::Mounted,
            }),
            Err(source) if is_permission(&source) => Err(HugePagesError::NotRoot { path, source }),
            Err(source) => Err(HugePagesError::Mount {
                page_size,
                path,
                source,
            }),
        }
    }
}

fn is_permission(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EACCES | libc::EPERM))
        || e.kind() == io::ErrorKind::PermissionDenied
}

/// Undoes the octal escapes (`\040` for space …) of a `/proc/mounts` field.
fn unescape_mount_path(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if let (b'\\', Some(digits)) = (bytes[i], bytes.get(i + 1..i + 4)) {
            if digits.iter().all(|d| (b'0'..=b'7').contains(d)) {
                let value = digits
                    .iter()
                    .fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
                if let Ok(b) = u8::try_from(value) {
                    out.push(b);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A file holding one decimal number.
fn read_count(path: &Path) -> Result<u64> {
    let text = fs::read_to_string(path).map_err(|source| HugePagesError::Io {
        path: path.to_owned(),
        source,
    })?;
    text.trim().parse().map_err(|_| HugePagesError::Parse {
        path: path.to_owned(),
        text: text.trim_end().to_owned(),
    })
}

#[cfg(test)]
mod tests;
