//! What `hugemem launch` is asked to do: its options (sizes, nodes, page
//! policy, VMM) and the ALLOC request they make.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use guest_mem::size::{format_size, parse_size};
use hugemem_client::proto::{AllocPart, AllocRequest, ClearMode, PagePolicy, ANY_NODE};

use super::command_line::{BuildOptions, Vmm};
use super::error::LaunchError;

/// Parses a page-size policy: `best`, `1G`, `2M` or `4K` (case-insensitive).
pub fn parse_page_policy(text: &str) -> Option<PagePolicy> {
    match text.to_ascii_lowercase().as_str() {
        "best" => Some(PagePolicy::Best),
        "1g" => Some(PagePolicy::Huge1G),
        "2m" => Some(PagePolicy::Huge2M),
        "4k" => Some(PagePolicy::Base4K),
        _ => None,
    }
}

/// `--nodes` syntax.
pub const NODES_SYNTAX: &str =
    "NODE:SIZE[,NODE:SIZE…], e.g. 0:2G,1:2G (one region per item; a node may appear more than once)";

/// A `--nodes` value that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid --nodes {text:?}: {why}; expected {NODES_SYNTAX}")]
pub struct NodesError {
    text: String,
    why: String,
}

/// Parses `--nodes 0:2G,1:2G` into ALLOC parts.
///
/// # Errors
///
/// [`NodesError`] for bad syntax or a zero size. A node may be given more
/// than once: each item is its own region (for cloud-hypervisor one memory
/// zone, and with `--guest-numa` one guest NUMA node), so `0:1G,0:1G` gives a
/// guest two NUMA nodes on a host with one.
pub fn parse_nodes(text: &str) -> Result<Vec<AllocPart>, NodesError> {
    let err = |why: String| NodesError {
        text: text.to_string(),
        why,
    };
    let mut parts = Vec::new();
    for item in text.split(',') {
        let (node, size) = item
            .split_once(':')
            .ok_or_else(|| err(format!("{item:?} has no ':'")))?;
        let node: u32 = node
            .trim()
            .parse()
            .map_err(|_| err(format!("{node:?} is not a node number")))?;
        if node == ANY_NODE {
            return Err(err(format!("node {node} is reserved")));
        }
        let size = parse_size(size).map_err(|e| err(e.to_string()))?;
        if size == 0 {
            return Err(err(format!("node {node} has size 0")));
        }
        parts.push(AllocPart { node, size });
    }
    Ok(parts)
}

/// Default of [`LaunchConfig::reattach_timeout`]: a `systemctl restart`
/// of the daemon is well within it.
pub const DEFAULT_REATTACH_TIMEOUT: Duration = Duration::from_secs(30);

/// Default of [`LaunchConfig::update_timeout`].
pub const DEFAULT_UPDATE_TIMEOUT: Duration = Duration::from_secs(60);

/// What `hugemem launch` runs.
#[derive(Debug, Clone)]
pub struct LaunchConfig {
    /// The daemon's socket.
    pub socket: PathBuf,
    /// Total bytes (required unless `nodes` is given).
    pub size: Option<u64>,
    /// All memory on this node (one region).
    pub node: Option<u32>,
    /// One region per node.
    pub nodes: Vec<AllocPart>,
    /// Page-size policy.
    pub page_policy: PagePolicy,
    /// Ask the daemon for hugetlbfs paths instead of passing fds.
    pub hugetlbfs: bool,
    /// Ask the daemon to `mlock` the memory.
    pub lock: bool,
    /// How long the daemon may wait for pages it holds but cannot hand out
    /// yet; `None`: the daemon's default (see [`Client::set_alloc_wait`](hugemem_client::client::Client::set_alloc_wait)).
    pub alloc_wait: Option<Duration>,
    /// See [`BuildOptions::guest_numa`].
    pub guest_numa: bool,
    /// How long to try to reach a restarted daemon and re-attach the
    /// allocation when the daemon connection closes while the VMM runs
    /// ([`DEFAULT_REATTACH_TIMEOUT`]).
    pub reattach_timeout: Duration,
    /// Listen on this control socket for `hugemem update`
    /// (live update of QEMU under the running guest; `update.rs`).
    pub control: Option<PathBuf>,
    /// How long each step of a live update may take (QMP replies and
    /// events, the old QEMU's exit).
    pub update_timeout: Duration,
    /// The VMM kind, when its program name does not tell.
    pub vmm: Option<Vmm>,
    /// Program and arguments.
    pub command: Vec<OsString>,
    /// Restore the VM parked under this name (`hugemem park`) instead of
    /// allocating memory for a new one (`restore.rs`).
    pub restore: Option<String>,
    /// With `restore`: a postcopy restore (the VM runs at once; memory
    /// parked on demand is filled as it asks for it).
    pub on_demand: bool,
    /// Start a clone of the VM parked under this name (its template, which
    /// stays parked) instead of allocating memory for a new one
    /// (`clone.rs`).
    pub clone_of: Option<String>,
    /// With `clone_of`: how the clone gets its memory.
    pub clone_mode: hugemem_client::proto::CloneMode,
    /// With a copy clone: fill its memory before the guest runs, instead of
    /// as it runs (postcopy).
    pub copy_eager: bool,
}

impl LaunchConfig {
    /// The ALLOC request for these options.
    ///
    /// # Errors
    ///
    /// [`LaunchError::Options`] when sizes are missing or disagree.
    pub fn alloc_request(&self) -> Result<AllocRequest, LaunchError> {
        let parts = match (self.node, self.nodes.is_empty()) {
            (Some(_), false) => {
                return Err(LaunchError::Options(
                    "give --node or --nodes, not both".into(),
                ))
            }
            (Some(node), true) => {
                let size = self
                    .size
                    .ok_or_else(|| LaunchError::Options("--node needs --size".into()))?;
                vec![AllocPart { node, size }]
            }
            (None, _) => self.nodes.clone(),
        };
        let sum: u64 = parts.iter().map(|p| p.size).sum();
        let total_size = match self.size {
            Some(size) if !parts.is_empty() && size != sum => {
                return Err(LaunchError::Options(format!(
                    "--size {} does not match the --nodes total {}",
                    format_size(size),
                    format_size(sum)
                )))
            }
            Some(0) => return Err(LaunchError::Options("--size must be non-zero".into())),
            Some(size) => size,
            None if !parts.is_empty() => sum,
            None => return Err(LaunchError::Options("give --size (or --nodes)".into())),
        };
        Ok(AllocRequest {
            total_size,
            page_policy: self.page_policy,
            clear_mode: ClearMode::Eager,
            lock: self.lock,
            parts,
            want_paths: self.hugetlbfs,
        })
    }

    pub(crate) fn build_options(&self) -> BuildOptions {
        BuildOptions {
            guest_numa: self.guest_numa,
            hugetlbfs: self.hugetlbfs,
        }
    }
}
