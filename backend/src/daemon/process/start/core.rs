//! What both starts share: the host checked and the runtime built first
//! ([`host`]), then, once each builder brought its sockets (and the
//! inherited one its document), the components, their rooms and the
//! daemon's thread ([`core`]).

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use guest_mem::PageSize;
use numa::Topology;
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::Notify;
use tracing::{info, warn};

use super::plane::{self, Loops, Plane};
use crate::daemon::background::quarantine::Recheck;
use crate::daemon::background::refill::Refill;
use crate::daemon::background::scrub::Scrubbers;
use crate::daemon::config::Config;
use crate::daemon::connections::server::{Server, Slots};
use crate::daemon::connections::session::Rooms;
use crate::daemon::counters::metrics::Metrics;
use crate::daemon::lifecycle::Lifecycle;
use crate::daemon::persist::RestoreContext;
use crate::daemon::pool::{Pool, Sources};
use crate::daemon::process::error::{DaemonError, Result};
use crate::daemon::process::handle::DaemonHandle;
use crate::daemon::process::hugetlbfs::{hugetlbfs_dirs, recover_leftovers};
use crate::daemon::requests::alloc::Alloc;
use crate::daemon::requests::parked::loads::PendingLoads;
use crate::daemon::requests::parked::loads_record;
use crate::daemon::requests::parked::note::ParkRecord;
use crate::daemon::requests::rebalance::Rebalancer;
use crate::daemon::requests::rooms::StoreSync;
use crate::daemon::requests::stats::StatsSource;
use crate::daemon::restart::fdstore::{self, FdStore};
use crate::daemon::restart::listeners::Listeners;
use crate::daemon::restart::takeover::{self, Inherited, Parts};

/// The host the daemon runs on, checked, and its runtime.
#[derive(Debug)]
pub(super) struct Host {
    pub config: Config,
    pub topology: Arc<Topology>,
    pub hugetlbfs: Vec<(PageSize, PathBuf)>,
    pub metrics: Arc<Metrics>,
    pub runtime: tokio::runtime::Runtime,
}

/// Validates the configuration, detects the topology and the hugetlbfs
/// mounts, releases region files an earlier instance left there (except
/// `kept`: files a predecessor passes on), and builds the runtime.
///
/// # Errors
///
/// [`DaemonError::Config`], [`DaemonError::Topology`],
/// [`DaemonError::Hugetlbfs`], [`DaemonError::Threads`].
pub(super) fn host(config: Config, kept: &HashSet<PathBuf>) -> Result<Host> {
    config.validate()?;
    let topology = Arc::new(Topology::detect().map_err(DaemonError::Topology)?);
    let hugetlbfs = hugetlbfs_dirs(&config.hugetlbfs)?;
    let metrics = Arc::new(Metrics::default());
    recover_leftovers(&hugetlbfs, &metrics, kept);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.control_threads)
        .thread_name("hm-ctl")
        .enable_all()
        .build()
        .map_err(DaemonError::Threads)?;
    Ok(Host {
        config,
        topology,
        hugetlbfs,
        metrics,
        runtime,
    })
}

/// The listening sockets a builder brings.
#[derive(Debug)]
pub(super) struct Sockets {
    /// The clients'.
    pub listener: UnixListener,
    /// The socket file's (dev, inode) when it is this daemon's to remove.
    pub socket_id: Option<(u64, u64)>,
    /// The metrics endpoint's.
    pub metrics: Option<TcpListener>,
}

/// A listening socket bound by someone else (systemd, a predecessor), on
/// `host`'s runtime.
///
/// # Errors
///
/// [`DaemonError::Bind`].
pub(super) fn listener_from(
    host: &Host,
    listener: std::os::unix::net::UnixListener,
) -> Result<UnixListener> {
    let bind_err = |source| DaemonError::Bind {
        path: host.config.socket.clone(),
        source,
    };
    let _guard = host.runtime.enter();
    listener.set_nonblocking(true).map_err(bind_err)?;
    UnixListener::from_std(listener).map_err(bind_err)
}

/// Binds the metrics endpoint at `addr`.
///
/// # Errors
///
/// [`DaemonError::Metrics`].
pub(super) fn bind_metrics(host: &Host, addr: SocketAddr) -> Result<TcpListener> {
    host.runtime
        .block_on(TcpListener::bind(addr))
        .map_err(|source| DaemonError::Metrics { addr, source })
}

/// The components built from the host, with the rooms that use them.
struct Components {
    pool: Arc<Pool>,
    lifecycle: Arc<Lifecycle>,
    quarantine_kick: Arc<Notify>,
    rooms: Arc<Rooms>,
    parts: Arc<Parts>,
    store: Arc<FdStore>,
    server: Arc<Server>,
    rebalance: Arc<Rebalancer>,
    refill: Arc<Refill>,
    /// The VMs the note of parked VMs listed (for the reconcile).
    park_listed: Vec<(u32, String, u64, u64)>,
}

/// The core of both starts: the pool (with what was inherited adopted
/// and checked before any scrubber runs), the scrubbers, the rooms, the
/// control socket, the inherited connections resumed, and the control
/// plane on a thread of its own.
///
/// # Errors
///
/// [`DaemonError::Threads`]. Nothing keeps running after an error; the
/// caller removes a socket file it bound.
pub(super) fn core(
    host: Host,
    sockets: Sockets,
    mut inherited: Option<&mut Inherited>,
    fd_store: bool,
) -> Result<DaemonHandle> {
    let lifecycle = Arc::new(Lifecycle::default());
    let quarantine_kick = Arc::new(Notify::new());
    let pool = Arc::new(Pool::new(
        host.config.pool.clone(),
        Arc::clone(&host.metrics),
        Sources {
            topology: Arc::clone(&host.topology),
            hugetlbfs: host.hugetlbfs.clone(),
            quarantine_kick: Arc::clone(&quarantine_kick),
            predecessor: Arc::clone(lifecycle.predecessor()),
        },
    ));
    // Regions first (before any scrubber runs): adopted and checked.
    let mut connections = Vec::new();
    let mut fills = Vec::new();
    if let Some(inh) = inherited.as_deref_mut() {
        host.metrics.restore_map(&inh.state.counters);
        // A predecessor that answers on the control channel: a takeover;
        // none: what systemd's fd store kept (a restart or a crash).
        let start = if inh.channel.is_some() {
            &host.metrics.takeovers
        } else {
            &host.metrics.fd_store_restores
        };
        Metrics::add(start, 1);
        takeover::adopt_into(&host.topology, &pool, lifecycle.predecessor(), inh);
        connections = std::mem::take(&mut inh.state.connections);
        fills = std::mem::take(&mut inh.state.fills);
    }
    let scrubbers = Scrubbers::start(&host.topology, &pool, &host.config.scrub)
        .map_err(DaemonError::Threads)?;
    let next_session = inherited
        .as_ref()
        .map_or(1, |i| i.state.next_session.max(1));
    let store = FdStore::new(fd_store);
    store.continue_from(inherited.as_ref().map_or(0, |i| i.state.seq));
    let mut c = Components::build(
        &host,
        pool,
        lifecycle,
        quarantine_kick,
        scrubbers,
        next_session,
        store,
    );
    if c.store.enabled() {
        let (store, parts) = (Arc::clone(&c.store), Arc::clone(&c.parts));
        let sync = StoreSync(Arc::new(move || {
            fdstore::sync_now(&store, &parts).map_err(Into::into)
        }));
        let _ = c.rooms.store_sync.set(sync);
    }
    if let Some(inh) = inherited.as_deref_mut() {
        // The files of VMs parked on demand, for the allocations kept.
        let mut ctx = RestoreContext {
            fds: &mut inh.fds,
            topology: &host.topology,
        };
        loads_record::restore_into(fills, &mut ctx, &c.pool, &c.rooms.fills);
    }
    let reason = match inherited.as_deref() {
        None => "the daemon started afresh (no systemd fd store, no takeover): the memory of the VMs parked before went back to the kernel",
        Some(i) if i.channel.is_some() => "the predecessor's state did not have it",
        Some(_) => "the state systemd's fd store kept did not have it (the store was dropped, or the daemon crashed before it stored the VM)",
    };
    let listed = std::mem::take(&mut c.park_listed);
    let parked = c.pool.parking().parked_list();
    c.rooms.park_record.reconcile(listed, &parked, reason);
    if let Some(inh) = inherited.as_deref() {
        // Templates shared clones may still map, uncounted: the
        // predecessor's marks; every parked VM when its document was
        // written while it served (it may be older than its last CLONE).
        let marked = &inh.state.clone_templates;
        let all = !inh.state.last;
        c.rooms.clones.mark(
            parked
                .iter()
                .map(|p| p.alloc)
                .filter(|a| all || marked.contains(a)),
        );
    }
    {
        use std::os::fd::AsFd;
        let dup = |fd: std::os::fd::BorrowedFd<'_>| fd.try_clone_to_owned().ok();
        c.parts.listeners.set(
            dup(sockets.listener.as_fd()),
            sockets.metrics.as_ref().and_then(|l| dup(l.as_fd())),
        );
    }
    let control = {
        let _guard = host.runtime.enter();
        takeover::bind_control(&host.config.socket, inherited.is_some())
    };
    if let Some(inh) = inherited.as_deref_mut() {
        let _guard = host.runtime.enter();
        takeover::resume_connections(&c.server, inh, connections);
    }
    spawn(host, sockets, control, c, inherited.is_some())
}

impl Components {
    /// Every component and room.
    fn build(
        host: &Host,
        pool: Arc<Pool>,
        lifecycle: Arc<Lifecycle>,
        quarantine_kick: Arc<Notify>,
        scrubbers: Scrubbers,
        next_session: u64,
        store: FdStore,
    ) -> Self {
        let fills: Arc<PendingLoads> = Arc::default();
        let (park_record, park_listed) = ParkRecord::open(host.config.park_record_path());
        let park_record = Arc::new(park_record);
        let cfg = &host.config;
        let (topology, metrics) = (&host.topology, &host.metrics);
        let fault_totals = Arc::default();
        let rebalance = Arc::new(Rebalancer::new(
            &cfg.rebalance,
            Arc::clone(&pool),
            Arc::clone(topology),
            Arc::clone(&lifecycle),
        ));
        let refill = Arc::new(Refill::new(
            Arc::clone(&pool),
            Arc::clone(topology),
            Arc::clone(&lifecycle),
        ));
        let max_alloc = if cfg.limits.max_alloc.0 == 0 {
            topology.nodes().iter().map(|n| n.mem_total).sum()
        } else {
            cfg.limits.max_alloc.0
        };
        let alloc = Arc::new(Alloc {
            pool: Arc::clone(&pool),
            topology: Arc::clone(topology),
            metrics: Arc::clone(metrics),
            refill: Arc::clone(&refill),
            lifecycle: Arc::clone(&lifecycle),
            hugetlbfs: host.hugetlbfs.clone(),
            max_alloc,
            cfg: cfg.pool.clone(),
        });
        let clones = Arc::new(crate::daemon::requests::parked::clones::Clones::new(
            cfg.clones.headroom.0,
        ));
        let copy_fills =
            Arc::new(crate::daemon::requests::parked::copy_fills::CopyFills::default());
        let stats = Arc::new(StatsSource {
            pool: Arc::clone(&pool),
            metrics: Arc::clone(metrics),
            fault_totals: Arc::clone(&fault_totals),
            scrub: scrubbers.counters().to_vec(),
            started: Instant::now(),
            socket: cfg.socket.clone(),
            hugetlbfs: host.hugetlbfs.clone(),
            refill: Arc::clone(&refill),
            refill_enabled: cfg.pool.refill,
            rebalance: Arc::clone(&rebalance),
            park_record: Arc::clone(&park_record),
            clones: Arc::clone(&clones),
            copy_fills: Arc::clone(&copy_fills),
        });
        let rooms = Arc::new(Rooms {
            pool: Arc::clone(&pool),
            metrics: Arc::clone(metrics),
            topology: Arc::clone(topology),
            fault_totals,
            lifecycle: Arc::clone(&lifecycle),
            quarantine_kick: Arc::clone(&quarantine_kick),
            rebalance: Arc::clone(&rebalance),
            alloc,
            stats,
            fills: Arc::clone(&fills),
            saving: Arc::default(),
            clones: Arc::clone(&clones),
            copy_fills,
            store_sync: std::sync::OnceLock::new(),
            park_record,
        });
        let next_session = Arc::new(AtomicU64::new(next_session));
        let parts = Arc::new(Parts {
            pool: Arc::clone(&pool),
            lifecycle: Arc::clone(&lifecycle),
            listeners: Arc::new(Listeners::default()),
            metrics: Arc::clone(metrics),
            next_session: Arc::clone(&next_session),
            scrubbers: Mutex::new(scrubbers),
            topology: Arc::clone(topology),
            fills,
            clones,
        });
        let server = Arc::new(Server {
            lifecycle: Arc::clone(&lifecycle),
            slots: Slots::new(&cfg.limits, rebalance.operators().to_vec()),
            allowed_uids: cfg.effective_uids(),
            limits: cfg.limits.clone(),
            metrics: Arc::clone(metrics),
            next_session,
            rooms: Arc::clone(&rooms),
        });
        Self {
            pool,
            lifecycle,
            quarantine_kick,
            rooms,
            parts,
            store: Arc::new(store),
            server,
            rebalance,
            refill,
            park_listed,
        }
    }
}

/// Runs the control plane on the daemon's thread and returns its handle.
fn spawn(
    host: Host,
    sockets: Sockets,
    control: Option<UnixListener>,
    c: Components,
    inherited: bool,
) -> Result<DaemonHandle> {
    let Host {
        config,
        hugetlbfs,
        runtime,
        ..
    } = host;
    let metrics_addr = sockets.metrics.as_ref().and_then(|l| l.local_addr().ok());
    let loops = Loops {
        parts: Arc::clone(&c.parts),
        store: Arc::clone(&c.store),
        recheck: Arc::new(Recheck {
            pool: Arc::clone(&c.pool),
            lifecycle: Arc::clone(&c.lifecycle),
            quarantine_kick: Arc::clone(&c.quarantine_kick),
            period: config.recheck_period(),
        }),
        rebalance: Arc::clone(&c.rebalance),
        refill: config
            .pool
            .refill
            .then(|| (Arc::clone(&c.refill), config.recheck_period())),
        rooms: Arc::clone(&c.rooms),
        reattach_wait: Duration::from_secs(config.limits.reattach_timeout_secs),
    };
    let control = {
        let _guard = runtime.enter();
        plane::spawn_loops(
            loops,
            &config.socket,
            sockets.socket_id.is_some(),
            control,
            sockets.metrics,
        )
    };
    let plane = Plane {
        lifecycle: Arc::clone(&c.lifecycle),
        socket: config.socket.clone(),
        socket_id: sockets.socket_id,
        listener: sockets.listener,
        control,
        server: Arc::clone(&c.server),
    };
    let (thread_parts, thread_pool) = (Arc::clone(&c.parts), Arc::clone(&c.pool));
    let rt = runtime.handle().clone();
    let thread = std::thread::Builder::new()
        .name("hm-daemon".into())
        .spawn(move || {
            runtime.block_on(plane::run(plane));
            runtime.shutdown_timeout(Duration::from_secs(5));
            thread_parts.stop_scrubbers();
            drop(thread_pool);
            info!("daemon stopped");
        })
        .map_err(|e| {
            c.pool.stop();
            DaemonError::Threads(e)
        })?;
    info!(
        socket = %config.socket.display(),
        uids = ?config.effective_uids(),
        hugetlbfs = ?hugetlbfs,
        inherited,
        "hugemem daemon listening"
    );
    Ok(DaemonHandle {
        rooms: c.rooms,
        parts: c.parts,
        store: c.store,
        metrics_addr,
        thread: Some(thread),
        rt,
    })
}

/// The socket file's identity, for a socket a predecessor created (the
/// successor removes it when it stops).
pub(super) fn socket_identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// Logs a metrics socket passed on that cannot be used.
pub(super) fn unusable_metrics(e: &std::io::Error) {
    warn!(error = %e, "cannot use the metrics socket the predecessor passed on");
}

/// Binds the socket file itself (see [`crate::daemon::process::socket`]), on
/// `host`'s runtime.
///
/// # Errors
///
/// As `bind_socket`.
pub(super) fn bind_own(host: &Host) -> Result<(UnixListener, (u64, u64))> {
    let _guard = host.runtime.enter();
    crate::daemon::process::socket::bind_socket(&host.config.socket, host.config.socket_group)
}
