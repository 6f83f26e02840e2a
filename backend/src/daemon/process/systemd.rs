//! systemd integration: readiness (`Type=notify`) and socket activation.
//!
//! Both go through the `sd-notify` crate (libc only, no libsystemd):
//!
//! * [`notify_ready`] / [`notify_stopping`] send `READY=1` / `STOPPING=1`
//!   with a `STATUS=` line to `$NOTIFY_SOCKET`. Without that variable (not
//!   started by systemd, or `Type=simple`) they do nothing. `READY=1` is sent
//!   once [`crate::daemon::Daemon::start`] has returned: the socket listens, the
//!   scrubbers run, the metrics endpoint (if any) is bound. `sd-notify` 0.5
//!   connects to a path only: an abstract `@name` fails, is logged, and the
//!   daemon serves anyway.
//! * [`inherited_listener`] takes the listening socket systemd passes under
//!   `hugemem.socket` (`LISTEN_FDS=1`, `LISTEN_PID` = this process, fd 3;
//!   `sd_listen_fds(3)`). It must be a listening `AF_UNIX` stream socket
//!   bound to the configured `socket` path, or the daemon refuses to start
//!   (so a unit that points at another path than the config cannot go
//!   unnoticed). The daemon then neither unlinks nor re-creates the socket
//!   file (systemd owns it and its mode: `SocketMode=`, `SocketGroup=`), and
//!   every connection passes the same `SO_PEERCRED` uid check and slot
//!   limits as with a socket the daemon bound itself.

use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use nix::sys::socket::{getsockname, getsockopt, sockopt, SockType, UnixAddr};
use sd_notify::NotifyState;
use tracing::{debug, info, warn};

use crate::daemon::process::error::{DaemonError, Result};

/// Set once the passed descriptor has been taken, so it is owned once only.
static TAKEN: AtomicBool = AtomicBool::new(false);

/// Sends `states` to the service manager; a failure is logged, never fatal
/// (the unit's start timeout reports a missing READY).
fn notify(states: &[NotifyState<'_>]) {
    if std::env::var_os("NOTIFY_SOCKET").is_none() {
        return;
    }
    match sd_notify::notify(states) {
        Ok(()) => debug!(?states, "notified the service manager"),
        Err(e) => warn!(error = %e, "cannot notify the service manager"),
    }
}

/// `READY=1` and a status line naming the socket.
pub fn notify_ready(socket: &Path, activated: bool) {
    let status = format!(
        "serving {}{}",
        socket.display(),
        if activated { " (socket-activated)" } else { "" }
    );
    notify(&[NotifyState::Ready, NotifyState::Status(&status)]);
}

/// `MAINPID=` this process: a successor that took over (see
/// `crate::daemon::restart::takeover`) is the service's main process from now on.
pub fn notify_main_pid() {
    notify(&[NotifyState::MainPid(std::process::id())]);
}

/// `STOPPING=1` and a status line with the signal.
pub fn notify_stopping(why: &str) {
    let status = format!("stopping on {why}");
    notify(&[NotifyState::Stopping, NotifyState::Status(&status)]);
}

/// What systemd passed this process.
#[derive(Debug, Default)]
pub struct Passed {
    /// The listening socket of `hugemem.socket`.
    pub listener: Option<UnixListener>,
    /// Descriptors of the fd store, by `FDNAME` (see [`crate::daemon::restart::fdstore`]).
    pub named: std::collections::HashMap<String, OwnedFd>,
}

/// The descriptors systemd passed (`LISTEN_FDS`, `LISTEN_FDNAMES`): at most
/// one listening socket of `hugemem.socket`, and what the daemon kept in
/// the fd store (names starting `hugemem-`). Nothing passed: empty.
///
/// # Errors
///
/// [`DaemonError::Activation`] when a passed descriptor is neither: not
/// exactly one listening UNIX stream socket bound to `expected`, or more
/// than one.
pub fn passed_fds(expected: &Path) -> Result<Passed> {
    let bad = |m: String| DaemonError::Activation(m);
    let fds: Vec<(i32, String)> = sd_notify::listen_fds_with_names()
        .map_err(|e| bad(format!("LISTEN_FDS/LISTEN_PID: {e}")))?
        .collect();
    if fds.is_empty() {
        return Ok(Passed::default());
    }
    if TAKEN.swap(true, Ordering::SeqCst) {
        return Err(bad("the passed descriptors were already taken".into()));
    }
    let mut out = Passed::default();
    for (raw, name) in fds {
        // SAFETY: `listen_fds_with_names` returned this descriptor, so
        // LISTEN_PID names this process and, by the sd_listen_fds(3)
        // protocol, the service manager left it open for this process and
        // nothing else in it owns it; `TAKEN` makes this the only `OwnedFd`
        // ever made of it.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        if name.starts_with("hugemem-") && name != crate::daemon::restart::fdstore::LISTENER {
            out.named.insert(name, fd);
            continue;
        }
        if out.listener.is_some() {
            return Err(bad(
                "more than one socket passed; hugemem.socket must have exactly one ListenStream="
                    .into(),
            ));
        }
        out.listener = Some(check_listener(fd, expected, raw)?);
        if name == crate::daemon::restart::fdstore::LISTENER {
            info!(socket = %expected.display(), "using the socket kept in systemd's fd store");
        } else {
            info!(socket = %expected.display(), "using the socket passed by systemd");
        }
    }
    Ok(out)
}

/// The listening socket systemd passed for `expected`, `None` when this
/// process was not socket-activated (the fd store's descriptors are
/// closed: use [`passed_fds`] to keep them).
///
/// # Errors
///
/// As [`passed_fds`].
pub fn inherited_listener(expected: &Path) -> Result<Option<UnixListener>> {
    Ok(passed_fds(expected)?.listener)
}

/// Checks that `fd` is a listening UNIX stream socket bound to `expected`.
fn check_listener(fd: OwnedFd, expected: &Path, raw: i32) -> Result<UnixListener> {
    let bad = |m: String| DaemonError::Activation(m);
    let kind = getsockopt(&fd, sockopt::SockType)
        .map_err(|e| bad(format!("fd {raw} is not a socket: {e}")))?;
    if kind != SockType::Stream {
        return Err(bad(format!(
            "fd {raw} is a {kind:?} socket, not a stream socket"
        )));
    }
    if !getsockopt(&fd, sockopt::AcceptConn).map_err(|e| bad(format!("fd {raw}: {e}")))? {
        return Err(bad(format!("fd {raw} is not listening")));
    }
    let addr: UnixAddr = getsockname(std::os::fd::AsRawFd::as_raw_fd(&fd))
        .map_err(|e| bad(format!("fd {raw} is not a UNIX socket: {e}")))?;
    match addr.path() {
        Some(p) if p == expected => {}
        Some(p) => {
            return Err(bad(format!(
                "the passed socket is bound to {}, the configuration says socket = {}",
                p.display(),
                expected.display()
            )))
        }
        None => {
            return Err(bad(format!(
                "the passed socket has no path; the configuration says socket = {}",
                expected.display()
            )))
        }
    }
    let listener = UnixListener::from(fd);
    listener
        .set_nonblocking(true)
        .map_err(|e| bad(format!("fd {raw}: {e}")))?;
    Ok(listener)
}
