//! Handing the daemon over to a successor without losing the pool, the
//! allocations or the connections (`hugemem serve --takeover`, issue 20).
//!
//! # The running daemon's side
//!
//! A successor connects to the control socket ([`channel`]) as the
//! daemon's own uid. The daemon then **freezes**, in this order:
//!
//! 1. the listener stops accepting (connections wait in the backlog of the
//!    listening socket, which the successor inherits);
//! 2. every connection handler finishes the request it is serving (an
//!    ALLOC waiting for pages on their way back still gets them: the
//!    quarantine and the scrubbers still run) and parks between requests: a frame the peer had begun to send stays
//!    in its reader and travels as bytes; a lazy allocation's fault
//!    service stops, finishing the page it clears, and its userfaultfd
//!    travels (faults wait in the kernel meanwhile: the VMM's own copy of
//!    the uffd keeps them pending);
//! 3. the background loops (quarantine, refill, rebalance policy) finish
//!    their current round and pause ([`Handover::work`]);
//! 4. the scrubbers finish their batch and are joined;
//! 5. the pool's table is snapshot ([`super::pool::Pool::snapshot`]).
//!
//! It sends a versioned state document in a sealed memfd ([`state`]) and
//! the fds it names: the listening socket (and the metrics one), every
//! region, every connection, every frame fd and userfaultfd. If the
//! successor answers `OK` it has taken everything: this daemon drops its
//! copies without releasing anything (no allocation is freed, no socket
//! file removed, no hugetlbfs file unlinked) and exits. If it refuses, or
//! anything fails before its answer, this daemon **thaws**: scrubbers,
//! handlers, fault services and loops go on as before, and no request was
//! lost (requests that arrived meanwhile wait in their sockets).
//!
//! # The successor's side
//!
//! [`receive`] checks the state document (its memfd's owner and seals, its
//! format and version: a newer document is refused whole) and every fd
//! against it. [`super::Daemon::start_inherited`] then adopts each region
//! (`guest_mem::Region::adopt`: size, page size, seals, page states) and
//! verifies the pooled ones as at FREE: population (every page present,
//! or holes still to refault), holders (a `/proc` scan that skips only the
//! predecessor while it runs) and the write lease. A pooled region that
//! fails a check enters quarantine, where the usual proofs decide; one
//! whose fd is not what the document says goes back to the kernel. In-use
//! regions keep their allocation, connection and page states; a lazy
//! allocation's fault service restarts on its userfaultfd and wakes every
//! range, so faults whose events the predecessor read but did not answer
//! fault again.

pub mod channel;
pub mod state;

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{watch, RwLock, RwLockReadGuard};
use tracing::{error, info, warn};

use super::pool::{Life, Snapshot};
use super::Shared;
use crate::proto::{RegionInfo, UffdRange};
pub use state::{State, StateError};

/// Where the daemon is in a handover.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Serving.
    Serving,
    /// Frozen for a handover in progress.
    Frozen,
    /// Handed over: this daemon exits without releasing anything.
    Gone,
}

/// A connection parked for a handover: duplicates of what travels (the
/// handler keeps the originals, to go on if the handover is given up).
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
    pub lazy: Vec<super::lazy_allocs::Suspended>,
}

/// The daemon's handover state (in [`Shared`]).
#[derive(Debug)]
pub struct Handover {
    phase: watch::Sender<Phase>,
    work: RwLock<()>,
    live: AtomicUsize,
    parked: Mutex<Vec<ParkedConnection>>,
    /// Duplicates of the listening sockets: clients' and metrics'.
    listeners: Mutex<(Option<OwnedFd>, Option<OwnedFd>)>,
    /// The socket file is this daemon's to remove (not systemd's).
    socket_owned: std::sync::atomic::AtomicBool,
}

impl Default for Handover {
    fn default() -> Self {
        Self {
            phase: watch::Sender::new(Phase::Serving),
            work: RwLock::new(()),
            live: AtomicUsize::new(0),
            parked: Mutex::new(Vec::new()),
            listeners: Mutex::new((None, None)),
            socket_owned: std::sync::atomic::AtomicBool::new(false),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Handover {
    /// The current phase.
    pub fn phase(&self) -> Phase {
        *self.phase.borrow()
    }

    /// A permit for one round of a background loop: while a handover
    /// freezes the daemon, it waits; `None` once the daemon was handed
    /// over (the loop ends: nothing here may touch a region any more).
    pub async fn work(&self) -> Option<RwLockReadGuard<'_, ()>> {
        let guard = self.work.read().await;
        (self.phase() != Phase::Gone).then_some(guard)
    }

    /// Resolves once a handover freezes the daemon.
    pub async fn frozen(&self) {
        let mut rx = self.phase.subscribe();
        let _ = rx.wait_for(|p| *p != Phase::Serving).await;
    }

    /// Waits until the daemon thaws ([`Phase::Serving`]) or is handed over
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

    /// See [`Handover::handler_started`].
    pub fn handler_ended(&self) {
        self.live.fetch_sub(1, Ordering::SeqCst);
    }

    /// A handler parked (see [`ParkedConnection`]).
    pub fn park(&self, conn: ParkedConnection) {
        lock(&self.parked).push(conn);
    }

    /// A duplicate of the listening socket when the daemon bound it itself.
    pub fn owned_listener(&self) -> Option<OwnedFd> {
        if !self.socket_owned.load(Ordering::SeqCst) {
            return None;
        }
        lock(&self.listeners)
            .0
            .as_ref()
            .and_then(|f| f.try_clone().ok())
    }

    /// Records whether the socket file is this daemon's to remove.
    pub fn set_socket_owned(&self, owned: bool) {
        self.socket_owned.store(owned, Ordering::SeqCst);
    }

    /// Remembers the listening sockets (duplicates) for a handover.
    pub fn set_listeners(&self, socket: Option<OwnedFd>, metrics: Option<OwnedFd>) {
        *lock(&self.listeners) = (socket, metrics);
    }
}

/// Serves the control socket: one takeover at a time, from the daemon's
/// own uid only.
pub async fn control_loop(shared: Arc<Shared>, listener: tokio::net::UnixListener) {
    loop {
        let stream = tokio::select! {
            () = shared.cancel.cancelled() => break,
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    warn!(error = %e, "control socket accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let peer = match super::peer::PeerCred::of(&stream) {
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
        if hand_over(&shared, std_stream, peer.pid).await {
            break;
        }
    }
}

/// One takeover (see the module docs). True when the daemon was handed
/// over and is to exit.
async fn hand_over(
    shared: &Arc<Shared>,
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
    let h = &shared.handover;
    let outcome = freeze_and_send(shared, &stream).await;
    match outcome {
        Ok(()) => {
            h.phase.send_replace(Phase::Gone);
            lock(&h.parked).clear();
            info!(ms = started.elapsed().as_secs_f64() * 1e3, successor = ?pid, "takeover done: the successor serves; exiting");
            shared.cancel.cancel();
            true
        }
        Err(why) => {
            error!(reason = %why, "takeover given up; serving on");
            thaw(shared);
            false
        }
    }
}

/// Freezes the daemon (see the module docs, steps 2-5): every handler
/// parked, the loops paused (the returned guard keeps them so), the
/// scrubbers joined, and the pool's table snapshot. `keep`: mark the
/// regions' files as kept (a successor process takes them over).
///
/// # Errors
///
/// A handler or loop that does not stop within 10 s, a region reserved.
pub(super) async fn freeze(
    shared: &Arc<Shared>,
    keep: bool,
) -> Result<(tokio::sync::RwLockWriteGuard<'_, ()>, Snapshot), String> {
    let h = &shared.handover;
    h.phase.send_replace(Phase::Frozen);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let parked = lock(&h.parked).len();
        let live = h.live.load(Ordering::SeqCst);
        if parked >= live {
            break;
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "{} of {live} connections did not park within 10 s (a request still running)",
                live - parked
            ));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // After the handlers: a request being served may wait for the
    // quarantine or a scrub (an ALLOC waiting for pages on their way).
    let work = tokio::time::timeout(Duration::from_secs(10), h.work.write())
        .await
        .map_err(|_| "the background loops did not pause within 10 s".to_string())?;
    let s = Arc::clone(shared);
    tokio::task::spawn_blocking(move || s.stop_scrubbers())
        .await
        .map_err(|e| e.to_string())?;
    let snapshot = shared.pool.snapshot(keep)?;
    Ok((work, snapshot))
}

/// Ends a freeze that did not lead anywhere: the daemon serves on.
pub(super) fn thaw(shared: &Shared) {
    shared.pool.unkeep();
    if let Err(e) = shared.restart_scrubbers() {
        error!(error = %e, "cannot restart the scrubbers after a freeze");
    }
    lock(&shared.handover.parked).clear();
    shared.handover.phase.send_replace(Phase::Serving);
}

/// Marks the daemon handed over (its loops end at their next round).
pub(super) fn gone(shared: &Shared) {
    shared.handover.phase.send_replace(Phase::Gone);
}

async fn freeze_and_send(
    shared: &Arc<Shared>,
    stream: &std::os::unix::net::UnixStream,
) -> Result<(), String> {
    let (_work, snapshot) = freeze(shared, true).await?;
    let (doc, fds) = build(shared, &snapshot, Target::Successor)?;
    let memfd = doc.to_memfd().map_err(|e| e.to_string())?;
    let s = stream.try_clone().map_err(|e| e.to_string())?;
    let answer = tokio::task::spawn_blocking(move || {
        channel::send_all(&s, &memfd, &fds)?;
        // Adopting and verifying every region takes the successor a while
        // on a big host; the clients wait in their sockets meanwhile.
        channel::read_line(&s, Duration::from_secs(120))
    })
    .await
    .map_err(|e| e.to_string())?
    .map_err(|e| format!("control channel: {e}"))?;
    if answer == "OK" {
        // Still holding the work lock: no loop round starts before it
        // sees the daemon handed over.
        gone(shared);
        Ok(())
    } else {
        Err(format!("the successor answered {answer:?}"))
    }
}

/// Who a state document is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Target {
    /// A successor on the control channel: connections travel.
    Successor,
    /// systemd's fd store (`super::fdstore`): no connection survives, so
    /// every allocation is orphaned until its VMM re-attaches; `last`
    /// when the daemon is frozen and stopping (the document is then exact).
    FdStore {
        /// Written frozen, at a clean stop.
        last: bool,
    },
}

/// The state document and its fds.
/// The fds a state document names, by index: duplicated for a successor,
/// only numbered for systemd's fd store (which keeps each fd by name, so
/// the periodic sync duplicates nothing).
struct FdList {
    fds: Option<Vec<OwnedFd>>,
    next: usize,
}

impl FdList {
    /// Index of `fd` in the document (and its duplicate when collecting).
    fn add(&mut self, fd: std::os::fd::BorrowedFd<'_>) -> Result<usize, String> {
        if let Some(v) = &mut self.fds {
            v.push(fd.try_clone_to_owned().map_err(|e| e.to_string())?);
        }
        self.next += 1;
        Ok(self.next - 1)
    }
}

pub(super) fn build(
    shared: &Shared,
    snap: &Snapshot,
    target: Target,
) -> Result<(State, Vec<OwnedFd>), String> {
    let to_store = matches!(target, Target::FdStore { .. });
    let mut fds = FdList {
        fds: (!to_store).then(Vec::new),
        next: 0,
    };
    // systemd keeps a socket it passed; one the daemon bound itself goes
    // into the store (by `fdstore`, as `hugemem-listener`) so that clients
    // queue in its backlog meanwhile. A new process binds the metrics port
    // again once this one is gone.
    let socket_owned = shared.handover.socket_owned.load(Ordering::SeqCst);
    let (listener, metrics) = {
        let l = lock(&shared.handover.listeners);
        (
            l.0.as_ref()
                .filter(|_| !to_store || socket_owned)
                .map(|f| fds.add(f.as_fd()))
                .transpose()?,
            l.1.as_ref()
                .filter(|_| !to_store)
                .map(|f| fds.add(f.as_fd()))
                .transpose()?,
        )
    };
    let mut regions = Vec::new();
    for r in &snap.regions {
        let fd = fds.add(r.region.fd())?;
        regions.push(state::RegionRecord {
            id: r.id,
            fd,
            name: r.region.name().to_string(),
            len: r.region.len(),
            page_size: r.region.page_size().bytes(),
            node: r.key.node,
            bound: r.region.node().is_some(),
            path: r.region.path().map(|p| p.display().to_string()),
            life: match r.life {
                Life::Clean => "clean",
                Life::Dirty => "dirty",
                Life::Quarantined => "quarantined",
                Life::InUse(_) => "in_use",
            }
            .into(),
            alloc: match r.life {
                Life::InUse(a) => Some(a),
                _ => None,
            },
            tenant: r.tenant,
            split: r.split,
            fill: r.fill,
            pages: state::encode_pages(&r.region.states().snapshot()),
        });
    }
    let mut connections = Vec::new();
    let mut max_session = 0;
    let parked = lock(&shared.handover.parked);
    let travelling = if to_store { &[][..] } else { &parked[..] };
    for c in travelling {
        max_session = max_session.max(c.session);
        let fd = fds.add(c.stream.as_fd())?;
        let mut partial_fds = Vec::new();
        for f in &c.partial_fds {
            partial_fds.push(fds.add(f.as_fd())?);
        }
        let mut lazy = Vec::new();
        for l in &c.lazy {
            let uffd = l.uffd.as_ref().map(|u| fds.add(u.as_fd())).transpose()?;
            lazy.push(state::LazyRecord {
                alloc: l.alloc,
                infos: l
                    .infos
                    .iter()
                    .map(|i| {
                        [
                            i.region_id,
                            i.guest_phys,
                            i.size,
                            i.page_size,
                            u64::from(i.node),
                            u64::from(i.flags),
                        ]
                    })
                    .collect(),
                ranges: l
                    .ranges
                    .iter()
                    .map(|r| [r.region_id, r.offset, r.vmm_addr, r.len])
                    .collect(),
                uffd,
            });
        }
        connections.push(state::ConnectionRecord {
            session: c.session,
            fd,
            handshaken: c.handshaken,
            features: c.features,
            partial: state::hex(&c.partial),
            partial_fds,
            lazy,
        });
    }
    drop(parked);
    let doc = State {
        format: state::FORMAT.into(),
        version: state::VERSION,
        // The fd store's sequence, for a successor to go on from.
        seq: shared.fdstore.seq(),
        last: matches!(target, Target::FdStore { last: true }) || target == Target::Successor,
        daemon_version: env!("CARGO_PKG_VERSION").into(),
        pid: std::process::id(),
        listener,
        metrics,
        socket_owned: shared.handover.socket_owned.load(Ordering::SeqCst),
        next_region: snap.next_region,
        next_alloc: snap.next_alloc,
        next_session: shared.next_session_hint().max(max_session + 1),
        regions,
        allocations: snap
            .allocs
            .iter()
            .map(|a| state::AllocRecord {
                id: a.id,
                // Through the store no connection survives: every
                // allocation waits for its VMM to re-attach, and a lazy
                // one's faults go to its VMM's fallback meanwhile.
                session: a.session.filter(|_| !to_store),
                regions: a.regions.clone(),
                locked: a.locked,
                tenant: a.tenant,
                token: state::hex(&a.token),
                lazy: a.lazy,
                lazy_fallback: a.lazy_fallback || (to_store && a.lazy),
            })
            .collect(),
        connections,
        counters: shared.metrics.to_map(),
    };
    Ok((doc, fds.fds.unwrap_or_default()))
}

/// What a successor received: the checked document and its fds (an
/// `Option` each, taken as they are used).
#[derive(Debug)]
pub struct Inherited {
    /// The document.
    pub state: State,
    /// Its fds, by index.
    pub fds: Vec<Option<OwnedFd>>,
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
        self.fds.get_mut(i).and_then(Option::take)
    }

    /// Tells the predecessor the takeover failed: it thaws and serves on.
    pub fn refuse(&self, why: &str) {
        let Some(ch) = &self.channel else { return };
        let line = format!("REFUSED {}", why.replace('\n', " "));
        if let Err(e) = channel::write_line(ch, &line) {
            warn!(error = %e, "cannot tell the predecessor the takeover failed");
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
        fds: fds.into_iter().map(Some).collect(),
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

/// The successor's import (see the module docs): adopts every region of
/// the document, checks the pooled ones as at FREE, and enters what passed
/// into `pool`.
pub fn adopt_into(topology: &numa::Topology, pool: &super::pool::Pool, inh: &mut Inherited) {
    use super::pool::{Adopted, AllocSnapshot, PoolKey};
    use guest_mem::{AdoptSpec, PageSize, Region};
    let started = Instant::now();
    // (A predecessor in this very process — a test — is never skipped.)
    let own = i32::try_from(std::process::id()).ok();
    inh.predecessor = inh.predecessor.filter(|p| Some(*p) != own);
    super::quarantine::holders::set_predecessor(inh.predecessor);
    let records = std::mem::take(&mut inh.state.regions);
    let mut adopted = Vec::new();
    let mut refused = 0u64;
    for r in records {
        let Some(fd) = inh.take(r.fd) else { continue };
        let page_size = PageSize::from_bytes(r.page_size);
        let pages = state::decode_pages(&r.pages);
        let life = match (r.life.as_str(), r.alloc) {
            ("clean", _) => Some(Life::Clean),
            ("dirty", _) => Some(Life::Dirty),
            ("quarantined", _) => Some(Life::Quarantined),
            ("in_use", Some(a)) => Some(Life::InUse(a)),
            _ => None,
        };
        let (Some(page_size), Ok(states), Some(life)) = (page_size, pages, life) else {
            warn!(
                region = r.id,
                "an inherited region's record is malformed; back to the kernel"
            );
            refused += 1;
            continue;
        };
        if topology.nodes().iter().all(|n| n.id != r.node) {
            warn!(
                region = r.id,
                node = r.node,
                "an inherited region is on a node this host does not have; back to the kernel"
            );
            refused += 1;
            continue;
        }
        let spec = AdoptSpec {
            name: r.name.clone(),
            len: r.len,
            page_size,
            node: r.bound.then_some(r.node),
            path: r.path.as_ref().map(std::path::PathBuf::from),
            states,
        };
        match Region::adopt(fd, spec) {
            Ok(region) => adopted.push(Adopted {
                id: r.id,
                region,
                key: PoolKey {
                    node: r.node,
                    page_size,
                    paths: r.path.is_some(),
                },
                life,
                tenant: r.tenant,
                split: r.split,
                fill: r.fill,
            }),
            Err(e) => {
                warn!(region = r.id, error = %e, "an inherited region failed its checks; back to the kernel");
                refused += 1;
            }
        }
    }
    // A document written while its daemon served may be older than the
    // last hand-out: none of its pooled regions is trusted clean.
    if !inh.state.last {
        for a in &mut adopted {
            if matches!(a.life, Life::Clean | Life::Dirty) {
                a.life = Life::Quarantined;
            }
        }
    }
    // Pooled regions: population, holders, lease, as at FREE.
    let pooled: Vec<usize> = adopted
        .iter()
        .enumerate()
        .filter(|(_, a)| matches!(a.life, Life::Clean | Life::Dirty))
        .map(|(i, _)| i)
        .collect();
    let owned: Vec<Option<super::quarantine::holders::Owned>> = pooled
        .iter()
        .map(|&i| {
            let r = &adopted[i].region;
            super::quarantine::holders::Owned::region(
                r.fd(),
                r.as_ptr() as usize,
                usize::try_from(r.len()).unwrap_or(usize::MAX),
            )
            .ok()
        })
        .collect();
    let targets: Vec<super::quarantine::holders::Owned> = owned.iter().flatten().cloned().collect();
    let scan = super::quarantine::holders::scan(&targets).holders;
    let mut found = scan.into_iter();
    let mut quarantined = 0u64;
    for (k, &i) in pooled.iter().enumerate() {
        let holder = if owned[k].is_some() {
            found.next().flatten()
        } else {
            None
        };
        let a = &mut adopted[i];
        let why = if owned[k].is_none() {
            Some("cannot identify its file".to_string())
        } else if let Some(h) = holder {
            Some(format!("held by pid {}", h.pid))
        } else if let Err(w) = super::quarantine::reuse::prove_unreachable(&a.region) {
            Some(w)
        } else if a.life == Life::Clean && !a.fill {
            match crate::sys::file_allocated_bytes(a.region.fd()) {
                Ok(b) if b >= a.region.len() => None,
                Ok(b) => Some(format!("{b} of {} bytes present", a.region.len())),
                Err(e) => Some(format!("fstat: {e}")),
            }
        } else {
            None
        };
        if let Some(why) = why {
            warn!(region = a.id, reason = %why, "an inherited pooled region goes through quarantine");
            a.life = Life::Quarantined;
            quarantined += 1;
        }
    }
    let allocs = std::mem::take(&mut inh.state.allocations)
        .into_iter()
        .filter_map(|a| {
            let token = state::unhex(&a.token)
                .ok()
                .and_then(|t| <[u8; 16]>::try_from(t).ok());
            let Some(token) = token else {
                warn!(
                    alloc = a.id,
                    "an inherited allocation's token is malformed; not tracked"
                );
                return None;
            };
            Some(AllocSnapshot {
                id: a.id,
                session: a.session,
                regions: a.regions,
                locked: a.locked,
                tenant: a.tenant,
                token,
                lazy: a.lazy,
                lazy_fallback: a.lazy_fallback,
            })
        })
        .collect();
    let regions = adopted.len();
    let kept = pool.import(adopted, allocs, inh.state.next_region, inh.state.next_alloc);
    info!(
        regions,
        refused,
        quarantined,
        allocations = kept,
        ms = started.elapsed().as_secs_f64() * 1e3,
        "takeover: regions adopted and checked"
    );
}

/// Starts a handler for every inherited connection (with its half-read
/// frame and its lazy allocations' fault services), and watches the
/// predecessor's exit.
pub fn resume_connections(
    shared: &Arc<Shared>,
    inh: &mut Inherited,
    conns: Vec<state::ConnectionRecord>,
) {
    for c in conns {
        let Some(fd) = inh.take(c.fd) else { continue };
        let stream = std::os::unix::net::UnixStream::from(fd);
        let partial_fds: Vec<OwnedFd> = c.partial_fds.iter().filter_map(|i| inh.take(*i)).collect();
        let reader = match state::unhex(&c.partial)
            .map_err(|e| e.to_string())
            .and_then(|b| {
                crate::proto::FrameReader::resume(&b, partial_fds).map_err(|e| e.to_string())
            }) {
            Ok(r) => r,
            Err(e) => {
                warn!(session = c.session, error = %e, "an inherited connection's half-read frame is malformed; closing it");
                continue;
            }
        };
        let lazy = c
            .lazy
            .into_iter()
            .map(|l| super::lazy_allocs::Suspended {
                alloc: l.alloc,
                infos: l
                    .infos
                    .iter()
                    .map(|i| RegionInfo {
                        region_id: i[0],
                        guest_phys: i[1],
                        size: i[2],
                        page_size: i[3],
                        node: u32::try_from(i[4]).unwrap_or(u32::MAX),
                        flags: u32::try_from(i[5]).unwrap_or(0),
                    })
                    .collect(),
                ranges: l
                    .ranges
                    .iter()
                    .map(|r| UffdRange {
                        region_id: r[0],
                        offset: r[1],
                        vmm_addr: r[2],
                        len: r[3],
                    })
                    .collect(),
                uffd: l.uffd.and_then(|i| inh.take(i)),
            })
            .collect();
        let conn = super::server::Inherited {
            session: c.session,
            handshaken: c.handshaken,
            features: c.features,
            reader,
            lazy,
        };
        if let Err(e) = super::server::adopt_connection(shared, stream, conn) {
            warn!(session = c.session, error = %e, "cannot take an inherited connection over; its allocations stay until its VMM exits");
        }
    }
    // The predecessor holds every region until it exits; scans skip it
    // until then, and look again at once when it is gone.
    if let Some(pid) = inh.predecessor {
        match super::peer::PidWatch::new(pid) {
            Ok(watch) => {
                let shared = Arc::clone(shared);
                shared.tracker.clone().spawn(async move {
                    let _ = watch.exited().await;
                    super::quarantine::holders::set_predecessor(None);
                    info!(pid, "the predecessor daemon exited");
                    shared.quarantine_kick.notify_one();
                });
            }
            Err(_) => super::quarantine::holders::set_predecessor(None),
        }
    }
}

/// Answers the predecessor: this daemon serves.
pub fn finish_takeover(inh: &Inherited) {
    let Some(ch) = &inh.channel else {
        info!(
            ms = inh.started.elapsed().as_secs_f64() * 1e3,
            "restored from systemd's fd store; serving"
        );
        return;
    };
    // Under systemd (`ExecReload=hugemem serve --takeover --detach`, with
    // `NotifyAccess=all`) this process becomes the unit's main process
    // before the predecessor is told to exit: systemd must not see its main
    // process gone.
    super::systemd::notify_main_pid();
    match channel::write_line(ch, "OK") {
        Ok(()) => info!(
            ms = inh.started.elapsed().as_secs_f64() * 1e3,
            "takeover: serving; the predecessor exits"
        ),
        Err(e) => {
            error!(error = %e, "cannot answer the predecessor; it thaws when it sees the channel close")
        }
    }
}
