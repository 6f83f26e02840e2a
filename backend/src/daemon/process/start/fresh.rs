//! The fresh start: a daemon of its own, on its own socket or systemd's,
//! with an empty pool.

use std::collections::HashSet;

use super::core::{self, Sockets};
use crate::daemon::config::Config;
use crate::daemon::process::error::Result;
use crate::daemon::process::handle::DaemonHandle;
use crate::daemon::process::socket::remove_socket;

/// Starts a daemon of its own: on `listener` when systemd passed one (the
/// socket file is then systemd's), else on a socket file it binds (and
/// removes again if the start fails).
///
/// # Errors
///
/// As [`crate::daemon::Daemon::start`].
pub(super) fn start(
    config: Config,
    listener: Option<std::os::unix::net::UnixListener>,
    fd_store: bool,
) -> Result<DaemonHandle> {
    let host = core::host(config, &HashSet::new())?;
    let (listener, socket_id) = match listener {
        Some(l) => (core::listener_from(&host, l)?, None),
        None => {
            let (l, id) = core::bind_own(&host)?;
            (l, Some(id))
        }
    };
    let socket = host.config.socket.clone();
    let metrics = match host.config.metrics.listen {
        Some(addr) => match core::bind_metrics(&host, addr) {
            Ok(l) => Some(l),
            Err(e) => {
                remove_socket(&socket, socket_id);
                return Err(e);
            }
        },
        None => None,
    };
    let sockets = Sockets {
        listener,
        socket_id,
        metrics,
    };
    core::core(host, sockets, None, fd_store).inspect_err(|_| remove_socket(&socket, socket_id))
}
