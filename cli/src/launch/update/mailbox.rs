//! The successor mailbox: how an update hands the daemon connection that
//! owns the allocation now (after HANDOFF) to the daemon watcher, which
//! runs on a thread of its own (`reattach.rs`) and FREEs on that connection
//! at the end.
//!
//! A mailbox rather than a channel because the watcher sleeps in `poll`:
//! the eventfd is readable while a connection waits, so it sits in the
//! same `poll` set as the daemon connection and the VMM's exit.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::{Mutex, PoisonError};

use hugemem_client::client::Client;
use nix::sys::eventfd::{EfdFlags, EventFd};
use tracing::debug;

use crate::launch::allocation::HeldAllocation;

/// The connection that owns the allocation now, on its way from the update
/// to the daemon watcher.
#[derive(Debug)]
pub(crate) struct SuccessorMailbox {
    /// Readable while a connection waits to be taken.
    event: EventFd,
    next: Mutex<Option<(Client, HeldAllocation)>>,
}

impl SuccessorMailbox {
    /// An empty mailbox.
    pub(crate) fn new() -> nix::Result<Self> {
        Ok(Self {
            event: EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?,
            next: Mutex::new(None),
        })
    }

    /// Hands `client`, which owns `held` now, to the watcher; the watcher
    /// closes the connection it had (which owns nothing any more).
    pub(crate) fn offer(&self, client: Client, held: HeldAllocation) {
        *self.next.lock().unwrap_or_else(PoisonError::into_inner) = Some((client, held));
        if let Err(e) = self.event.write(1) {
            debug!(error = %e, "cannot write the successor eventfd");
        }
    }

    /// Readable while a connection waits to be taken.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.event.as_fd()
    }

    /// The connection waiting, if any.
    pub(crate) fn take(&self) -> Option<(Client, HeldAllocation)> {
        let _ = self.event.read();
        self.next
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}
