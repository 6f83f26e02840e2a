//! The accept loop and the per-connection handlers (mini-redis style).
//!
//! [`Listener`] accepts connections, checks the peer's uid, and spawns one
//! task per connection that owns a `Handler`. A `Slot` moved into each
//! task caps live connections: at most `max_connections_per_uid` per uid
//! (refused uids included), at most `max_connections` in all, of which
//! `reserved_connections` only operators (root, `[rebalance]
//! operator_uids`) may take. A connection beyond its uid's share is closed
//! right after `accept`, so one tenant's flood never keeps another tenant,
//! or the operator, waiting. A handshaken connection that holds no
//! allocation or a shared clone and stays silent for `idle_timeout_secs` is closed. All tasks are spawned on a `TaskTracker`
//! and watch a `CancellationToken`: shutdown cancels, then waits for the
//! tracker to drain.
//!
//! A handler reads a frame ([`crate::proto::async_io::read_frame`]), decodes
//! the request, lets its [`Session`] serve it, and writes the reply with a
//! timeout. Errors stay on their connection:
//!
//! * A bad **header** (version, code, flags, size) or EOF inside a frame:
//!   the framing can no longer be trusted, so the connection is closed
//!   without a reply.
//! * A bad **payload** (truncated, too many parts, trailing bytes) inside an
//!   intact frame: answered with `INVALID` and the reason, then closed, as
//!   the protocol says decoding errors close the connection.
//! * A request that decodes but cannot be served gets an error reply and the
//!   connection stays open.
//!
//! Refused peers (uid not allowed) get one `INVALID` reply naming their uid
//! to their first request, then the connection closes; they reach no
//! session code at all.

use std::os::fd::AsFd;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::{debug, info, warn};

use crate::daemon::config::LimitsConfig;
use crate::daemon::connections::session::Rooms;
use crate::daemon::connections::session::Session;
use crate::daemon::counters::metrics::Metrics;
use crate::daemon::lifecycle::Lifecycle;
use crate::daemon::lifecycle::{InheritedConnection, ParkedConnection, Phase};
use crate::daemon::peers::peer::PeerCred;
use crate::daemon::peers::peer_log;
use crate::diag::RateLimit;
use crate::proto::async_io::{read_frame, read_frame_with, write_frame};
use crate::proto::messages::{Reply, Request};
use crate::proto::FrameReader;
use crate::proto::{Header, ProtoError, Status};

// The lines a peer can cause are limited per uid (`crate::daemon::peers::peer_log`);
// accept errors have no peer.
static ACCEPT_LOG: RateLimit = RateLimit::new(Duration::from_secs(1));

/// Connection slots: the general pool, the operators' reserve, per-uid counts.
#[derive(Debug)]
pub struct Slots {
    general: Arc<Semaphore>,
    reserved: Arc<Semaphore>,
    per_uid: Mutex<HashMap<u32, usize>>,
    max_per_uid: usize,
    operators: Vec<u32>,
}

/// One live connection's slot; given back on drop.
#[derive(Debug)]
struct Slot {
    slots: Arc<Slots>,
    uid: u32,
    /// `None` for an inherited connection over the limits (see
    /// [`adopt_connection`]).
    _permit: Option<OwnedSemaphorePermit>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut g = self
            .slots
            .per_uid
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = g.get_mut(&self.uid) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                g.remove(&self.uid);
            }
        }
    }
}

impl Slots {
    /// Slots under `limits`; root and `operators` may take the reserve.
    pub fn new(limits: &crate::daemon::config::LimitsConfig, mut operators: Vec<u32>) -> Arc<Self> {
        let reserved = limits.reserved_connections.min(limits.max_connections);
        // Root is always an operator.
        operators.push(0);
        Arc::new(Self {
            general: Arc::new(Semaphore::new(limits.max_connections - reserved)),
            reserved: Arc::new(Semaphore::new(reserved)),
            per_uid: Mutex::new(HashMap::new()),
            max_per_uid: limits.max_connections_per_uid,
            operators,
        })
    }

    /// A slot for `uid` beyond the limits (counted for its uid).
    fn force(self: &Arc<Self>, uid: u32) -> Slot {
        *self
            .per_uid
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(uid)
            .or_insert(0) += 1;
        Slot {
            slots: Arc::clone(self),
            uid,
            _permit: None,
        }
    }

    /// A slot for `uid`, or the reason there is none.
    fn take(self: &Arc<Self>, uid: u32) -> Result<Slot, &'static str> {
        let mut g = self
            .per_uid
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = g.get(&uid).copied().unwrap_or(0);
        if n >= self.max_per_uid {
            return Err("the uid has max_connections_per_uid connections");
        }
        let permit = match Arc::clone(&self.general).try_acquire_owned() {
            Ok(p) => p,
            Err(_) if self.operators.contains(&uid) => Arc::clone(&self.reserved)
                .try_acquire_owned()
                .map_err(|_| "every connection slot, the operators' reserve included, is taken")?,
            Err(_) => return Err("every general connection slot is taken"),
        };
        g.insert(uid, n + 1);
        Ok(Slot {
            slots: Arc::clone(self),
            uid,
            _permit: Some(permit),
        })
    }
}

/// What the accept loop and the connection handlers use.
#[derive(Debug)]
pub struct Server {
    /// Shutdown, the task tracker, parking for a takeover.
    pub lifecycle: Arc<Lifecycle>,
    /// Connection slots.
    pub slots: Arc<Slots>,
    /// Uids allowed to connect.
    pub allowed_uids: Vec<u32>,
    /// Timeouts.
    pub limits: LimitsConfig,
    /// The counters.
    pub metrics: Arc<Metrics>,
    /// The next session id.
    pub next_session: Arc<AtomicU64>,
    /// What a session serves its requests from.
    pub rooms: Arc<Rooms>,
}

/// The accept loop.
#[derive(Debug)]
pub struct Listener {
    listener: UnixListener,
    server: Arc<Server>,
    slots: Arc<Slots>,
}

impl Listener {
    /// A listener over a bound socket.
    pub fn new(listener: UnixListener, server: Arc<Server>) -> Self {
        let slots = Arc::clone(&server.slots);
        Self {
            listener,
            server,
            slots,
        }
    }

    /// Accepts until the daemon's token is cancelled.
    pub async fn run(&mut self) {
        let cancel = self.server.lifecycle.cancel().clone();
        loop {
            let stream = tokio::select! {
                () = cancel.cancelled() => break,
                // A takeover: stop accepting (connections wait in the
                // backlog) until it is done or given up.
                () = self.server.lifecycle.frozen() => {
                    if self.server.lifecycle.thawed().await == Phase::Gone {
                        break;
                    }
                    continue;
                }
                r = self.listener.accept() => match r {
                    Ok((s, _)) => s,
                    Err(e) => {
                        // EMFILE and friends: back off instead of spinning.
                        if let Some(n) = ACCEPT_LOG.check() {
                            warn!(error = %e, suppressed = n, "accept failed");
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
            };
            self.spawn_connection(stream);
        }
        info!("listener stopped accepting");
    }

    fn spawn_connection(&mut self, stream: UnixStream) {
        let peer = match PeerCred::of(&stream) {
            Ok(p) => p,
            Err(e) => {
                warn!(error = %e, "cannot read peer credentials; closing");
                return;
            }
        };
        let permit = match self.slots.take(peer.uid) {
            Ok(slot) => slot,
            Err(why) => {
                Metrics::add(&self.server.metrics.connection_errors, 1);
                if let Some(n) = peer_log::NO_SLOT.check(peer.uid) {
                    warn!(uid = peer.uid, pid = ?peer.pid, reason = why, suppressed = n, "no connection slot; closing");
                }
                return;
            }
        };
        let server = Arc::clone(&self.server);
        if !server.allowed_uids.contains(&peer.uid) {
            Metrics::add(&server.metrics.peers_refused, 1);
            if let Some(n) = peer_log::UID_REFUSED.check(peer.uid) {
                warn!(uid = peer.uid, pid = ?peer.pid, suppressed = n, "peer uid is not allowed; refusing");
            }
            self.server
                .lifecycle
                .tracker()
                .spawn(refuse(stream, peer, permit));
            return;
        }
        let id = self
            .server
            .next_session
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let session = Session::new(id, peer, Arc::clone(&server.rooms));
        let handler = Handler {
            stream,
            session,
            server,
            reader: FrameReader::new(),
            _permit: permit,
        };
        spawn_handler(handler);
    }
}

/// Runs a connection's handler on the tracker until the connection ends,
/// parking it whenever a takeover freezes the daemon.
fn spawn_handler(mut handler: Handler) {
    let server = Arc::clone(&handler.server);
    server.lifecycle.handler_started();
    let tracker = server.lifecycle.tracker().clone();
    tracker.spawn(async move {
        let (id, uid) = (handler.session.id(), handler.session.uid());
        loop {
            match handler.run().await {
                Ok(End::Park) => {
                    if handler.park().await {
                        continue;
                    }
                    // Taken over: the successor owns the session now.
                    // Nothing is released; the socket closes here, the
                    // successor keeps its own copy.
                    handler.session.forget();
                    handler.server.lifecycle.handler_ended();
                    return;
                }
                Ok(End::Closed) => {}
                Err(e) => {
                    Metrics::add(&handler.server.metrics.connection_errors, 1);
                    if let Some(n) = peer_log::CONNECTION_CLOSED.check(uid) {
                        warn!(session = id, uid, error = %crate::diag::chain(&e), suppressed = n, "closing connection");
                    }
                }
            }
            break;
        }
        handler.session.close();
        handler.server.lifecycle.handler_ended();
    });
}

/// A connection a predecessor daemon passed on (`crate::daemon::restart::takeover`): its
/// socket, session id, handshake state, the frame its peer had begun, and
/// its lazy allocations (their fault services restart here).
pub fn adopt_connection(server: &Arc<Server>, conn: InheritedConnection) -> std::io::Result<()> {
    conn.stream.set_nonblocking(true)?;
    let stream = UnixStream::from_std(conn.stream)?;
    let peer = PeerCred::of(&stream)?;
    let permit = match server.slots.take(peer.uid) {
        Ok(p) => p,
        Err(why) => {
            // More inherited connections than this configuration allows:
            // served anyway (closing one would free a running VM's memory).
            warn!(
                uid = peer.uid,
                reason = why,
                "an inherited connection is over the limits; served anyway"
            );
            server.slots.force(peer.uid)
        }
    };
    let mut session = Session::inherited(
        conn.session,
        peer,
        Arc::clone(&server.rooms),
        conn.handshaken,
        conn.features,
    );
    session.resume_refusals(conn.token_refusals);
    // Its shared clones count against their templates again.
    server.rooms.clones.resume(
        (conn.session, peer.pid.and_then(|p| u32::try_from(p).ok())),
        &conn.shared_clones,
    );
    session.resume_lazy(conn.lazy);
    spawn_handler(Handler {
        stream,
        session,
        server: Arc::clone(server),
        reader: conn.reader,
        _permit: permit,
    });
    Ok(())
}

/// Answers a refused peer's first request with `INVALID`, then closes.
async fn refuse(stream: UnixStream, peer: PeerCred, _permit: Slot) {
    let Ok(Ok(frame)) = tokio::time::timeout(Duration::from_secs(2), read_frame(&stream)).await
    else {
        return;
    };
    let reply = Reply::error(
        Status::Invalid,
        format!("uid {} is not allowed to use this hugemem daemon", peer.uid),
    );
    let payload = reply.encode();
    if let Ok(header) = Header::reply_to(&frame.header, payload.len()) {
        let _ = tokio::time::timeout(
            Duration::from_secs(2),
            write_frame(&stream, &header, &payload, &[]),
        )
        .await;
    }
}

/// One connection.
#[derive(Debug)]
struct Handler {
    stream: UnixStream,
    session: Session,
    server: Arc<Server>,
    /// Kept across reads: a frame half read when a takeover parks the
    /// handler is still here (see `read_frame_with`).
    reader: FrameReader,
    _permit: Slot,
}

/// How a handler's loop ended without a protocol error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// EOF or shutdown.
    Closed,
    /// A takeover froze the daemon: park between requests.
    Park,
}

impl Handler {
    /// Parks for a takeover: stops the session's fault services (keeping
    /// their userfaultfds), hands duplicates of what travels to the
    /// takeover, and waits. True when the takeover was given up and the
    /// handler goes on; false when the successor took the connection.
    async fn park(&mut self) -> bool {
        let suspended = tokio::task::block_in_place(|| self.session.suspend_lazy());
        let (partial, partial_fds) = self.reader.take_partial();
        let dup = |fd: std::os::fd::BorrowedFd<'_>| fd.try_clone_to_owned();
        let parked = (|| -> std::io::Result<ParkedConnection> {
            Ok(ParkedConnection {
                session: self.session.id(),
                stream: dup(self.stream.as_fd())?,
                handshaken: self.session.handshaken(),
                features: self.session.features(),
                token_refusals: self.session.token_refusals(),
                shared_clones: self.server.rooms.clones.templates_of(self.session.id()),
                partial: partial.clone(),
                partial_fds: partial_fds
                    .iter()
                    .map(|f| dup(f.as_fd()))
                    .collect::<std::io::Result<_>>()?,
                lazy: suspended
                    .iter()
                    .map(|s| {
                        Ok(crate::daemon::lifecycle::suspended::Suspended {
                            alloc: s.alloc,
                            infos: s.infos.clone(),
                            ranges: s.ranges.clone(),
                            uffd: s.uffd.as_ref().map(|u| dup(u.as_fd())).transpose()?,
                        })
                    })
                    .collect::<std::io::Result<_>>()?,
            })
        })();
        match parked {
            Ok(p) => self.server.lifecycle.park(p),
            // Not parked: the freeze times out waiting for it and the
            // takeover is given up.
            Err(e) => {
                warn!(session = self.session.id(), error = %e, "cannot park a connection for a takeover")
            }
        }
        let phase = self.server.lifecycle.thawed().await;
        if phase == Phase::Gone {
            return false;
        }
        match FrameReader::resume(&partial, partial_fds) {
            Ok(r) => self.reader = r,
            Err(e) => {
                warn!(session = self.session.id(), error = %e, "cannot resume a half-read frame")
            }
        }
        self.session.resume_lazy(suspended);
        true
    }

    /// Serves requests until EOF, a malformed frame, shutdown, or a
    /// takeover. `Ok` for an orderly end, the protocol error otherwise.
    async fn run(&mut self) -> Result<End, ProtoError> {
        let limits = &self.server.limits;
        let handshake_deadline =
            tokio::time::Instant::now() + Duration::from_secs(limits.handshake_timeout_secs);
        let write_timeout = Duration::from_secs(limits.write_timeout_secs);
        let idle_timeout = Duration::from_secs(limits.idle_timeout_secs);
        let cancel = self.server.lifecycle.cancel().clone();
        loop {
            let (stream, reader, session) = (&self.stream, &mut self.reader, &self.session);
            let read = async {
                if session.handshaken() && session.never_idle() {
                    read_frame_with(stream, reader).await
                } else if session.handshaken() {
                    match tokio::time::timeout(idle_timeout, read_frame_with(stream, reader)).await
                    {
                        Ok(r) => r,
                        Err(_) => Err(ProtoError::OutOfBounds(
                            "idle without an allocation or a shared clone for limits.idle_timeout_secs".into(),
                        )),
                    }
                } else {
                    match tokio::time::timeout_at(
                        handshake_deadline,
                        read_frame_with(stream, reader),
                    )
                    .await
                    {
                        Ok(r) => r,
                        Err(_) => Err(ProtoError::OutOfBounds(
                            "no HANDSHAKE within the handshake timeout".into(),
                        )),
                    }
                }
            };
            let frame = tokio::select! {
                () = cancel.cancelled() => return Ok(End::Closed),
                // Between requests only: a request being served finishes
                // first (with its reply) before the handler parks.
                () = self.server.lifecycle.frozen() => return Ok(End::Park),
                // A lazy allocation's fault service failed: closing the
                // connection hands its faults to the VMM's fallback.
                () = session.lazy_failed() => {
                    return Err(ProtoError::OutOfBounds("a lazy-mode fault service failed".into()));
                }
                f = read => f,
            };
            let frame = match frame {
                Ok(f) => f,
                Err(ProtoError::Closed) => return Ok(End::Closed),
                Err(e) => return Err(e),
            };
            if frame.header.is_reply() {
                return Err(ProtoError::OutOfBounds(
                    "a reply arrived where a request was expected".into(),
                ));
            }
            let request = match Request::decode(frame.header.code, &frame.payload) {
                Ok(r) => r,
                Err(e) => {
                    let reply = Reply::error(Status::Invalid, format!("malformed request: {e}"));
                    let _ = self.send(&frame.header, &reply, &[], write_timeout).await;
                    return Err(e);
                }
            };
            debug!(session = self.session.id(), code = ?frame.header.code, id = frame.header.id, "request");
            // Only UFFD carries an fd; any other request's fds were taken
            // into OwnedFd on arrival and close here.
            let out = if request.expected_fds() > 0 {
                self.session.handle_with_fds(request, frame.fds).await
            } else {
                if !frame.fds.is_empty() {
                    if let Some(n) = peer_log::STRAY_FDS.check(self.session.uid()) {
                        warn!(
                            session = self.session.id(),
                            uid = self.session.uid(),
                            fds = frame.fds.len(),
                            suppressed = n,
                            "request carried file descriptors; closed them"
                        );
                    }
                }
                drop(frame.fds);
                self.session.handle(request).await
            };
            let fds: Vec<_> = out.fds.iter().map(AsFd::as_fd).collect();
            if let Err(e) = self
                .send(&frame.header, &out.reply, &fds, write_timeout)
                .await
            {
                drop(fds);
                if let Some(alloc) = out.alloc {
                    self.session.release_undelivered(alloc);
                }
                return Err(e);
            }
            if out.close {
                return Err(ProtoError::OutOfBounds(format!(
                    "{} on one connection",
                    self.session.token_refusals_summary()
                )));
            }
        }
    }

    async fn send(
        &self,
        request: &Header,
        reply: &Reply,
        fds: &[std::os::fd::BorrowedFd<'_>],
        timeout: Duration,
    ) -> Result<(), ProtoError> {
        let payload = reply.encode();
        let header = Header::reply_to(request, payload.len())?;
        match tokio::time::timeout(timeout, write_frame(&self.stream, &header, &payload, fds)).await
        {
            Ok(r) => r,
            Err(_) => Err(ProtoError::OutOfBounds(
                "the client did not read its reply within the write timeout".into(),
            )),
        }
    }
}
