//! The daemon's configuration: a TOML file, defaults that work on a small
//! machine, and a validation pass separate from parsing.
//!
//! Every key is optional; `Config::default()` is what an empty file gives.
//! Unknown keys are an error (`deny_unknown_fields`): a misspelt `limit`
//! silently ignored would let the pool grow without bound. Sizes are either
//! integers (bytes) or strings with a binary suffix (`"2G"`, `"512M"`), the
//! same syntax as the CLI ([`guest_mem::size::parse_size`]).
//!
//! `scripts/hugemem.toml` documents every key with its default.
//!
//! Parse errors ([`ConfigError`]) and validation errors ([`ValidationError`])
//! are separate: CLI flags are applied between parsing and validation, so an
//! override can fix a file value that alone would not validate.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

mod byte_size;
mod scrub;
pub use byte_size::ByteSize;
pub use scrub::ScrubConfig;

/// Default socket path.
pub const DEFAULT_SOCKET: &str = "/run/hugemem/hugemem.sock";

/// Pool limits of one NUMA node, overriding [`PoolConfig::target`] and
/// [`PoolConfig::limit`] there.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodePoolConfig {
    /// The node.
    pub id: u32,
    /// Idle bytes the pool keeps on this node after `trim_after_secs`.
    pub target: Option<ByteSize>,
    /// Most idle (clean, dirty and quarantined) bytes pooled on this node.
    pub limit: Option<ByteSize>,
}

/// The recycled pool.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PoolConfig {
    /// Idle bytes per node that the pool keeps for later allocations; above
    /// it, clean regions idle for `trim_after_secs` go back to the kernel.
    pub target: ByteSize,
    /// Hard cap of pooled bytes per node (clean + dirty + quarantined). A
    /// released region that would exceed it goes back to the kernel at once.
    pub limit: ByteSize,
    /// Seconds a node's pool may stay above its target before it is trimmed.
    pub trim_after_secs: u64,
    /// Per-node overrides.
    pub node: Vec<NodePoolConfig>,
    /// How often quarantined regions are checked for other holders, in ms.
    pub recheck_ms: u64,
    /// Scan `/proc` for other holders of a pooled memfd again right before it
    /// is handed out. Off by default: the scan that let the region leave
    /// quarantine already proved nobody else holds it, and a memfd cannot be
    /// reopened by name, so nobody can have gained it since; the scan costs
    /// 5-25 ms on a busy host, several times a pooled ALLOC. Path-backed
    /// (hugetlbfs) regions are always re-scanned: a path can be opened.
    pub recheck_on_reuse: bool,
    /// Before a released region is reused, punch every page out of its file
    /// (`FALLOC_FL_PUNCH_HOLE`) and fault fresh, kernel-zeroed ones in. Pins
    /// (io_uring fixed buffers, VFIO, RDMA, pages held by a pipe after
    /// `vmsplice`) outlive every fd and mapping and no check can see them;
    /// punched, a pinned page stays with the tenant that pinned it and the
    /// file gets a new one. On by default; turning it off trusts tenants
    /// not to pin (see `docs/security.md` for what it costs).
    pub detach_pages: bool,
    /// Fault a detached region's holes in ahead of its guest, on the node's
    /// scrubber threads, whether it is still pooled or already handed out
    /// (the region is clean and may be handed out the moment its pages are
    /// punched: each hole is reserved, and the kernel zeroes whatever page
    /// fills it). On by default; off, each hole is faulted in (and zeroed
    /// by the kernel) at the guest's first touch.
    pub refault_ahead: bool,
    /// Uids that may be handed a previous tenant's dirty (uncleared) pooled
    /// memory in lazy mode, cleared page by page at first touch. Empty by
    /// default: such a VMM could read the uncleared pages through a second
    /// mapping, so only VMMs the operator trusts with other tenants' data
    /// belong here. Every other lazy ALLOC gets clean pooled or fresh
    /// (kernel-zeroed on first touch) memory.
    pub lazy_dirty_uids: Vec<u32>,
    /// How long an ALLOC that names no wait of its own may wait for pages
    /// the daemon holds but cannot hand out yet (a region in quarantine, one
    /// being scrubbed, pages on their way back to the kernel), in ms.
    pub alloc_wait_ms: u64,
    /// The longest wait an ALLOC may ask for, in ms: a client cannot keep a
    /// daemon thread longer than this.
    pub max_alloc_wait_ms: u64,
    /// Most pooled (idle: clean, dirty, quarantined) bytes of 1 GiB pages
    /// per node; absent: only `limit`. A released region above it goes back
    /// to the kernel at once.
    pub limit_1g: Option<ByteSize>,
    /// The same for 2 MiB pages.
    pub limit_2m: Option<ByteSize>,
    /// The same for 4 KiB (shmem) pages. Default 0: a 4 KiB region costs
    /// nothing to create again (the kernel zeroes shmem pages at first
    /// touch), so a pooled one only keeps memory from everyone else.
    pub limit_4k: Option<ByteSize>,
    /// Refill each node's pool to its `target` with fresh, pre-zeroed
    /// regions while the daemon is idle, in the largest page size the
    /// kernel has free, at low priority (one region at a time, never while
    /// an ALLOC is running). Off by default.
    pub refill: bool,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            target: ByteSize(2 << 30),
            limit: ByteSize(8 << 30),
            trim_after_secs: 300,
            node: Vec::new(),
            recheck_ms: 500,
            recheck_on_reuse: false,
            detach_pages: true,
            refault_ahead: true,
            lazy_dirty_uids: Vec::new(),
            alloc_wait_ms: 5000,
            max_alloc_wait_ms: 60_000,
            limit_1g: None,
            limit_2m: None,
            limit_4k: Some(ByteSize(0)),
            refill: false,
        }
    }
}

impl PoolConfig {
    /// (target, limit) in bytes for `node`.
    pub fn limits(&self, node: u32) -> (u64, u64) {
        let o = self.node.iter().find(|n| n.id == node);
        (
            o.and_then(|n| n.target).unwrap_or(self.target).0,
            o.and_then(|n| n.limit).unwrap_or(self.limit).0,
        )
    }

    /// Most pooled bytes of `page_size` per node (`u64::MAX`: no limit of
    /// its own).
    pub fn size_limit(&self, page_size: guest_mem::PageSize) -> u64 {
        match page_size {
            guest_mem::PageSize::Huge1G => self.limit_1g,
            guest_mem::PageSize::Huge2M => self.limit_2m,
            guest_mem::PageSize::Base4K => self.limit_4k,
        }
        .map_or(u64::MAX, |b| b.0)
    }

    /// The wait of an ALLOC that asked for `wait_ms` (`None`: the default),
    /// capped at `max_alloc_wait_ms`.
    pub fn alloc_wait(&self, wait_ms: Option<u32>) -> Duration {
        let ms = wait_ms.map_or(self.alloc_wait_ms, u64::from);
        Duration::from_millis(ms.min(self.max_alloc_wait_ms))
    }
}

/// hugetlbfs mounts for ALLOC requests that ask for paths
/// ([`crate::proto::ALLOC_FLAG_PATHS`]).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct HugetlbfsConfig {
    /// Directory on a hugetlbfs mount of 2 MiB pages; absent = the first such
    /// mount in `/proc/mounts`.
    pub dir_2m: Option<PathBuf>,
    /// Directory on a hugetlbfs mount of 1 GiB pages; absent = the first such
    /// mount in `/proc/mounts`.
    pub dir_1g: Option<PathBuf>,
}

/// The Prometheus text endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// Loopback address to serve `GET /metrics` on; absent = off.
    pub listen: Option<SocketAddr>,
}

/// Huge pages `hugemem hugepages --config FILE` reserves (the systemd
/// unit's privileged `ExecStartPre=`, since the daemon's sandbox makes /sys
/// read-only). The daemon itself never reads this section.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HugepagesSection {
    /// 1 GiB pages wanted (absent: leave that pool alone).
    pub pages_1g: Option<u64>,
    /// 2 MiB pages wanted (absent: leave that pool alone).
    pub pages_2m: Option<u64>,
    /// Reserve on this NUMA node only (absent: host-wide).
    pub node: Option<u32>,
    /// What the counts mean: `total` (a floor on the pool; pools only
    /// grow), `free` (pages free and unreserved) or `exact`.
    pub mode: HugepagesMode,
    /// Mount hugetlbfs at `mount_root`/hugepages-1G and -2M.
    pub mount: bool,
    /// Where to mount.
    pub mount_root: PathBuf,
}

impl Default for HugepagesSection {
    fn default() -> Self {
        Self {
            pages_1g: None,
            pages_2m: None,
            node: None,
            mode: HugepagesMode::Total,
            mount: true,
            mount_root: PathBuf::from("/dev"),
        }
    }
}

/// `[hugepages] mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HugepagesMode {
    /// A floor on the pool size.
    Total,
    /// Pages free and not reserved by any mapping.
    Free,
    /// Exactly this many (shrinks the pool).
    Exact,
}

impl From<HugepagesMode> for numa::ReserveMode {
    fn from(m: HugepagesMode) -> Self {
        match m {
            HugepagesMode::Total => Self::Total,
            HugepagesMode::Free => Self::Free,
            HugepagesMode::Exact => Self::Exact,
        }
    }
}

/// Limits on what clients may ask for.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Most live connections, `reserved_connections` of them kept for
    /// operators (root, `[rebalance] operator_uids`); a connection beyond
    /// what its uid may have is closed at once.
    pub max_connections: usize,
    /// Of `max_connections`, slots only operators may take, so that a flood
    /// from one tenant never locks the operator out. Must be below
    /// `max_connections`.
    pub reserved_connections: usize,
    /// Most live connections of one uid (operators included; refused uids
    /// count too). One uid cannot starve another.
    pub max_connections_per_uid: usize,
    /// Seconds a handshaken connection that holds no allocation may stay
    /// silent before it is closed. A connection that holds memory is never
    /// timed out (closing it would free its guest RAM).
    pub idle_timeout_secs: u64,
    /// Largest single ALLOC (0 = the host's RAM).
    pub max_alloc: ByteSize,
    /// Seconds a new connection has to complete its handshake.
    pub handshake_timeout_secs: u64,
    /// Seconds a reply write may take before the connection is dropped.
    pub write_timeout_secs: u64,
    /// Seconds an allocation restored from systemd's fd store (after a
    /// restart or crash) waits for its VMM to re-attach (REATTACH with its
    /// token) before it is released into quarantine, where it stays until
    /// the VMM lets go of it.
    pub reattach_timeout_secs: u64,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            max_connections: 64,
            reserved_connections: 4,
            max_connections_per_uid: 16,
            idle_timeout_secs: 60,
            max_alloc: ByteSize(0),
            handshake_timeout_secs: 10,
            write_timeout_secs: 30,
            reattach_timeout_secs: 60,
        }
    }
}

/// NUMA rebalancing: REBALANCE requests and the vCPU-affinity policy
/// (see `backend::daemon::requests::rebalance` and `docs/migration.md`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RebalanceConfig {
    /// Run the vCPU-affinity policy loop (off by default: a move copies all
    /// of a VM's memory).
    pub policy: bool,
    /// Milliseconds between two samples of every client's vCPU threads.
    pub interval_ms: u64,
    /// Percentage (1-100) of a VM's vCPUs one other node must hold.
    pub threshold_pct: u32,
    /// Consecutive samples the same node must pass the threshold.
    pub persist: u32,
    /// Samples ignored after a move (policy or REBALANCE).
    pub cooldown: u32,
    /// Fewest vCPU threads a sample must see to count.
    pub min_vcpus: usize,
    /// Average MiB per second a move may copy (REBALANCE and policy); 0 = no limit.
    pub rate_limit_mib_s: u64,
    /// uids that may REBALANCE regions of other connections (operators,
    /// e.g. `hugemem rebalance`); empty = root and the daemon's own uid.
    pub operator_uids: Vec<u32>,
}

impl Default for RebalanceConfig {
    fn default() -> Self {
        Self {
            policy: false,
            interval_ms: 10_000,
            threshold_pct: 75,
            persist: 6,
            cooldown: 30,
            min_vcpus: 1,
            rate_limit_mib_s: 0,
            operator_uids: Vec::new(),
        }
    }
}

impl RebalanceConfig {
    /// The uids that act as operators: root plus the list, or root and the daemon's uid.
    pub fn effective_operators(&self) -> Vec<u32> {
        if self.operator_uids.is_empty() {
            // SAFETY: geteuid has no preconditions and cannot fail.
            let me = unsafe { libc::geteuid() };
            let mut v = vec![0, me];
            v.dedup();
            v
        } else {
            // Root is always an operator.
            let mut v = vec![0];
            v.extend(self.operator_uids.iter().copied());
            v.sort_unstable();
            v.dedup();
            v
        }
    }

    /// The rate limit in bytes per second, `None` for none.
    pub fn rate_limit_bytes_per_s(&self) -> Option<u64> {
        (self.rate_limit_mib_s > 0).then(|| self.rate_limit_mib_s.saturating_mul(1 << 20))
    }
}

/// The daemon's configuration (see the module docs and `scripts/hugemem.toml`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The UNIX socket clients connect to (created mode 0600, or 0660 with
    /// `socket_group`).
    pub socket: PathBuf,
    /// uids allowed to connect (`SO_PEERCRED`) besides root and the
    /// daemon's own uid, which always are.
    pub allowed_uids: Vec<u32>,
    /// A group whose members may reach the socket: the socket is made
    /// `root:<gid>` 0660, and a parent directory the daemon creates 0710
    /// with that group. Allowed non-root uids need this (or their own way
    /// through the file permissions) to connect at all; the uid check still
    /// applies to every connection.
    pub socket_group: Option<u32>,
    /// Tokio worker threads of the control plane.
    pub control_threads: usize,
    /// The pool.
    pub pool: PoolConfig,
    /// The scrubbers.
    pub scrub: ScrubConfig,
    /// The Prometheus endpoint.
    pub metrics: MetricsConfig,
    /// hugetlbfs mounts for path-backed regions.
    pub hugetlbfs: HugetlbfsConfig,
    /// Client limits.
    pub limits: LimitsConfig,
    /// NUMA rebalancing.
    pub rebalance: RebalanceConfig,
    /// What `hugemem hugepages --config` reserves (not read by the daemon).
    pub hugepages: HugepagesSection,
    /// The file where the daemon notes its parked VMs (name, uid, size,
    /// when parked), so that a start that cannot restore them says which
    /// were lost; unset: `<socket>.parked`, beside the socket.
    pub park_record: Option<PathBuf>,
    /// Clones of parked VMs (CLONE).
    pub clones: ClonesConfig,
}

/// Clones of parked VMs: the budget of the pages shared clones write.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClonesConfig {
    /// Free huge pages (of the template's size, host-wide, not reserved by
    /// anyone) that must be left once a shared clone reserved every page
    /// it may write; a CLONE that would leave fewer is refused, naming the
    /// shortfall. Default 0: a clone is refused only when its pages do
    /// not fit.
    pub headroom: ByteSize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            socket: PathBuf::from(DEFAULT_SOCKET),
            allowed_uids: Vec::new(),
            socket_group: None,
            control_threads: 2,
            pool: PoolConfig::default(),
            scrub: ScrubConfig::default(),
            metrics: MetricsConfig::default(),
            hugetlbfs: HugetlbfsConfig::default(),
            limits: LimitsConfig::default(),
            rebalance: RebalanceConfig::default(),
            hugepages: HugepagesSection::default(),
            park_record: None,
            clones: ClonesConfig::default(),
        }
    }
}

impl Config {
    /// Where the parked VMs are noted: `park_record`, or `<socket>.parked`.
    pub fn park_record_path(&self) -> PathBuf {
        self.park_record.clone().unwrap_or_else(|| {
            let mut p = self.socket.as_os_str().to_owned();
            p.push(".parked");
            PathBuf::from(p)
        })
    }
}

/// Command-line overrides of `hugemem serve`; `None` keeps the file's value.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    /// `--socket`.
    pub socket: Option<PathBuf>,
    /// `--metrics-listen`.
    pub metrics_listen: Option<SocketAddr>,
    /// `--pool-target`.
    pub pool_target: Option<u64>,
    /// `--pool-limit`.
    pub pool_limit: Option<u64>,
    /// `--scrub-threads`.
    pub scrub_threads: Option<usize>,
    /// `--allow-uid` (replaces the list when non-empty).
    pub allowed_uids: Vec<u32>,
}

impl Config {
    /// Applies CLI overrides (validate afterwards).
    pub fn apply(&mut self, o: &Overrides) {
        if let Some(s) = &o.socket {
            self.socket.clone_from(s);
        }
        if o.metrics_listen.is_some() {
            self.metrics.listen = o.metrics_listen;
        }
        if let Some(v) = o.pool_target {
            self.pool.target = ByteSize(v);
        }
        if let Some(v) = o.pool_limit {
            self.pool.limit = ByteSize(v);
        }
        if let Some(v) = o.scrub_threads {
            self.scrub.threads_per_node = v;
        }
        if !o.allowed_uids.is_empty() {
            self.allowed_uids.clone_from(&o.allowed_uids);
        }
    }
}

/// Errors reading a configuration file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read configuration file {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid TOML for this schema.
    #[error("invalid configuration{}", .path.as_ref().map(|p| format!(" in {}", p.display())).unwrap_or_default())]
    Parse {
        /// The file, when there is one.
        path: Option<PathBuf>,
        /// The cause (names the key and line).
        #[source]
        source: Box<toml::de::Error>,
    },
}

/// A configuration that parsed but cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValidationError {
    /// The metrics endpoint must not be reachable from the network.
    #[error("metrics.listen = {0} is not a loopback address; the endpoint is unauthenticated")]
    MetricsNotLoopback(SocketAddr),
    /// A node's target is above its limit.
    #[error("pool target {target} is above the limit {limit} on node {node}")]
    TargetAboveLimit {
        /// Node.
        node: u32,
        /// Target.
        target: ByteSize,
        /// Limit.
        limit: ByteSize,
    },
    /// A count that must be at least 1.
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    /// The same node is configured twice.
    #[error("pool.node id {0} appears more than once")]
    DuplicateNode(u32),
    /// The scrub batch is not a multiple of 2 MiB.
    #[error("scrub.batch must be a non-zero multiple of 2M, got {0}")]
    BadBatch(ByteSize),
    /// A per-page-size pool limit that is not a whole number of pages.
    #[error("pool.{key} = {value} is not a multiple of the {page} page size")]
    SizeLimit {
        /// The key.
        key: &'static str,
        /// Its value.
        value: ByteSize,
        /// The page size.
        page: &'static str,
    },
    /// The default ALLOC wait is longer than the longest allowed.
    #[error("pool.alloc_wait_ms = {0} is above pool.max_alloc_wait_ms = {1}")]
    AllocWait(u64, u64),
    /// The socket path is empty or relative.
    #[error("socket path {0:?} must be absolute")]
    RelativeSocket(PathBuf),
    /// The policy threshold is not a percentage.
    #[error("rebalance.threshold_pct must be between 1 and 100, got {0}")]
    RebalanceThreshold(u32),
}

impl Config {
    /// Parses TOML text.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Parse`] naming the offending key.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: None,
            source: Box::new(e),
        })
    }

    /// Reads and parses a TOML file (not validated yet: see [`Config::validate`]).
    ///
    /// # Errors
    ///
    /// [`ConfigError::Read`], [`ConfigError::Parse`].
    pub fn from_toml_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: Some(path.to_path_buf()),
            source: Box::new(e),
        })
    }

    /// Checks what parsing cannot: loopback metrics, targets ≤ limits, counts ≥ 1.
    ///
    /// # Errors
    ///
    /// The first [`ValidationError`] found.
    pub fn validate(&self) -> Result<(), ValidationError> {
        if !self.socket.is_absolute() {
            return Err(ValidationError::RelativeSocket(self.socket.clone()));
        }
        if let Some(addr) = self.metrics.listen {
            if !addr.ip().is_loopback() {
                return Err(ValidationError::MetricsNotLoopback(addr));
            }
        }
        if self.scrub.threads_per_node == 0 {
            return Err(ValidationError::Zero("scrub.threads_per_node"));
        }
        if self.control_threads == 0 {
            return Err(ValidationError::Zero("control_threads"));
        }
        if self.limits.max_connections <= self.limits.reserved_connections {
            return Err(ValidationError::Zero(
                "limits.max_connections - limits.reserved_connections",
            ));
        }
        if self.limits.max_connections_per_uid == 0 {
            return Err(ValidationError::Zero("limits.max_connections_per_uid"));
        }
        if self.limits.idle_timeout_secs == 0 {
            return Err(ValidationError::Zero("limits.idle_timeout_secs"));
        }
        if self.limits.max_connections == 0 {
            return Err(ValidationError::Zero("limits.max_connections"));
        }
        if self.pool.recheck_ms == 0 {
            return Err(ValidationError::Zero("pool.recheck_ms"));
        }
        if self.rebalance.interval_ms == 0 {
            return Err(ValidationError::Zero("rebalance.interval_ms"));
        }
        if !(1..=100).contains(&self.rebalance.threshold_pct) {
            return Err(ValidationError::RebalanceThreshold(
                self.rebalance.threshold_pct,
            ));
        }
        if self.scrub.batch.0 == 0 || !self.scrub.batch.0.is_multiple_of(2 << 20) {
            return Err(ValidationError::BadBatch(self.scrub.batch));
        }
        for (key, page, bytes, value) in [
            ("limit_1g", "1G", 1u64 << 30, self.pool.limit_1g),
            ("limit_2m", "2M", 2 << 20, self.pool.limit_2m),
            ("limit_4k", "4K", 4 << 10, self.pool.limit_4k),
        ] {
            if let Some(v) = value {
                if !v.0.is_multiple_of(bytes) {
                    return Err(ValidationError::SizeLimit {
                        key,
                        value: v,
                        page,
                    });
                }
            }
        }
        if self.pool.alloc_wait_ms > self.pool.max_alloc_wait_ms {
            return Err(ValidationError::AllocWait(
                self.pool.alloc_wait_ms,
                self.pool.max_alloc_wait_ms,
            ));
        }
        let mut seen = Vec::new();
        for n in &self.pool.node {
            if seen.contains(&n.id) {
                return Err(ValidationError::DuplicateNode(n.id));
            }
            seen.push(n.id);
        }
        for id in seen.iter().copied().chain(std::iter::once(u32::MAX)) {
            let (target, limit) = self.pool.limits(id);
            if target > limit {
                return Err(ValidationError::TargetAboveLimit {
                    node: id,
                    target: ByteSize(target),
                    limit: ByteSize(limit),
                });
            }
        }
        Ok(())
    }

    /// The uids allowed to connect: root, the daemon's uid, and the list.
    pub fn effective_uids(&self) -> Vec<u32> {
        // SAFETY: getuid has no preconditions and cannot fail.
        let me = unsafe { libc::getuid() };
        // Root and the daemon's own uid are always allowed: a list
        // (`--allow-uid`) adds tenants, it never locks the operator out.
        let mut v = vec![me, 0];
        v.extend(self.allowed_uids.iter().copied());
        v.sort_unstable();
        v.dedup();
        v
    }

    /// The quarantine recheck period.
    pub fn recheck_period(&self) -> Duration {
        Duration::from_millis(self.pool.recheck_ms)
    }
}

#[cfg(test)]
mod tests;
