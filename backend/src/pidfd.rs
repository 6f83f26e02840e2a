//! `pidfd_open`, which has no wrapper in `libc` or `nix` here: the one safe
//! wrapper, below the daemon and the fault helpers, which both wait for
//! processes through it.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd};

/// `pidfd_open(pid, 0)`: an fd that becomes readable when `pid` exits.
///
/// # Errors
///
/// `ESRCH` when the process is already gone, `ENOSYS` on kernels before 5.3.
pub fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and a flags word by value and touches no
    // memory of ours; on success it returns a new fd that nothing else owns.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(fd)
        .map_err(|_| io::Error::other("pidfd_open returned an fd out of range"))?;
    // SAFETY: the kernel just installed `fd` for us; nothing else knows it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}
