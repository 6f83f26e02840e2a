//! systemd's file-descriptor store: the pool, the allocations and
//! the listening socket survive `systemctl restart hugemem` and a crash.
//!
//! With `hugemem serve --fd-store` (the unit sets it, with
//! `FileDescriptorStoreMax=`), the daemon keeps in the service manager,
//! through `sd_notify` `FDSTORE=1` with `FDNAME=` (systemd keeps a
//! duplicate of each fd and passes them back on the next start, as
//! `LISTEN_FDS` / `LISTEN_FDNAMES`, beside a `hugemem.socket` socket):
//!
//! * every region's fd, as `hugemem-r<ID>` (removed with `FDSTOREREMOVE=1`
//!   once the region goes back to the kernel);
//! * the files of every VM parked on demand (`hugemem park --from-dir
//!   --on-demand`), as `hugemem-f<ALLOC>-<N>`, until its memory is read
//!   (removed then, or when it is unparked);
//! * the listening socket, as `hugemem-listener`, when the daemon bound it
//!   itself (systemd keeps a `hugemem.socket` one anyway): clients that
//!   connect meanwhile wait in its backlog;
//! * a state document (`crate::daemon::restart::takeover::state`, in a sealed memfd) as
//!   `hugemem-state-0` / `hugemem-state-1`, alternately: the new one is
//!   stored before the old is removed, so a crash between the two leaves
//!   one whole document; the higher `seq` is the newer.
//!
//! **While serving** the store is brought up to date every
//! [`SYNC_PERIOD`]; such a document may be older than the last hand-out, so
//! after a crash every pooled region of it goes through quarantine before
//! reuse (holders, lease, detach: see `crate::daemon::reuse`). **At a clean stop**
//! (SIGTERM) the daemon freezes as for a takeover (handlers parked, loops
//! paused, scrubbers joined) and stores a last, exact document: the clean
//! pool is then served warm by the next start. Connections never survive
//! a process: every allocation is restored orphaned, and its VMM re-attaches
//! it with the token of its ALLOC reply (`hugemem-client`'s `reconnect`,
//! `hugemem launch`); a lazy one is served by its VMM's fallback from the
//! moment the connection closed. One nobody re-attaches within
//! `limits.reattach_timeout_secs` is released into quarantine.

use std::collections::{BTreeSet, HashMap};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sd_notify::NotifyState;
use tracing::{debug, info, warn};

use crate::daemon::persist::fds::Fds;
use crate::daemon::persist::SaveError;
use crate::daemon::requests::parked::loads_record::LoadSnapshot;
use crate::daemon::restart::takeover::{self, state::State, Parts, Target};

/// How often a serving daemon brings the store up to date.
pub const SYNC_PERIOD: Duration = Duration::from_millis(250);
/// `FDNAME` of the listening socket.
pub const LISTENER: &str = "hugemem-listener";
const STATE_PREFIX: &str = "hugemem-state-";
const REGION_PREFIX: &str = "hugemem-r";
const FILL_PREFIX: &str = "hugemem-f";

/// `FDNAME` of file `n` of allocation `alloc`'s pending fill.
fn fill_name(alloc: u64, n: usize) -> String {
    format!("{FILL_PREFIX}{alloc}-{n}")
}

/// What this daemon has in the store.
#[derive(Debug, Default)]
struct Stored {
    regions: BTreeSet<u64>,
    fills: BTreeSet<String>,
    listener: bool,
    seq: u64,
    last_doc: Vec<u8>,
}

/// Why the store could not be brought up to date.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The daemon could not be frozen for the last document.
    #[error(transparent)]
    Freeze(#[from] takeover::FreezeError),
    /// A component's part could not be saved.
    #[error(transparent)]
    Save(#[from] SaveError),
    /// The document could not be encoded.
    #[error("the state document: {0}")]
    Encode(#[from] serde_json::Error),
    /// The document could not be written into its memfd.
    #[error("the state document: {0}")]
    Document(#[from] takeover::StateError),
    /// systemd did not take an fd (`FDSTORE=1`, `FDNAME=` the name).
    #[error("FDSTORE {0}: {1}")]
    Send(String, #[source] std::io::Error),
    /// The storing thread panicked.
    #[error("the storing thread: {0}")]
    Thread(#[source] tokio::task::JoinError),
}

/// The daemon's side of the store.
#[derive(Debug, Default)]
pub struct FdStore {
    enabled: bool,
    stored: Mutex<Stored>,
}

fn send(states: &[NotifyState<'_>], fds: &[BorrowedFd<'_>]) -> std::io::Result<()> {
    sd_notify::notify_with_fds(states, fds)
}

impl FdStore {
    /// A store that is used only when `enabled` and a service manager
    /// listens (`NOTIFY_SOCKET`).
    pub fn new(enabled: bool) -> Self {
        let on = enabled && std::env::var_os("NOTIFY_SOCKET").is_some();
        if enabled && !on {
            warn!("--fd-store without NOTIFY_SOCKET (not started by systemd): nothing is kept across restarts");
        }
        Self {
            enabled: on,
            stored: Mutex::new(Stored::default()),
        }
    }

    /// True when the store is used.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// The sequence number of the last document stored.
    pub fn seq(&self) -> u64 {
        self.stored
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .seq
    }

    /// Goes on from a predecessor's sequence number (a takeover, or a
    /// restart from the store), so that the next document replaces the
    /// other of the two names and the newest is always the highest.
    pub fn continue_from(&self, seq: u64) {
        let mut st = self
            .stored
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        st.seq = st.seq.max(seq);
    }

    /// Brings the store up to date with a snapshot of the daemon: new
    /// regions stored, gone ones removed, the listener once, and the state
    /// document when it changed. Blocking (small `sendmsg`s).
    fn sync(&self, parts: &Parts, last: bool) -> Result<(), StoreError> {
        // Held from the snapshot on: two syncs (the loop's, a park's) store
        // their documents in the order they took them.
        let mut st = self
            .stored
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let snapshot = parts.pool.records().snapshot_partial();
        let (mut doc, _) = takeover::build(parts, &snapshot, Target::FdStore { last }, st.seq)?;
        if !st.listener {
            if let Some(fd) = parts.listeners.owned_listener() {
                send(
                    &[NotifyState::FdStore, NotifyState::FdName(LISTENER)],
                    &[fd.as_fd()],
                )
                .map_err(|e| StoreError::Send(LISTENER.to_string(), e))?;
            }
            st.listener = true;
        }
        let now: BTreeSet<u64> = snapshot.regions.iter().map(|r| r.id).collect();
        for r in &snapshot.regions {
            if st.regions.contains(&r.id) {
                continue;
            }
            let name = format!("{REGION_PREFIX}{}", r.id);
            send(
                &[NotifyState::FdStore, NotifyState::FdName(&name)],
                &[r.region.fd()],
            )
            .map_err(|e| StoreError::Send(name.clone(), e))?;
            st.regions.insert(r.id);
        }
        store_fills(&mut st, parts)?;
        let gone: Vec<u64> = st.regions.difference(&now).copied().collect();
        for id in gone {
            let name = format!("{REGION_PREFIX}{id}");
            if let Err(e) = send(
                &[NotifyState::FdStoreRemove, NotifyState::FdName(&name)],
                &[],
            ) {
                warn!(error = %e, name, "FDSTOREREMOVE failed");
            }
            st.regions.remove(&id);
        }
        // The document, when it says something new (`seq` and `pid` aside).
        doc.seq = 0;
        let bytes = serde_json::to_vec(&doc)?;
        if bytes == st.last_doc && !last {
            return Ok(());
        }
        st.seq += 1;
        doc.seq = st.seq;
        let memfd = doc.to_memfd()?;
        let name = format!("{STATE_PREFIX}{}", st.seq % 2);
        let old = format!("{STATE_PREFIX}{}", (st.seq + 1) % 2);
        send(
            &[NotifyState::FdStore, NotifyState::FdName(&name)],
            &[memfd.as_fd()],
        )
        .map_err(|e| StoreError::Send(name, e))?;
        if st.seq > 1 {
            if let Err(e) = send(
                &[NotifyState::FdStoreRemove, NotifyState::FdName(&old)],
                &[],
            ) {
                warn!(error = %e, name = old, "FDSTOREREMOVE failed");
            }
        }
        st.last_doc = bytes;
        debug!(
            seq = st.seq,
            last,
            regions = snapshot.regions.len(),
            "state stored"
        );
        Ok(())
    }
}

/// Stores the files of every pending fill not stored yet, and removes
/// those of fills gone (read, or unparked).
fn store_fills(st: &mut Stored, parts: &Parts) -> Result<(), StoreError> {
    let mut now = BTreeSet::new();
    for f in LoadSnapshot::all(&parts.fills) {
        for (n, file) in f.fill.files.iter().enumerate() {
            let name = fill_name(f.alloc, n);
            if !st.fills.contains(&name) {
                send(
                    &[NotifyState::FdStore, NotifyState::FdName(&name)],
                    &[file.as_fd()],
                )
                .map_err(|e| StoreError::Send(name.clone(), e))?;
                st.fills.insert(name.clone());
            }
            now.insert(name);
        }
    }
    let gone: Vec<String> = st.fills.difference(&now).cloned().collect();
    for name in gone {
        if let Err(e) = send(
            &[NotifyState::FdStoreRemove, NotifyState::FdName(&name)],
            &[],
        ) {
            warn!(error = %e, name, "FDSTOREREMOVE failed");
        }
        st.fills.remove(&name);
    }
    Ok(())
}

/// Brings the store up to date now, when it is used (a PARK before it
/// answers its sender, an UNPARK before the memory leaves, a RESTORE
/// before it answers: `Rooms::sync_now`). Blocking.
///
/// # Errors
///
/// As the periodic sync.
pub fn sync_now(store: &FdStore, parts: &Parts) -> Result<(), StoreError> {
    if store.enabled() {
        store.sync(parts, false)
    } else {
        Ok(())
    }
}

/// Keeps the store up to date while the daemon serves.
pub async fn sync_loop(store: Arc<FdStore>, parts: Arc<Parts>) {
    if !store.enabled() {
        return;
    }
    let round = || {
        let (store, parts) = (Arc::clone(&store), Arc::clone(&parts));
        async move {
            match tokio::task::spawn_blocking(move || store.sync(&parts, false)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => warn!(error = %e, "cannot bring systemd's fd store up to date"),
                Err(e) => warn!(error = %e, "fd store sync panicked"),
            }
            true
        }
    };
    parts.lifecycle.periodic(SYNC_PERIOD, None, round).await;
}

/// A clean stop that keeps everything in the store: freezes, stores the
/// last document, and leaves the daemon taken over (it then exits without
/// releasing anything). `Err` (nothing kept beyond the last sync): the
/// caller stops the usual way.
///
/// # Errors
///
/// A freeze that does not complete, a store that fails.
pub async fn stop_into_store(store: &Arc<FdStore>, parts: &Arc<Parts>) -> Result<(), StoreError> {
    let (_work, _) = parts.freeze(true).await?;
    let (s, p) = (Arc::clone(store), Arc::clone(parts));
    let stored = tokio::task::spawn_blocking(move || s.sync(&p, true))
        .await
        .map_err(StoreError::Thread)?;
    match stored {
        Ok(()) => {
            parts.lifecycle.gone();
            info!("pool, allocations and socket kept in systemd's fd store for the next start");
            Ok(())
        }
        Err(e) => {
            parts.thaw();
            Err(e)
        }
    }
}

/// What systemd passed back: the newest trusted state document and the
/// fds it names, as a [`takeover::Inherited`]; `None` without a document.
/// Stored fds no document names (a region created after the last sync
/// before a crash) are closed: their pages go back to the kernel once
/// their VMM lets go.
pub fn restore(mut named: HashMap<String, OwnedFd>) -> Option<takeover::Inherited> {
    let mut docs: Vec<State> = Vec::new();
    for k in [0, 1] {
        if let Some(fd) = named.remove(&format!("{STATE_PREFIX}{k}")) {
            match State::from_memfd(fd) {
                Ok(d) => docs.push(d),
                Err(e) => warn!(error = %e, "a state document in systemd's fd store is refused"),
            }
        }
    }
    let mut state = docs.into_iter().max_by_key(|d| d.seq)?;
    let mut fds: Vec<Option<OwnedFd>> = Vec::new();
    state.listener = named.remove(LISTENER).map(|fd| {
        fds.push(Some(fd));
        fds.len() - 1
    });
    state.metrics = None;
    let mut missing = Vec::new();
    state.regions.retain_mut(
        |r| match named.remove(&format!("{REGION_PREFIX}{}", r.id)) {
            Some(fd) => {
                fds.push(Some(fd));
                r.fd = fds.len() - 1;
                true
            }
            None => {
                missing.push(r.id);
                false
            }
        },
    );
    for f in &mut state.fills {
        let alloc = f.alloc;
        for (n, i) in f.files.iter_mut().enumerate() {
            match named.remove(&fill_name(alloc, n)) {
                Some(fd) => {
                    fds.push(Some(fd));
                    *i = fds.len() - 1;
                }
                // Not among the fds: the fill's restore says so.
                None => *i = usize::MAX,
            }
        }
    }
    let untracked: Vec<String> = named.keys().cloned().collect();
    if !missing.is_empty() || !untracked.is_empty() {
        warn!(?missing, ?untracked, "the fd store and its state document differ; regions the document names without an fd are gone, fds it does not name are let go");
    }
    state.connections.clear();
    info!(
        seq = state.seq,
        exact = state.last,
        regions = state.regions.len(),
        allocations = state.allocations.len(),
        "restoring from systemd's fd store"
    );
    Some(takeover::Inherited {
        predecessor: None,
        state,
        fds: Fds(fds),
        channel: None,
        started: std::time::Instant::now(),
    })
}
