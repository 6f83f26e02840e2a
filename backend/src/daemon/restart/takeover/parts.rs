//! What a takeover (or a stop into systemd's fd store) freezes, saves and
//! thaws: the daemon's components with a state of their own.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use numa::Topology;
use tokio::sync::RwLockWriteGuard;
use tracing::error;

use crate::daemon::background::scrub::Scrubbers;
use crate::daemon::counters::metrics::Metrics;
use crate::daemon::lifecycle::Lifecycle;
use crate::daemon::pool::{Pool, Snapshot};
use crate::daemon::restart::listeners::Listeners;

/// Why the daemon could not be frozen for a takeover or the fd store (it
/// is thawed and serves on).
#[derive(Debug, thiserror::Error)]
pub enum FreezeError {
    /// A handler or a loop did not stop in time.
    #[error(transparent)]
    Timeout(#[from] crate::daemon::lifecycle::FreezeTimeout),
    /// The scrubbers' join panicked.
    #[error("the scrubbers did not stop: {0}")]
    Scrubbers(#[source] tokio::task::JoinError),
    /// A region is still reserved by an ALLOC.
    #[error(transparent)]
    Snapshot(#[from] crate::daemon::pool::SnapshotError),
}

/// The components a takeover freezes and saves (see the module docs).
#[derive(Debug)]
pub struct Parts {
    /// The pool: regions and allocations.
    pub pool: Arc<Pool>,
    /// Phase, parked connections, the loops' work lock.
    pub lifecycle: Arc<Lifecycle>,
    /// The listening sockets.
    pub listeners: Arc<Listeners>,
    /// The counters (STATS `counters`).
    pub metrics: Arc<Metrics>,
    /// The next session id (the accept loop takes from it).
    pub next_session: Arc<AtomicU64>,
    /// The scrubbers, joined while frozen.
    pub scrubbers: Mutex<Scrubbers>,
    /// The topology the scrubbers restart on.
    pub topology: Arc<Topology>,
    /// The files of VMs parked on demand.
    pub fills: Arc<crate::daemon::requests::parked::loads::PendingLoads>,
    /// The shared clones' book (its marked templates travel).
    pub clones: Arc<crate::daemon::requests::parked::clones::Clones>,
}

impl Parts {
    /// Stops the scrubbers and joins them (a takeover freezing the daemon,
    /// or the daemon stopping).
    pub fn stop_scrubbers(&self) {
        self.scrubbers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .stop_and_join(&self.pool);
    }

    /// Starts them again (a takeover given up).
    fn restart_scrubbers(&self) -> io::Result<()> {
        self.scrubbers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .restart(&self.topology, &self.pool)
    }

    /// The next session id.
    pub fn next_session_hint(&self) -> u64 {
        self.next_session.load(Ordering::Relaxed)
    }

    /// Freezes the daemon (see the module docs, steps 2-5): every handler
    /// parked, the loops paused (the returned guard keeps them so), the
    /// scrubbers joined, and the pool's table snapshot. `keep`: mark the
    /// regions' files as kept (a successor process takes them over).
    ///
    /// # Errors
    ///
    /// A handler or loop that does not stop within 10 s, a region reserved.
    pub async fn freeze(
        self: &Arc<Self>,
        keep: bool,
    ) -> Result<(RwLockWriteGuard<'_, ()>, Snapshot), FreezeError> {
        let work = self.lifecycle.freeze(Duration::from_secs(10)).await?;
        let parts = Arc::clone(self);
        tokio::task::spawn_blocking(move || parts.stop_scrubbers())
            .await
            .map_err(FreezeError::Scrubbers)?;
        let snapshot = self.pool.records().snapshot(keep)?;
        Ok((work, snapshot))
    }

    /// Ends a freeze that did not lead anywhere: the daemon serves on.
    pub fn thaw(&self) {
        self.pool.records().unkeep();
        if let Err(e) = self.restart_scrubbers() {
            error!(error = %e, "cannot restart the scrubbers after a freeze");
        }
        self.lifecycle.thaw();
    }
}
