//! `hugemem serve`: the daemon as a process, from its start (fresh, on
//! systemd's socket and fd store, or taking over) to its signal.

use std::io;

use tracing::info;

use crate::daemon::config::Config;
use crate::daemon::process::error::{DaemonError, Result};
use crate::daemon::process::start::Daemon;
use crate::daemon::process::systemd;
use crate::daemon::restart::{fdstore, takeover};

/// How [`serve`] starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// A daemon of its own (or on systemd's socket).
    Fresh,
    /// Taking over from the daemon running on the same socket
    /// ([`takeover`]).
    Takeover,
}

/// `hugemem serve`: starts the daemon and runs it until SIGTERM or SIGINT,
/// then shuts it down cleanly (socket removed, scrubbers joined). Under
/// systemd it takes a socket-activated listener when one was passed, and
/// sends `READY=1` once serving and `STOPPING=1` on the signal ([`systemd`]).
///
/// # Errors
///
/// As [`Daemon::start`] and [`DaemonHandle::shutdown`](crate::daemon::DaemonHandle::shutdown);
/// [`DaemonError::Threads`] when the signal handlers cannot be installed.
pub fn serve(
    config: Config,
    start: Start,
    fd_store: bool,
    ready: Option<std::os::fd::OwnedFd>,
) -> Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(DaemonError::Threads)?;
    // Handlers first, so a SIGTERM that arrives while starting is not lost.
    let (mut term, mut int) = rt
        .block_on(async {
            Ok::<_, io::Error>((
                signal(SignalKind::terminate())?,
                signal(SignalKind::interrupt())?,
            ))
        })
        .map_err(DaemonError::Threads)?;
    let (handle, activated) = match start {
        Start::Fresh => {
            let passed = systemd::passed_fds(&config.socket)?;
            let activated = passed.listener.is_some();
            let restored = fdstore::restore(passed.named);
            (
                Daemon::start_with(config, passed.listener, restored, fd_store)?,
                activated,
            )
        }
        Start::Takeover => {
            let inherited = takeover::receive(&config.socket)?;
            let activated = !inherited.state.socket_owned;
            (
                Daemon::start_with(config, None, Some(inherited), fd_store)?,
                activated,
            )
        }
    };
    systemd::notify_ready(handle.socket_path(), activated);
    // `--detach`: the process that forked this one exits now, successfully.
    if let Some(fd) = ready {
        use std::io::Write;
        let _ = std::fs::File::from(fd).write_all(b"1");
    }
    let taken_over = handle.cancelled();
    let which = rt.block_on(async {
        tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
            () = taken_over.cancelled() => "takeover",
        }
    });
    if which == "takeover" {
        info!("taken over by a successor; exiting");
        return handle.shutdown();
    }
    info!(signal = which, "shutting down");
    systemd::notify_stopping(which);
    handle.shutdown_into_store()
}
