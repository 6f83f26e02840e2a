//! The listening sockets a takeover or systemd's fd store passes on:
//! duplicates of the clients' socket and of the metrics endpoint's, and
//! whether the socket file is this daemon's to remove. Each saves and
//! restores its own part of the state document ([`Listeners::save`]).

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use super::persist::fds::FdList;
use super::persist::SaveError;

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

    /// Adds the sockets that travel to `fds`. For systemd's fd store
    /// (`to_store`), systemd keeps a socket it passed, and one the daemon
    /// bound itself goes into the store by name (`crate::daemon::fdstore`,
    /// as `hugemem-listener`) so that clients queue in its backlog
    /// meanwhile; a new process binds the metrics port again once this one
    /// is gone.
    ///
    /// # Errors
    ///
    /// A socket that cannot be duplicated.
    pub fn save(&self, fds: &mut FdList, to_store: bool) -> Result<SavedListeners, SaveError> {
        let socket_owned = self.socket_owned();
        let l = lock(&self.sockets);
        Ok(SavedListeners {
            listener: l
                .0
                .as_ref()
                .filter(|_| !to_store || socket_owned)
                .map(|f| fds.add(f.as_fd()))
                .transpose()?,
            metrics: l
                .1
                .as_ref()
                .filter(|_| !to_store)
                .map(|f| fds.add(f.as_fd()))
                .transpose()?,
            socket_owned,
        })
    }
}
