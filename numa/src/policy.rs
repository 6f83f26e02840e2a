//! Memory-policy syscalls with typed errors.
//!
//! Thin, safe wrappers over `mbind`, `set_mempolicy`, `get_mempolicy`,
//! `move_pages` and `migrate_pages`. The raw calls are in the private `sys`
//! module; this module validates arguments first (so a bad request never
//! reaches the kernel), then maps the kernel's errno to a [`PolicyError`]
//! variant that says what went wrong.
//!
//! # Design
//!
//! A node set is a [`NodeMask`], a growable `u64` bitset laid out exactly like
//! the kernel's `unsigned long` node mask, so it is passed to the kernel as is.
//! The alternative, a fixed 1024-bit array like libnuma's `struct bitmask`,
//! would cost 128 bytes per mask and still need the same `maxnode` care.
//!
//! None of these calls change what memory contains: they choose which node
//! backs it, and migration copies pages. That is why they are safe functions
//! even though they take raw addresses.

use std::io;

use tracing::debug;

use crate::sys::{self, abi};
use crate::topology::NodeId;

/// Kernel errors of the memory-policy calls, mapped to what they mean.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// EINVAL: bad mode, flags, node mask or unaligned address.
    #[error("{op}: invalid argument")]
    InvalidArgument {
        /// Which call.
        op: &'static str,
    },
    /// EFAULT: part of the range is not mapped.
    #[error("{op}: address range is not mapped")]
    NotMapped {
        /// Which call.
        op: &'static str,
    },
    /// ENOMEM: the kernel ran out of memory (or no page on the target node).
    #[error("{op}: out of memory")]
    OutOfMemory {
        /// Which call.
        op: &'static str,
    },
    /// EPERM/EACCES: moving pages of another process, or MOVE_ALL without CAP_SYS_NICE.
    #[error("{op}: permission denied")]
    PermissionDenied {
        /// Which call.
        op: &'static str,
    },
    /// ENODEV: a node in the request is offline or absent.
    #[error("{op}: node not online")]
    NodeNotOnline {
        /// Which call.
        op: &'static str,
    },
    /// ESRCH: no such process.
    #[error("{op}: no such process")]
    NoSuchProcess {
        /// Which call.
        op: &'static str,
    },
    /// EIO: pages could not be moved (strict MPOL_MF_STRICT violation).
    #[error("{op}: pages could not be moved")]
    Io {
        /// Which call.
        op: &'static str,
    },
    /// E2BIG: too many pages in one request.
    #[error("{op}: too many pages")]
    TooBig {
        /// Which call.
        op: &'static str,
    },
    /// Any other errno.
    #[error("{op} failed")]
    Other {
        /// Which call.
        op: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

impl PolicyError {
    /// Maps an `io::Error` from a syscall to the variant for its errno.
    fn from_io(op: &'static str, source: io::Error) -> Self {
        match source.raw_os_error() {
            Some(libc::EINVAL) => Self::InvalidArgument { op },
            Some(libc::EFAULT) => Self::NotMapped { op },
            Some(libc::ENOMEM) => Self::OutOfMemory { op },
            Some(libc::EPERM | libc::EACCES) => Self::PermissionDenied { op },
            Some(libc::ENODEV) => Self::NodeNotOnline { op },
            Some(libc::ESRCH) => Self::NoSuchProcess { op },
            Some(libc::EIO) => Self::Io { op },
            Some(libc::E2BIG) => Self::TooBig { op },
            _ => Self::Other { op, source },
        }
    }

    /// The errno this error stands for, where it stands for exactly one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Self::InvalidArgument { .. } => Some(libc::EINVAL),
            Self::NotMapped { .. } => Some(libc::EFAULT),
            Self::OutOfMemory { .. } => Some(libc::ENOMEM),
            Self::PermissionDenied { .. } => None,
            Self::NodeNotOnline { .. } => Some(libc::ENODEV),
            Self::NoSuchProcess { .. } => Some(libc::ESRCH),
            Self::Io { .. } => Some(libc::EIO),
            Self::TooBig { .. } => Some(libc::E2BIG),
            Self::Other { source, .. } => source.raw_os_error(),
        }
    }
}

/// A set of node ids, as the kernel's `unsigned long` node mask.
///
/// Invariant: `words` never ends in a zero word, so two masks holding the same
/// nodes compare equal however they were built. Memory grows with the largest
/// id (one `u64` per 64 ids); the kernel accepts ids below 32768 at most (and
/// usually below 1024), and the calls here refuse wider masks with
/// [`PolicyError::InvalidArgument`] before making the syscall.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeMask {
    words: Vec<u64>,
}

impl NodeMask {
    /// An empty mask.
    pub fn new() -> Self {
        Self::default()
    }
    /// A mask holding one node.
    pub fn single(node: NodeId) -> Self {
        let mut m = Self::new();
        m.insert(node);
        m
    }
    /// Adds `node`.
    pub fn insert(&mut self, node: NodeId) {
        let (word, bit) = Self::position(node);
        if self.words.len() <= word {
            self.words.resize(word + 1, 0);
        }
        self.words[word] |= 1 << bit;
    }
    /// True when `node` is in the mask.
    pub fn contains(&self, node: NodeId) -> bool {
        let (word, bit) = Self::position(node);
        self.words.get(word).is_some_and(|w| w & (1 << bit) != 0)
    }
    /// Node ids in the mask, ascending.
    pub fn nodes(&self) -> Vec<NodeId> {
        let mut out = Vec::new();
        for (i, &word) in self.words.iter().enumerate() {
            // Word `i` exists because some `insert(id)` had `id / 64 >= i`,
            // so `i * 64` (and every bit set in it) fits a `NodeId`.
            let base = NodeId::try_from(i * 64).expect("mask words only come from NodeId inserts");
            let mut w = word;
            while w != 0 {
                out.push(base + w.trailing_zeros());
                w &= w - 1;
            }
        }
        out
    }
    /// True when the mask holds no node.
    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }
    /// The words as the kernel reads them (bit `n % 64` of word `n / 64` = node `n`).
    pub(crate) fn as_words(&self) -> &[u64] {
        &self.words
    }
    /// The number of bits the mask spans (a multiple of 64).
    pub(crate) fn max_bits(&self) -> usize {
        self.words.len() * 64
    }
    /// A mask from kernel words, dropping trailing zero words (the invariant).
    pub(crate) fn from_words(mut words: Vec<u64>) -> Self {
        while words.last() == Some(&0) {
            words.pop();
        }
        Self { words }
    }
    /// Word index and bit of `node`.
    fn position(node: NodeId) -> (usize, u32) {
        // u32 -> usize is lossless on the 64-bit hosts this crate builds for.
        ((node / 64) as usize, node % 64)
    }
}

impl FromIterator<NodeId> for NodeMask {
    fn from_iter<I: IntoIterator<Item = NodeId>>(iter: I) -> Self {
        let mut m = Self::new();
        for node in iter {
            m.insert(node);
        }
        m
    }
}

/// Memory-policy modes (`MPOL_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemPolicyMode {
    /// MPOL_DEFAULT.
    Default,
    /// MPOL_PREFERRED.
    Preferred,
    /// MPOL_BIND.
    Bind,
    /// MPOL_INTERLEAVE.
    Interleave,
    /// MPOL_LOCAL.
    Local,
}

impl MemPolicyMode {
    /// The kernel's number for the mode.
    fn to_raw(self) -> libc::c_int {
        match self {
            Self::Default => abi::MPOL_DEFAULT,
            Self::Preferred => abi::MPOL_PREFERRED,
            Self::Bind => abi::MPOL_BIND,
            Self::Interleave => abi::MPOL_INTERLEAVE,
            Self::Local => abi::MPOL_LOCAL,
        }
    }
    /// The mode for a number `get_mempolicy` reported, mode flags stripped.
    fn from_raw(raw: libc::c_int) -> Option<Self> {
        match raw & !abi::MPOL_MODE_FLAGS {
            abi::MPOL_DEFAULT => Some(Self::Default),
            abi::MPOL_PREFERRED => Some(Self::Preferred),
            abi::MPOL_BIND => Some(Self::Bind),
            abi::MPOL_INTERLEAVE => Some(Self::Interleave),
            abi::MPOL_LOCAL => Some(Self::Local),
            _ => None,
        }
    }
}

/// `mbind` flags.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MbindFlags {
    /// MPOL_MF_STRICT.
    pub strict: bool,
    /// MPOL_MF_MOVE.
    pub move_pages: bool,
    /// MPOL_MF_MOVE_ALL (needs CAP_SYS_NICE).
    pub move_all: bool,
}

impl MbindFlags {
    /// The kernel's flag bits.
    fn to_raw(self) -> libc::c_uint {
        let mut raw = 0;
        if self.strict {
            raw |= abi::MPOL_MF_STRICT;
        }
        if self.move_pages {
            raw |= abi::MPOL_MF_MOVE;
        }
        if self.move_all {
            raw |= abi::MPOL_MF_MOVE_ALL;
        }
        raw
    }
}

/// Where one page is, or why the kernel could not say / move it (`move_pages` status).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageLocation {
    /// On this node.
    Node(NodeId),
    /// The per-page status was a negative errno (e.g. -ENOENT: not present, -EBUSY, -ENOMEM).
    Error(i32),
}

impl PageLocation {
    /// Decodes one `move_pages` status entry: a node id, or a negative errno.
    fn from_status(status: libc::c_int) -> Self {
        match NodeId::try_from(status) {
            Ok(node) => Self::Node(node),
            Err(_) => Self::Error(status),
        }
    }
}

/// Refuses masks wider than the kernel reads, before making the call.
fn check_mask(op: &'static str, mask: &NodeMask) -> Result<(), PolicyError> {
    if mask.as_words().len() > sys::MAX_MASK_WORDS {
        return Err(PolicyError::InvalidArgument { op });
    }
    Ok(())
}

/// `pid` for the kernel: `None` (and `Some(0)`) mean the calling process.
fn raw_pid(op: &'static str, pid: Option<i32>) -> Result<libc::pid_t, PolicyError> {
    match pid {
        None => Ok(0),
        Some(p) if p >= 0 => Ok(p),
        Some(_) => Err(PolicyError::InvalidArgument { op }),
    }
}

/// `mbind(addr, len, mode, nodes, flags)`. Memory-safe for any range: the kernel
/// validates it and only changes placement, never contents.
///
/// `addr` must be page aligned (for hugetlb mappings: huge-page aligned, and
/// `len` a multiple of the huge page size), else
/// [`PolicyError::InvalidArgument`]. A range with an unmapped hole gives
/// [`PolicyError::NotMapped`] (kernel 6.18 reports EFAULT there).
///
/// # Errors
///
/// The kernel's errno mapped to [`PolicyError`]; a mask wider than the kernel
/// reads is refused as `InvalidArgument` without a syscall.
pub fn mbind(
    addr: usize,
    len: usize,
    mode: MemPolicyMode,
    nodes: &NodeMask,
    flags: MbindFlags,
) -> Result<(), PolicyError> {
    const OP: &str = "mbind";
    check_mask(OP, nodes)?;
    sys::mbind(addr, len, mode.to_raw(), nodes.as_words(), flags.to_raw())
        .map_err(|e| PolicyError::from_io(OP, e))
}

/// `set_mempolicy` for the calling thread.
///
/// The policy is per thread: it applies to later allocations by this thread
/// (and threads it spawns afterwards), not to memory already placed.
/// `Default` and `Local` take an empty mask; `Bind`/`Interleave` need a
/// non-empty one.
///
/// # Errors
///
/// The kernel's errno mapped to [`PolicyError`].
pub fn set_mempolicy(mode: MemPolicyMode, nodes: &NodeMask) -> Result<(), PolicyError> {
    const OP: &str = "set_mempolicy";
    check_mask(OP, nodes)?;
    sys::set_mempolicy(mode.to_raw(), nodes.as_words()).map_err(|e| PolicyError::from_io(OP, e))
}

/// Node-mask size for `get_mempolicy`, in 64-bit words. The kernel refuses
/// (EINVAL) a `maxnode` below `nr_node_ids`, so start at 1024 bits, which is
/// `MAX_NUMNODES` with x86_64's largest `NODES_SHIFT`; wider kernels get a
/// retry with twice the size, up to the one-page limit.
const GET_MEMPOLICY_START_WORDS: usize = 1024 / 64;

/// `get_mempolicy` of the calling thread: its mode and node mask.
///
/// For `Default` the mask is empty. Mode flags (`MPOL_F_STATIC_NODES` etc.)
/// are dropped. A mode this enum has no variant for (`MPOL_PREFERRED_MANY`,
/// `MPOL_WEIGHTED_INTERLEAVE`) is reported as [`PolicyError::Other`] with
/// `io::ErrorKind::Unsupported`.
///
/// # Errors
///
/// The kernel's errno mapped to [`PolicyError`], or the unknown mode above.
pub fn get_mempolicy() -> Result<(MemPolicyMode, NodeMask), PolicyError> {
    const OP: &str = "get_mempolicy";
    let mut words = GET_MEMPOLICY_START_WORDS;
    let (raw, buf) = loop {
        let mut buf = vec![0u64; words];
        match sys::get_mempolicy(Some(&mut buf), 0, 0) {
            Ok(raw) => break (raw, buf),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) && words < sys::MAX_MASK_WORDS => {
                debug!(
                    bits = words * 64,
                    "get_mempolicy: mask too small for nr_node_ids, retrying"
                );
                words *= 2;
            }
            Err(e) => return Err(PolicyError::from_io(OP, e)),
        }
    };
    let mode = MemPolicyMode::from_raw(raw).ok_or_else(|| unknown_mode(OP, raw))?;
    Ok((mode, NodeMask::from_words(buf)))
}

/// The error for a mode number this crate has no variant for.
fn unknown_mode(op: &'static str, raw: libc::c_int) -> PolicyError {
    let name = match raw & !abi::MPOL_MODE_FLAGS {
        abi::MPOL_PREFERRED_MANY => "MPOL_PREFERRED_MANY",
        abi::MPOL_WEIGHTED_INTERLEAVE => "MPOL_WEIGHTED_INTERLEAVE",
        _ => "unknown",
    };
    PolicyError::Other {
        op,
        source: io::Error::new(
            io::ErrorKind::Unsupported,
            format!("policy mode {raw} ({name}) is not supported by this crate"),
        ),
    }
}

/// `get_mempolicy(MPOL_F_NODE|MPOL_F_ADDR)`: the node of the page at `addr`.
///
/// The kernel looks the page up with a read fault, so a page that was never
/// touched is faulted in first: for private anonymous memory that maps the
/// shared zero page, whose node says nothing about where a write would land.
/// Use [`move_pages_query`] to ask without faulting (it reports `-ENOENT`).
///
/// # Errors
///
/// [`PolicyError::NotMapped`] when `addr` is not mapped; other errnos mapped to
/// [`PolicyError`].
pub fn get_mempolicy_node_of_addr(addr: usize) -> Result<NodeId, PolicyError> {
    const OP: &str = "get_mempolicy";
    let raw = sys::get_mempolicy(None, addr, abi::MPOL_F_NODE | abi::MPOL_F_ADDR)
        .map_err(|e| PolicyError::from_io(OP, e))?;
    NodeId::try_from(raw).map_err(|_| PolicyError::Other {
        op: OP,
        source: io::Error::new(
            io::ErrorKind::InvalidData,
            format!("kernel reported node {raw}"),
        ),
    })
}

/// `move_pages` with no target nodes: where each page is (pid `None` = self).
///
/// A page that is not present (never touched, or swapped out) reports
/// `PageLocation::Error(-ENOENT)`; an unmapped address `Error(-EFAULT)`.
///
/// # Errors
///
/// Errors of the call as a whole (no such process, permission) mapped to
/// [`PolicyError`]; per-page problems are in the returned statuses.
pub fn move_pages_query(
    pid: Option<i32>,
    pages: &[usize],
) -> Result<Vec<PageLocation>, PolicyError> {
    const OP: &str = "move_pages";
    let pid = raw_pid(OP, pid)?;
    if pages.is_empty() {
        return Ok(Vec::new());
    }
    let mut status = vec![0; pages.len()];
    sys::move_pages(pid, pages, None, &mut status, 0).map_err(|e| PolicyError::from_io(OP, e))?;
    Ok(status.into_iter().map(PageLocation::from_status).collect())
}

/// `move_pages` to `targets[i]` for `pages[i]`; returns each page's status.
///
/// `move_all` selects `MPOL_MF_MOVE_ALL` (also pages shared with other
/// processes; needs CAP_SYS_NICE), else `MPOL_MF_MOVE`.
///
/// Since Linux 4.17 the call returns a positive count when some pages could
/// not be moved. The kernel then stops at the failed batch (`do_pages_move`:
/// the rest are counted as not moved) and leaves the status entries of that
/// batch and of every later page unwritten, so they would read as whatever
/// the buffer held. In that case this function asks the kernel again without
/// targets, so every `Node(n)` returned is where the page really is; compare
/// with `targets` to find the pages that did not move.
///
/// # Errors
///
/// [`PolicyError::InvalidArgument`] without a syscall when `pages` and
/// `targets` differ in length or a target does not fit the kernel's `int`;
/// [`PolicyError::NodeNotOnline`] when a target node has no memory or is
/// absent; other errnos of the call as a whole mapped to [`PolicyError`].
pub fn move_pages(
    pid: Option<i32>,
    pages: &[usize],
    targets: &[NodeId],
    move_all: bool,
) -> Result<Vec<PageLocation>, PolicyError> {
    const OP: &str = "move_pages";
    if pages.len() != targets.len() {
        return Err(PolicyError::InvalidArgument { op: OP });
    }
    let raw_pid = raw_pid(OP, pid)?;
    let nodes = targets
        .iter()
        .map(|&n| libc::c_int::try_from(n))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| PolicyError::InvalidArgument { op: OP })?;
    if pages.is_empty() {
        return Ok(Vec::new());
    }
    let flags = if move_all {
        abi::MPOL_MF_MOVE_ALL
    } else {
        abi::MPOL_MF_MOVE
    };
    let mut status = vec![0; pages.len()];
    let not_moved = sys::move_pages(raw_pid, pages, Some(&nodes), &mut status, flags)
        .map_err(|e| PolicyError::from_io(OP, e))?;
    if not_moved > 0 {
        debug!(
            not_moved,
            pages = pages.len(),
            "move_pages: some pages not moved; re-querying their nodes"
        );
        return move_pages_query(pid, pages);
    }
    Ok(status.into_iter().map(PageLocation::from_status).collect())
}

/// `migrate_pages(pid, from, to)`: returns the number of pages that could not be moved.
///
/// Moves every page of the process that is on a node in `from` to the node in
/// the same relative position in `to` (see `migrate_pages(2)`).
///
/// # Errors
///
/// [`PolicyError::InvalidArgument`] for an empty `to` or bad masks,
/// [`PolicyError::PermissionDenied`] for another user's process or a target
/// outside its cpuset without CAP_SYS_NICE, [`PolicyError::NoSuchProcess`];
/// other errnos mapped to [`PolicyError`].
pub fn migrate_pages(
    pid: Option<i32>,
    from: &NodeMask,
    to: &NodeMask,
) -> Result<usize, PolicyError> {
    const OP: &str = "migrate_pages";
    check_mask(OP, from)?;
    check_mask(OP, to)?;
    let pid = raw_pid(OP, pid)?;
    debug!(
        from_bits = from.max_bits(),
        to_bits = to.max_bits(),
        pid,
        "migrate_pages"
    );
    sys::migrate_pages(pid, from.as_words(), to.as_words()).map_err(|e| PolicyError::from_io(OP, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mask_insert_contains_nodes() {
        let mut m = NodeMask::new();
        assert!(m.is_empty());
        assert!(!m.contains(0));
        assert_eq!(m.nodes(), Vec::<NodeId>::new());
        m.insert(3);
        m.insert(0);
        m.insert(3);
        assert!(m.contains(0) && m.contains(3));
        assert!(!m.contains(1) && !m.contains(64) && !m.contains(1000));
        assert_eq!(m.nodes(), vec![0, 3]);
        assert_eq!(m.as_words(), &[0b1001]);
        assert_eq!(m.max_bits(), 64);
    }

    #[test]
    fn mask_ids_beyond_first_word() {
        let mut m = NodeMask::single(64);
        m.insert(63);
        m.insert(130);
        m.insert(1023);
        assert_eq!(m.nodes(), vec![63, 64, 130, 1023]);
        assert!(m.contains(64) && m.contains(1023));
        assert!(!m.contains(65) && !m.contains(1024) && !m.contains(NodeId::MAX));
        assert_eq!(m.as_words().len(), 16);
        assert_eq!(m.as_words()[0], 1 << 63);
        assert_eq!(m.as_words()[1], 1);
        assert_eq!(m.as_words()[2], 1 << 2);
        assert_eq!(m.as_words()[15], 1 << 63);
        assert_eq!(m.max_bits(), 1024);
    }

    #[test]
    fn mask_equality_ignores_trailing_zero_words() {
        let from_kernel = NodeMask::from_words(vec![1, 0, 0, 0]);
        assert_eq!(from_kernel, NodeMask::single(0));
        assert_eq!(NodeMask::from_words(vec![0; 16]), NodeMask::new());
        let collected: NodeMask = [5, 70, 5].into_iter().collect();
        assert_eq!(collected.nodes(), vec![5, 70]);
    }

    #[test]
    fn errno_maps_to_variant() {
        let map = |e| PolicyError::from_io("op", io::Error::from_raw_os_error(e));
        assert!(matches!(
            map(libc::EINVAL),
            PolicyError::InvalidArgument { op: "op" }
        ));
        assert!(matches!(map(libc::EFAULT), PolicyError::NotMapped { .. }));
        assert!(matches!(map(libc::ENOMEM), PolicyError::OutOfMemory { .. }));
        assert!(matches!(
            map(libc::EPERM),
            PolicyError::PermissionDenied { .. }
        ));
        assert!(matches!(
            map(libc::EACCES),
            PolicyError::PermissionDenied { .. }
        ));
        assert!(matches!(
            map(libc::ENODEV),
            PolicyError::NodeNotOnline { .. }
        ));
        assert!(matches!(
            map(libc::ESRCH),
            PolicyError::NoSuchProcess { .. }
        ));
        assert!(matches!(map(libc::EIO), PolicyError::Io { .. }));
        assert!(matches!(map(libc::E2BIG), PolicyError::TooBig { .. }));
        let other = map(libc::EBUSY);
        assert!(matches!(other, PolicyError::Other { .. }));
        assert_eq!(other.errno(), Some(libc::EBUSY));
        assert_eq!(map(libc::ENODEV).errno(), Some(libc::ENODEV));
        assert_eq!(map(libc::ENODEV).to_string(), "op: node not online");
    }

    #[test]
    fn modes_and_flags_round_trip() {
        for mode in [
            MemPolicyMode::Default,
            MemPolicyMode::Preferred,
            MemPolicyMode::Bind,
            MemPolicyMode::Interleave,
            MemPolicyMode::Local,
        ] {
            assert_eq!(MemPolicyMode::from_raw(mode.to_raw()), Some(mode));
            // Mode flags the kernel ORs in are stripped.
            assert_eq!(
                MemPolicyMode::from_raw(mode.to_raw() | libc::MPOL_F_STATIC_NODES),
                Some(mode)
            );
        }
        assert_eq!(MemPolicyMode::from_raw(abi::MPOL_PREFERRED_MANY), None);
        let err = unknown_mode("get_mempolicy", abi::MPOL_WEIGHTED_INTERLEAVE);
        assert!(matches!(err, PolicyError::Other { .. }));
        assert_eq!(MbindFlags::default().to_raw(), 0);
        let all = MbindFlags {
            strict: true,
            move_pages: true,
            move_all: true,
        };
        assert_eq!(all.to_raw(), 0b111);
    }

    #[test]
    fn page_location_from_status() {
        assert_eq!(PageLocation::from_status(0), PageLocation::Node(0));
        assert_eq!(PageLocation::from_status(3), PageLocation::Node(3));
        assert_eq!(
            PageLocation::from_status(-libc::ENOENT),
            PageLocation::Error(-libc::ENOENT)
        );
    }

    #[test]
    fn invalid_inputs_rejected_before_syscall() {
        // Length mismatch: refused here, the (bogus) addresses never reach the kernel.
        let err = move_pages(None, &[0x1000, 0x2000], &[0], false).expect_err("length mismatch");
        assert!(matches!(
            err,
            PolicyError::InvalidArgument { op: "move_pages" }
        ));
        // A target that does not fit the kernel's `int`.
        let err = move_pages(None, &[0x1000], &[NodeId::MAX], false).expect_err("huge node");
        assert!(matches!(err, PolicyError::InvalidArgument { .. }));
        // Negative pid.
        let err = move_pages_query(Some(-5), &[0x1000]).expect_err("negative pid");
        assert!(matches!(err, PolicyError::InvalidArgument { .. }));
        // Masks wider than a page of bits.
        let wide = NodeMask::single(40_000);
        let err = set_mempolicy(MemPolicyMode::Bind, &wide).expect_err("wide mask");
        assert!(matches!(
            err,
            PolicyError::InvalidArgument {
                op: "set_mempolicy"
            }
        ));
        let err = migrate_pages(None, &wide, &NodeMask::single(0)).expect_err("wide mask");
        assert!(matches!(
            err,
            PolicyError::InvalidArgument {
                op: "migrate_pages"
            }
        ));
        // Empty requests succeed without a syscall.
        assert_eq!(move_pages(None, &[], &[], false).expect("empty"), vec![]);
        assert_eq!(move_pages_query(None, &[]).expect("empty"), vec![]);
    }
}
