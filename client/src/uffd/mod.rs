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
//!
//! [`Uffd`]: crate::uffd::Uffd
//! [`Uffd::new`]: crate::uffd::Uffd::new
//! [`Uffd::api`]: crate::uffd::Uffd::api
//! [`Uffd::register`]: crate::uffd::Uffd::register
//! [`Uffd::from_owned_fd`]: crate::uffd::Uffd::from_owned_fd
//! [`Uffd::read_event`]: crate::uffd::Uffd::read_event
//! [`Uffd::continue_range`]: crate::uffd::Uffd::continue_range
//! [`CreateFlags::new`]: crate::uffd::CreateFlags::new
//! [`abi`]: crate::uffd::abi
//! [`PageFault::page_start`]: crate::uffd::PageFault::page_start
//! [`Fill::AlreadyMapped`]: crate::uffd::Fill::AlreadyMapped
//! [`Fill::Retry`]: crate::uffd::Fill::Retry

pub mod abi;
mod error;
mod types;

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

pub use abi::UffdMsg;

pub use error::*;
pub use types::*;
use types::{parse_fdinfo, parse_msg, Parsed};

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

#[cfg(test)]
mod tests;
