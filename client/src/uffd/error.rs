//! The errors of userfaultfd operations.

use std::io;
use std::os::fd::RawFd;

use super::*;

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
