//! The vocabulary of a VMM command line carrying daemon memory: which VMM,
//! how it reaches each region (an inherited fd or a hugetlbfs path), the
//! build options and why a user's command line is refused. The adapters
//! ([`vmm`](crate::launch::vmm)) speak it; what a VMM kind does is its
//! adapter's ([`Vmm::adapter`]), never a `match` here.

use std::ffi::OsStr;
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};

/// A VMM that `hugemem launch` knows how to give memory to: only a name
/// for its adapter ([`Vmm::adapter`], in `launch/vmm/`), which does all
/// that is particular to it. Shown by its adapter's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Vmm {
    /// cloud-hypervisor (`--memory size=0 --memory-zone …,file=…,shared=on`).
    CloudHypervisor,
    /// `qemu-system-*` (`-object memory-backend-file,…,share=on`).
    Qemu,
}

impl Vmm {
    /// Every VMM kind.
    pub const ALL: [Vmm; 2] = [Self::CloudHypervisor, Self::Qemu];

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

    pub(crate) fn is_fd(&self) -> bool {
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
    /// allocating, so the adapter's `check_args` can judge `--landlock`).
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
