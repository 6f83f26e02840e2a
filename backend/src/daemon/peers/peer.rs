//! Who is on the other end of a connection, and when that process is gone.
//!
//! **Credentials.** `SO_PEERCRED` (through tokio's `peer_cred`) gives the uid
//! and pid the kernel recorded at `connect`; they cannot be forged by the
//! peer. The uid is checked against an allow-list; the pid is what the
//! release path watches.
//!
//! **pidfd.** A region a client released may still be mapped by that client
//! (an `mmap` outlives the fd it was made from). The quarantine re-checks
//! holders periodically anyway; a pidfd makes the common case — the VMM
//! exits — immediate: it becomes readable once the process has exited, and
//! the kernel tears down a process's mappings (`exit_mm`) before it signals
//! that. A pidfd names one process, not a number, so pid reuse cannot fool
//! it. The alternative, polling `/proc/PID`, has exactly that reuse race.
//!
//! `pidfd_open` has no wrapper in `libc` or `nix` here; [`crate::pidfd`]
//! has the one safe wrapper.

use std::io;
use std::os::fd::OwnedFd;

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// The credentials of a connected peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    /// User id.
    pub uid: u32,
    /// Group id.
    pub gid: u32,
    /// Process id (`None` when the kernel did not record one).
    pub pid: Option<i32>,
}

impl PeerCred {
    /// Reads `SO_PEERCRED` of a connected stream.
    ///
    /// # Errors
    ///
    /// The `getsockopt` error.
    pub fn of(stream: &tokio::net::UnixStream) -> io::Result<Self> {
        let c = stream.peer_cred()?;
        Ok(Self {
            uid: c.uid(),
            gid: c.gid(),
            pid: c.pid().filter(|p| *p > 0),
        })
    }
}

pub use crate::pidfd::pidfd_open;

/// A process the daemon waits for.
#[derive(Debug)]
pub struct PidWatch {
    pid: i32,
    fd: AsyncFd<OwnedFd>,
}

impl PidWatch {
    /// Opens a pidfd for `pid` and registers it with the tokio reactor (call
    /// from inside the runtime).
    ///
    /// # Errors
    ///
    /// As [`pidfd_open`], plus reactor registration errors.
    pub fn new(pid: i32) -> io::Result<Self> {
        let fd = pidfd_open(pid)?;
        // SAFETY: `fd` is an `OwnedFd` moved into the `AsyncFd`: it is open,
        // nothing else can close it, and `as_raw_fd` always returns the same
        // number until the `AsyncFd` drops it.
        let fd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
            .map_err(io::Error::from)?;
        Ok(Self { pid, fd })
    }

    /// The process id.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Waits until the process has exited.
    ///
    /// # Errors
    ///
    /// Reactor errors.
    pub async fn exited(&self) -> io::Result<()> {
        // A pidfd stays readable once the process is gone; readiness is never
        // cleared, so this returns at once on every later call too.
        let _guard = self.fd.readable().await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pidfd_sees_a_child_exit() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let mut child = std::process::Command::new("sleep")
                .arg("0.05")
                .spawn()
                .expect("spawn sleep");
            let pid = i32::try_from(child.id()).expect("pid");
            let watch = PidWatch::new(pid).expect("pidfd");
            tokio::time::timeout(std::time::Duration::from_secs(10), watch.exited())
                .await
                .expect("child exit seen within 10 s")
                .expect("reactor");
            child.wait().expect("reap");
        });
    }

    #[test]
    fn pidfd_of_a_missing_process_fails() {
        // pid_max is at most 2^22; this pid cannot exist.
        assert!(pidfd_open(i32::MAX).is_err());
    }
}
