//! The inherited start: a takeover, or systemd's fd store after a restart
//! or a crash. The sockets come from the document (or systemd), the
//! regions, allocations and connections are adopted and checked by the
//! core; the predecessor is answered once this daemon serves, or told why
//! not, in one place.

use std::collections::HashSet;
use std::path::PathBuf;

use super::core::{self, Host, Sockets};
use crate::daemon::config::Config;
use crate::daemon::persist::{Persist, RestoreContext};
use crate::daemon::process::error::Result;
use crate::daemon::process::handle::DaemonHandle;
use crate::daemon::process::systemd;
use crate::daemon::restart::listeners::{Listeners, SavedListeners};
use crate::daemon::restart::takeover::Inherited;

/// Starts on what a predecessor or systemd's fd store passed on, on
/// `listener` when systemd passed one and the document names none.
///
/// # Errors
///
/// As [`crate::daemon::Daemon::start`]; the predecessor is told why and
/// serves on.
pub(super) fn start(
    config: Config,
    listener: Option<std::os::unix::net::UnixListener>,
    mut inherited: Inherited,
    fd_store: bool,
) -> Result<DaemonHandle> {
    match build(config, listener, &mut inherited, fd_store) {
        Ok(handle) => {
            if inherited.channel.is_some() {
                // Under systemd (`ExecReload=hugemem serve --takeover
                // --detach`, with `NotifyAccess=all`) this process becomes
                // the unit's main process before the predecessor is told
                // to exit: systemd must not see its main process gone.
                systemd::notify_main_pid();
            }
            inherited.accept();
            Ok(handle)
        }
        Err(e) => {
            inherited.refuse(&crate::diag::chain(&e));
            Err(e)
        }
    }
}

fn build(
    config: Config,
    listener: Option<std::os::unix::net::UnixListener>,
    inh: &mut Inherited,
    fd_store: bool,
) -> Result<DaemonHandle> {
    // A region passed on keeps its file, whoever created it.
    let kept: HashSet<PathBuf> = inh
        .state
        .regions
        .iter()
        .filter_map(|r| r.path.as_ref().map(PathBuf::from))
        .collect();
    let host = core::host(config, &kept)?;
    let sockets = sockets(&host, listener, inh)?;
    core::core(host, sockets, Some(inh), fd_store)
}

/// The listening sockets: the predecessor's, systemd's, or bound here.
fn sockets(
    host: &Host,
    passed: Option<std::os::unix::net::UnixListener>,
    inh: &mut Inherited,
) -> Result<Sockets> {
    let saved = SavedListeners {
        listener: inh.state.listener,
        metrics: inh.state.metrics,
        socket_owned: inh.state.socket_owned,
    };
    let mut ctx = RestoreContext {
        fds: &mut inh.fds,
        topology: &host.topology,
    };
    let inherited = Listeners::restore(saved, &mut ctx).unwrap_or_else(|never| match never {});
    let inherited_listener = inherited
        .listener
        .map(std::os::unix::net::UnixListener::from);
    let inherited_metrics = inherited.metrics.map(std::net::TcpListener::from);
    let (listener, socket_id) = match inherited_listener.or(passed) {
        Some(l) => (core::listener_from(host, l)?, None),
        None => {
            let (l, id) = core::bind_own(host)?;
            (l, Some(id))
        }
    };
    // A socket the predecessor created stays the successor's to remove:
    // the same file, so its identity is taken now.
    let socket_id = socket_id.or_else(|| {
        inherited
            .socket_owned
            .then(|| core::socket_identity(&host.config.socket))
            .flatten()
    });
    let metrics = match (inherited_metrics, host.config.metrics.listen) {
        (Some(l), _) => {
            let _guard = host.runtime.enter();
            match l
                .set_nonblocking(true)
                .and_then(|()| tokio::net::TcpListener::from_std(l))
            {
                Ok(l) => Some(l),
                Err(e) => {
                    core::unusable_metrics(&e);
                    None
                }
            }
        }
        (None, Some(addr)) => Some(core::bind_metrics(host, addr)?),
        (None, None) => None,
    };
    Ok(Sockets {
        listener,
        socket_id,
        metrics,
    })
}
