//! The VMM's exit as an event the daemon watcher (`reattach.rs`) can wait
//! on: an eventfd it keeps in its `poll` set beside the daemon connection,
//! so the launch's FREE follows the VMM's exit at once instead of after the
//! watcher's next timer slice.
//!
//! While the watcher sets up a new connection after a daemon restart, it
//! blocks in `connect` and the handshake's read, where no `poll` set is
//! involved; it lends that socket to the event ([`ExitEvent::interruptible`]),
//! and [`ExitEvent::fire`] shuts it down, which ends the blocked read at once.

use std::net::Shutdown;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use nix::sys::eventfd::{EfdFlags, EventFd};
use tracing::debug;

/// Fired once, when the VMM has exited (or could not be started).
#[derive(Debug)]
pub(crate) struct ExitEvent {
    fired: AtomicBool,
    /// Readable from the moment the event fires.
    event: EventFd,
    /// A connection being set up that the exit must interrupt, if any.
    lent: Mutex<Option<UnixStream>>,
}

impl ExitEvent {
    /// A new event, not fired.
    ///
    /// # Errors
    ///
    /// `eventfd`'s error (out of fds or memory).
    pub(crate) fn new() -> nix::Result<Self> {
        Ok(Self {
            fired: AtomicBool::new(false),
            event: EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?,
            lent: Mutex::new(None),
        })
    }

    /// Fires the event: wakes whoever polls [`ExitEvent::fd`] and ends a
    /// blocked read on a lent connection.
    pub(crate) fn fire(&self) {
        self.fired.store(true, Ordering::Release);
        if let Err(e) = self.event.write(1) {
            // Only EAGAIN at a counter near u64::MAX: readable anyway.
            debug!(error = %e, "cannot write the VMM-exit eventfd");
        }
        if let Some(sock) = self
            .lent
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            // ENOTCONN when it was never connected: nothing blocks on it then.
            let _ = sock.shutdown(Shutdown::Both);
        }
    }

    /// True once the event has fired.
    pub(crate) fn fired(&self) -> bool {
        self.fired.load(Ordering::Acquire)
    }

    /// The eventfd: readable once the event has fired (never read, so it
    /// stays readable).
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.event.as_fd()
    }

    /// Runs `setup` on `sock` (a handshake, say) so that the event, if it
    /// fires meanwhile, shuts `sock` down and `setup` returns at once, failed.
    /// `None` when the event has fired already (`setup` is not run) or the
    /// socket cannot be lent (`dup` failed: out of fds).
    pub(crate) fn interruptible<T>(
        &self,
        sock: UnixStream,
        setup: impl FnOnce(UnixStream) -> T,
    ) -> Option<T> {
        let copy = sock.try_clone().ok()?;
        {
            let mut lent = self.lent.lock().unwrap_or_else(PoisonError::into_inner);
            // Checked under the lock `fire` takes: either it sees the copy
            // or this sees the flag.
            if self.fired() {
                return None;
            }
            *lent = Some(copy);
        }
        let out = setup(sock);
        self.lent
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::io::{Read, Write};

    #[test]
    fn the_eventfd_turns_readable_when_fired() {
        let exit = ExitEvent::new().expect("eventfd");
        let mut fds = [PollFd::new(exit.fd(), PollFlags::POLLIN)];
        assert_eq!(poll(&mut fds, PollTimeout::ZERO).expect("poll"), 0);
        assert!(!exit.fired());
        exit.fire();
        assert!(exit.fired());
        assert_eq!(poll(&mut fds, PollTimeout::ZERO).expect("poll"), 1);
    }

    #[test]
    fn firing_ends_a_blocked_read_on_the_lent_socket() {
        let exit = ExitEvent::new().expect("eventfd");
        let (ours, mut peer) = UnixStream::pair().expect("socketpair");
        let read = std::thread::scope(|s| {
            let reader = s.spawn(|| {
                exit.interruptible(ours, |mut sock| {
                    // Tells the peer the socket is lent, then waits for a
                    // byte that never comes.
                    sock.write_all(b"l").expect("write");
                    let mut byte = [0u8; 1];
                    sock.read(&mut byte)
                })
            });
            let mut lent = [0u8; 1];
            peer.read_exact(&mut lent)
                .expect("the reader lent its socket");
            exit.fire();
            reader.join().expect("reader")
        });
        let read = read.expect("lent before the event fired");
        assert_eq!(read.expect("read"), 0, "EOF after the shutdown");
        let (late, _peer) = UnixStream::pair().expect("socketpair");
        assert!(
            exit.interruptible(late, |_| ()).is_none(),
            "nothing is set up once the VMM has exited"
        );
    }
}
