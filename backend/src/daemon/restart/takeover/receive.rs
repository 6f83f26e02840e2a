//! The successor's side of a takeover: connecting to the running
//! daemon's control socket, receiving and checking the state document and
//! its fds, and answering (see [`crate::daemon::restart::takeover`]).

use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use tracing::{error, info, warn};

use super::channel;
use super::state::{State, StateError};
use crate::daemon::persist::fds::Fds;

/// What a successor received: the checked document and its fds (an
/// `Option` each, taken as they are used).
#[derive(Debug)]
pub struct Inherited {
    /// The document.
    pub state: State,
    /// Its fds, by index.
    pub fds: Fds,
    /// The predecessor's pid.
    pub predecessor: Option<i32>,
    /// The control channel, answered once the successor serves (none for
    /// what systemd's fd store kept).
    pub channel: Option<std::os::unix::net::UnixStream>,
    /// When the takeover started (for the log and the benchmark).
    pub started: Instant,
}

impl Inherited {
    /// Takes fd `i` (once).
    pub fn take(&mut self, i: usize) -> Option<OwnedFd> {
        self.fds.take(i)
    }

    /// Tells the predecessor the takeover failed: it thaws and serves on.
    pub fn refuse(&self, why: &str) {
        let Some(ch) = &self.channel else { return };
        let line = format!("REFUSED {}", why.replace('\n', " "));
        if let Err(e) = channel::write_line(ch, &line) {
            warn!(error = %e, "cannot tell the predecessor the takeover failed");
        }
    }

    /// Answers the predecessor: this daemon serves (the start calls it
    /// once serving; under systemd, after telling systemd this process is
    /// the unit's main process).
    pub fn accept(&self) {
        let Some(ch) = &self.channel else {
            info!(
                ms = self.started.elapsed().as_secs_f64() * 1e3,
                "restored from systemd's fd store; serving"
            );
            return;
        };
        match channel::write_line(ch, "OK") {
            Ok(()) => info!(
                ms = self.started.elapsed().as_secs_f64() * 1e3,
                "takeover: serving; the predecessor exits"
            ),
            Err(e) => {
                error!(error = %e, "cannot answer the predecessor; it thaws when it sees the channel close")
            }
        }
    }
}

/// Errors of [`receive`].
#[derive(Debug, thiserror::Error)]
pub enum TakeoverError {
    /// No daemon answers on the control socket.
    #[error("no running hugemem daemon answers on {path}")]
    Connect {
        /// The control socket.
        path: std::path::PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The control socket is another uid's.
    #[error("the daemon on {0} runs as another uid; refusing to take over from it")]
    Foreign(std::path::PathBuf),
    /// The channel failed.
    #[error("takeover channel")]
    Channel(#[source] std::io::Error),
    /// The running daemon refused.
    #[error("the running daemon refused the takeover: {0}")]
    Refused(String),
    /// The state document was refused (the predecessor serves on).
    #[error(transparent)]
    State(#[from] StateError),
}

/// The successor's first step: connects to the running daemon's control
/// socket, asks for the takeover, and receives and checks the state
/// document and its fds. On a refused document the predecessor is told,
/// and thaws.
///
/// # Errors
///
/// [`TakeoverError`].
pub fn receive(socket: &std::path::Path) -> Result<Inherited, TakeoverError> {
    let started = Instant::now();
    let path = channel::control_path(socket);
    let stream = std::os::unix::net::UnixStream::connect(&path).map_err(|source| {
        TakeoverError::Connect {
            path: path.clone(),
            source,
        }
    })?;
    let cred = nix::sys::socket::getsockopt(&stream, nix::sys::socket::sockopt::PeerCredentials)
        .map_err(|e| TakeoverError::Channel(e.into()))?;
    if cred.uid() != crate::sys::euid() {
        return Err(TakeoverError::Foreign(path));
    }
    channel::write_line(&stream, channel::HELLO).map_err(TakeoverError::Channel)?;
    let (memfd, fds) = match channel::recv_all(&stream) {
        Ok(x) => x,
        Err(e) => {
            if let Some(refusal) = e
                .get_ref()
                .and_then(|i| i.downcast_ref::<channel::Refusal>())
            {
                return Err(TakeoverError::Refused(refusal.0.clone()));
            }
            // A refusal comes as a line instead of the magic.
            return Err(
                match channel::read_line(&stream, Duration::from_millis(100)) {
                    Ok(line) if line.starts_with("REFUSED") => TakeoverError::Refused(line),
                    _ => TakeoverError::Channel(e),
                },
            );
        }
    };
    let checked = State::from_memfd(memfd).and_then(|s| s.check_fds(fds.len()).map(|()| s));
    let state = match checked {
        Ok(s) => s,
        Err(e) => {
            let _ = channel::write_line(&stream, &format!("REFUSED {e}"));
            return Err(e.into());
        }
    };
    info!(
        predecessor = state.pid,
        version = %state.daemon_version,
        regions = state.regions.len(),
        allocations = state.allocations.len(),
        connections = state.connections.len(),
        fds = fds.len(),
        ms = started.elapsed().as_secs_f64() * 1e3,
        "takeover: state received"
    );
    Ok(Inherited {
        predecessor: Some(cred.pid()).filter(|p| *p > 0),
        state,
        fds: Fds(fds.into_iter().map(Some).collect()),
        channel: Some(stream),
        started,
    })
}

/// Binds the control socket next to the daemon's socket (mode 0600). A
/// successor (`replace`) takes the path over from its predecessor, which
/// no longer listens on it once it answers; otherwise a stale one (nothing
/// answers) is replaced and a live one left alone (the takeover is then
/// unavailable, said in the log).
pub fn bind_control(socket: &std::path::Path, replace: bool) -> Option<tokio::net::UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    let path = channel::control_path(socket);
    if path.exists() {
        let live = !replace && std::os::unix::net::UnixStream::connect(&path).is_ok();
        if live {
            warn!(path = %path.display(), "another daemon's control socket is live; takeover unavailable");
            return None;
        }
        let _ = std::fs::remove_file(&path);
    }
    let bound = std::os::unix::net::UnixListener::bind(&path).and_then(|l| {
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
        l.set_nonblocking(true)?;
        tokio::net::UnixListener::from_std(l)
    });
    match bound {
        Ok(l) => Some(l),
        Err(e) => {
            warn!(path = %path.display(), error = %e, "cannot bind the control socket; takeover unavailable");
            None
        }
    }
}
