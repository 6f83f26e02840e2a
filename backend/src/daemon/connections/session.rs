//! One client's session: handshake state, the allocations it owns, and the
//! meaning of each request.
//!
//! A session is created per accepted connection and lives as long as it.
//! Ownership is recorded in the pool ([`crate::daemon::pool::Pool`] keeps the
//! session id of every allocation), so FREE, LOCK and UNLOCK on an id this
//! session was not given are refused with `NotFound` whether the id exists or
//! not — another client's ids are not even confirmed to exist in the status;
//! the message says which case it was, for the operator's logs.
//!
//! When the session ends (disconnect, malformed frame, shutdown) every
//! allocation it still owns is released into quarantine, exactly as FREE
//! would. The first release starts a pidfd watch on the peer process (when
//! it is another process), so its exit re-checks the quarantine at once.
//!
//! **Re-attach**: a session that negotiated `FEATURE_REATTACH`
//! gets each allocation's token in the ALLOC reply; REATTACH with it takes
//! an *orphaned* allocation (restored by a restarted daemon) into this
//! session. Refusals all read like an unknown id, and after
//! [`MAX_REATTACH_REFUSALS`] of them the connection is closed, so a tenant
//! cannot guess tokens.

use std::sync::Arc;

use tracing::{debug, info, warn};

use crate::daemon::counters::metrics::Metrics;
use crate::daemon::peers::peer::{PeerCred, PidWatch};
use crate::daemon::peers::peer_log;
use crate::daemon::peers::refusals::TokenRequest;
use crate::daemon::pool::{AllocId, HandoffError, Released, SessionId};
use crate::daemon::requests::alloc;
use crate::daemon::requests::outcome::Outcome;
pub use crate::daemon::requests::rooms::{settle_released, Rooms};
use crate::proto::messages::{Reply, ReplyBody, Request};
use crate::proto::{
    Status, FEATURE_HANDOFF, FEATURE_PARK, FEATURE_REATTACH, PROTOCOL_VERSION, TOKEN_SIZE,
};

/// Features this daemon implements: REBALANCE, lazy mode, re-attach tokens.
pub const DAEMON_FEATURES: u64 = crate::proto::FEATURE_REBALANCE
    | crate::proto::FEATURE_LAZY
    | FEATURE_REATTACH
    | crate::proto::FEATURE_HANDOFF
    | FEATURE_PARK
    | crate::proto::FEATURE_CLONE;

/// Refused REATTACH and HANDOFF requests (id, uid or token) a connection may make; the reply to the last
/// one is followed by closing the connection (a tenant must not guess
/// tokens; a VMM re-attaching its own allocations is never refused).
pub const MAX_REATTACH_REFUSALS: u32 = 8;

/// A client session.
#[derive(Debug)]
pub struct Session {
    id: SessionId,
    peer: PeerCred,
    rooms: Arc<Rooms>,
    handshaken: bool,
    /// Features negotiated in the handshake (the client's ∩ the daemon's).
    features: u64,
    /// REATTACH and HANDOFF requests refused on this connection for their
    /// id, uid or token.
    token_refusals: crate::daemon::peers::refusals::OnConnection,
    watching: bool,
    /// Lazy allocations and their fault services (`backend::fault`).
    lazy: crate::daemon::requests::lazy_allocs::LazyAllocs,
}

impl Session {
    /// A new session for a peer that passed the uid check.
    pub fn new(id: SessionId, peer: PeerCred, rooms: Arc<Rooms>) -> Self {
        Metrics::add(&rooms.metrics.sessions_total, 1);
        if let Some(suppressed) = peer_log::SESSION_STARTED.check(peer.uid) {
            info!(session = id, uid = peer.uid, pid = ?peer.pid, suppressed, "session started");
        }
        Self::open(id, peer, rooms, false, 0)
    }

    /// A session a predecessor daemon passed on (`crate::daemon::restart::takeover`):
    /// same id, same allocations (in the pool already), same handshake.
    pub fn inherited(
        id: SessionId,
        peer: PeerCred,
        rooms: Arc<Rooms>,
        handshaken: bool,
        features: u64,
    ) -> Self {
        info!(session = id, uid = peer.uid, pid = ?peer.pid, "session taken over");
        let mut me = Self::open(id, peer, rooms, handshaken, features & DAEMON_FEATURES);
        if me.never_idle() {
            me.watch_peer();
        }
        me
    }

    /// A live session (counted active, known to the rebalancer).
    fn open(
        id: SessionId,
        peer: PeerCred,
        rooms: Arc<Rooms>,
        handshaken: bool,
        features: u64,
    ) -> Self {
        Metrics::add(&rooms.metrics.sessions_active, 1);
        rooms.rebalance.client_started(id, peer.pid);
        Self {
            id,
            peer,
            rooms,
            handshaken,
            features,
            token_refusals: crate::daemon::peers::refusals::OnConnection::default(),
            watching: false,
            lazy: crate::daemon::requests::lazy_allocs::LazyAllocs::new(),
        }
    }

    /// Stops this session's fault services for a takeover, keeping their
    /// userfaultfds (blocking: at most one page clear per thread). The
    /// records of allocations that are no longer this connection's (handed
    /// off, parked, orphaned, released by their new owner) are dropped,
    /// not passed on: the successor would find their regions gone, or
    /// someone else's, and close this connection.
    pub fn suspend_lazy(&mut self) -> Vec<crate::daemon::lifecycle::suspended::Suspended> {
        let (owners, session) = (self.rooms.pool.owners(), self.id);
        self.lazy
            .retain(|alloc| owners.regions_of(alloc, session).is_ok());
        self.lazy.suspend_all()
    }

    /// Restarts suspended lazy allocations (a takeover given up, or taken
    /// over here). One whose service cannot restart ends the connection
    /// (its VMM's fallback then serves it), as a failed service does.
    pub fn resume_lazy(&mut self, suspended: Vec<crate::daemon::lifecycle::suspended::Suspended>) {
        if suspended.is_empty() {
            return;
        }
        let cfg = crate::fault::FaultServiceConfig {
            topology: Some(Arc::clone(&self.rooms.topology)),
            totals: Some(Arc::clone(&self.rooms.fault_totals)),
            ..crate::fault::FaultServiceConfig::default()
        };
        let pool = Arc::clone(&self.rooms.pool);
        let failed = self.lazy.resume(
            suspended,
            |infos| {
                infos
                    .iter()
                    .map(|i| pool.owners().region(i.region_id))
                    .collect()
            },
            self.peer.pid,
            &cfg,
        );
        for (alloc, why) in failed {
            warn!(session = self.id, alloc, reason = %why, "a lazy allocation's fault service did not restart; the VMM's fallback serves it");
            self.lazy.fail();
        }
    }

    /// Ends a session that a successor daemon took over: nothing is
    /// released (the successor owns its allocations now).
    pub fn forget(self) {
        self.rooms
            .metrics
            .sessions_active
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        debug!(
            session = self.id,
            "session taken over by the successor daemon"
        );
    }

    /// The session id.
    pub fn id(&self) -> SessionId {
        self.id
    }

    /// The peer's uid.
    pub fn uid(&self) -> u32 {
        self.peer.uid
    }

    /// The refused REATTACH and HANDOFF requests on this connection (they
    /// travel with it through a takeover).
    pub fn token_refusals(&self) -> crate::daemon::peers::refusals::OnConnection {
        self.token_refusals
    }

    /// Takes on the refusals a predecessor counted on this connection.
    pub fn resume_refusals(&mut self, refusals: crate::daemon::peers::refusals::OnConnection) {
        self.token_refusals = refusals;
    }

    /// What its refusals' closing says: "8 refused HANDOFF requests".
    pub fn token_refusals_summary(&self) -> String {
        self.token_refusals.summary()
    }

    /// True while the session holds an allocation or runs shared clones:
    /// never timed out for being idle (that would free its guest RAM, or
    /// stop counting clones that still map their template).
    pub fn never_idle(&self) -> bool {
        self.rooms.pool.owners().allocations_of(self.id) > 0
            || !self.rooms.clones.templates_of(self.id).is_empty()
    }

    /// The features negotiated at HANDSHAKE.
    pub fn features(&self) -> u64 {
        self.features
    }

    /// True once HANDSHAKE succeeded.
    pub fn handshaken(&self) -> bool {
        self.handshaken
    }

    /// Serves one decoded request.
    pub async fn handle(&mut self, req: Request) -> Outcome {
        match req {
            Request::Handshake {
                min_version,
                max_version,
                features,
            } => self.handshake(min_version, max_version, features),
            _ if !self.handshaken => Outcome::error(
                Status::Version,
                "HANDSHAKE must be the first request on a connection",
            ),
            Request::Alloc { req, wait_ms } => self.alloc(&req, wait_ms).await,
            Request::Free { alloc_id } => self.free(alloc_id).await,
            Request::Lock { alloc_id, chunk } => self.lock(alloc_id, chunk, true).await,
            Request::Unlock { alloc_id, chunk } => self.lock(alloc_id, chunk, false).await,
            Request::Rebalance {
                region_id,
                offset,
                len,
                node,
            } => {
                let req = crate::daemon::requests::rebalance::MoveRequest {
                    region_id,
                    offset,
                    len,
                    node,
                };
                self.rebalance(req).await
            }
            Request::Stats => self.stats().await,
            // Without its fd (see `handle_with_fds`): refused with the reason.
            Request::Uffd { alloc_id, ranges } => self.uffd(alloc_id, &ranges, Vec::new()).await,
            Request::Reattach { .. } if self.features & FEATURE_REATTACH == 0 => {
                not_negotiated("REATTACH", FEATURE_REATTACH)
            }
            Request::Reattach { alloc_id, token } => self.reattach(alloc_id, &token),
            Request::Handoff { .. } if self.features & FEATURE_HANDOFF == 0 => {
                not_negotiated("HANDOFF", FEATURE_HANDOFF)
            }
            Request::Handoff {
                alloc_id,
                token,
                want_paths,
            } => {
                self.handoff(crate::daemon::requests::handoff::HandoffRequest {
                    alloc_id,
                    token,
                    want_paths,
                })
                .await
            }
            Request::Park { .. }
            | Request::Restore { .. }
            | Request::Unpark { .. }
            | Request::Export { .. }
            | Request::Clone { .. } => self.park(req, Vec::new()).await,
        }
    }

    /// The park room's requests (`crate::daemon::requests::park`), with the fds they carry.
    async fn park(&mut self, req: Request, fds: Vec<std::os::fd::OwnedFd>) -> Outcome {
        let needs = crate::daemon::requests::park::features_needed(&req);
        if let Some((what, feature)) = needs.into_iter().find(|(_, f)| self.features & f == 0) {
            return not_negotiated(what, feature);
        }
        let out =
            crate::daemon::requests::park::serve(&self.rooms, self.id, &self.peer, req, fds).await;
        // A restored VM's allocation is this connection's now.
        if out.alloc.is_some() && !self.watching {
            self.watch_peer();
        }
        out
    }

    /// REBALANCE. The owner's request holds its allocation's change gate
    /// for the whole move, so a HANDOFF never hands out memory that one of
    /// its predecessor's moves still moves (the HANDOFF cancels such a move
    /// first: it waits for one batch). An operator's move of another
    /// connection's region takes no gate: it does not depend on who owns
    /// the region.
    async fn rebalance(&mut self, req: crate::daemon::requests::rebalance::MoveRequest) -> Outcome {
        let gate = self
            .rooms
            .pool
            .placement()
            .in_use(req.region_id)
            .filter(|r| r.session == self.id)
            .and_then(|r| self.rooms.pool.owners().change_gate(r.alloc, self.id).ok());
        let _held = match gate {
            Some(g) => Some(g.lock_owned().await),
            None => None,
        };
        // Ownership is checked (again) inside, under the gate.
        let reply = crate::daemon::requests::rebalance::serve(
            &self.rooms.rebalance,
            self.id,
            self.peer.uid,
            req,
        )
        .await;
        Outcome::reply(reply)
    }

    fn handshake(&mut self, min: u32, max: u32, features: u64) -> Outcome {
        if self.handshaken {
            return Outcome::error(
                Status::Invalid,
                "HANDSHAKE was already done on this connection",
            );
        }
        if min > max || min > PROTOCOL_VERSION || max < PROTOCOL_VERSION {
            return Outcome::error(
                Status::Version,
                format!("client speaks protocol versions {min}..={max}; this daemon speaks {PROTOCOL_VERSION}"),
            );
        }
        self.handshaken = true;
        self.features = features & DAEMON_FEATURES;
        debug!(session = self.id, features, "handshake done");
        Outcome::reply(Reply::ok(ReplyBody::Handshake {
            version: PROTOCOL_VERSION,
            features: self.features,
        }))
    }

    async fn alloc(&mut self, req: &crate::proto::AllocRequest, wait_ms: Option<u32>) -> Outcome {
        let requester = alloc::Requester {
            session: self.id,
            uid: self.peer.uid,
            gid: self.peer.gid,
            reattach: self.features & FEATURE_REATTACH != 0,
            fills_every_byte: false,
        };
        let started = std::time::Instant::now();
        let served = alloc::serve(&self.rooms.alloc, requester, req, wait_ms).await;
        if served.outcome.reply.status == Status::Ok {
            self.rooms.metrics.alloc_latency.record(started.elapsed());
        }
        if let Some(lazy) = served.lazy {
            self.lazy.record(lazy.alloc, lazy.infos, lazy.regions);
        }
        served.outcome
    }

    /// REATTACH: take orphaned allocation `alloc_id` into this session with
    /// its token (`crate::daemon::requests::reattach`); reply with its region table as it is
    /// now.
    fn reattach(&mut self, alloc_id: AllocId, token: &[u8; TOKEN_SIZE]) -> Outcome {
        let pool = &self.rooms.pool;
        match crate::daemon::requests::reattach::serve(
            pool,
            self.id,
            self.peer.uid,
            alloc_id,
            token,
        ) {
            Ok(served) => {
                Metrics::add(&self.rooms.metrics.reattach_ok, 1);
                if let Some(lazy) = served.lazy {
                    self.lazy.record(lazy.alloc, lazy.infos, lazy.regions);
                }
                served.outcome
            }
            Err(e) => {
                Metrics::add(&self.rooms.metrics.reattach_refused, 1);
                self.token_refused(
                    TokenRequest::Reattach,
                    alloc_id,
                    Status::NotFound,
                    e.to_string(),
                )
            }
        }
    }

    /// HANDOFF: take allocation `alloc_id` over from the connection that
    /// owns it (`crate::daemon::requests::handoff`), once a change its owner began is done:
    /// the move waits on the allocation's change gate (the predecessor's
    /// moves are cancelled first), and a LOCK, UNLOCK, UFFD or REBALANCE of
    /// the predecessor that comes after it finds the allocation gone.
    async fn handoff(&mut self, req: crate::daemon::requests::handoff::HandoffRequest) -> Outcome {
        let pool = &self.rooms.pool;
        let served =
            match pool
                .owners()
                .hand_off_gate(req.alloc_id, &req.token, self.id, self.peer.uid)
            {
                Ok((gate, predecessor)) => {
                    if let Some(p) = predecessor {
                        self.rooms.rebalance.cancel_client_moves(req.alloc_id, p);
                    }
                    let _held = gate.lock_owned().await;
                    crate::daemon::requests::handoff::serve(pool, self.id, self.peer.uid, req)
                }
                Err(e) => Err(e),
            };
        match served {
            Ok(out) => {
                self.rooms.rebalance.alloc_handed_off(req.alloc_id, self.id);
                Metrics::add(&self.rooms.metrics.handoff_ok, 1);
                out
            }
            Err(e @ HandoffError::Refused(_)) => {
                Metrics::add(&self.rooms.metrics.handoff_refused, 1);
                let status = crate::daemon::requests::handoff::refusal_status(&e);
                self.token_refused(TokenRequest::Handoff, req.alloc_id, status, e.to_string())
            }
            Err(e) => {
                if let Some(suppressed) = peer_log::REQUEST_REFUSED.check(self.peer.uid) {
                    info!(session = self.id, uid = self.peer.uid, alloc = req.alloc_id, reason = %e, suppressed, "HANDOFF refused");
                }
                Outcome::error(
                    crate::daemon::requests::handoff::refusal_status(&e),
                    e.to_string(),
                )
            }
        }
    }

    /// A REATTACH or HANDOFF refused for its id, uid or token: counted (by
    /// kind and uid too), and after [`MAX_REATTACH_REFUSALS`] of them the
    /// connection closes (a tenant must not guess tokens).
    fn token_refused(
        &mut self,
        request: TokenRequest,
        alloc_id: AllocId,
        status: Status,
        message: String,
    ) -> Outcome {
        let (uid, refused) = (self.peer.uid, self.token_refusals.count(request));
        self.rooms.metrics.token_refusals.add(request, uid, 1);
        let close = refused >= MAX_REATTACH_REFUSALS;
        crate::daemon::peers::refusals::log(self.id, uid, alloc_id, request, (refused, close));
        let mut out = Outcome::error(status, message);
        out.close = close;
        out
    }

    /// [`Session::handle`] for a request that came with fds: UFFD takes its
    /// one fd; any other request's fds are closed (the caller logs them).
    pub async fn handle_with_fds(
        &mut self,
        req: Request,
        fds: Vec<std::os::fd::OwnedFd>,
    ) -> Outcome {
        match req {
            Request::Uffd { alloc_id, ranges } if self.handshaken => {
                self.uffd(alloc_id, &ranges, fds).await
            }
            req if self.handshaken && crate::daemon::requests::park::takes_fds(&req) => {
                self.park(req, fds).await
            }
            other => {
                drop(fds);
                self.handle(other).await
            }
        }
    }

    /// UFFD: start the fault service of a lazy allocation of this session,
    /// under the allocation's change gate (a HANDOFF that won the gate
    /// first leaves this session nothing to serve).
    async fn uffd(
        &mut self,
        alloc_id: AllocId,
        ranges: &[crate::proto::UffdRange],
        fds: Vec<std::os::fd::OwnedFd>,
    ) -> Outcome {
        let gate = match self.rooms.pool.owners().change_gate(alloc_id, self.id) {
            Ok(g) => g,
            Err(e) => return Outcome::error(Status::NotFound, e.to_string()),
        };
        let _held = gate.lock_owned().await;
        if let Err(e) = self.rooms.pool.owners().regions_of(alloc_id, self.id) {
            return Outcome::error(Status::NotFound, e.to_string());
        }
        // Served by the VMM's fallback since a restart: the VMM hands the
        // uffd back. Pages the fallback installed are unknown here, so the
        // service resumes without scrubbers ahead of the guest: it clears
        // a page only when it faults (a MINOR fault proves the guest has no
        // mapping of it), never one the guest may hold.
        let resumed = self.rooms.pool.owners().lazy_fallback(alloc_id);
        let cfg = crate::fault::FaultServiceConfig {
            topology: Some(Arc::clone(&self.rooms.topology)),
            totals: Some(Arc::clone(&self.rooms.fault_totals)),
            scrub_threads_per_node: if resumed {
                0
            } else {
                crate::fault::FaultServiceConfig::default().scrub_threads_per_node
            },
            ..crate::fault::FaultServiceConfig::default()
        };
        match self.lazy.attach(alloc_id, ranges, fds, self.peer.pid, cfg) {
            Ok(()) => {
                if resumed {
                    self.rooms.pool.owners().set_lazy_fallback(alloc_id, false);
                    info!(
                        session = self.id,
                        alloc = alloc_id,
                        "lazy fault service resumed after the VMM's fallback (faulting pages only)"
                    );
                }
                Outcome::reply(Reply::ok(ReplyBody::Empty))
            }
            Err((status, msg)) => {
                if let Some(suppressed) = peer_log::REQUEST_REFUSED.check(self.peer.uid) {
                    info!(session = self.id, uid = self.peer.uid, alloc = alloc_id, ?status, reason = %msg, suppressed, "UFFD refused");
                }
                Outcome::error(status, msg)
            }
        }
    }

    /// Resolves when one of this session's fault services failed (the
    /// connection is then closed, so the VMM's fallback serves its faults).
    pub async fn lazy_failed(&self) {
        self.lazy.failed().await;
    }

    async fn free(&mut self, alloc_id: AllocId) -> Outcome {
        // The fault service stops (threads joined, its uffd closed) before
        // the regions go to quarantine.
        if let Some(service) = self.lazy.take_service(alloc_id) {
            let _ = tokio::task::spawn_blocking(move || service.stop()).await;
        }
        match self.rooms.pool.release(alloc_id, self.id) {
            Ok(released) => {
                Metrics::add(&self.rooms.metrics.frees, 1);
                self.rooms.rebalance.alloc_released(alloc_id);
                self.after_release(vec![released]);
                Outcome::reply(Reply::ok(ReplyBody::Empty))
            }
            Err(e) => {
                debug!(session = self.id, error = %e, "FREE refused");
                crate::daemon::requests::park::free_refused(
                    &self.rooms,
                    alloc_id,
                    self.peer.uid,
                    &e,
                )
            }
        }
    }

    /// Releases an allocation whose reply could not be delivered.
    pub fn release_undelivered(&mut self, alloc_id: AllocId) {
        self.lazy.stop(alloc_id);
        if let Ok(r) = self.rooms.pool.release(alloc_id, self.id) {
            if let Some(suppressed) = peer_log::ALLOC_UNDELIVERED.check(self.peer.uid) {
                warn!(
                    session = self.id,
                    uid = self.peer.uid,
                    alloc = alloc_id,
                    suppressed,
                    "ALLOC reply not delivered; allocation released"
                );
            }
            self.after_release(vec![r]);
        }
    }

    /// LOCK and UNLOCK (`crate::daemon::requests::locking`).
    async fn lock(&mut self, alloc_id: AllocId, chunk: u64, lock: bool) -> Outcome {
        let rooms = &self.rooms;
        let who = (self.id, self.peer.uid);
        crate::daemon::requests::locking::serve(
            &rooms.pool,
            &rooms.topology,
            who,
            alloc_id,
            chunk,
            lock,
        )
        .await
    }

    async fn stats(&self) -> Outcome {
        let mut stats = self.rooms.stats.stats();
        crate::daemon::requests::rebalance::add_placement(&self.rooms.rebalance, &mut stats).await;
        // This connection's lazy allocations and their fault counters.
        stats.lazy = Some(self.lazy.stats());
        // A tenant that is not an operator sees aggregates and its own
        // regions only (`crate::daemon::requests::stats::tenant_view`).
        if !self.rooms.rebalance.operators().contains(&self.peer.uid) && self.peer.uid != 0 {
            let own = self.rooms.pool.owners().region_ids_of(self.id);
            stats = crate::daemon::requests::stats::tenant_view(stats, &own, self.peer.uid);
        }
        crate::daemon::requests::stats::reply(stats)
    }

    /// Unlocks (off the executor), drops regions over the limit, starts the
    /// peer's pidfd watch, and wakes the quarantine.
    fn after_release(&mut self, released: Vec<Released>) {
        if released.is_empty() {
            return;
        }
        settle_released(&self.rooms, released);
        self.watch_peer();
    }

    fn watch_peer(&mut self) {
        if self.watching {
            return;
        }
        let Some(pid) = self.peer.pid else { return };
        if u32::try_from(pid).is_ok_and(|p| p == std::process::id()) {
            return;
        }
        self.watching = true;
        match PidWatch::new(pid) {
            Ok(watch) => {
                let rooms = Arc::clone(&self.rooms);
                self.rooms.lifecycle.tracker().spawn(async move {
                    tokio::select! {
                        r = watch.exited() => {
                            if r.is_ok() {
                                debug!(pid = watch.pid(), "client process exited; re-checking quarantine");
                                rooms.quarantine_kick.notify_one();
                            }
                        }
                        () = rooms.lifecycle.cancel().cancelled() => {}
                    }
                });
            }
            // Gone already (ESRCH): the next scan will see it.
            Err(e) => debug!(pid, error = %e, "cannot watch the client process"),
        }
    }

    /// Ends the session: every allocation it owns is released.
    pub fn close(mut self) {
        // Before the connection's socket closes (the caller drops it after
        // this returns): the VMM's fallback may serve faults once it sees the
        // close. Blocks for at most one page clear per fault-service thread.
        self.lazy.stop_all();
        // A parked VM this connection was saving stays parked, free again.
        self.rooms.saving.release_session(self.id);
        // Its shared clones no longer count against their templates.
        self.rooms.clones.release_session(self.id);
        let released = self.rooms.pool.release_session(self.id);
        if !released.is_empty() {
            if let Some(suppressed) = peer_log::SESSION_RELEASED.check(self.peer.uid) {
                info!(
                    session = self.id,
                    uid = self.peer.uid,
                    allocations = released.len(),
                    suppressed,
                    "session ended with live allocations; released"
                );
            }
        }
        self.after_release(released);
        self.rooms.rebalance.client_ended(self.id);
        self.rooms
            .metrics
            .sessions_active
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        if let Some(suppressed) = peer_log::SESSION_ENDED.check(self.peer.uid) {
            info!(
                session = self.id,
                uid = self.peer.uid,
                suppressed,
                "session ended"
            );
        }
    }
}

/// The answer to a request whose feature the connection did not negotiate
/// at HANDSHAKE: the feature bits are the agreement, so the daemon serves
/// nothing outside it (a client library that negotiated nothing cannot
/// have meant to send it).
fn not_negotiated(request: &str, feature: u64) -> Outcome {
    Outcome::error(
        Status::Invalid,
        format!(
            "{request} was not negotiated on this connection (feature bit {} at HANDSHAKE)",
            feature.trailing_zeros()
        ),
    )
}
