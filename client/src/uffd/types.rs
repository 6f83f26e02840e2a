//! What the userfaultfd ioctls take and return: features, flags, modes,
//! fills, fault events, fdinfo.

use std::fmt;

use super::abi::{self, UffdMsg};

/// A set of `UFFD_FEATURE_*` bits that prints as their header names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Features(pub u64);

impl Features {
    /// True when every bit of `features` is set.
    pub fn contains(self, features: u64) -> bool {
        self.0 & features == features
    }
}

impl fmt::Display for Features {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 == 0 {
            return f.write_str("none");
        }
        let mut known = 0;
        let mut first = true;
        for (bit, name) in abi::FEATURE_NAMES {
            if self.0 & bit != 0 {
                f.write_str(if first { "" } else { "|" })?;
                f.write_str(name)?;
                known |= bit;
                first = false;
            }
        }
        if self.0 & !known != 0 {
            write!(f, "{}{:#x}", if first { "" } else { "|" }, self.0 & !known)?;
        }
        Ok(())
    }
}

/// Flags for creating a userfaultfd. [`CreateFlags::new`] (= `Default`) is
/// `O_CLOEXEC | O_NONBLOCK`, which is what the daemon and a KVM VMM want.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CreateFlags {
    blocking: bool,
    user_mode_only: bool,
}

impl Default for CreateFlags {
    fn default() -> Self {
        Self::new()
    }
}

impl CreateFlags {
    /// `O_CLOEXEC | O_NONBLOCK`; kernel-mode faults are handled too.
    pub const fn new() -> Self {
        Self {
            blocking: false,
            user_mode_only: false,
        }
    }

    /// Leave out `O_NONBLOCK`: `read` waits for an event.
    pub const fn blocking(self) -> Self {
        Self {
            blocking: true,
            ..self
        }
    }

    /// Add `UFFD_USER_MODE_ONLY`. Faults taken in kernel mode on the process's
    /// behalf then fail instead of waiting: KVM guest accesses to registered
    /// memory become MMIO exits, syscalls reading it get `EFAULT`. Allowed
    /// without privilege even when `vm.unprivileged_userfaultfd = 0`.
    /// Never use it for guest RAM.
    pub const fn user_mode_only(self) -> Self {
        Self {
            user_mode_only: true,
            ..self
        }
    }

    /// The `userfaultfd(2)` flags word.
    pub const fn bits(self) -> libc::c_int {
        let mut bits = libc::O_CLOEXEC;
        if !self.blocking {
            bits |= libc::O_NONBLOCK;
        }
        if self.user_mode_only {
            bits |= abi::UFFD_USER_MODE_ONLY;
        }
        bits
    }
}

/// Register modes (`UFFDIO_REGISTER_MODE_*`); combine with `|`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegisterMode(pub u64);

impl RegisterMode {
    /// Faults on pages the backing file or anon VMA does not have.
    pub const MISSING: Self = Self(abi::UFFDIO_REGISTER_MODE_MISSING);
    /// Writes to pages write-protected with [`Uffd::write_protect`](super::Uffd::write_protect).
    pub const WP: Self = Self(abi::UFFDIO_REGISTER_MODE_WP);
    /// Faults on pages in the page cache but not mapped (hugetlbfs, shmem).
    pub const MINOR: Self = Self(abi::UFFDIO_REGISTER_MODE_MINOR);
}

impl std::ops::BitOr for RegisterMode {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        Self(self.0 | rhs.0)
    }
}

/// The ioctls the kernel allows on a registered range (`uffdio_register.ioctls`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RangeIoctls(pub u64);

impl RangeIoctls {
    fn has(self, nr: u32) -> bool {
        self.0 & (1u64 << nr) != 0
    }
    /// `UFFDIO_CONTINUE` is allowed.
    pub fn continue_(self) -> bool {
        self.has(abi::NR_CONTINUE)
    }
    /// `UFFDIO_COPY` is allowed.
    pub fn copy(self) -> bool {
        self.has(abi::NR_COPY)
    }
    /// `UFFDIO_ZEROPAGE` is allowed (never on hugetlbfs).
    pub fn zeropage(self) -> bool {
        self.has(abi::NR_ZEROPAGE)
    }
    /// `UFFDIO_WAKE` is allowed.
    pub fn wake(self) -> bool {
        self.has(abi::NR_WAKE)
    }
    /// `UFFDIO_WRITEPROTECT` is allowed.
    pub fn write_protect(self) -> bool {
        self.has(abi::NR_WRITEPROTECT)
    }
}

/// What `UFFDIO_API` answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApiInfo {
    /// The features asked for, which are now enabled on this uffd.
    pub enabled: Features,
    /// Every feature the kernel supports (it reports all of them, not only
    /// the enabled ones).
    pub available: Features,
    /// Bit `_UFFDIO_*` set for each ioctl the fd accepts.
    pub ioctls: u64,
}

/// How a fill ioctl (`CONTINUE`, `COPY`, `ZEROPAGE`) ended without an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fill {
    /// The whole range is mapped now (and woken, unless asked not to).
    Done,
    /// `EEXIST`: the first page was already mapped, by an earlier fill or a
    /// racing fault on the same page. Treat as served.
    AlreadyMapped,
    /// `EAGAIN`: stopped after `done` bytes (woken, unless asked not to).
    /// Either the address space is changing under a pending non-cooperative
    /// event (REMOVE/UNMAP/REMAP/FORK not yet read: read events, then retry),
    /// or the fill stopped early at a page that was already mapped: retry
    /// from `start + done`, and on [`Fill::AlreadyMapped`] skip that page.
    Retry {
        /// Bytes mapped before stopping.
        done: u64,
    },
}

impl Fill {
    /// True for [`Fill::Done`] and [`Fill::AlreadyMapped`].
    pub fn is_served(self) -> bool {
        matches!(self, Fill::Done | Fill::AlreadyMapped)
    }

    /// Sorts a fill ioctl's outcome: `errno` is `None` on success, `written`
    /// is the ioctl's out field (bytes done, or `-errno`).
    pub(super) fn classify(errno: Option<i32>, written: i64) -> Option<Self> {
        match errno {
            None => Some(Fill::Done),
            Some(libc::EEXIST) => Some(Fill::AlreadyMapped),
            Some(libc::EAGAIN) => Some(Fill::Retry {
                done: u64::try_from(written).unwrap_or(0),
            }),
            Some(_) => None,
        }
    }
}

/// Why a page fault was raised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// The backing has no page there.
    Missing,
    /// The page is in the page cache but not mapped.
    Minor,
    /// A write hit a write-protected page.
    WriteProtect,
}

/// A `UFFD_EVENT_PAGEFAULT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageFault {
    /// Faulting address: aligned down to the mapping's page size (the huge
    /// page on hugetlbfs) unless `UFFD_FEATURE_EXACT_ADDRESS` was enabled.
    pub address: u64,
    /// `UFFD_PAGEFAULT_FLAG_*` bits.
    pub flags: u64,
    /// Faulting thread's id, 0 unless `UFFD_FEATURE_THREAD_ID` was enabled.
    pub thread_id: u32,
}

impl PageFault {
    /// The access was a write.
    pub fn is_write(&self) -> bool {
        self.flags & abi::UFFD_PAGEFAULT_FLAG_WRITE != 0
    }
    /// A MINOR fault.
    pub fn is_minor(&self) -> bool {
        self.flags & abi::UFFD_PAGEFAULT_FLAG_MINOR != 0
    }
    /// A write-protect fault.
    pub fn is_wp(&self) -> bool {
        self.flags & abi::UFFD_PAGEFAULT_FLAG_WP != 0
    }
    /// MISSING when neither MINOR nor WP is set.
    pub fn kind(&self) -> FaultKind {
        if self.is_wp() {
            FaultKind::WriteProtect
        } else if self.is_minor() {
            FaultKind::Minor
        } else {
            FaultKind::Missing
        }
    }
    /// Start of the page of `page_size` bytes (a power of two) holding the
    /// faulting address.
    pub fn page_start(&self, page_size: u64) -> u64 {
        debug_assert!(page_size.is_power_of_two());
        self.address & !(page_size - 1)
    }
}

/// A message decoded without touching the fd table.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Parsed {
    PageFault(PageFault),
    Fork(u32),
    Remap { from: u64, to: u64, len: u64 },
    Remove { start: u64, end: u64 },
    Unmap { start: u64, end: u64 },
    Unknown(u8),
}

pub(super) fn parse_msg(msg: &UffdMsg) -> Parsed {
    match msg.event {
        abi::UFFD_EVENT_PAGEFAULT => Parsed::PageFault(PageFault {
            address: msg.pagefault_address(),
            flags: msg.pagefault_flags(),
            thread_id: msg.pagefault_ptid(),
        }),
        abi::UFFD_EVENT_FORK => Parsed::Fork(msg.fork_ufd()),
        abi::UFFD_EVENT_REMAP => Parsed::Remap {
            from: msg.remap_from(),
            to: msg.remap_to(),
            len: msg.remap_len(),
        },
        abi::UFFD_EVENT_REMOVE => Parsed::Remove {
            start: msg.remove_start(),
            end: msg.remove_end(),
        },
        abi::UFFD_EVENT_UNMAP => Parsed::Unmap {
            start: msg.remove_start(),
            end: msg.remove_end(),
        },
        other => Parsed::Unknown(other),
    }
}

/// The counters `/proc/self/fdinfo` shows for a uffd.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FdInfo {
    /// Faults waiting and not yet read.
    pub pending: u64,
    /// Faults waiting in total, read or not.
    pub total: u64,
    /// The features enabled by the handshake (with the kernel's internal
    /// "initialized" bit 31 removed); lets the daemon check what the VMM set.
    pub features: Features,
}

/// Kernel-internal `UFFD_FEATURE_INITIALIZED` bit that fdinfo shows.
pub(super) const FEATURE_INITIALIZED: u64 = 1 << 31;

pub(super) fn parse_fdinfo(text: &str) -> Option<FdInfo> {
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .map(str::trim)
    };
    let pending = field("pending:")?.parse().ok()?;
    let total = field("total:")?.parse().ok()?;
    // "API:\t<api>:<features>:<ioctls>", all hex.
    let features = field("API:")?.split(':').nth(1)?;
    let features = u64::from_str_radix(features, 16).ok()?;
    Some(FdInfo {
        pending,
        total,
        features: Features(features & !FEATURE_INITIALIZED),
    })
}
