//! `hugemem launch`: allocate guest RAM through the daemon and run a VMM on it.
//!
//! ```text
//! hugemem launch --size 4G --nodes 0:2G,1:2G -- cloud-hypervisor --kernel vmlinux …
//! hugemem launch --size 2G -- qemu-system-x86_64 -M microvm -kernel guest.elf …
//! ```
//!
//! # Design
//!
//! The work is split in three:
//!
//! * **Command-line construction** ([`cloud_hypervisor`], [`qemu`], and
//!   [`build_args`] here) is pure: user arguments and a region table in, the
//!   VMM's argument list out. It refuses any user option that would give the
//!   VMM a second, conflicting idea of guest RAM (`--memory`, `-m`,
//!   `-object memory-backend-*`, …) with a message naming the option, rather
//!   than produce a command line whose meaning depends on which option the VMM
//!   parses last. The checks run *before* anything is allocated
//!   ([`check_args`]).
//! * **Allocation** goes through [`backend::client::Client`] like any VMM would.
//! * **Running the VMM** ([`run_vmm`]) spawns it with the region fds
//!   inherited, forwards SIGTERM/SIGINT/SIGHUP to it, waits, and returns its
//!   exit status; [`run`] then sends FREE. The daemon releases the allocation
//!   on disconnect as well, so a `launch` killed with SIGKILL leaks nothing.
//! * **The daemon connection** is watched on a thread while the VMM runs
//!   (`reattach.rs`): when the daemon closes it (a crash or a restart, after
//!   which the new daemon restores the allocation orphaned), launch
//!   reconnects within [`reattach_timeout`] and re-attaches the
//!   allocation with the token of its ALLOC reply, so FREE at the end still
//!   works. If that fails it says so and the VMM keeps running: its memory
//!   stays mapped, and the daemon never reuses memory a process maps.
//!
//! # How the VMM reaches the memory
//!
//! * **fd mode** (default): the region memfds are inherited by the VMM and
//!   named `/dev/fd/N` on its command line. cloud-hypervisor opens `file=` with
//!   no create, truncate or fallocate, and takes alignment from `statfs` of
//!   the file, which for a hugetlb memfd reports the huge-page size; QEMU's
//!   `memory-backend-file` does the same with `mem-path=`. The fds keep their
//!   numbers: `FD_CLOEXEC` is cleared in the child only, after `fork`, for
//!   exactly these fds (see [`run_vmm`] for why not `dup2` to fixed numbers).
//! * **hugetlbfs mode** (`--hugetlbfs`): the daemon creates each region as a
//!   file on a hugetlbfs mount and sends its path (ALLOC flag `PATHS`). Needed
//!   where a memfd will not do: cloud-hypervisor `--landlock` adds a landlock
//!   rule for each file in its configuration, and adding one for a memfd
//!   (`/dev/fd/N`, a file of the kernel's internal hugetlbfs mount) fails with
//!   EBADFD, so the VM is not created (`docs/operations.md`).
//!
//! # What hugemem does instead of the VMM
//!
//! cloud-hypervisor refuses `host_numa_node` for a shared file zone, so NUMA
//! placement is done by the daemon (one region per node, `mbind` before the
//! first fault). cloud-hypervisor splits guest RAM around the 3 GiB hole and
//! maps one zone file at two offsets; that needs nothing from hugemem beyond a
//! file as large as the zone. Prefault is left off: the daemon hands out
//! memory that is already populated and clean.
//!
//! [`cloud_hypervisor`]: crate::launch::cloud_hypervisor
//! [`qemu`]: crate::launch::qemu
//! [`build_args`]: crate::launch::build_args
//! [`check_args`]: crate::launch::check_args
//! [`run_vmm`]: crate::launch::run_vmm
//! [`run`]: crate::launch::run
//! [`reattach_timeout`]: crate::launch::LaunchConfig::reattach_timeout

pub mod cloud_hypervisor;
mod process;
pub mod qemu;
mod reattach;

use std::ffi::{OsStr, OsString};
use std::fmt;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tracing::{info, warn};

pub(crate) use process::keep_across_exec;
pub use process::{run_vmm, VmmExit};

use backend::client::{Client, ClientError};
use backend::proto::{AllocPart, AllocRequest, ClearMode, PagePolicy, ANY_NODE};
use guest_mem::size::{format_size, parse_size};

/// A VMM that `hugemem launch` knows how to give memory to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Vmm {
    /// cloud-hypervisor (`--memory size=0 --memory-zone …,file=…,shared=on`).
    CloudHypervisor,
    /// `qemu-system-*` (`-object memory-backend-file,…,share=on`).
    Qemu,
}

impl Vmm {
    /// Recognises the VMM from its program name: a basename that contains
    /// `cloud-hypervisor`, or starts with `qemu-system-` or `qemu-kvm`.
    pub fn detect(program: &OsStr) -> Option<Self> {
        let base = Path::new(program)
            .file_name()?
            .to_string_lossy()
            .into_owned();
        if base.contains("cloud-hypervisor") {
            Some(Self::CloudHypervisor)
        } else if base.starts_with("qemu-system-") || base.starts_with("qemu-kvm") {
            Some(Self::Qemu)
        } else {
            None
        }
    }

    /// Parses `cloud-hypervisor`/`ch` or `qemu`.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "cloud-hypervisor" | "ch" => Some(Self::CloudHypervisor),
            "qemu" => Some(Self::Qemu),
            _ => None,
        }
    }
}

impl fmt::Display for Vmm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::CloudHypervisor => "cloud-hypervisor",
            Self::Qemu => "QEMU",
        })
    }
}

/// How the VMM reaches one region's memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemoryFile {
    /// An fd the VMM inherits, named `/dev/fd/N`.
    Fd(RawFd),
    /// A file on a hugetlbfs mount.
    Path(PathBuf),
}

impl MemoryFile {
    /// The path the VMM opens.
    pub fn vmm_path(&self) -> String {
        match self {
            Self::Fd(fd) => format!("/dev/fd/{fd}"),
            Self::Path(p) => p.display().to_string(),
        }
    }

    fn is_fd(&self) -> bool {
        matches!(self, Self::Fd(_))
    }
}

/// One region as a VMM command line needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryRegion {
    /// Bytes (the file is exactly this large).
    pub size: u64,
    /// Host node the daemon placed it on, if bound.
    pub node: Option<u32>,
    /// fd or path.
    pub file: MemoryFile,
}

/// Options of the command-line construction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BuildOptions {
    /// cloud-hypervisor: one guest NUMA node per region
    /// (`--numa guest_numa_id=I,memory_zones=hugememI`). QEMU always gets
    /// one `-numa node` per region when there is more than one.
    pub guest_numa: bool,
    /// The regions will be hugetlbfs paths, not `/dev/fd/N` (known before
    /// allocating, so [`check_args`] can judge `--landlock`).
    pub hugetlbfs: bool,
}

/// The user's VMM command line cannot be combined with hugemem's memory.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BuildError {
    /// The user passed an option that sets guest RAM.
    #[error(
        "{vmm} option `{option}` conflicts with the guest RAM hugemem launch provides: {hint}"
    )]
    Conflict {
        /// The VMM.
        vmm: Vmm,
        /// The option as given.
        option: String,
        /// What to do instead.
        hint: &'static str,
    },
    /// No regions to give.
    #[error("the allocation has no regions")]
    NoRegions,
    /// QEMU microvm has no NUMA, so it takes exactly one memory backend.
    #[error(
        "QEMU -M microvm has no NUMA support and takes one memory backend, but the allocation has {0} regions; \
         ask for one region (--size alone or --node N) or use another machine type"
    )]
    MicrovmRegions(usize),
    /// `/dev/fd/N` paths cannot be opened under cloud-hypervisor's landlock.
    #[error(
        "cloud-hypervisor --landlock cannot add a landlock rule for a memfd (/dev/fd/N fails with EBADFD); \
         run hugemem launch with --hugetlbfs so the VMM gets hugetlbfs paths"
    )]
    LandlockNeedsPaths,
    /// The region table does not match `--hugetlbfs` (fds where paths were
    /// asked for, or the other way round).
    #[error("the memory files do not all match --hugetlbfs={0}")]
    MixedFiles(bool),
    /// A path the VMM's option syntax cannot carry.
    #[error("memory file path {path:?} cannot be written in a {vmm} option ({why})")]
    BadPath {
        /// The VMM.
        vmm: Vmm,
        /// The path.
        path: String,
        /// Which character.
        why: &'static str,
    },
}

/// Checks the user's VMM arguments before anything is allocated, for an
/// allocation of `regions` regions.
///
/// # Errors
///
/// [`BuildError::Conflict`] naming the first option that sets guest RAM,
/// [`BuildError::LandlockNeedsPaths`], [`BuildError::MicrovmRegions`].
pub fn check_args(
    vmm: Vmm,
    args: &[OsString],
    opts: &BuildOptions,
    regions: usize,
) -> Result<(), BuildError> {
    match vmm {
        Vmm::CloudHypervisor => cloud_hypervisor::check(args, opts),
        Vmm::Qemu => match qemu::check(args)? {
            m if m.microvm && regions > 1 => Err(BuildError::MicrovmRegions(regions)),
            _ => Ok(()),
        },
    }
}

/// The VMM's arguments (without the program): hugemem's memory options
/// followed by the user's arguments.
///
/// # Errors
///
/// As [`check_args`], plus [`BuildError::NoRegions`],
/// [`BuildError::MicrovmRegions`], [`BuildError::BadPath`].
pub fn build_args(
    vmm: Vmm,
    args: &[OsString],
    regions: &[MemoryRegion],
    opts: &BuildOptions,
) -> Result<Vec<OsString>, BuildError> {
    if regions.is_empty() {
        return Err(BuildError::NoRegions);
    }
    match vmm {
        Vmm::CloudHypervisor => cloud_hypervisor::build(args, regions, opts),
        Vmm::Qemu => qemu::build(args, regions),
    }
}

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

/// Errors of `hugemem launch`.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The launch options are inconsistent.
    #[error("{0}")]
    Options(String),
    /// The VMM could not be recognised.
    #[error("cannot tell which VMM {0:?} is (expected cloud-hypervisor or qemu-system-*); name it with --vmm")]
    UnknownVmm(OsString),
    /// The VMM command line cannot carry hugemem's memory.
    #[error("cannot build the VMM command line")]
    Build(#[from] BuildError),
    /// Talking to the daemon failed.
    #[error("the hugemem daemon did not provide the memory")]
    Client(#[from] ClientError),
    /// The daemon's reply cannot be used.
    #[error("unusable allocation from the daemon: {0}")]
    Reply(String),
    /// Starting the VMM failed.
    #[error("cannot start {program:?}")]
    Spawn {
        /// The program.
        program: OsString,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Waiting for the VMM or handling signals failed.
    #[error("cannot wait for the VMM")]
    Wait(#[source] std::io::Error),
}

/// Default of [`LaunchConfig::reattach_timeout`]: a `systemctl restart`
/// of the daemon is well within it.
pub const DEFAULT_REATTACH_TIMEOUT: Duration = Duration::from_secs(30);

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
    /// yet; `None`: the daemon's default (see [`Client::set_alloc_wait`]).
    pub alloc_wait: Option<Duration>,
    /// See [`BuildOptions::guest_numa`].
    pub guest_numa: bool,
    /// How long to try to reach a restarted daemon and re-attach the
    /// allocation when the daemon connection closes while the VMM runs
    /// ([`DEFAULT_REATTACH_TIMEOUT`]).
    pub reattach_timeout: Duration,
    /// The VMM kind, when its program name does not tell.
    pub vmm: Option<Vmm>,
    /// Program and arguments.
    pub command: Vec<OsString>,
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

    fn build_options(&self) -> BuildOptions {
        BuildOptions {
            guest_numa: self.guest_numa,
            hugetlbfs: self.hugetlbfs,
        }
    }
}

/// What a launch did.
#[derive(Debug, Clone)]
pub struct LaunchReport {
    /// How the VMM ended.
    pub exit: VmmExit,
    /// Connect + ALLOC, wall time.
    pub alloc: Duration,
    /// VMM start to VMM exit.
    pub vmm: Duration,
    /// Bytes given to the VMM.
    pub size: u64,
    /// Page size per region, bytes.
    pub page_sizes: Vec<u64>,
    /// The daemon's note on the ALLOC (empty, or e.g. which larger pages
    /// were missing when `best` served a smaller size).
    pub note: String,
}

/// Allocates, runs the VMM, waits, frees. Returns how the VMM ended; the
/// caller exits with [`VmmExit::shell_code`].
///
/// Call from the main thread of a process that has started no other thread
/// that could take SIGTERM/SIGINT (see [`run_vmm`]).
///
/// # Errors
///
/// Option, command-line, daemon and process errors; see [`LaunchError`].
/// Nothing is allocated when the command line is refused.
pub fn run(cfg: &LaunchConfig) -> Result<LaunchReport, LaunchError> {
    let program = cfg
        .command
        .first()
        .ok_or_else(|| LaunchError::Options("no VMM command given after --".into()))?;
    let vmm = match cfg.vmm {
        Some(v) => v,
        None => Vmm::detect(program).ok_or_else(|| LaunchError::UnknownVmm(program.clone()))?,
    };
    let user_args = &cfg.command[1..];
    let opts = cfg.build_options();
    let request = cfg.alloc_request()?;
    // The daemon makes one region per part (one when no part is given).
    check_args(vmm, user_args, &opts, request.parts.len().max(1))?;

    info!(
        size = %format_size(request.total_size),
        parts = request.parts.len(),
        socket = %cfg.socket.display(),
        "asking the daemon for guest RAM (populated and zeroed before the VMM starts)"
    );
    let started = Instant::now();
    let mut client = Client::connect(&cfg.socket)?;
    client.set_alloc_wait(cfg.alloc_wait);
    let alloc = client.alloc(request)?;
    let alloc_time = started.elapsed();
    let note = alloc.note.clone();
    if !note.is_empty() {
        warn!(%note, "the daemon's note on this allocation");
    }
    let page_sizes: Vec<u64> = alloc.regions.iter().map(|r| r.page_size).collect();
    info!(
        id = alloc.id,
        size = %format_size(alloc.size()),
        regions = alloc.regions.len(),
        page_sizes = ?page_sizes.iter().map(|p| format_size(*p)).collect::<Vec<_>>(),
        seconds = alloc_time.as_secs_f64(),
        "memory allocated"
    );
    let regions = memory_regions(&alloc, cfg.hugetlbfs)?;
    let argv = build_args(vmm, user_args, &regions, &opts)?;
    let mut full = Vec::with_capacity(argv.len() + 1);
    full.push(program.clone());
    full.extend(argv);
    info!(command = ?full, "starting {vmm}");

    let inherit: Vec<BorrowedFd<'_>> = if cfg.hugetlbfs {
        Vec::new()
    } else {
        alloc.fds.iter().map(AsFd::as_fd).collect()
    };
    let held = reattach::Held::of(&alloc);
    let socket = cfg.socket.as_path();
    let timeout = cfg.reattach_timeout;
    // The watcher owns the connection while the VMM runs and gives back the
    // one to FREE on (a new one after a daemon restart), if any.
    let (outcome, client) = process::run_vmm_watching(
        &full,
        &inherit,
        Some(|stop: &std::sync::atomic::AtomicBool| {
            reattach::watch(client, socket, &held, timeout, stop)
        }),
    );
    drop(inherit);
    let size = alloc.size();
    let id = alloc.id;
    // Close our copies before FREE, so the daemon sees no holder but itself.
    drop(alloc);
    match client.flatten() {
        Some(mut client) => {
            if let Err(e) = client.free(id) {
                warn!(error = %e, "FREE failed; the daemon releases the memory when this connection closes");
            }
        }
        None => warn!(
            alloc = id,
            "no daemon connection holds the allocation any more; not freed by launch (the daemon releases it)"
        ),
    }
    let (exit, vmm_time) = outcome?;
    info!(exit = %exit, vmm_seconds = vmm_time.as_secs_f64(), "{vmm} exited; memory freed");
    Ok(LaunchReport {
        exit,
        alloc: alloc_time,
        vmm: vmm_time,
        size,
        page_sizes,
        note,
    })
}

/// The region table as the VMM will see it: `/dev/fd/N` of our fds, or the
/// daemon's hugetlbfs paths (`hugemem qemu-wrapper` uses it too).
pub(crate) fn memory_regions(
    alloc: &backend::client::Allocation,
    hugetlbfs: bool,
) -> Result<Vec<MemoryRegion>, LaunchError> {
    if hugetlbfs && alloc.paths.len() != alloc.regions.len() {
        return Err(LaunchError::Reply(format!(
            "asked for hugetlbfs paths, got {} for {} regions (does the daemon have a hugetlbfs mount?)",
            alloc.paths.len(),
            alloc.regions.len()
        )));
    }
    let mut out = Vec::with_capacity(alloc.regions.len());
    for (i, (r, fd)) in alloc.regions.iter().zip(&alloc.fds).enumerate() {
        let file = if hugetlbfs {
            MemoryFile::Path(PathBuf::from(&alloc.paths[i]))
        } else {
            MemoryFile::Fd(fd.as_raw_fd())
        };
        if r.flags & backend::proto::RegionInfo::FLAG_LAZY != 0 {
            return Err(LaunchError::Reply(
                "a lazy region needs a userfaultfd, which VMMs cannot hand over".into(),
            ));
        }
        out.push(MemoryRegion {
            size: r.size,
            node: (r.node != ANY_NODE).then_some(r.node),
            file,
        });
    }
    Ok(out)
}

/// Where a QEMU/CH option's name starts: the argument without its one or two
/// leading dashes, cut at `=`; `None` for arguments that are not options.
pub(crate) fn option_name(arg: &str) -> Option<&str> {
    let name = arg.strip_prefix("--").or_else(|| arg.strip_prefix('-'))?;
    if name.is_empty() {
        return None;
    }
    Some(name.split_once('=').map_or(name, |(n, _)| n))
}

/// The argument as text, for option matching (lossy for non-UTF-8 values,
/// which never name an option).
pub(crate) fn text(arg: &OsStr) -> String {
    arg.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_vmms() {
        assert_eq!(
            Vmm::detect(OsStr::new("/usr/bin/cloud-hypervisor")),
            Some(Vmm::CloudHypervisor)
        );
        assert_eq!(
            Vmm::detect(OsStr::new("cloud-hypervisor-static")),
            Some(Vmm::CloudHypervisor)
        );
        assert_eq!(
            Vmm::detect(OsStr::new("qemu-system-x86_64")),
            Some(Vmm::Qemu)
        );
        assert_eq!(
            Vmm::detect(OsStr::new("/opt/qemu/bin/qemu-system-aarch64")),
            Some(Vmm::Qemu)
        );
        assert_eq!(Vmm::detect(OsStr::new("qemu-kvm")), Some(Vmm::Qemu));
        assert_eq!(Vmm::detect(OsStr::new("firecracker")), None);
        assert_eq!(Vmm::detect(OsStr::new("/usr/bin/qemu-img")), None);
        assert_eq!(Vmm::parse("ch"), Some(Vmm::CloudHypervisor));
        assert_eq!(Vmm::parse("qemu"), Some(Vmm::Qemu));
        assert_eq!(Vmm::parse("xen"), None);
    }

    #[test]
    fn parses_nodes() {
        assert_eq!(
            parse_nodes("0:2G,1:2G"),
            Ok(vec![
                AllocPart {
                    node: 0,
                    size: 2 << 30
                },
                AllocPart {
                    node: 1,
                    size: 2 << 30
                }
            ])
        );
        assert_eq!(
            parse_nodes("3:512M"),
            Ok(vec![AllocPart {
                node: 3,
                size: 512 << 20
            }])
        );
        for bad in [
            "",
            "0",
            "0:",
            "x:1G",
            "0:0",
            "0:1X",
            "4294967295:1G",
            "0:1G,",
        ] {
            assert!(parse_nodes(bad).is_err(), "{bad:?}");
        }
        // Two regions on one node.
        let two = parse_nodes("0:1G,0:1G").expect("one node twice");
        assert_eq!(two.len(), 2);
        assert!(two.iter().all(|p| p.node == 0 && p.size == 1 << 30));
    }

    fn cfg() -> LaunchConfig {
        LaunchConfig {
            socket: PathBuf::from("/tmp/s"),
            size: None,
            node: None,
            nodes: Vec::new(),
            page_policy: PagePolicy::Best,
            hugetlbfs: false,
            alloc_wait: None,
            lock: false,
            guest_numa: false,
            reattach_timeout: DEFAULT_REATTACH_TIMEOUT,
            vmm: None,
            command: vec!["qemu-system-x86_64".into()],
        }
    }

    #[test]
    fn alloc_requests_from_options() {
        let r = LaunchConfig {
            size: Some(4 << 30),
            ..cfg()
        }
        .alloc_request()
        .expect("size");
        assert_eq!(
            (r.total_size, r.parts.len(), r.want_paths),
            (4 << 30, 0, false)
        );
        let r = LaunchConfig {
            size: Some(2 << 30),
            node: Some(1),
            hugetlbfs: true,
            ..cfg()
        }
        .alloc_request()
        .expect("node");
        assert_eq!(
            r.parts,
            vec![AllocPart {
                node: 1,
                size: 2 << 30
            }]
        );
        assert!(r.want_paths);
        let nodes = parse_nodes("0:1G,1:3G").expect("nodes");
        let r = LaunchConfig {
            nodes: nodes.clone(),
            ..cfg()
        }
        .alloc_request()
        .expect("nodes");
        assert_eq!(r.total_size, 4 << 30);
        assert!(LaunchConfig {
            nodes: nodes.clone(),
            size: Some(4 << 30),
            ..cfg()
        }
        .alloc_request()
        .is_ok());
        for bad in [
            LaunchConfig {
                nodes: nodes.clone(),
                size: Some(2 << 30),
                ..cfg()
            },
            LaunchConfig {
                nodes,
                node: Some(0),
                size: Some(4 << 30),
                ..cfg()
            },
            LaunchConfig {
                node: Some(0),
                ..cfg()
            },
            cfg(),
            LaunchConfig {
                size: Some(0),
                ..cfg()
            },
        ] {
            assert!(
                matches!(bad.alloc_request(), Err(LaunchError::Options(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn page_policies() {
        assert_eq!(parse_page_policy("best"), Some(PagePolicy::Best));
        assert_eq!(parse_page_policy("1G"), Some(PagePolicy::Huge1G));
        assert_eq!(parse_page_policy("2m"), Some(PagePolicy::Huge2M));
        assert_eq!(parse_page_policy("4K"), Some(PagePolicy::Base4K));
        assert_eq!(parse_page_policy("3M"), None);
    }

    #[test]
    fn option_names() {
        assert_eq!(option_name("--memory"), Some("memory"));
        assert_eq!(option_name("--memory=size=1G"), Some("memory"));
        assert_eq!(option_name("-m"), Some("m"));
        assert_eq!(option_name("--m"), Some("m"));
        assert_eq!(option_name("-"), None);
        assert_eq!(option_name("--"), None);
        assert_eq!(option_name("size=1G"), None);
    }

    #[test]
    fn memory_file_paths() {
        assert_eq!(MemoryFile::Fd(7).vmm_path(), "/dev/fd/7");
        assert_eq!(
            MemoryFile::Path("/dev/hugepages-1G/a".into()).vmm_path(),
            "/dev/hugepages-1G/a"
        );
    }
}
