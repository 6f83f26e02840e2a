//! The daemon's lifecycle: serving, frozen for a takeover, taken over, and
//! shut down.
//!
//! A room below the server, the background loops and the takeover: each of
//! them depends on it, it depends on none of them. It owns
//!
//! * the shutdown token and the tracker every daemon task is spawned on;
//! * the [`Phase`], which a takeover moves from [`Phase::Serving`] to
//!   [`Phase::Frozen`] and then to [`Phase::Gone`] (taken over) or back
//!   (thawed);
//! * the connection handlers' count and the connections they parked for a
//!   takeover ([`ParkedConnection`]), which saves and restores its own
//!   part of the state document ([`ConnectionRecord`]);
//! * the work lock that pauses the background loops: [`Lifecycle::periodic`]
//!   runs a loop's rounds under it, so no loop can forget to pause.

pub mod suspended;

use crate::daemon::peers::refusals::OnConnection;
use std::future::Future;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::{watch, Notify, RwLock, RwLockReadGuard, RwLockWriteGuard};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::daemon::peers::holders::Predecessor;
use crate::daemon::persist::encoding::{hex, unhex};
use crate::daemon::persist::{DecodeError, Persist, RestoreContext, SaveContext, SaveError};
use crate::proto::FrameReader;
use suspended::{LazyRecord, Suspended};

/// Where the daemon is in a takeover.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Serving.
    Serving,
    /// Frozen for a takeover in progress.
    Frozen,
    /// Taken over: this daemon exits without releasing anything.
    Gone,
}

/// A connection parked for a takeover: duplicates of what travels (the
/// handler keeps the originals, to go on if the takeover is given up).
#[derive(Debug)]
pub struct ParkedConnection {
    /// Its session id.
    pub session: u64,
    /// The socket.
    pub stream: OwnedFd,
    /// HANDSHAKE done.
    pub handshaken: bool,
    /// The features it negotiated.
    pub features: u64,
    /// A frame begun: its bytes and fds.
    pub partial: Vec<u8>,
    /// See `partial`.
    pub partial_fds: Vec<OwnedFd>,
    /// Lazy allocations: region table, mappings, uffd.
    pub lazy: Vec<Suspended>,
    /// Its refused token requests so far.
    pub token_refusals: OnConnection,
    /// The templates its shared clones map, one entry a clone.
    pub shared_clones: Vec<u64>,
}

/// A connection in the state document: its socket, handshake, half-read
/// frame and lazy allocations, the fds by their index in its fd list.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ConnectionRecord {
    /// Its session id.
    pub session: u64,
    /// Index of its socket in the fd list.
    pub fd: usize,
    /// HANDSHAKE done.
    pub handshaken: bool,
    /// The features it negotiated.
    pub features: u64,
    /// A frame the peer had begun to send, as hex (its first bytes).
    pub partial: String,
    /// Fds that came with that partial frame (indices in the fd list).
    pub partial_fds: Vec<usize>,
    /// Lazy allocations of this connection.
    pub lazy: Vec<LazyRecord>,
    /// Its refused token requests so far (left out when there are none,
    /// as in a document of an earlier version).
    #[serde(default, skip_serializing_if = "OnConnection::is_none")]
    pub token_refusals: OnConnection,
    /// The templates (parked allocations) its shared clones map, one entry
    /// a clone (left out when there are none, as in a document of an
    /// earlier version).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shared_clones: Vec<u64>,
}

/// A connection a predecessor passed on, restored from its record, for
/// the server to resume.
#[derive(Debug)]
pub struct InheritedConnection {
    /// Its socket.
    pub stream: std::os::unix::net::UnixStream,
    /// Its session id.
    pub session: u64,
    /// HANDSHAKE done.
    pub handshaken: bool,
    /// The features it negotiated.
    pub features: u64,
    /// The frame its peer had begun.
    pub reader: FrameReader,
    /// Its lazy allocations.
    pub lazy: Vec<Suspended>,
    /// Its refused token requests so far.
    pub token_refusals: OnConnection,
    /// The templates its shared clones map, one entry a clone.
    pub shared_clones: Vec<u64>,
}

impl Persist for ParkedConnection {
    type State = ConnectionRecord;
    type Restored = Option<InheritedConnection>;
    type RestoreError = ConnectionRestoreError;

    /// Its record, its socket, the fds of its half-read frame and its lazy
    /// allocations' userfaultfds numbered in the document.
    fn save(&self, ctx: &mut SaveContext<'_>) -> Result<ConnectionRecord, SaveError> {
        let fds = &mut *ctx.fds;
        let fd = fds.add(self.stream.as_fd())?;
        let partial_fds = self
            .partial_fds
            .iter()
            .map(|f| fds.add(f.as_fd()))
            .collect::<Result<_, _>>()?;
        let lazy = self
            .lazy
            .iter()
            .map(|l| l.save(ctx))
            .collect::<Result<_, _>>()?;
        Ok(ConnectionRecord {
            session: self.session,
            fd,
            handshaken: self.handshaken,
            features: self.features,
            partial: hex(&self.partial),
            partial_fds,
            lazy,
            token_refusals: self.token_refusals,
            shared_clones: self.shared_clones.clone(),
        })
    }

    /// The connection the record describes (`None` without its socket),
    /// its fds taken from the document's.
    fn restore(
        state: ConnectionRecord,
        ctx: &mut RestoreContext<'_>,
    ) -> Result<Option<InheritedConnection>, ConnectionRestoreError> {
        let fds = &mut *ctx.fds;
        let Some(fd) = fds.take(state.fd) else {
            return Ok(None);
        };
        let stream = std::os::unix::net::UnixStream::from(fd);
        let partial_fds: Vec<OwnedFd> = state
            .partial_fds
            .iter()
            .filter_map(|i| fds.take(*i))
            .collect();
        let bytes = unhex(&state.partial)?;
        let reader = FrameReader::resume(&bytes, partial_fds)?;
        let lazy = state
            .lazy
            .into_iter()
            .map(|l| Suspended::restore(l, ctx))
            .collect::<Result<_, _>>()
            .unwrap_or_else(|never| match never {});
        Ok(Some(InheritedConnection {
            stream,
            session: state.session,
            handshaken: state.handshaken,
            features: state.features,
            reader,
            lazy,
            token_refusals: state.token_refusals,
            shared_clones: state.shared_clones,
        }))
    }
}

/// Why a connection's record does not restore (the connection is then
/// closed).
#[derive(Debug, thiserror::Error)]
pub enum ConnectionRestoreError {
    /// Its half-read frame is not hex.
    #[error("half-read frame")]
    Partial(#[from] DecodeError),
    /// Its half-read frame is not the start of a frame.
    #[error("half-read frame")]
    Frame(#[from] crate::proto::ProtoError),
}

/// What did not stop in time for a freeze.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FreezeTimeout {
    /// Handlers still serving a request.
    #[error(
        "{stuck} of {live} connections did not park within {secs} s (a request still running: an ALLOC waiting for pages, an on-demand RESTORE still filling a VM's memory)"
    )]
    NotParked {
        /// Handlers not parked.
        stuck: usize,
        /// Handlers alive.
        live: usize,
        /// The limit.
        secs: u64,
    },
    /// A background loop still in its round.
    #[error("the background loops did not pause within {secs} s")]
    LoopsBusy {
        /// The limit.
        secs: u64,
    },
}

/// The daemon's lifecycle (see the module docs).
#[derive(Debug)]
pub struct Lifecycle {
    cancel: CancellationToken,
    tracker: TaskTracker,
    phase: watch::Sender<Phase>,
    work: RwLock<()>,
    live: AtomicUsize,
    parked: Mutex<Vec<ParkedConnection>>,
    predecessor: Arc<Predecessor>,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Self {
            cancel: CancellationToken::new(),
            tracker: TaskTracker::new(),
            phase: watch::Sender::new(Phase::Serving),
            work: RwLock::new(()),
            live: AtomicUsize::new(0),
            parked: Mutex::new(Vec::new()),
            predecessor: Arc::default(),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Resolves when `kick` is notified; never without one.
async fn kicked(kick: Option<&Notify>) {
    match kick {
        Some(k) => k.notified().await,
        None => std::future::pending().await,
    }
}

impl Lifecycle {
    /// The shutdown token: cancelled by a shutdown, and once taken over.
    pub fn cancel(&self) -> &CancellationToken {
        &self.cancel
    }

    /// The tracker every daemon task runs on (shutdown drains it).
    pub fn tracker(&self) -> &TaskTracker {
        &self.tracker
    }

    /// The daemon this one took over from, while it runs (the holder
    /// scans skip it).
    pub fn predecessor(&self) -> &Arc<Predecessor> {
        &self.predecessor
    }

    /// The current phase.
    pub fn phase(&self) -> Phase {
        *self.phase.borrow()
    }

    /// A permit for one round of a background loop: while a takeover
    /// freezes the daemon, it waits; `None` once the daemon was handed
    /// over (the loop ends: nothing here may touch a region any more).
    pub async fn work(&self) -> Option<RwLockReadGuard<'_, ()>> {
        let guard = self.work.read().await;
        (self.phase() != Phase::Gone).then_some(guard)
    }

    /// Runs `round` every `period`, and at once whenever `kick` is
    /// notified, each round under a [`Lifecycle::work`] permit (a takeover
    /// waits for the round to end, and no round starts while it freezes the
    /// daemon), until shutdown or the takeover. `round` says whether to go
    /// on.
    pub async fn periodic<F, Fut>(&self, period: Duration, kick: Option<&Notify>, mut round: F)
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = bool>,
    {
        loop {
            tokio::select! {
                () = self.cancel.cancelled() => break,
                () = kicked(kick) => {}
                () = tokio::time::sleep(period) => {}
            }
            let Some(_work) = self.work().await else {
                break;
            };
            if !round().await {
                break;
            }
        }
    }

    /// Awaits `round` once, `delay` from now, under a [`Lifecycle::work`]
    /// permit; not at all after a shutdown or a takeover.
    pub async fn after<Fut: Future<Output = ()>>(&self, delay: Duration, round: Fut) {
        tokio::select! {
            () = self.cancel.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
        let Some(_work) = self.work().await else {
            return;
        };
        round.await;
    }

    /// Resolves once a takeover freezes the daemon.
    pub async fn frozen(&self) {
        let mut rx = self.phase.subscribe();
        let _ = rx.wait_for(|p| *p != Phase::Serving).await;
    }

    /// Waits until the daemon thaws ([`Phase::Serving`]) or is taken over
    /// ([`Phase::Gone`]), and says which.
    pub async fn thawed(&self) -> Phase {
        let mut rx = self.phase.subscribe();
        let phase = match rx.wait_for(|p| *p != Phase::Frozen).await {
            Ok(p) => *p,
            Err(_) => Phase::Gone,
        };
        phase
    }

    /// A connection handler started / ended (the freeze waits for every
    /// live one to park).
    pub fn handler_started(&self) {
        self.live.fetch_add(1, Ordering::SeqCst);
    }

    /// See [`Lifecycle::handler_started`].
    pub fn handler_ended(&self) {
        self.live.fetch_sub(1, Ordering::SeqCst);
    }

    /// A handler parked (see [`ParkedConnection`]).
    pub fn park(&self, conn: ParkedConnection) {
        lock(&self.parked).push(conn);
    }

    /// Freezes the connections and the loops: every live handler parked
    /// (each finishes the request it serves first), then every background
    /// loop paused between rounds (the returned guard keeps them so).
    ///
    /// # Errors
    ///
    /// A handler or loop that does not stop within `limit`.
    pub async fn freeze(&self, limit: Duration) -> Result<RwLockWriteGuard<'_, ()>, FreezeTimeout> {
        self.phase.send_replace(Phase::Frozen);
        let deadline = Instant::now() + limit;
        loop {
            let parked = lock(&self.parked).len();
            let live = self.live.load(Ordering::SeqCst);
            if parked >= live {
                break;
            }
            if Instant::now() >= deadline {
                return Err(FreezeTimeout::NotParked {
                    stuck: live - parked,
                    live,
                    secs: limit.as_secs(),
                });
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        // After the handlers: a request being served may wait for the
        // quarantine or a scrub (an ALLOC waiting for pages on their way).
        tokio::time::timeout(limit, self.work.write())
            .await
            .map_err(|_| FreezeTimeout::LoopsBusy {
                secs: limit.as_secs(),
            })
    }

    /// The parked connections, while frozen.
    pub fn parked(&self) -> std::sync::MutexGuard<'_, Vec<ParkedConnection>> {
        lock(&self.parked)
    }

    /// Ends a freeze that did not lead anywhere: the daemon serves on.
    pub fn thaw(&self) {
        lock(&self.parked).clear();
        self.phase.send_replace(Phase::Serving);
    }

    /// Marks the daemon taken over (its loops end at their next round).
    pub fn gone(&self) {
        self.phase.send_replace(Phase::Gone);
        lock(&self.parked).clear();
    }
}
