//! Whether a fault connection's requests are all answered: what a sender
//! waits for before it lets the receiver's guest run.
//!
//! cloud-hypervisor starts serving its fault connection when the state
//! comes, and its first request, for the guest's first page, goes out
//! then, before it answers the state. A guest resumed (`Complete`)
//! before that request is answered has been seen to die on a host whose
//! KVM shadows the guest's page tables (`kvm_pvm`): a page fault on its
//! first instruction fetch, a double fault, a reset (`docs/operations.md`,
//! "Clones"). [`InFlight::wait_answered`] lets the sender hold `Complete`
//! until every request the receiver sent so far is answered.

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::sys::unread_bytes;

/// A fault connection's serving thread, as the sender's other thread sees
/// it: a request in hand (read, not answered yet), or the connection
/// ended. [`serve_page_faults_tracked`](super::fault::serve_page_faults_tracked)
/// keeps it.
#[derive(Debug, Default)]
pub struct InFlight {
    state: Mutex<Turn>,
    changed: Condvar,
}

#[derive(Debug, Default, Clone, Copy)]
struct Turn {
    /// A request's header was read and its answer is not written yet.
    busy: bool,
    /// The serving loop returned: nothing more is read or answered.
    ended: bool,
}

impl InFlight {
    fn set(&self, change: impl FnOnce(&mut Turn)) {
        let mut turn = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        change(&mut turn);
        self.changed.notify_all();
    }

    /// A request's header was read.
    pub(crate) fn started(&self) {
        self.set(|t| t.busy = true);
    }

    /// Its answer was written.
    pub(crate) fn answered(&self) {
        self.set(|t| t.busy = false);
    }

    /// The serving loop returned.
    pub(crate) fn ended(&self) {
        self.set(|t| {
            t.busy = false;
            t.ended = true;
        });
    }

    /// Blocks until every request `sock` (the fault connection) has
    /// received so far is answered: none in hand, no byte unread; true
    /// then, and at once once the serving loop ended. A request that comes
    /// while it waits is waited for too; each answer wakes it (the serving
    /// thread reads whatever is unread, so the wait ends with the answers
    /// or the connection). False when the receiver kept it busy for all of
    /// `limit` (a receiver that never stops asking).
    pub fn wait_answered(&self, sock: &UnixStream, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        let mut turn = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if turn.ended {
                return true;
            }
            // An error reading the count: the connection is broken, and
            // the serving loop ends on it (and wakes this wait).
            let unread = unread_bytes(sock.as_fd()).unwrap_or(0);
            if !turn.busy && unread == 0 {
                return true;
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return false;
            };
            turn = self
                .changed
                .wait_timeout(turn, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

/// Marks its [`InFlight`] ended when dropped, however the loop returns.
pub(crate) struct EndOnDrop<'a>(pub(crate) &'a InFlight);

impl Drop for EndOnDrop<'_> {
    fn drop(&mut self) {
        self.0.ended();
    }
}
