//! The control plane: the background loops, the metrics endpoint and the
//! control socket ([`spawn_loops`]), and the accept loop the daemon's
//! thread runs, then the drain ([`run`]).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, UnixListener};
use tracing::{info, warn};

use crate::daemon::background::quarantine::{quarantine_loop, Recheck};
use crate::daemon::background::refill::{refill_loop, Refill};
use crate::daemon::connections::orphans::orphans_loop;
use crate::daemon::connections::server::{Listener, Server};
use crate::daemon::connections::session::Rooms;
use crate::daemon::lifecycle::{Lifecycle, Phase};
use crate::daemon::process::exporter;
use crate::daemon::process::socket::remove_socket;
use crate::daemon::requests::rebalance::{policy_loop, Rebalancer};
use crate::daemon::restart::fdstore::{self, FdStore};
use crate::daemon::restart::takeover::{self, Parts};

/// What the accept loop runs on (see [`run`]); the background loops run
/// on their own ([`spawn_loops`]).
#[derive(Debug)]
pub(super) struct Plane {
    /// Shutdown, the tracker, the takeover's phase.
    pub lifecycle: Arc<Lifecycle>,
    /// The socket file.
    pub socket: PathBuf,
    /// Its identity, when it is this daemon's to remove.
    pub socket_id: Option<(u64, u64)>,
    /// The clients' listening socket.
    pub listener: UnixListener,
    /// The control socket file and its identity, when one was bound.
    pub control: Option<(PathBuf, (u64, u64))>,
    /// The accept loop's parts.
    pub server: Arc<Server>,
}

/// The background loops' parts.
#[derive(Debug)]
pub(super) struct Loops {
    /// What a takeover freezes and saves (the control loop, the fd store).
    pub parts: Arc<Parts>,
    /// systemd's fd store.
    pub store: Arc<FdStore>,
    /// The quarantine loop's parts.
    pub recheck: Arc<Recheck>,
    /// The rebalancer (its policy loop).
    pub rebalance: Arc<Rebalancer>,
    /// The refill and its period, when `pool.refill` is on.
    pub refill: Option<(Arc<Refill>, Duration)>,
    /// The sessions' rooms (orphans release through them; STATS).
    pub rooms: Arc<Rooms>,
    /// `limits.reattach_timeout_secs`.
    pub reattach_wait: Duration,
}

/// Spawns the background loops on the tracker (inside the runtime): the
/// control socket's, the quarantine's, the policy's, the fd store's, the
/// orphans', the refill's and the metrics endpoint. Returns the control
/// socket file and its identity, for the drain to remove.
pub(super) fn spawn_loops(
    loops: Loops,
    socket: &Path,
    socket_owned: bool,
    control: Option<UnixListener>,
    metrics: Option<TcpListener>,
) -> Option<(PathBuf, (u64, u64))> {
    let Loops {
        parts,
        store,
        recheck,
        rebalance,
        refill,
        rooms,
        reattach_wait,
    } = loops;
    // Before the fd store's first sync: it keeps a listener only of ours.
    parts.listeners.set_socket_owned(socket_owned);
    let lifecycle = Arc::clone(&parts.lifecycle);
    let tracker = lifecycle.tracker();
    let control_file = control.as_ref().and_then(|_| {
        let path = takeover::channel::control_path(socket);
        let id = std::fs::metadata(&path).ok().map(|m| (m.dev(), m.ino()))?;
        Some((path, id))
    });
    if let Some(c) = control {
        let parts = Arc::clone(&parts);
        let store = Arc::clone(&store);
        let store_seq: takeover::StoreSeq = Arc::new(move || store.seq());
        tracker.spawn(takeover::control_loop(parts, store_seq, c));
    }
    tracker.spawn(quarantine_loop(recheck));
    tracker.spawn(policy_loop(rebalance));
    tracker.spawn(fdstore::sync_loop(store, parts));
    tracker.spawn(orphans_loop(Arc::clone(&rooms), reattach_wait));
    if let Some((refill, period)) = refill {
        tracker.spawn(refill_loop(refill, period));
    }
    if let Some(l) = metrics {
        let registry = exporter::registry(Arc::clone(&rooms.stats));
        tracker.spawn(exporter::serve(l, registry, lifecycle.cancel().clone()));
    }
    control_file
}

/// The accept loop; then the socket files removed (unless taken over)
/// and the tasks drained.
pub(super) async fn run(plane: Plane) {
    let Plane {
        lifecycle,
        socket,
        socket_id,
        listener,
        control,
        server,
    } = plane;
    let tracker = lifecycle.tracker();
    Listener::new(listener, server).run().await;
    if lifecycle.phase() == Phase::Gone {
        // The successor serves on the same socket file.
        info!("taken over: leaving the socket to the successor");
    } else {
        remove_socket(&socket, socket_id);
    }
    // The control socket, unless a successor bound its own there.
    if let Some((path, id)) = control {
        remove_socket(&path, Some(id));
    }
    tracker.close();
    if tokio::time::timeout(Duration::from_secs(30), tracker.wait())
        .await
        .is_err()
    {
        warn!("some daemon tasks did not finish within 30 s of shutdown");
    }
}
