//! Raw syscalls the daemon needs that `nix` does not wrap the way it must be
//! done, each behind a small safe function.
//!
//! * [`recv_with_fds`]: `recvmsg` that takes every `SCM_RIGHTS` fd the kernel
//!   installed into an [`OwnedFd`], **including when the control data was
//!   truncated** (`MSG_CTRUNC`). `nix`'s `RecvMsg::cmsgs` refuses to iterate a
//!   truncated buffer (`ENOBUFS`), but the kernel has already installed as
//!   many fds as fit into it (`scm_detach_fds`: the rest are dropped), so a
//!   caller that returns an error there leaks them: 64 per frame, from any
//!   peer, even a refused one.
//!
//! [`recv_with_fds`]: crate::sys::recv_with_fds
//! [`OwnedFd`]: std::os::fd::OwnedFd

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

pub use hugemem_client::sys::{recv_with_fds, Received};

pub mod helper;

/// The size of the file behind `fd` (`fstat`).
///
/// # Errors
///
/// The `fstat` error.
pub fn file_size(fd: BorrowedFd<'_>) -> io::Result<u64> {
    let st = nix::sys::stat::fstat(fd).map_err(io::Error::from)?;
    u64::try_from(st.st_size).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))
}

/// `madvise(MADV_POPULATE_WRITE)` over `len` bytes at `addr`: faults every
/// page in writable, allocating pages for holes, without writing any data.
/// Where a store would raise `SIGBUS` (the file was truncated below the
/// range, or a hole cannot get a page because the huge-page pool is empty)
/// it returns an error instead (`EFAULT`, `ENOMEM`, ...), which is what
/// makes the scrubber SIGBUS-proof: populate first, clear only on success.
///
/// Memory-safe for any range: the kernel validates it and changes no byte.
///
/// # Errors
///
/// The `madvise` error.
pub fn populate_write(addr: *const u8, len: usize) -> io::Result<()> {
    // SAFETY: MADV_POPULATE_WRITE only faults pages in (allocating zeroed
    // ones for holes); it writes no data and unmaps nothing, so no Rust
    // object can be affected; an invalid range is an error from the kernel.
    let r = unsafe { libc::madvise(addr.cast_mut().cast(), len, libc::MADV_POPULATE_WRITE) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)` over `len` bytes
/// at `offset` of `fd`: the pages leave the file (a pinned page stays with
/// its pinner, holding only what it held); the next fault gets a fresh
/// kernel-zeroed page.
///
/// # Errors
///
/// The `fallocate` error.
pub fn punch_hole(fd: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<()> {
    let off =
        libc::off_t::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let n = libc::off_t::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: fallocate on a valid fd with integer arguments; no memory of
    // ours is touched (mappings of the range fault fresh pages afterwards).
    let r = unsafe {
        libc::fallocate(
            fd.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            off,
            n,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `fallocate(0)` over `len` bytes at `offset` of `fd` (`FALLOC_FL_KEEP_SIZE`):
/// allocates (and, on hugetlbfs, zeroes) every missing page of the range
/// without mapping it, so no process's `mmap_lock` is taken. hugetlbfs holds
/// the file's inode lock for the whole call (measured by `hugemem bench
/// refault`: two threads on one file do not go faster than one).
///
/// # Errors
///
/// The `fallocate` error.
pub fn allocate(fd: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<()> {
    let off =
        libc::off_t::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let n = libc::off_t::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: fallocate on a valid fd with integer arguments; it adds pages
    // to the file and touches no memory of ours.
    let r = unsafe { libc::fallocate(fd.as_raw_fd(), libc::FALLOC_FL_KEEP_SIZE, off, n) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Bytes of the file behind `fd` that have pages (`st_blocks` x 512):
/// hugetlbfs counts each huge page in its file's blocks while it is in the
/// file, and stops at the punch or truncation that removes it.
///
/// # Errors
///
/// The `fstat` error.
pub fn file_allocated_bytes(fd: BorrowedFd<'_>) -> io::Result<u64> {
    let st = nix::sys::stat::fstat(fd).map_err(io::Error::from)?;
    u64::try_from(st.st_blocks)
        .map(|b| b.saturating_mul(512))
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidData))
}

/// Reserves huge pages for every hole in the first `len` bytes of the
/// hugetlb file behind `fd`, as a new shared mapping of it does
/// (`hugetlb_reserve_pages`), and unmaps again: the reservation of a shared
/// hugetlb mapping belongs to the file (its `resv_map`), not to the mapping,
/// so it stays until a punch or truncation removes those offsets, and the
/// next fault of any mapping of the file takes a reserved page.
///
/// # Errors
///
/// `ENOMEM` when the host has fewer free, unreserved pages than the file
/// has holes; other `mmap` errors.
pub fn reserve_holes(fd: BorrowedFd<'_>, len: usize) -> io::Result<()> {
    // SAFETY: a NULL hint without MAP_FIXED makes a new mapping that aliases
    // no Rust object; it is read-only, never touched, and unmapped below.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the mapping made just above, which nothing else knows of.
    if unsafe { libc::munmap(addr, len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A new open file description of the file behind `fd`, read-write
/// (`open("/proc/self/fd/N", O_RDWR | O_CLOEXEC)`), not a `dup`: the kernel
/// counts it as one more opener of the inode, which is what makes
/// [`write_lease_free`] see it. A memfd's original `memfd_create`
/// description is not counted that way, so the daemon never hands it out.
///
/// # Errors
///
/// The `open` error.
pub fn reopen(fd: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    reopen_as(fd, true)
}

/// [`reopen`], read-only (`O_RDONLY`): for a saver, which reads a parked
/// VM's memory and must not change it. Errors as [`reopen`]'s.
pub fn reopen_read_only(fd: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    reopen_as(fd, false)
}

fn reopen_as(fd: BorrowedFd<'_>, write: bool) -> io::Result<OwnedFd> {
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(write)
        .open(path)?;
    Ok(OwnedFd::from(file))
}

/// True when a write lease (`F_SETLEASE`, `F_WRLCK`) on `fd` is granted,
/// i.e. the kernel counts no open description of the inode but `fd`'s own
/// (other fds, fds in flight in unreceived `SCM_RIGHTS` messages, and the
/// descriptions behind shared mappings all count; `dup`s of `fd` do not).
/// The lease is released again at once (`F_UNLCK`). False on `EAGAIN`/`EBUSY`.
///
/// # Errors
///
/// Other `fcntl` errors (`EINVAL` where leases are unsupported or disabled).
pub fn write_lease_free(fd: BorrowedFd<'_>) -> io::Result<bool> {
    // SAFETY: F_SETLEASE on a valid fd takes an integer argument and touches
    // no memory of ours.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETLEASE, libc::F_WRLCK) };
    if r != 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::EAGAIN | libc::EBUSY) => Ok(false),
            _ => Err(e),
        };
    }
    // SAFETY: as above.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETLEASE, libc::F_UNLCK) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(true)
}

/// This process's effective uid.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// A new memfd that can be sealed (`MFD_CLOEXEC | MFD_ALLOW_SEALING`).
///
/// # Errors
///
/// The `memfd_create` error.
pub fn sealable_memfd(name: &std::ffi::CStr) -> io::Result<OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: `name` is a valid NUL-terminated string for the call.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: memfd_create returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Seals a memfd against every change: writes, size, further seals.
///
/// # Errors
///
/// The `fcntl` error.
pub fn seal_all(fd: BorrowedFd<'_>) -> io::Result<()> {
    let seals = libc::F_SEAL_WRITE | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: the borrowed fd is open for the call; F_ADD_SEALS takes an int.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The seals of a memfd (`F_GET_SEALS`; 0 for a file that cannot be sealed).
///
/// # Errors
///
/// The `fcntl` error.
pub fn seals(fd: BorrowedFd<'_>) -> io::Result<libc::c_int> {
    // SAFETY: the borrowed fd is open for the call; F_GET_SEALS takes no argument.
    let s = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if s < 0 {
        let e = io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::EINVAL) {
            Ok(0)
        } else {
            Err(e)
        };
    }
    Ok(s)
}

/// The owner uid and size of an open file (`fstat`).
///
/// # Errors
///
/// The `fstat` error.
pub fn owner_and_size(fd: BorrowedFd<'_>) -> io::Result<(u32, u64)> {
    let st = nix::sys::stat::fstat(fd).map_err(io::Error::from)?;
    Ok((st.st_uid, u64::try_from(st.st_size).unwrap_or(0)))
}

/// True when fd `their_fd` of process `pid` is the very open file
/// description that this process's `own_fd` is (`kcmp(KCMP_FILE)`): a
/// duplicate of the daemon's own, held by the service manager's fd store or
/// in flight to a successor, never a tenant's (tenants get descriptions of
/// their own, [`reopen`]). False when it is not, or cannot be told
/// (`kcmp` missing or not permitted): the caller then counts a holder.
pub fn same_description(pid: i32, their_fd: i32, own_fd: i32) -> bool {
    const KCMP_FILE: libc::c_long = 0;
    let me = libc::c_long::from(std::process::id() as i32);
    // SAFETY: kcmp takes integers only and touches no memory of this process.
    let r = unsafe {
        libc::syscall(
            libc::SYS_kcmp,
            me,
            libc::c_long::from(pid),
            KCMP_FILE,
            libc::c_long::from(own_fd),
            libc::c_long::from(their_fd),
        )
    };
    r == 0
}
