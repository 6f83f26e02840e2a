//! The running daemon's side of a takeover: the control socket, the
//! freeze, and sending the state document and its fds (see
//! [`crate::daemon::restart::takeover`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{error, info, warn};

use super::channel;
use super::document::{build, Target};
use super::parts::{FreezeError, Parts};
use super::state::StateError;
use crate::daemon::peers::peer::PeerCred;
use crate::daemon::persist::SaveError;

/// Why a takeover was given up (the daemon serves on).
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// The daemon could not be frozen.
    #[error(transparent)]
    Freeze(#[from] FreezeError),
    /// A component's part could not be saved.
    #[error(transparent)]
    Save(#[from] SaveError),
    /// The document could not be written into its memfd.
    #[error("the state document: {0}")]
    Document(#[from] StateError),
    /// Sending or the successor's answer failed.
    #[error("control channel: {0}")]
    Channel(#[source] std::io::Error),
    /// The sending thread panicked.
    #[error("the sending thread: {0}")]
    Thread(#[source] tokio::task::JoinError),
    /// The successor did not answer OK.
    #[error("the successor answered {0:?}")]
    Refused(String),
}

/// The sequence number of the fd store's last document (the successor
/// goes on from it): the fd store's, handed in by the start, which sits
/// above both.
pub type StoreSeq = Arc<dyn Fn() -> u64 + Send + Sync>;

/// Serves the control socket: one takeover at a time, from the daemon's
/// own uid only.
pub async fn control_loop(
    parts: Arc<Parts>,
    store_seq: StoreSeq,
    listener: tokio::net::UnixListener,
) {
    loop {
        let stream = tokio::select! {
            () = parts.lifecycle.cancel().cancelled() => break,
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    warn!(error = %e, "control socket accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let peer = match PeerCred::of(&stream) {
            Ok(p) => p,
            Err(_) => continue,
        };
        if peer.uid != crate::sys::euid() {
            warn!(uid = peer.uid, pid = ?peer.pid, "a takeover from another uid; refused");
            continue;
        }
        let Ok(std_stream) = stream.into_std() else {
            continue;
        };
        if std_stream.set_nonblocking(false).is_err() {
            continue;
        }
        if serve_successor(&parts, &*store_seq, std_stream, peer.pid).await {
            break;
        }
    }
}

/// One takeover (see the module docs). True when the daemon was handed
/// over and is to exit.
async fn serve_successor(
    parts: &Arc<Parts>,
    store_seq: &(dyn Fn() -> u64 + Send + Sync),
    stream: std::os::unix::net::UnixStream,
    pid: Option<i32>,
) -> bool {
    let started = Instant::now();
    let hello = {
        let s = stream.try_clone();
        tokio::task::spawn_blocking(move || {
            s.and_then(|s| channel::read_line(&s, Duration::from_secs(5)))
        })
        .await
    };
    match hello {
        Ok(Ok(line)) if line == channel::HELLO => {}
        Ok(Ok(line)) => {
            warn!(line = %line, "the control socket got something other than a takeover");
            let _ = channel::write_line(
                &stream,
                &format!("REFUSED this daemon speaks {:?}", channel::HELLO),
            );
            return false;
        }
        _ => return false,
    }
    info!(successor = ?pid, "takeover: freezing");
    let outcome = freeze_and_send(parts, store_seq, &stream).await;
    match outcome {
        Ok(()) => {
            parts.lifecycle.gone();
            info!(ms = started.elapsed().as_secs_f64() * 1e3, successor = ?pid, "takeover done: the successor serves; exiting");
            parts.lifecycle.cancel().cancel();
            true
        }
        Err(why) => {
            error!(reason = %why, "takeover given up; serving on");
            if matches!(
                why,
                SendError::Freeze(_) | SendError::Save(_) | SendError::Document(_)
            ) {
                // Nothing was sent: the successor is told why.
                let _ = channel::write_line(&stream, &format!("REFUSED {why}"));
            }
            parts.thaw();
            false
        }
    }
}

async fn freeze_and_send(
    parts: &Arc<Parts>,
    store_seq: &(dyn Fn() -> u64 + Send + Sync),
    stream: &std::os::unix::net::UnixStream,
) -> Result<(), SendError> {
    let (_work, snapshot) = parts.freeze(true).await?;
    let (doc, fds) = build(parts, &snapshot, Target::Successor, store_seq())?;
    let memfd = doc.to_memfd()?;
    let s = stream.try_clone().map_err(SendError::Channel)?;
    let answer = tokio::task::spawn_blocking(move || {
        channel::send_all(&s, &memfd, &fds)?;
        // Adopting and verifying every region takes the successor a while
        // on a big host; the clients wait in their sockets meanwhile.
        channel::read_line(&s, Duration::from_secs(120))
    })
    .await
    .map_err(SendError::Thread)?
    .map_err(SendError::Channel)?;
    if answer == "OK" {
        // Still holding the work lock: no loop round starts before it
        // sees the daemon taken over.
        parts.lifecycle.gone();
        Ok(())
    } else {
        Err(SendError::Refused(answer))
    }
}
