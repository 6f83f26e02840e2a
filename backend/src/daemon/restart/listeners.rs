//! The listening sockets a takeover or systemd's fd store passes on:
//! duplicates of the clients' socket and of the metrics endpoint's, and
//! whether the socket file is this daemon's to remove. Each saves and
//! restores its own part of the state document ([`Listeners::save`]).

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crate::daemon::persist::{Persist, RestoreContext, SaveContext, SaveError};

/// See the module docs.
#[derive(Debug, Default)]
pub struct Listeners {
    /// Duplicates of the listening sockets: clients' and metrics'.
    sockets: Mutex<(Option<OwnedFd>, Option<OwnedFd>)>,
    /// The socket file is this daemon's to remove (not systemd's).
    socket_owned: AtomicBool,
}

/// The listeners' part of the state document: indices in its fd list.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SavedListeners {
    /// The clients' listening socket.
    pub listener: Option<usize>,
    /// The metrics endpoint's.
    pub metrics: Option<usize>,
    /// See [`Listeners::socket_owned`].
    pub socket_owned: bool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Listeners {
    /// A duplicate of the listening socket when the daemon bound it itself.
    pub fn owned_listener(&self) -> Option<OwnedFd> {
        if !self.socket_owned() {
            return None;
        }
        lock(&self.sockets)
            .0
            .as_ref()
            .and_then(|f| f.try_clone().ok())
    }

    /// Whether the socket file is this daemon's to remove.
    pub fn socket_owned(&self) -> bool {
        self.socket_owned.load(Ordering::SeqCst)
    }

    /// Records whether the socket file is this daemon's to remove.
    pub fn set_socket_owned(&self, owned: bool) {
        self.socket_owned.store(owned, Ordering::SeqCst);
    }

    /// Remembers the listening sockets (duplicates) for a takeover.
    pub fn set(&self, socket: Option<OwnedFd>, metrics: Option<OwnedFd>) {
        *lock(&self.sockets) = (socket, metrics);
    }
}

/// The listening sockets a document brought, as the successor takes them.
#[derive(Debug)]
pub struct InheritedListeners {
    /// The clients' listening socket.
    pub listener: Option<OwnedFd>,
    /// The metrics endpoint's.
    pub metrics: Option<OwnedFd>,
    /// The predecessor created the socket's file (it stays the
    /// successor's to remove).
    pub socket_owned: bool,
}

impl Persist for Listeners {
    type State = SavedListeners;
    type Restored = InheritedListeners;
    type RestoreError = std::convert::Infallible;

    /// The sockets that travel, numbered in the document. For systemd's
    /// fd store, systemd keeps a socket it passed, and one the daemon bound
    /// itself goes into the store by name (`crate::daemon::restart::fdstore`, as
    /// `hugemem-listener`) so that clients queue in its backlog meanwhile;
    /// a new process binds the metrics port again once this one is gone.
    fn save(&self, ctx: &mut SaveContext<'_>) -> Result<SavedListeners, SaveError> {
        let to_store = ctx.to_store;
        let socket_owned = self.socket_owned();
        let l = lock(&self.sockets);
        Ok(SavedListeners {
            listener: l
                .0
                .as_ref()
                .filter(|_| !to_store || socket_owned)
                .map(|f| ctx.fds.add(f.as_fd()))
                .transpose()?,
            metrics: l
                .1
                .as_ref()
                .filter(|_| !to_store)
                .map(|f| ctx.fds.add(f.as_fd()))
                .transpose()?,
            socket_owned,
        })
    }

    /// The sockets the record names, taken from the document's fds.
    fn restore(
        state: SavedListeners,
        ctx: &mut RestoreContext<'_>,
    ) -> Result<InheritedListeners, std::convert::Infallible> {
        Ok(InheritedListeners {
            listener: state.listener.and_then(|i| ctx.fds.take(i)),
            metrics: state.metrics.and_then(|i| ctx.fds.take(i)),
            socket_owned: state.socket_owned,
        })
    }
}
