//! The clients that talk to the daemon while it is switched: pingers (STATS
//! in a loop on a connection of their own, reconnecting when it is lost)
//! and a connector (a new connection after another).

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use backend::client::{Client, ClientError};
use serde::Serialize;

/// Pause between two requests of one client: a steady stream without
/// keeping the daemon (and the bench's two CPUs) busy.
const GAP: Duration = Duration::from_millis(2);
/// A request (or handshake) taking longer than this fails it.
pub(super) const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// What one client saw during the window.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct ClientRun {
    /// Requests sent (STATS, or the handshake of a new connection).
    pub requests: u64,
    /// Of which failed: an error or the connection closed.
    pub failed: u64,
    /// Connections that could not be opened (no daemon listening).
    pub refused: u64,
    /// New connections opened after the first was lost.
    pub reconnects: u64,
    /// The longest wait from a request sent to the next successful reply,
    /// failed attempts and reconnects in between included, ms.
    pub max_stall_ms: f64,
}

impl ClientRun {
    fn answered(&mut self, since: Instant) {
        self.max_stall_ms = self.max_stall_ms.max(since.elapsed().as_secs_f64() * 1e3);
    }

    /// Sums counts and keeps the longest stall.
    pub fn merge(&mut self, o: &Self) {
        self.requests += o.requests;
        self.failed += o.failed;
        self.refused += o.refused;
        self.reconnects += o.reconnects;
        self.max_stall_ms = self.max_stall_ms.max(o.max_stall_ms);
    }
}

/// Connects with the bench's request timeout set.
pub(super) fn connect(socket: &Path) -> Result<Client, ClientError> {
    let c = Client::connect(socket)?;
    c.set_timeout(Some(REQUEST_TIMEOUT))?;
    Ok(c)
}

/// STATS on `conn` until `stop`; a lost connection is replaced by a new
/// one (its allocations stay with the old one, as for a VMM that
/// reconnects).
pub(super) fn ping(conn: &mut Option<Client>, socket: &Path, stop: &AtomicBool) -> ClientRun {
    let mut r = ClientRun::default();
    let mut waiting: Option<Instant> = None;
    while !stop.load(Ordering::Relaxed) {
        let since = *waiting.get_or_insert_with(Instant::now);
        match conn.as_mut() {
            Some(c) => {
                r.requests += 1;
                if c.stats().is_ok() {
                    r.answered(since);
                    waiting = None;
                } else {
                    r.failed += 1;
                    *conn = None;
                }
            }
            None => match connect(socket) {
                Ok(c) => {
                    r.reconnects += 1;
                    *conn = Some(c);
                    // The wait ends with the next STATS's reply.
                    continue;
                }
                Err(ClientError::Connect { .. }) => r.refused += 1,
                Err(_) => r.failed += 1,
            },
        }
        std::thread::sleep(GAP);
    }
    if let Some(since) = waiting {
        r.answered(since);
    }
    r
}

/// New connections (connect and handshake), one after another, until `stop`.
pub(super) fn connector(socket: &Path, stop: &AtomicBool) -> ClientRun {
    let mut r = ClientRun::default();
    let mut waiting: Option<Instant> = None;
    while !stop.load(Ordering::Relaxed) {
        let since = *waiting.get_or_insert_with(Instant::now);
        r.requests += 1;
        match connect(socket) {
            Ok(c) => {
                r.answered(since);
                waiting = None;
                drop(c);
            }
            Err(ClientError::Connect { .. }) => r.refused += 1,
            // Accepted, then closed before the handshake's reply.
            Err(_) => r.failed += 1,
        }
        std::thread::sleep(GAP);
    }
    if let Some(since) = waiting {
        r.answered(since);
    }
    r
}
