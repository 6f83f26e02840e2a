//! A running daemon's handle: its STATS, its shutdown (clean, or into
//! systemd's fd store), and hooks for tests.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;

use hugemem_client::stats::Stats;
use tracing::{error, warn};

use crate::daemon::connections::session::Rooms;
use crate::daemon::process::error::{DaemonError, Result};
use crate::daemon::restart::fdstore::{self, FdStore};
use crate::daemon::restart::takeover::Parts;

/// A running daemon. Dropping it shuts the daemon down too (errors logged).
#[derive(Debug)]
pub struct DaemonHandle {
    /// What the sessions serve from (the pool, the counters, STATS).
    pub(crate) rooms: Arc<Rooms>,
    /// What a stop into systemd's fd store freezes and saves.
    pub(crate) parts: Arc<Parts>,
    /// systemd's fd store.
    pub(crate) store: Arc<FdStore>,
    pub(crate) metrics_addr: Option<SocketAddr>,
    pub(crate) thread: Option<JoinHandle<()>>,
    pub(crate) rt: tokio::runtime::Handle,
}

impl DaemonHandle {
    /// The socket clients connect to.
    pub fn socket_path(&self) -> &Path {
        &self.rooms.stats.socket
    }

    /// The STATS document, as a client would get it (without the
    /// per-connection `lazy` list and placement).
    pub fn stats(&self) -> Stats {
        self.rooms.stats.stats()
    }

    /// [`DaemonHandle::stats`] as a JSON value, for readers that look up
    /// keys by name.
    pub fn stats_json(&self) -> serde_json::Value {
        serde_json::to_value(self.rooms.stats.stats()).unwrap_or(serde_json::Value::Null)
    }

    /// Test hook standing for a daemon restart: orphans allocation `alloc`
    /// (as the restore code does, [`crate::daemon::pool::Owners::orphan`]) and, with
    /// `tenant`, makes it that uid's. Its old connection no longer owns it;
    /// a REATTACH with its token can take it back. False for an unknown id.
    #[doc(hidden)]
    pub fn orphan_for_tests(&self, alloc: u64, tenant: Option<u32>) -> bool {
        self.rooms.pool.owners().orphan(alloc, tenant)
    }

    /// Everything this daemon's lazy fault services counted so far (faults
    /// read and served, pages cleared and continued ahead of the guest):
    /// for tests that check which daemon served a lazy guest.
    #[doc(hidden)]
    pub fn lazy_work(&self) -> u64 {
        self.rooms.fault_totals.read().counters.iter().sum()
    }

    /// Where the metrics endpoint listens, when it is on.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// A clean stop that keeps the pool, the allocations and the socket in
    /// systemd's fd store for the next start ([`fdstore`](crate::daemon::restart::fdstore)); when the store
    /// is off or keeping fails, the usual [`DaemonHandle::shutdown`].
    ///
    /// # Errors
    ///
    /// As [`DaemonHandle::shutdown`].
    pub fn shutdown_into_store(self) -> Result<()> {
        if self.store.enabled() {
            if let Err(e) = self
                .rt
                .block_on(fdstore::stop_into_store(&self.store, &self.parts))
            {
                warn!(reason = %e, "cannot keep the daemon's state in systemd's fd store; stopping the usual way");
            }
        }
        self.shutdown()
    }

    /// Clean shutdown (see the module docs); returns when every daemon thread
    /// has stopped and the socket is gone.
    ///
    /// # Errors
    ///
    /// [`DaemonError::Panicked`] when the daemon thread panicked.
    pub fn shutdown(mut self) -> Result<()> {
        self.stop()
    }

    /// The lifecycle's shutdown token: cancelled once the daemon was
    /// taken over (or is stopping).
    pub(crate) fn cancelled(&self) -> tokio_util::sync::CancellationToken {
        self.rooms.lifecycle.cancel().clone()
    }

    fn stop(&mut self) -> Result<()> {
        self.rooms.lifecycle.cancel().cancel();
        match self.thread.take() {
            Some(t) => t.join().map_err(|_| DaemonError::Panicked),
            None => Ok(()),
        }
    }
}

impl Drop for DaemonHandle {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            error!(error = %e, "daemon shutdown failed");
        }
    }
}
