//! The control plane the daemon's thread runs: the background loops, the
//! metrics endpoint, the control socket and the accept loop; then the
//! drain.

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, UnixListener};
use tracing::{info, warn};

use crate::daemon::exporter;
use crate::daemon::fdstore::{self, FdStore};
use crate::daemon::handover::{self, Parts};
use crate::daemon::lifecycle::{Lifecycle, Phase};
use crate::daemon::orphans::orphans_loop;
use crate::daemon::quarantine::{quarantine_loop, Recheck};
use crate::daemon::rebalance::{policy_loop, Rebalancer};
use crate::daemon::refill::{refill_loop, Refill};
use crate::daemon::server::{Listener, Server};
use crate::daemon::session::Rooms;
use crate::daemon::socket::remove_socket;

/// Everything the control plane runs (see [`run`]).
#[derive(Debug)]
pub(super) struct Plane {
    /// Shutdown, the tracker, the handover's phase.
    pub lifecycle: Arc<Lifecycle>,
    /// The socket file.
    pub socket: PathBuf,
    /// Its identity, when it is this daemon's to remove.
    pub socket_id: Option<(u64, u64)>,
    /// The clients' listening socket.
    pub listener: UnixListener,
    /// The metrics endpoint's, when it is on.
    pub metrics_listener: Option<TcpListener>,
    /// The control socket (takeovers), when it could be bound.
    pub control: Option<UnixListener>,
    /// What a handover freezes and saves.
    pub parts: Arc<Parts>,
    /// systemd's fd store.
    pub store: Arc<FdStore>,
    /// The quarantine loop's parts.
    pub recheck: Arc<Recheck>,
    /// The rebalancer (its policy loop).
    pub rebalance: Arc<Rebalancer>,
    /// The refill and its period, when `pool.refill` is on.
    pub refill: Option<(Arc<Refill>, Duration)>,
    /// The sessions' rooms (the orphan loop releases through them).
    pub rooms: Arc<Rooms>,
    /// `limits.reattach_timeout_secs`.
    pub reattach_wait: Duration,
    /// The accept loop's parts.
    pub server: Arc<Server>,
}

/// The control plane: loops, metrics, control socket, accept loop; then
/// the socket files removed (unless handed over) and the tasks drained.
pub(super) async fn run(plane: Plane) {
    let Plane {
        lifecycle,
        socket,
        socket_id,
        listener,
        metrics_listener,
        control,
        parts,
        store,
        recheck,
        rebalance,
        refill,
        rooms,
        reattach_wait,
        server,
    } = plane;
    parts.listeners.set_socket_owned(socket_id.is_some());
    let tracker = lifecycle.tracker();
    let control_path = control
        .as_ref()
        .map(|_| handover::channel::control_path(&socket));
    let control_id = control_path
        .as_ref()
        .and_then(|p| std::fs::metadata(p).ok())
        .map(|m| (m.dev(), m.ino()));
    if let Some(c) = control {
        let (parts, store) = (Arc::clone(&parts), Arc::clone(&store));
        tracker.spawn(handover::control_loop(parts, store, c));
    }
    tracker.spawn(quarantine_loop(recheck));
    tracker.spawn(policy_loop(rebalance));
    tracker.spawn(fdstore::sync_loop(store, Arc::clone(&parts)));
    tracker.spawn(orphans_loop(Arc::clone(&rooms), reattach_wait));
    if let Some((refill, period)) = refill {
        tracker.spawn(refill_loop(refill, period));
    }
    if let Some(l) = metrics_listener {
        let registry = exporter::registry(Arc::clone(&rooms.stats));
        tracker.spawn(exporter::serve(l, registry, lifecycle.cancel().clone()));
    }
    Listener::new(listener, server).run().await;
    if lifecycle.phase() == Phase::Gone {
        // The successor serves on the same socket file.
        info!("handed over: leaving the socket to the successor");
    } else {
        remove_socket(&socket, socket_id);
    }
    // The control socket, unless a successor bound its own there.
    if let (Some(p), Some(id)) = (control_path, control_id) {
        remove_socket(&p, Some(id));
    }
    tracker.close();
    if tokio::time::timeout(Duration::from_secs(30), tracker.wait())
        .await
        .is_err()
    {
        warn!("some daemon tasks did not finish within 30 s of shutdown");
    }
}
