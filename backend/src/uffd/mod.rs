//! userfaultfd: the small safe layer lazy mode serves guest faults through.
//!
//! In lazy mode the VMM creates a userfaultfd, does the `UFFDIO_API`
//! handshake, registers its own guest-RAM mapping of the hugemem memfd in
//! MINOR mode and sends the uffd to the daemon over the socket (a uffd always
//! registers ranges of the process that created it, so the daemon cannot do
//! that part). The daemon reads page-fault events, clears the huge page through
//! its own mapping of the same memfd and answers with `UFFDIO_CONTINUE`, which
//! maps the page-cache page into the VMM and wakes the faulting thread.
//! [`Uffd`] serves both sides: [`Uffd::new`], [`Uffd::api`] and
//! [`Uffd::register`] for the VMM; [`Uffd::from_owned_fd`],
//! [`Uffd::read_event`] and [`Uffd::continue_range`] for the daemon.
//!
//! # Design
//!
//! Our own module rather than the `userfaultfd` crate: that crate needs
//! libclang at build time (bindgen), has no `UFFD_FEATURE_MINOR_HUGETLBFS`,
//! and its builder defaults to `UFFD_USER_MODE_ONLY`, with which KVM's guest
//! accesses to registered memory fail and become silent MMIO exits. Here
//! [`CreateFlags::new`] is `O_CLOEXEC | O_NONBLOCK` and user-mode-only is an
//! explicit opt-in. Kernel numbers live in [`abi`], recomputed from the
//! `_IOWR` formula and pinned by a unit test; this file holds one wrapper per
//! syscall or ioctl.
//!
//! The fill operations (`UFFDIO_CONTINUE`, `COPY`, `ZEROPAGE`) are safe
//! functions: they only install pages where the registered process has none
//! mapped yet (an existing page gives `EEXIST`), which is the same as another
//! process writing a shared mapping, not a change to memory Rust code holds.
//!
//! # Kernel behaviour the daemon relies on (checked by `tests/uffd.rs`)
//!
//! - MINOR faults fire only for pages already in the file's page cache. A page
//!   the memfd never allocated raises a MISSING fault instead (neither the
//!   MINOR nor the WP flag set) when the range is registered `MISSING |
//!   MINOR`; registered MINOR only, such a fault is not reported at all and
//!   the kernel maps a page it zeroed itself.
//! - Without `UFFD_FEATURE_EXACT_ADDRESS` the fault address is aligned down
//!   to the mapping's page (the huge page on hugetlbfs, observed on 6.18);
//!   with it, it is the byte that faulted. [`PageFault::page_start`] aligns
//!   either way.
//! - `UFFDIO_CONTINUE` on a page the file does not hold fails with `EFAULT`;
//!   on a page already mapped it fails with `EEXIST` *without* waking anyone
//!   ([`Fill::AlreadyMapped`]; [`Uffd::continue_range`] then wakes the range
//!   itself when asked to wake). Partial progress, or a pending non-cooperative
//!   event (`mmap_changing`), gives `EAGAIN` ([`Fill::Retry`]).
//! - When the last reference to a uffd is closed while a thread waits on a
//!   fault, the kernel unregisters the ranges and wakes the thread, which
//!   retries the fault without userfaultfd: a MINOR fault then maps the
//!   page-cache page as it is, *uncleared* (no SIGBUS). The VMM must keep its
//!   own copy of the uffd open for as long as the guest runs, so a daemon crash
//!   leaves faults waiting rather than serving stale memory.

pub mod abi;

use std::fmt;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

pub use abi::UffdMsg;

/// Errors from userfaultfd operations; each names the operation that failed.
#[derive(Debug, thiserror::Error)]
pub enum UffdError {
    /// `userfaultfd(2)` failed.
    #[error("cannot create a userfaultfd")]
    Create(#[source] io::Error),
    /// `userfaultfd(2)` was refused and `/dev/userfaultfd` did not work either.
    #[error("userfaultfd(2) was refused ({syscall}) and /dev/userfaultfd failed too")]
    CreateViaDevice {
        /// Why the syscall was refused.
        syscall: io::Error,
        /// Why the device failed.
        #[source]
        source: io::Error,
    },
    /// The fd could not be inspected through `/proc/self/fd`.
    #[error("cannot inspect fd {0}")]
    Inspect(RawFd, #[source] io::Error),
    /// The fd is something other than a userfaultfd.
    #[error("fd is not a userfaultfd (it is {0})")]
    NotUserfaultfd(String),
    /// The `UFFDIO_API` handshake failed.
    #[error("UFFDIO_API handshake failed")]
    Api(#[source] io::Error),
    /// The kernel does not offer every feature asked for.
    #[error("the kernel's userfaultfd lacks features {missing} (it offers {available})")]
    MissingFeatures {
        /// Asked for, not offered.
        missing: Features,
        /// What the kernel offers.
        available: Features,
    },
    /// `UFFDIO_REGISTER` failed.
    #[error("UFFDIO_REGISTER of {len:#x} bytes at {start:#x} (mode {mode:#x}) failed")]
    Register {
        /// Range start.
        start: u64,
        /// Range length.
        len: u64,
        /// Register mode bits.
        mode: u64,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// `UFFDIO_UNREGISTER` failed.
    #[error("UFFDIO_UNREGISTER of {len:#x} bytes at {start:#x} failed")]
    Unregister {
        /// Range start.
        start: u64,
        /// Range length.
        len: u64,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// `UFFDIO_WAKE` failed.
    #[error("UFFDIO_WAKE of {len:#x} bytes at {start:#x} failed")]
    Wake {
        /// Range start.
        start: u64,
        /// Range length.
        len: u64,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// `UFFDIO_CONTINUE` failed (`EFAULT`: the file holds no page there;
    /// `ESRCH`: the registering process is gone).
    #[error("UFFDIO_CONTINUE of {len:#x} bytes at {start:#x} failed")]
    Continue {
        /// Range start.
        start: u64,
        /// Range length.
        len: u64,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// `UFFDIO_COPY` failed.
    #[error("UFFDIO_COPY of {len:#x} bytes to {start:#x} failed")]
    Copy {
        /// Destination start.
        start: u64,
        /// Length.
        len: u64,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// `UFFDIO_ZEROPAGE` failed (hugetlbfs does not support it: `EINVAL`).
    #[error("UFFDIO_ZEROPAGE of {len:#x} bytes at {start:#x} failed")]
    ZeroPage {
        /// Range start.
        start: u64,
        /// Range length.
        len: u64,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// `UFFDIO_WRITEPROTECT` failed.
    #[error("UFFDIO_WRITEPROTECT of {len:#x} bytes at {start:#x} failed")]
    WriteProtect {
        /// Range start.
        start: u64,
        /// Range length.
        len: u64,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Reading events failed.
    #[error("cannot read userfaultfd events")]
    Read(#[source] io::Error),
    /// Waiting for events failed.
    #[error("cannot poll the userfaultfd")]
    Poll(#[source] io::Error),
    /// `/proc/self/fdinfo` of the uffd could not be read or parsed.
    #[error("cannot read the userfaultfd's fdinfo")]
    FdInfo(#[source] io::Error),
}

/// Result alias for this module.
pub type Result<T> = std::result::Result<T, UffdError>;

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
    /// Writes to pages write-protected with [`Uffd::write_protect`].
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
    fn classify(errno: Option<i32>, written: i64) -> Option<Self> {
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

/// One event read from a uffd.
#[derive(Debug)]
pub enum UffdEvent {
    /// A thread waits on a fault.
    PageFault(PageFault),
    /// The registered process forked (`UFFD_FEATURE_EVENT_FORK`); `uffd` is
    /// the child's new userfaultfd, installed in our fd table by the read.
    Fork {
        /// The child's uffd.
        uffd: Uffd,
    },
    /// `mremap` moved a registered range (`UFFD_FEATURE_EVENT_REMAP`).
    Remap {
        /// Old start.
        from: u64,
        /// New start.
        to: u64,
        /// Length.
        len: u64,
    },
    /// `madvise(DONTNEED/REMOVE)` or hole punch dropped pages of a registered
    /// range (`UFFD_FEATURE_EVENT_REMOVE`); `end` is exclusive.
    Remove {
        /// Start.
        start: u64,
        /// End (exclusive).
        end: u64,
    },
    /// `munmap` of a registered range (`UFFD_FEATURE_EVENT_UNMAP`).
    Unmap {
        /// Start.
        start: u64,
        /// End (exclusive).
        end: u64,
    },
    /// An event code this module does not know.
    Unknown {
        /// `uffd_msg.event`.
        event: u8,
    },
}

/// A message decoded without touching the fd table.
#[derive(Debug, PartialEq, Eq)]
enum Parsed {
    PageFault(PageFault),
    Fork(u32),
    Remap { from: u64, to: u64, len: u64 },
    Remove { start: u64, end: u64 },
    Unmap { start: u64, end: u64 },
    Unknown(u8),
}

fn parse_msg(msg: &UffdMsg) -> Parsed {
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
const FEATURE_INITIALIZED: u64 = 1 << 31;

fn parse_fdinfo(text: &str) -> Option<FdInfo> {
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

/// An owned userfaultfd.
#[derive(Debug)]
pub struct Uffd {
    fd: OwnedFd,
}

impl Uffd {
    /// Creates a userfaultfd for this process with `userfaultfd(2)`.
    ///
    /// When the syscall is refused (`EPERM`: `vm.unprivileged_userfaultfd = 0`
    /// without `CAP_SYS_PTRACE`; `ENOSYS`: a seccomp filter) it falls back to
    /// `/dev/userfaultfd`, whose access is granted by file permissions.
    ///
    /// # Errors
    ///
    /// [`UffdError::Create`] or, after the fallback, [`UffdError::CreateViaDevice`].
    pub fn new(flags: CreateFlags) -> Result<Self> {
        // SAFETY: userfaultfd(2) takes one int of flags and touches no user
        // memory; it returns a new fd or -1.
        let rc = unsafe { libc::syscall(libc::SYS_userfaultfd, flags.bits()) };
        if rc >= 0 {
            let raw = RawFd::try_from(rc)
                .map_err(|_| UffdError::Create(io::Error::from(io::ErrorKind::InvalidData)))?;
            // SAFETY: the syscall just returned `raw` as a new fd that nothing
            // else owns.
            let fd = unsafe { OwnedFd::from_raw_fd(raw) };
            return Ok(Self { fd });
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EPERM | libc::ENOSYS) => {
                tracing::debug!("userfaultfd(2) refused ({err}); trying /dev/userfaultfd");
                Self::new_via_device(flags).map_err(|e| UffdError::CreateViaDevice {
                    syscall: err,
                    source: e,
                })
            }
            _ => Err(UffdError::Create(err)),
        }
    }

    /// Creates a userfaultfd through `/dev/userfaultfd` and
    /// `USERFAULTFD_IOC_NEW` (Linux 6.1+), without trying the syscall.
    ///
    /// # Errors
    ///
    /// The `io::Error` of the `open` or of the ioctl.
    pub fn new_via_device(flags: CreateFlags) -> io::Result<Self> {
        let dev = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/userfaultfd")?;
        // SAFETY: USERFAULTFD_IOC_NEW is `_IO`: its argument is the flags int
        // passed by value, no memory is read or written; `dev` is open for the
        // whole call. It returns a new fd or -1.
        let rc = unsafe {
            libc::ioctl(
                dev.as_raw_fd(),
                ioctl_nr(abi::USERFAULTFD_IOC_NEW),
                flags.bits(),
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the ioctl just returned `rc` as a new fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(rc) };
        Ok(Self { fd })
    }

    /// Takes an fd received from a peer, after checking through
    /// `/proc/self/fd` that it is a userfaultfd.
    ///
    /// # Errors
    ///
    /// [`UffdError::Inspect`] when `/proc` cannot tell, [`UffdError::NotUserfaultfd`]
    /// when it is something else.
    pub fn from_owned_fd(fd: OwnedFd) -> Result<Self> {
        let raw = fd.as_raw_fd();
        let target = std::fs::read_link(format!("/proc/self/fd/{raw}"))
            .map_err(|e| UffdError::Inspect(raw, e))?;
        let target = target.to_string_lossy().into_owned();
        if target != "anon_inode:[userfaultfd]" {
            return Err(UffdError::NotUserfaultfd(target));
        }
        Ok(Self { fd })
    }

    /// Gives the fd back.
    pub fn into_owned_fd(self) -> OwnedFd {
        self.fd
    }

    /// A second fd on the same userfaultfd (`F_DUPFD_CLOEXEC`). The kernel
    /// releases the uffd, and unregisters its ranges, only when the last one
    /// closes.
    ///
    /// # Errors
    ///
    /// The `fcntl` error.
    pub fn try_clone(&self) -> io::Result<Self> {
        Ok(Self {
            fd: self.fd.try_clone()?,
        })
    }

    /// The `UFFDIO_API` handshake, once per uffd, before anything else;
    /// enables `wanted` (`UFFD_FEATURE_*` bits).
    ///
    /// Ask only for features that change behaviour (`THREAD_ID`,
    /// `EXACT_ADDRESS`, the `EVENT_*` ones); `MINOR_HUGETLBFS` and the like are
    /// mere probes that the kernel reports in [`ApiInfo::available`] anyway.
    ///
    /// # Errors
    ///
    /// [`UffdError::MissingFeatures`] naming the features the kernel lacks
    /// (learnt from a throw-away uffd, since a failed handshake reports
    /// nothing), or [`UffdError::Api`] (`EINVAL` for a second handshake too).
    pub fn api(&self, wanted: u64) -> Result<ApiInfo> {
        let mut arg = abi::UffdioApi {
            api: abi::UFFD_API,
            features: wanted,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_API is `_IOWR` of `struct uffdio_api`; `arg` is that
        // struct (24 bytes, asserted in abi) and lives across the call.
        let rc =
            unsafe { libc::ioctl(self.fd.as_raw_fd(), ioctl_nr(abi::UFFDIO_API), &raw mut arg) };
        if rc == 0 {
            return Ok(ApiInfo {
                enabled: Features(wanted),
                available: Features(arg.features),
                ioctls: arg.ioctls,
            });
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EINVAL) && wanted != 0 {
            // The kernel zeroes the struct on failure: ask a fresh uffd what
            // it offers, so the error can name what is missing.
            if let Ok(available) = Self::new(CreateFlags::new()).and_then(|probe| probe.api(0)) {
                let missing = wanted & !available.available.0;
                if missing != 0 {
                    return Err(UffdError::MissingFeatures {
                        missing: Features(missing),
                        available: available.available,
                    });
                }
            }
        }
        Err(UffdError::Api(err))
    }

    /// Registers `[start, start + len)` of this process (the creating
    /// process's address space, wherever the fd is used from) in `mode`.
    /// Both must be aligned to the mapping's page size (2 MiB/1 GiB on
    /// hugetlbfs), and the range must be mapped.
    ///
    /// # Errors
    ///
    /// [`UffdError::Register`]: `EINVAL` for misalignment, a mode the VMA does
    /// not support (MINOR on anonymous memory) or no handshake yet.
    pub fn register(&self, start: u64, len: u64, mode: RegisterMode) -> Result<RangeIoctls> {
        let mut arg = abi::UffdioRegister {
            range: abi::UffdioRange { start, len },
            mode: mode.0,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_REGISTER is `_IOWR` of `struct uffdio_register`; `arg`
        // is that struct (32 bytes) and lives across the call. The kernel only
        // reads and writes `arg`; the range is an address, not dereferenced here.
        let rc = unsafe {
            libc::ioctl(
                self.fd.as_raw_fd(),
                ioctl_nr(abi::UFFDIO_REGISTER),
                &raw mut arg,
            )
        };
        if rc < 0 {
            return Err(UffdError::Register {
                start,
                len,
                mode: mode.0,
                source: io::Error::last_os_error(),
            });
        }
        Ok(RangeIoctls(arg.ioctls))
    }

    /// Unregisters a range; threads waiting on faults in it are woken and
    /// fault again without userfaultfd.
    ///
    /// # Errors
    ///
    /// [`UffdError::Unregister`].
    pub fn unregister(&self, start: u64, len: u64) -> Result<()> {
        let mut arg = abi::UffdioRange { start, len };
        // SAFETY: UFFDIO_UNREGISTER is `_IOR` of `struct uffdio_range`; `arg`
        // is that struct (16 bytes) and lives across the call.
        let rc = unsafe {
            libc::ioctl(
                self.fd.as_raw_fd(),
                ioctl_nr(abi::UFFDIO_UNREGISTER),
                &raw mut arg,
            )
        };
        if rc < 0 {
            return Err(UffdError::Unregister {
                start,
                len,
                source: io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// Wakes the threads waiting on faults in a range (after fills done with
    /// `wake = false`).
    ///
    /// # Errors
    ///
    /// [`UffdError::Wake`].
    pub fn wake(&self, start: u64, len: u64) -> Result<()> {
        let mut arg = abi::UffdioRange { start, len };
        // SAFETY: UFFDIO_WAKE is `_IOR` of `struct uffdio_range`; `arg` is that
        // struct (16 bytes) and lives across the call.
        let rc = unsafe {
            libc::ioctl(
                self.fd.as_raw_fd(),
                ioctl_nr(abi::UFFDIO_WAKE),
                &raw mut arg,
            )
        };
        if rc < 0 {
            return Err(UffdError::Wake {
                start,
                len,
                source: io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// `UFFDIO_CONTINUE`: maps the page-cache pages of a MINOR-registered
    /// range into the registering process and, when `wake`, wakes the threads
    /// waiting on them. This is how the daemon answers a MINOR fault after
    /// clearing the page through its own mapping.
    ///
    /// On `EEXIST` the kernel wakes nobody; with `wake` set this function then
    /// issues [`Uffd::wake`] on the range itself, so a served range never
    /// leaves a thread asleep.
    ///
    /// # Errors
    ///
    /// [`UffdError::Continue`] (`EFAULT`: the file holds no page there, the
    /// fault is a MISSING one; `ESRCH`: the VMM's address space is gone;
    /// `EINVAL`: misaligned or not registered MINOR), or [`UffdError::Wake`].
    pub fn continue_range(&self, start: u64, len: u64, wake: bool) -> Result<Fill> {
        let mode = if wake {
            0
        } else {
            abi::UFFDIO_CONTINUE_MODE_DONTWAKE
        };
        let mut arg = abi::UffdioContinue {
            range: abi::UffdioRange { start, len },
            mode,
            mapped: 0,
        };
        // SAFETY: UFFDIO_CONTINUE is `_IOWR` of `struct uffdio_continue`; `arg`
        // is that struct (32 bytes) and lives across the call. The kernel maps
        // pages only where the target has none (else EEXIST), so no memory
        // anyone holds changes.
        let rc = unsafe {
            libc::ioctl(
                self.fd.as_raw_fd(),
                ioctl_nr(abi::UFFDIO_CONTINUE),
                &raw mut arg,
            )
        };
        let errno = (rc < 0).then(io::Error::last_os_error);
        let outcome = Fill::classify(errno.as_ref().and_then(io::Error::raw_os_error), arg.mapped);
        match (outcome, errno) {
            (Some(Fill::AlreadyMapped), _) if wake => {
                self.wake(start, len)?;
                Ok(Fill::AlreadyMapped)
            }
            (Some(fill), _) => Ok(fill),
            (None, err) => Err(UffdError::Continue {
                start,
                len,
                source: err.unwrap_or_else(|| io::Error::from(io::ErrorKind::Other)),
            }),
        }
    }

    /// `UFFDIO_COPY`: fills a MISSING range with a copy of `src` (its length
    /// is the range length, a multiple of the page size) and wakes it unless
    /// `wake` is false. The hugetlbfs answer to a MISSING fault, since
    /// `UFFDIO_ZEROPAGE` is not supported there.
    ///
    /// # Errors
    ///
    /// [`UffdError::Copy`].
    pub fn copy(&self, dst: u64, src: &[u8], wake: bool) -> Result<Fill> {
        let len = src.len() as u64;
        let mode = if wake {
            0
        } else {
            abi::UFFDIO_COPY_MODE_DONTWAKE
        };
        let mut arg = abi::UffdioCopy {
            dst,
            src: src.as_ptr() as u64,
            len,
            mode,
            copy: 0,
        };
        // SAFETY: UFFDIO_COPY is `_IOWR` of `struct uffdio_copy`; `arg` is that
        // struct (40 bytes) and lives across the call. The kernel reads `len`
        // bytes at `src`, which is the borrowed slice, and writes only pages
        // of `dst` that were not present (else EEXIST).
        let rc = unsafe {
            libc::ioctl(
                self.fd.as_raw_fd(),
                ioctl_nr(abi::UFFDIO_COPY),
                &raw mut arg,
            )
        };
        let errno = (rc < 0).then(io::Error::last_os_error);
        match Fill::classify(errno.as_ref().and_then(io::Error::raw_os_error), arg.copy) {
            Some(fill) => Ok(fill),
            None => Err(UffdError::Copy {
                start: dst,
                len,
                source: errno.unwrap_or_else(|| io::Error::from(io::ErrorKind::Other)),
            }),
        }
    }

    /// `UFFDIO_ZEROPAGE`: maps the zero page over a MISSING range (anonymous
    /// and shmem memory only; `EINVAL` on hugetlbfs).
    ///
    /// # Errors
    ///
    /// [`UffdError::ZeroPage`].
    pub fn zeropage(&self, start: u64, len: u64, wake: bool) -> Result<Fill> {
        let mode = if wake {
            0
        } else {
            abi::UFFDIO_ZEROPAGE_MODE_DONTWAKE
        };
        let mut arg = abi::UffdioZeropage {
            range: abi::UffdioRange { start, len },
            mode,
            zeropage: 0,
        };
        // SAFETY: UFFDIO_ZEROPAGE is `_IOWR` of `struct uffdio_zeropage`; `arg`
        // is that struct (32 bytes) and lives across the call. Only pages that
        // were not present are mapped.
        let rc = unsafe {
            libc::ioctl(
                self.fd.as_raw_fd(),
                ioctl_nr(abi::UFFDIO_ZEROPAGE),
                &raw mut arg,
            )
        };
        let errno = (rc < 0).then(io::Error::last_os_error);
        match Fill::classify(
            errno.as_ref().and_then(io::Error::raw_os_error),
            arg.zeropage,
        ) {
            Some(fill) => Ok(fill),
            None => Err(UffdError::ZeroPage {
                start,
                len,
                source: errno.unwrap_or_else(|| io::Error::from(io::ErrorKind::Other)),
            }),
        }
    }

    /// `UFFDIO_WRITEPROTECT`: sets (`protect`) or clears write protection on
    /// a WP-registered range; clearing wakes the waiting writers unless `wake`
    /// is false.
    ///
    /// # Errors
    ///
    /// [`UffdError::WriteProtect`].
    pub fn write_protect(&self, start: u64, len: u64, protect: bool, wake: bool) -> Result<()> {
        let mut mode = if protect {
            abi::UFFDIO_WRITEPROTECT_MODE_WP
        } else {
            0
        };
        if !wake {
            mode |= abi::UFFDIO_WRITEPROTECT_MODE_DONTWAKE;
        }
        let mut arg = abi::UffdioWriteprotect {
            range: abi::UffdioRange { start, len },
            mode,
        };
        // SAFETY: UFFDIO_WRITEPROTECT is `_IOWR` of `struct
        // uffdio_writeprotect`; `arg` is that struct (24 bytes) and lives
        // across the call. It changes page protection, not contents.
        let rc = unsafe {
            libc::ioctl(
                self.fd.as_raw_fd(),
                ioctl_nr(abi::UFFDIO_WRITEPROTECT),
                &raw mut arg,
            )
        };
        if rc < 0 {
            return Err(UffdError::WriteProtect {
                start,
                len,
                source: io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// One `read(2)` of up to `buf.len()` messages. Returns how many were
    /// read; 0 when none is pending on a non-blocking fd (`EAGAIN`). A
    /// blocking fd waits. Retries on `EINTR`.
    fn read_msgs(&self, buf: &mut [UffdMsg]) -> io::Result<usize> {
        let bytes = std::mem::size_of_val(buf);
        loop {
            // SAFETY: `buf` is a live, exclusively borrowed slice of `bytes`
            // bytes; UffdMsg is plain bytes (align 1, 32 bytes, asserted in
            // abi), so whatever the kernel writes is a valid value.
            let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), bytes) };
            if n >= 0 {
                // The kernel writes whole messages only.
                return Ok(n.unsigned_abs() / std::mem::size_of::<UffdMsg>());
            }
            let err = io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EAGAIN) => return Ok(0),
                _ => return Err(err),
            }
        }
    }

    /// Turns a message from [`Uffd::read_msgs`] into an event, taking
    /// ownership of a FORK event's new fd.
    fn event_from_read(msg: &UffdMsg) -> UffdEvent {
        match parse_msg(msg) {
            Parsed::PageFault(pf) => UffdEvent::PageFault(pf),
            Parsed::Fork(ufd) => match RawFd::try_from(ufd) {
                Ok(raw) => {
                    // SAFETY: a FORK message's `ufd` is an fd the kernel
                    // installed in this process's table while servicing the
                    // read that produced `msg`; only this call sees it, once.
                    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
                    UffdEvent::Fork { uffd: Uffd { fd } }
                }
                Err(_) => UffdEvent::Unknown {
                    event: abi::UFFD_EVENT_FORK,
                },
            },
            Parsed::Remap { from, to, len } => UffdEvent::Remap { from, to, len },
            Parsed::Remove { start, end } => UffdEvent::Remove { start, end },
            Parsed::Unmap { start, end } => UffdEvent::Unmap { start, end },
            Parsed::Unknown(event) => UffdEvent::Unknown { event },
        }
    }

    /// Reads up to `max` pending events (one `read`) into `out`; returns how
    /// many were added, 0 when none is pending on a non-blocking fd.
    ///
    /// # Errors
    ///
    /// [`UffdError::Read`] (`EINVAL` before the handshake).
    pub fn read_events(&self, out: &mut Vec<UffdEvent>, max: usize) -> Result<usize> {
        let mut buf = vec![UffdMsg::default(); max.max(1)];
        let n = self.read_msgs(&mut buf).map_err(UffdError::Read)?;
        out.extend(buf[..n].iter().map(Self::event_from_read));
        Ok(n)
    }

    /// Reads one pending event; `None` when none is pending (non-blocking fd).
    ///
    /// # Errors
    ///
    /// [`UffdError::Read`].
    pub fn read_event(&self) -> Result<Option<UffdEvent>> {
        let mut buf = [UffdMsg::default()];
        let n = self.read_msgs(&mut buf).map_err(UffdError::Read)?;
        Ok((n == 1).then(|| Self::event_from_read(&buf[0])))
    }

    /// Waits until an event can be read or `timeout` passes (`None`: no
    /// limit). Returns false on timeout. `POLLERR` (no handshake yet) counts
    /// as ready, so the following read reports the error.
    ///
    /// # Errors
    ///
    /// [`UffdError::Poll`].
    pub fn wait_readable(&self, timeout: Option<Duration>) -> Result<bool> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let ms = match deadline {
                None => -1,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    // Round up so a sub-millisecond remainder still waits.
                    libc::c_int::try_from(left.as_micros().div_ceil(1000))
                        .unwrap_or(libc::c_int::MAX)
                }
            };
            let mut pfd = libc::pollfd {
                fd: self.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: `pfd` is one live pollfd and the count passed is 1.
            let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
            if rc > 0 {
                return Ok(true);
            }
            if rc == 0 {
                return Ok(false);
            }
            let err = io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EINTR) {
                return Err(UffdError::Poll(err));
            }
        }
    }

    /// Reads `/proc/self/fdinfo/<fd>`: pending and total fault counts and the
    /// enabled features.
    ///
    /// # Errors
    ///
    /// [`UffdError::FdInfo`].
    pub fn fdinfo(&self) -> Result<FdInfo> {
        let path = format!("/proc/self/fdinfo/{}", self.fd.as_raw_fd());
        let text = std::fs::read_to_string(path).map_err(UffdError::FdInfo)?;
        parse_fdinfo(&text).ok_or_else(|| {
            UffdError::FdInfo(io::Error::new(
                io::ErrorKind::InvalidData,
                "no userfaultfd fields in fdinfo",
            ))
        })
    }
}

/// The ioctl request type differs between libcs (`c_ulong` on glibc, `c_int`
/// on musl); the numbers are 32-bit patterns either way.
#[allow(clippy::cast_possible_wrap, clippy::useless_conversion)]
fn ioctl_nr(nr: u32) -> libc::Ioctl {
    nr as libc::Ioctl
}

impl AsFd for Uffd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsRawFd for Uffd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl From<Uffd> for OwnedFd {
    fn from(uffd: Uffd) -> Self {
        uffd.fd
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uffd_create_flags_default_is_not_user_mode_only() {
        let bits = CreateFlags::default().bits();
        assert_eq!(bits, libc::O_CLOEXEC | libc::O_NONBLOCK);
        assert_eq!(bits & abi::UFFD_USER_MODE_ONLY, 0);
        assert_eq!(
            CreateFlags::new().user_mode_only().bits() & abi::UFFD_USER_MODE_ONLY,
            abi::UFFD_USER_MODE_ONLY
        );
        assert_eq!(CreateFlags::new().blocking().bits(), libc::O_CLOEXEC);
    }

    #[test]
    fn uffd_features_display_names_bits() {
        let f =
            Features(abi::UFFD_FEATURE_MINOR_HUGETLBFS | abi::UFFD_FEATURE_THREAD_ID | (1 << 40));
        assert_eq!(f.to_string(), "THREAD_ID|MINOR_HUGETLBFS|0x10000000000");
        assert_eq!(Features(0).to_string(), "none");
        assert!(Features(0x1fff).contains(abi::UFFD_FEATURE_MINOR_HUGETLBFS));
    }

    #[test]
    fn uffd_parse_pagefault_and_kinds() {
        let m = UffdMsg::pagefault(abi::UFFD_PAGEFAULT_FLAG_MINOR, 0x20_1000, 99);
        let Parsed::PageFault(pf) = parse_msg(&m) else {
            panic!("not a page fault")
        };
        assert_eq!(
            pf,
            PageFault {
                address: 0x20_1000,
                flags: abi::UFFD_PAGEFAULT_FLAG_MINOR,
                thread_id: 99
            }
        );
        assert_eq!(pf.kind(), FaultKind::Minor);
        assert!(!pf.is_write());
        assert_eq!(pf.page_start(2 << 20), 0x20_0000);

        let missing = PageFault {
            address: 0,
            flags: abi::UFFD_PAGEFAULT_FLAG_WRITE,
            thread_id: 0,
        };
        assert_eq!(missing.kind(), FaultKind::Missing);
        assert!(missing.is_write());
        let wp = PageFault {
            address: 0,
            flags: abi::UFFD_PAGEFAULT_FLAG_WP | 1,
            thread_id: 0,
        };
        assert_eq!(wp.kind(), FaultKind::WriteProtect);
    }

    #[test]
    fn uffd_parse_non_cooperative_events() {
        assert_eq!(
            parse_msg(&UffdMsg::range_event(
                abi::UFFD_EVENT_REMOVE,
                0x1000,
                0x3000
            )),
            Parsed::Remove {
                start: 0x1000,
                end: 0x3000
            }
        );
        assert_eq!(
            parse_msg(&UffdMsg::range_event(abi::UFFD_EVENT_UNMAP, 0x4000, 0x5000)),
            Parsed::Unmap {
                start: 0x4000,
                end: 0x5000
            }
        );
        assert_eq!(
            parse_msg(&UffdMsg::remap(1, 2, 3)),
            Parsed::Remap {
                from: 1,
                to: 2,
                len: 3
            }
        );
        assert_eq!(parse_msg(&UffdMsg::fork(12)), Parsed::Fork(12));
        let odd = UffdMsg {
            event: 0x42,
            ..UffdMsg::default()
        };
        assert_eq!(parse_msg(&odd), Parsed::Unknown(0x42));
    }

    #[test]
    fn uffd_fill_classification() {
        assert_eq!(Fill::classify(None, 0), Some(Fill::Done));
        assert_eq!(
            Fill::classify(Some(libc::EEXIST), -i64::from(libc::EEXIST)),
            Some(Fill::AlreadyMapped)
        );
        assert_eq!(
            Fill::classify(Some(libc::EAGAIN), 4096),
            Some(Fill::Retry { done: 4096 })
        );
        assert_eq!(
            Fill::classify(Some(libc::EAGAIN), -i64::from(libc::EAGAIN)),
            Some(Fill::Retry { done: 0 })
        );
        assert_eq!(
            Fill::classify(Some(libc::EFAULT), -i64::from(libc::EFAULT)),
            None
        );
        assert!(Fill::AlreadyMapped.is_served());
        assert!(!Fill::Retry { done: 0 }.is_served());
    }

    #[test]
    fn uffd_parse_fdinfo_text() {
        let text = "pos:\t0\nflags:\t02004002\nmnt_id:\t15\nino:\t1057\npending:\t1\ntotal:\t2\nAPI:\taa:80000300:1fc00000000003\n";
        let info = parse_fdinfo(text).expect("parses");
        assert_eq!(info.pending, 1);
        assert_eq!(info.total, 2);
        assert_eq!(info.features, Features(0x300));
        assert_eq!(parse_fdinfo("pos:\t0\n"), None);
    }

    #[test]
    fn uffd_from_owned_fd_rejects_other_fds() {
        let file = std::fs::File::open("/proc/self/stat").expect("open");
        match Uffd::from_owned_fd(OwnedFd::from(file)) {
            Err(UffdError::NotUserfaultfd(target)) => assert!(target.contains("stat"), "{target}"),
            other => panic!("expected NotUserfaultfd, got {other:?}"),
        }
    }
}
