//! `hugemem serve`: the daemon that owns guest RAM and hands it to VMMs.
//!
//! # Shape
//!
//! ```text
//!            UNIX socket (0600, SO_PEERCRED uid check)
//!                 │
//!   tokio control plane ── Listener ─► Handler/Session per connection ──┐
//!     (hm-ctl threads)     quarantine loop (/proc scans, trims)        │ spawn_blocking
//!                          metrics endpoint (loopback, optional)        ▼
//!                                                              alloc path: pool / fresh
//!                                                              (clearing::run_jobs: pinned workers)
//!   hm-scrub-nN-i threads (pinned per node) ◄── Pool (Mutex + Condvar) ──┘
//! ```
//!
//! * [`config`]: TOML configuration with small-machine defaults.
//! * [`server`]: accept loop, per-connection handlers, connection cap.
//! * [`session`]: what each request means for one client.
//! * [`alloc`]: the ALLOC path: validating a request, locking, handing files to the client.
//! * [`pool`]: the one owner of region state, with a small API: take regions
//!   for a request (the one rule for which region serves it), commit, release,
//!   the scrubbers' and the quarantine's verbs, trim; the clean-before-map check.
//! * [`scrub`]: pinned scrubber threads.
//! * [`holders`]: `/proc` scan for other processes holding a region.
//! * [`reuse`]: the proofs a released region passes before it is reused.
//! * [`peer`]: peer credentials and pidfds.
//! * [`metrics`]: counters and `hugemem status`'s report.
//! * [`exporter`]: the Prometheus endpoint (`prometheus-client` + `hyper`).
//! * [`systemd`]: readiness notification and socket activation.
//! * [`refill`]: refilling the pool to its targets while idle (`pool.refill`).
//! * [`rebalance`]: REBALANCE, per-region placement, the vCPU-affinity policy loop.
//!
//! # Threads
//!
//! [`Daemon::start`] builds a multi-thread tokio runtime (`control_threads`
//! workers, default 2) and runs it on a thread of its own, so the caller —
//! `hugemem serve`, a test, an embedding program — keeps its thread. The
//! runtime only moves messages and bookkeeping; clearing runs on the pinned
//! scrubbers, populating and ALLOC-path clearing on the job runner's pinned
//! workers, `/proc` scans and `munmap`s on blocking threads.
//!
//! # Shutdown
//!
//! [`DaemonHandle::shutdown`] cancels one `CancellationToken`: the listener
//! stops accepting and removes the socket, each handler stops reading and
//! releases its session's allocations into quarantine (an ALLOC in progress
//! is cancelled between chunks), the tracker is drained, scrubbers finish
//! their current batch and are joined, and the pool drops every region it
//! owns (unmapped and closed: regions still mapped by running VMMs stay
//! theirs; the kernel frees them when they exit). A daemon that is killed
//! instead leaves a stale socket file, which the next start detects (nothing
//! answers on it) and replaces. A socket passed by systemd (`hugemem.socket`)
//! is neither created nor removed by the daemon: it stays with systemd, and
//! connections made while the daemon (re)starts wait in its backlog.
//!
//! # Restart and upgrade
//!
//! With [`handover`], a successor (`hugemem serve --takeover`) takes the
//! listening socket, the pool, the allocations, the connections and the
//! lazy fault services over a control socket; this daemon freezes, sends a
//! versioned state document and the fds, and exits releasing nothing. With
//! [`fdstore`], under systemd (`--fd-store`), the same state and the region
//! fds live in the service manager's fd store, so a restart or a crash keeps
//! them; allocations come back orphaned until their VMM re-attaches.
//!
//! [`config`]: crate::daemon::config
//! [`server`]: crate::daemon::server
//! [`session`]: crate::daemon::session
//! [`alloc`]: crate::daemon::alloc
//! [`pool`]: crate::daemon::pool
//! [`scrub`]: crate::daemon::scrub
//! [`holders`]: crate::daemon::quarantine::holders
//! [`reuse`]: crate::daemon::quarantine::reuse
//! [`peer`]: crate::daemon::peer
//! [`metrics`]: crate::daemon::metrics
//! [`exporter`]: crate::daemon::exporter
//! [`systemd`]: crate::daemon::systemd
//! [`refill`]: crate::daemon::refill
//! [`rebalance`]: crate::daemon::rebalance
//! [`handover`]: crate::daemon::handover
//! [`fdstore`]: crate::daemon::fdstore
//! [`Daemon::start`]: crate::daemon::Daemon::start
//! [`DaemonHandle::shutdown`]: crate::daemon::DaemonHandle::shutdown

pub mod alloc;
pub mod config;
pub mod exporter;
pub mod fdstore;
pub mod handover;
pub mod lazy_allocs;
pub mod metrics;
pub mod peer;
pub mod pool;
pub mod quarantine;
pub mod rebalance;
pub mod refill;
pub mod scrub;
pub mod server;
pub mod session;
pub mod systemd;

use std::io;
use std::net::SocketAddr;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hugemem_client::stats::{Counters, ScrubNode, ScrubStats, Sessions, Stats, Totals};
use numa::Topology;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{error, info, warn};

pub use config::{ByteSize, Config, ConfigError, Overrides, ValidationError};

use metrics::{Metrics, ScrubCounters};
use pool::Pool;
use scrub::Scrubbers;

/// Errors starting or stopping the daemon.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// The configuration does not validate.
    #[error("invalid configuration")]
    Config(#[from] ValidationError),
    /// NUMA topology detection failed.
    #[error("cannot detect the NUMA topology")]
    Topology(#[source] numa::TopologyError),
    /// Another daemon answers on the socket.
    #[error("another hugemem daemon is already serving {0}")]
    AlreadyRunning(PathBuf),
    /// Something that is not a socket is in the way.
    #[error("{0} exists and is not a socket; refusing to replace it")]
    NotASocket(PathBuf),
    /// Creating, binding or securing the socket failed.
    #[error("cannot listen on {path}")]
    Bind {
        /// Socket path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Binding the metrics endpoint failed.
    #[error("cannot listen for metrics on {addr}")]
    Metrics {
        /// Address.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The runtime or a daemon thread could not be created.
    #[error("cannot start the daemon's threads")]
    Threads(#[source] io::Error),
    /// A configured hugetlbfs directory is not on a hugetlbfs mount of its size.
    #[error("hugetlbfs.{key} = {path} is not on a hugetlbfs mount of {key_size} pages")]
    Hugetlbfs {
        /// The configuration key.
        key: &'static str,
        /// Its page size.
        key_size: &'static str,
        /// The directory.
        path: PathBuf,
    },
    /// A takeover could not start (nothing was taken; the running daemon
    /// serves on).
    #[error("takeover")]
    Takeover(#[from] handover::TakeoverError),
    /// The socket systemd passed (socket activation) cannot be used.
    #[error("socket activation: {0}")]
    Activation(String),
    /// The daemon thread panicked.
    #[error("the daemon thread panicked")]
    Panicked,
}

/// Page size of the hugetlbfs mount holding `dir`, if it is one.
fn hugetlbfs_page_size(dir: &Path) -> Option<guest_mem::PageSize> {
    let st = nix::sys::statfs::statfs(dir).ok()?;
    if st.filesystem_type() != nix::sys::statfs::HUGETLBFS_MAGIC {
        return None;
    }
    #[allow(clippy::useless_conversion)] // the field type differs between libcs
    let bytes = u64::try_from(i128::from(st.block_size())).ok()?;
    guest_mem::PageSize::from_bytes(bytes).filter(|p| p.is_huge())
}

/// Releases hugetlbfs files an earlier daemon instance left behind (it was
/// killed, or died: a tenant could crash it before issue 11's fixes). Region
/// files are named `hugemem-r<ID>.<PID>.<N>` (see `guest_mem`'s
/// `create_hugetlbfs_file`); a file whose `<PID>` is not a live process is
/// unlinked, never reused: its pages may hold a tenant's data and go back to
/// the kernel (which zeroes them) once no process still has the file open or
/// mapped. Files of a live pid (another daemon sharing the mount) are left
/// alone. Counted in STATS (`leftover_files_released`, `leftover_bytes_released`).
fn recover_leftovers(
    dirs: &[(guest_mem::PageSize, PathBuf)],
    metrics: &Metrics,
    inherited: &std::collections::HashSet<PathBuf>,
) {
    for (_, dir) in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(pid) = leftover_pid(&name.to_string_lossy()) else {
                continue;
            };
            // A region handed over (a takeover, systemd's fd store) keeps
            // its file, whoever created it.
            if inherited.contains(&entry.path()) {
                continue;
            }
            if pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists() {
                continue;
            }
            let path = entry.path();
            let bytes = std::fs::symlink_metadata(&path).map_or(0, |m| m.blocks() * 512);
            match std::fs::remove_file(&path) {
                Ok(()) => {
                    Metrics::add(&metrics.leftover_files_released, 1);
                    Metrics::add(&metrics.leftover_bytes_released, bytes);
                    warn!(path = %path.display(), pid, bytes, "released a region file left by an earlier daemon instance");
                }
                Err(e) => {
                    warn!(path = %path.display(), error = %e, "cannot release a region file left by an earlier daemon instance");
                }
            }
        }
    }
}

/// The pid in a region file name `hugemem-r<ID>.<PID>.<N>`, or `None`.
fn leftover_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("hugemem-r")?;
    let mut parts = rest.split('.');
    let (id, pid, n) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some()
        || id.is_empty()
        || n.is_empty()
        || !id.bytes().all(|b| b.is_ascii_digit())
        || !n.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    pid.parse().ok()
}

/// The hugetlbfs directory per page size: configured (checked) or the first
/// mount of that size in `/proc/mounts`.
fn hugetlbfs_dirs(cfg: &config::HugetlbfsConfig) -> Result<Vec<(guest_mem::PageSize, PathBuf)>> {
    use guest_mem::PageSize;
    let mounts: Vec<PathBuf> = std::fs::read_to_string("/proc/mounts")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, dir, kind) = (f.next()?, f.next()?, f.next()?);
            (kind == "hugetlbfs").then(|| PathBuf::from(dir.replace("\\040", " ")))
        })
        .collect();
    let mut out = Vec::new();
    for (size, key, key_size, configured) in [
        (PageSize::Huge2M, "dir_2m", "2M", &cfg.dir_2m),
        (PageSize::Huge1G, "dir_1g", "1G", &cfg.dir_1g),
    ] {
        match configured {
            Some(dir) if hugetlbfs_page_size(dir) == Some(size) => out.push((size, dir.clone())),
            Some(dir) => {
                return Err(DaemonError::Hugetlbfs {
                    key,
                    key_size,
                    path: dir.clone(),
                })
            }
            None => {
                if let Some(dir) = mounts.iter().find(|m| hugetlbfs_page_size(m) == Some(size)) {
                    out.push((size, dir.clone()));
                }
            }
        }
    }
    Ok(out)
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, DaemonError>;

/// State shared by the control plane, the blocking jobs and the handle.
#[derive(Debug)]
pub struct Shared {
    cfg: Config,
    topology: Arc<Topology>,
    pool: Arc<Pool>,
    metrics: Arc<Metrics>,
    fault_totals: Arc<crate::fault::FaultTotals>,
    scrub: Vec<Arc<ScrubCounters>>,
    allowed_uids: Vec<u32>,
    hugetlbfs: Vec<(guest_mem::PageSize, PathBuf)>,
    max_alloc: u64,
    started: Instant,
    socket: PathBuf,
    cancel: CancellationToken,
    tracker: TaskTracker,
    quarantine_kick: Arc<Notify>,
    rebalance: rebalance::Rebalancer,
    refill: refill::Refill,
    handover: handover::Handover,
    fdstore: fdstore::FdStore,
    slots: Arc<server::Slots>,
    scrubbers: std::sync::Mutex<Scrubbers>,
    next_session: std::sync::atomic::AtomicU64,
}

impl Shared {
    /// Stops the scrubbers and joins them (a handover freezing the daemon).
    fn stop_scrubbers(&self) {
        self.scrubbers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .stop_and_join(&self.pool);
    }

    /// Starts them again (a handover given up).
    fn restart_scrubbers(&self) -> io::Result<()> {
        self.scrubbers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .restart(&self.topology, &self.pool, self.cfg.scrub.batch.0)
    }

    /// The next session id.
    fn next_session_hint(&self) -> u64 {
        self.next_session.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The hugetlbfs directory for path-backed regions of `page_size`.
    pub fn hugetlbfs_dir(&self, page_size: guest_mem::PageSize) -> Option<&Path> {
        self.hugetlbfs
            .iter()
            .find(|(p, _)| *p == page_size)
            .map(|(_, d)| d.as_path())
    }

    /// The STATS document (see `docs/protocol.md` and `hugemem status`),
    /// without the per-connection parts (`lazy`, placement), which the
    /// session adds.
    pub fn stats(&self) -> Stats {
        let (pool, pending) = self.pool.stats();
        let m = &self.metrics;
        let g = Metrics::get;
        let mut total_bytes = 0;
        let mut total_nanos = 0;
        let nodes: Vec<ScrubNode> = self
            .scrub
            .iter()
            .map(|c| {
                let (b, n) = (g(&c.bytes), g(&c.nanos));
                total_bytes += b;
                total_nanos += n;
                ScrubNode {
                    node: c.node,
                    threads: c.threads as u64,
                    bytes: b,
                    // Nanoseconds to seconds: precision is irrelevant here.
                    seconds: Duration::from_nanos(n).as_secs_f64(),
                    gb_per_s: c.gb_per_s(),
                    batches: g(&c.batches),
                    refault_bytes: g(&c.refault_bytes),
                    refault_seconds: Duration::from_nanos(g(&c.refault_nanos)).as_secs_f64(),
                    refault_gb_per_s: metrics::gb_per_s(g(&c.refault_bytes), g(&c.refault_nanos)),
                    pending_bytes: pending.get(&c.node).copied().unwrap_or(0),
                }
            })
            .collect();
        let held: u64 = pool
            .pools
            .iter()
            .map(|p| p.clean_bytes + p.dirty_bytes + p.quarantined_bytes + p.in_use_bytes)
            .sum();
        Stats {
            version: env!("CARGO_PKG_VERSION").into(),
            pid: std::process::id(),
            uptime_s: self.started.elapsed().as_secs_f64(),
            socket: Some(self.socket.display().to_string()),
            hugetlbfs: Some(
                self.hugetlbfs
                    .iter()
                    .map(|(p, d)| (p.to_string(), d.display().to_string()))
                    .collect(),
            ),
            sessions: Sessions {
                active: g(&m.sessions_active),
                total: g(&m.sessions_total),
                refused: g(&m.peers_refused),
            },
            lazy: None,
            allocations: pool.allocations,
            pools: pool.pools,
            quarantine: Some(pool.quarantine),
            regions: Some(pool.regions),
            regions_omitted: false,
            given_back: Some(pool.given_back),
            refill: Some(self.refill.stats(self.cfg.pool.refill)),
            rebalance: Some(self.rebalance.stats()),
            scrub: ScrubStats {
                kernel: clearing::ClearKernel::default_kernel().name().into(),
                bytes: total_bytes,
                seconds: Duration::from_nanos(total_nanos).as_secs_f64(),
                gb_per_s: metrics::gb_per_s(total_bytes, total_nanos),
                pending_bytes: pending.values().sum::<u64>(),
                nodes,
            },
            totals: Totals {
                created_bytes: g(&m.bytes_created),
                released_bytes: g(&m.bytes_released),
                held_bytes: held,
            },
            counters: Counters {
                sessions_total: g(&m.sessions_total),
                sessions_active: g(&m.sessions_active),
                peers_refused: g(&m.peers_refused),
                connection_errors: g(&m.connection_errors),
                allocs_ok: g(&m.allocs_ok),
                allocs_failed: g(&m.allocs_failed),
                regions_pooled: g(&m.regions_pooled),
                regions_recleared: g(&m.regions_recleared),
                regions_grown: g(&m.regions_grown),
                downgrades: g(&m.downgrades),
                regions_discarded: g(&m.regions_discarded),
                hole_bytes_handed_out: g(&m.hole_bytes_handed_out),
                regions_pinned: g(&m.regions_pinned),
                regions_short: g(&m.regions_short),
                pages_detached: g(&m.pages_detached),
                regions_withheld: g(&m.regions_withheld),
                leftover_files_released: g(&m.leftover_files_released),
                leftover_bytes_released: g(&m.leftover_bytes_released),
                regions_fresh: g(&m.regions_fresh),
                frees: g(&m.frees),
                bytes_created: g(&m.bytes_created),
                bytes_released: g(&m.bytes_released),
                quarantine_scans: g(&m.quarantine_scans),
                reattach_ok: g(&m.reattach_ok),
                reattach_refused: g(&m.reattach_refused),
            },
        }
    }
}

/// The daemon (see the module docs); [`Daemon::start`] is the entry point.
#[derive(Debug)]
pub struct Daemon;

/// A running daemon. Dropping it shuts the daemon down too (errors logged).
#[derive(Debug)]
pub struct DaemonHandle {
    shared: Arc<Shared>,
    metrics_addr: Option<SocketAddr>,
    thread: Option<JoinHandle<()>>,
    rt: tokio::runtime::Handle,
}

impl Daemon {
    /// Validates `config`, detects the topology, starts the scrubbers, binds
    /// the socket (and the metrics endpoint), and runs the control plane on
    /// its own threads. Returns once the socket is listening.
    ///
    /// # Errors
    ///
    /// [`DaemonError::Config`], [`DaemonError::Topology`],
    /// [`DaemonError::AlreadyRunning`], [`DaemonError::NotASocket`],
    /// [`DaemonError::Bind`], [`DaemonError::Metrics`], [`DaemonError::Threads`].
    /// Nothing keeps running after an error.
    pub fn start(config: Config) -> Result<DaemonHandle> {
        Self::start_on(config, None)
    }

    /// As [`Daemon::start`], on `listener` when given: a listening socket
    /// bound to `config.socket` by someone else (systemd's `hugemem.socket`,
    /// see [`systemd::inherited_listener`]). The daemon then neither creates
    /// nor removes the socket file; peer checks apply unchanged.
    ///
    /// # Errors
    ///
    /// As [`Daemon::start`].
    pub fn start_on(
        config: Config,
        listener: Option<std::os::unix::net::UnixListener>,
    ) -> Result<DaemonHandle> {
        Self::start_with(config, listener, None, false)
    }

    /// As [`Daemon::start`], on what a predecessor handed over
    /// ([`handover::receive`]): its listening sockets, regions,
    /// allocations and connections, each checked (see [`handover`]). The
    /// predecessor is answered `OK` once this daemon serves, or told why
    /// not (it then serves on).
    ///
    /// # Errors
    ///
    /// As [`Daemon::start`]; a region that fails its checks is no error
    /// (it is quarantined or given back, and logged).
    pub fn start_inherited(config: Config, inherited: handover::Inherited) -> Result<DaemonHandle> {
        Self::start_with(config, None, Some(inherited), false)
    }

    /// The general start: on a passed listener (systemd's socket), on what
    /// a predecessor or systemd's fd store handed over, and keeping state
    /// in systemd's fd store (`fd_store`, see [`fdstore`]).
    ///
    /// # Errors
    ///
    /// As [`Daemon::start`].
    pub fn start_with(
        config: Config,
        listener: Option<std::os::unix::net::UnixListener>,
        mut inherited: Option<handover::Inherited>,
        fd_store: bool,
    ) -> Result<DaemonHandle> {
        let refuse = |inh: &Option<handover::Inherited>, why: &str| {
            if let Some(i) = inh {
                i.refuse(why);
            }
        };
        if let Err(e) = config.validate() {
            refuse(&inherited, &e.to_string());
            return Err(e.into());
        }
        let topology = match Topology::detect() {
            Ok(t) => Arc::new(t),
            Err(e) => {
                refuse(&inherited, &e.to_string());
                return Err(DaemonError::Topology(e));
            }
        };
        let hugetlbfs = match hugetlbfs_dirs(&config.hugetlbfs) {
            Ok(h) => h,
            Err(e) => {
                refuse(&inherited, &e.to_string());
                return Err(e);
            }
        };
        let metrics = Arc::new(Metrics::default());
        let inherited_paths: std::collections::HashSet<PathBuf> = inherited
            .iter()
            .flat_map(|i| i.state.regions.iter())
            .filter_map(|r| r.path.as_ref().map(PathBuf::from))
            .collect();
        recover_leftovers(&hugetlbfs, &metrics, &inherited_paths);
        let quarantine_kick = Arc::new(Notify::new());
        let pool = Arc::new(Pool::new(
            config.pool.clone(),
            Arc::clone(&metrics),
            pool::Sources {
                topology: Arc::clone(&topology),
                hugetlbfs: hugetlbfs.clone(),
                quarantine_kick: Arc::clone(&quarantine_kick),
            },
        ));
        let max_alloc = if config.limits.max_alloc.0 == 0 {
            topology.nodes().iter().map(|n| n.mem_total).sum()
        } else {
            config.limits.max_alloc.0
        };
        let runtime = match tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.control_threads)
            .thread_name("hm-ctl")
            .enable_all()
            .build()
        {
            Ok(r) => r,
            Err(e) => {
                refuse(&inherited, &e.to_string());
                return Err(DaemonError::Threads(e));
            }
        };
        // The listening sockets: the predecessor's, systemd's, or our own.
        let (inherited_listener, inherited_metrics) = match inherited.as_mut() {
            Some(inh) => {
                let l = inh.state.listener.and_then(|i| inh.take(i));
                let m = inh.state.metrics.and_then(|i| inh.take(i));
                (
                    l.map(std::os::unix::net::UnixListener::from),
                    m.map(std::net::TcpListener::from),
                )
            }
            None => (None, None),
        };
        let bound = {
            let _guard = runtime.enter();
            match inherited_listener.or(listener) {
                Some(l) => {
                    let bind_err = |source| DaemonError::Bind {
                        path: config.socket.clone(),
                        source,
                    };
                    l.set_nonblocking(true)
                        .map_err(bind_err)
                        .and_then(|()| tokio::net::UnixListener::from_std(l).map_err(bind_err))
                        .map(|l| (l, None))
                }
                None => {
                    bind_socket(&config.socket, config.socket_group).map(|(l, id)| (l, Some(id)))
                }
            }
        };
        let (listener, socket_id) = match bound {
            Ok(b) => b,
            Err(e) => {
                refuse(&inherited, &e.to_string());
                return Err(e);
            }
        };
        // A socket the predecessor created stays the successor's to remove:
        // the same file, so its identity is taken now.
        let socket_id = socket_id.or_else(|| {
            inherited.as_ref().filter(|i| i.state.socket_owned)?;
            std::fs::metadata(&config.socket)
                .ok()
                .map(|m| (m.dev(), m.ino()))
        });
        let metrics_listener = match (inherited_metrics, config.metrics.listen) {
            (Some(l), _) => {
                let _guard = runtime.enter();
                match l
                    .set_nonblocking(true)
                    .and_then(|()| tokio::net::TcpListener::from_std(l))
                {
                    Ok(l) => Some(l),
                    Err(e) => {
                        warn!(error = %e, "cannot use the metrics socket the predecessor handed over");
                        None
                    }
                }
            }
            (None, Some(addr)) => match runtime.block_on(tokio::net::TcpListener::bind(addr)) {
                Ok(l) => Some(l),
                Err(source) => {
                    refuse(&inherited, &source.to_string());
                    remove_socket(&config.socket, socket_id.filter(|_| inherited.is_none()));
                    return Err(DaemonError::Metrics { addr, source });
                }
            },
            (None, None) => None,
        };
        let metrics_addr = metrics_listener.as_ref().and_then(|l| l.local_addr().ok());
        // Regions first (before any scrubber runs): adopted and checked.
        let mut adopted_connections = Vec::new();
        if let Some(inh) = inherited.as_mut() {
            metrics.restore_map(&inh.state.counters);
            handover::adopt_into(&topology, &pool, inh);
            adopted_connections = std::mem::take(&mut inh.state.connections);
        }
        let scrubbers = match Scrubbers::start(
            &topology,
            &pool,
            config.scrub.threads_per_node,
            config.scrub.batch.0,
        ) {
            Ok(s) => s,
            Err(e) => {
                refuse(&inherited, &e.to_string());
                remove_socket(&config.socket, socket_id.filter(|_| inherited.is_none()));
                return Err(DaemonError::Threads(e));
            }
        };
        let next_session = inherited
            .as_ref()
            .map_or(1, |i| i.state.next_session.max(1));
        let store_seq = inherited.as_ref().map_or(0, |i| i.state.seq);
        let config_limits = config.limits.clone();
        let rebalance = rebalance::Rebalancer::new(&config.rebalance);
        let rebalance_operators = rebalance.operators().to_vec();
        let shared = Arc::new(Shared {
            allowed_uids: config.effective_uids(),
            hugetlbfs,
            socket: config.socket.clone(),
            rebalance,
            refill: refill::Refill::default(),
            cfg: config,
            topology,
            pool: Arc::clone(&pool),
            metrics,
            fault_totals: Arc::default(),
            scrub: scrubbers.counters().to_vec(),
            max_alloc,
            started: Instant::now(),
            cancel: CancellationToken::new(),
            tracker: TaskTracker::new(),
            quarantine_kick,
            handover: handover::Handover::default(),
            fdstore: {
                let store = fdstore::FdStore::new(fd_store);
                store.continue_from(store_seq);
                store
            },
            slots: server::Slots::new(&config_limits, rebalance_operators),
            scrubbers: std::sync::Mutex::new(scrubbers),
            next_session: std::sync::atomic::AtomicU64::new(next_session),
        });
        {
            use std::os::fd::AsFd;
            let dup = |fd: std::os::fd::BorrowedFd<'_>| fd.try_clone_to_owned().ok();
            shared.handover.set_listeners(
                dup(listener.as_fd()),
                metrics_listener.as_ref().and_then(|l| dup(l.as_fd())),
            );
        }
        let control = {
            let _guard = runtime.enter();
            handover::bind_control(&shared.socket, inherited.is_some())
        };
        let thread_shared = Arc::clone(&shared);
        let thread_pool = Arc::clone(&pool);
        let rt = runtime.handle().clone();
        if let Some(inh) = inherited.as_mut() {
            let _guard = runtime.enter();
            handover::resume_connections(&shared, inh, adopted_connections);
        }
        let thread = std::thread::Builder::new()
            .name("hm-daemon".into())
            .spawn(move || {
                let shared = thread_shared;
                runtime.block_on(run(
                    Arc::clone(&shared),
                    listener,
                    metrics_listener,
                    socket_id,
                    control,
                ));
                runtime.shutdown_timeout(Duration::from_secs(5));
                shared.stop_scrubbers();
                drop(thread_pool);
                info!("daemon stopped");
            });
        let thread = match thread {
            Ok(t) => t,
            Err(e) => {
                refuse(&inherited, &e.to_string());
                pool.stop();
                remove_socket(&shared.socket, socket_id.filter(|_| inherited.is_none()));
                return Err(DaemonError::Threads(e));
            }
        };
        if let Some(inh) = &inherited {
            handover::finish_takeover(inh);
        }
        info!(
            socket = %shared.socket.display(),
            uids = ?shared.allowed_uids,
            hugetlbfs = ?shared.hugetlbfs,
            inherited = inherited.is_some(),
            "hugemem daemon listening"
        );
        Ok(DaemonHandle {
            shared,
            metrics_addr,
            thread: Some(thread),
            rt,
        })
    }
}

/// How [`serve`] starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// A daemon of its own (or on systemd's socket).
    Fresh,
    /// Taking over from the daemon running on the same socket
    /// ([`handover`]).
    Takeover,
}

/// `hugemem serve`: starts the daemon and runs it until SIGTERM or SIGINT,
/// then shuts it down cleanly (socket removed, scrubbers joined). Under
/// systemd it takes a socket-activated listener when one was passed, and
/// sends `READY=1` once serving and `STOPPING=1` on the signal ([`systemd`]).
///
/// # Errors
///
/// As [`Daemon::start`] and [`DaemonHandle::shutdown`];
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
            let inherited = handover::receive(&config.socket)?;
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
    let handed_over = handle.shared.cancel.clone();
    let which = rt.block_on(async {
        tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
            () = handed_over.cancelled() => "handover",
        }
    });
    if which == "handover" {
        info!("handed over to a successor; exiting");
        return handle.shutdown();
    }
    info!(signal = which, "shutting down");
    systemd::notify_stopping(which);
    handle.shutdown_into_store()
}

impl DaemonHandle {
    /// The socket clients connect to.
    pub fn socket_path(&self) -> &Path {
        &self.shared.socket
    }

    /// The STATS document, as a client would get it (without the
    /// per-connection `lazy` list and placement).
    pub fn stats(&self) -> Stats {
        self.shared.stats()
    }

    /// [`DaemonHandle::stats`] as a JSON value, for readers that look up
    /// keys by name.
    pub fn stats_json(&self) -> serde_json::Value {
        serde_json::to_value(self.shared.stats()).unwrap_or(serde_json::Value::Null)
    }

    /// Test hook standing for a daemon restart: orphans allocation `alloc`
    /// (as the restore code does, [`pool::Pool::orphan`]) and, with
    /// `tenant`, makes it that uid's. Its old connection no longer owns it;
    /// a REATTACH with its token can take it back. False for an unknown id.
    #[doc(hidden)]
    pub fn orphan_for_tests(&self, alloc: u64, tenant: Option<u32>) -> bool {
        self.shared.pool.orphan(alloc, tenant)
    }

    /// Everything this daemon's lazy fault services counted so far (faults
    /// read and served, pages cleared and continued ahead of the guest):
    /// for tests that check which daemon served a lazy guest.
    #[doc(hidden)]
    pub fn lazy_work(&self) -> u64 {
        self.shared.fault_totals.read().counters.iter().sum()
    }

    /// Where the metrics endpoint listens, when it is on.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// A clean stop that keeps the pool, the allocations and the socket in
    /// systemd's fd store for the next start ([`fdstore`]); when the store
    /// is off or keeping fails, the usual [`DaemonHandle::shutdown`].
    ///
    /// # Errors
    ///
    /// As [`DaemonHandle::shutdown`].
    pub fn shutdown_into_store(self) -> Result<()> {
        if self.shared.fdstore.enabled() {
            let shared = Arc::clone(&self.shared);
            if let Err(e) = self.rt.block_on(fdstore::stop_into_store(&shared)) {
                warn!(reason = %e, "cannot keep the daemon's state in systemd's fd store; stopping the usual way");
            }
        }
        self.shutdown()
    }

    /// Clean shutdown (see the module docs); returns when every daemon thread
    /// has stopped and the socket is gone.
    ///
    /// # Errors
    ///
    /// [`DaemonError::Panicked`] when the daemon thread panicked.
    pub fn shutdown(mut self) -> Result<()> {
        self.stop()
    }

    fn stop(&mut self) -> Result<()> {
        self.shared.cancel.cancel();
        match self.thread.take() {
            Some(t) => t.join().map_err(|_| DaemonError::Panicked),
            None => Ok(()),
        }
    }
}

impl Drop for DaemonHandle {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            error!(error = %e, "daemon shutdown failed");
        }
    }
}

/// The control plane: quarantine loop, metrics, accept loop; then drain.
async fn run(
    shared: Arc<Shared>,
    listener: tokio::net::UnixListener,
    metrics_listener: Option<tokio::net::TcpListener>,
    socket_id: Option<(u64, u64)>,
    control: Option<tokio::net::UnixListener>,
) {
    shared.handover.set_socket_owned(socket_id.is_some());
    let control_path = control
        .as_ref()
        .map(|_| handover::channel::control_path(&shared.socket));
    let control_id = control_path
        .as_ref()
        .and_then(|p| std::fs::metadata(p).ok())
        .map(|m| (m.dev(), m.ino()));
    if let Some(c) = control {
        shared
            .tracker
            .spawn(handover::control_loop(Arc::clone(&shared), c));
    }
    shared
        .tracker
        .spawn(quarantine::quarantine_loop(Arc::clone(&shared)));
    shared
        .tracker
        .spawn(rebalance::policy_loop(Arc::clone(&shared)));
    shared
        .tracker
        .spawn(fdstore::sync_loop(Arc::clone(&shared)));
    shared.tracker.spawn(orphans_loop(Arc::clone(&shared)));
    if shared.cfg.pool.refill {
        shared
            .tracker
            .spawn(refill::refill_loop(Arc::clone(&shared)));
    }
    if let Some(l) = metrics_listener {
        let registry = exporter::registry(Arc::clone(&shared));
        shared
            .tracker
            .spawn(exporter::serve(l, registry, shared.cancel.clone()));
    }
    server::Listener::new(listener, Arc::clone(&shared))
        .run()
        .await;
    if shared.handover.phase() == handover::Phase::Gone {
        // The successor serves on the same socket file.
        info!("handed over: leaving the socket to the successor");
    } else {
        remove_socket(&shared.socket, socket_id);
    }
    // The control socket, unless a successor bound its own there.
    if let (Some(p), Some(id)) = (control_path, control_id) {
        remove_socket(&p, Some(id));
    }
    shared.tracker.close();
    if tokio::time::timeout(Duration::from_secs(30), shared.tracker.wait())
        .await
        .is_err()
    {
        warn!("some daemon tasks did not finish within 30 s of shutdown");
    }
}

/// Releases allocations restored orphaned (from systemd's fd store) that no
/// VMM re-attached within `limits.reattach_timeout_secs`: into quarantine,
/// where they stay until their VMM lets go.
async fn orphans_loop(shared: Arc<Shared>) {
    if shared.pool.orphans() == 0 {
        return;
    }
    let wait = Duration::from_secs(shared.cfg.limits.reattach_timeout_secs);
    tokio::select! {
        () = shared.cancel.cancelled() => return,
        () = tokio::time::sleep(wait) => {}
    }
    let Some(_work) = shared.handover.work().await else {
        return;
    };
    let released = shared.pool.release_orphans();
    if !released.is_empty() {
        warn!(
            allocations = released.len(),
            secs = wait.as_secs(),
            "restored allocations nobody re-attached; released into quarantine"
        );
        session::settle_released(&shared, released);
    }
}

/// Binds the socket: creates the parent directory (0700) when missing,
/// replaces a stale socket nobody answers on, refuses to replace a live one
/// or a non-socket, and sets mode 0600 before anyone is told it exists.
/// Returns the listener and the socket file's (dev, inode), so shutdown
/// removes only its own file.
fn bind_socket(path: &Path, group: Option<u32>) -> Result<(tokio::net::UnixListener, (u64, u64))> {
    let bind_err = |source: io::Error| DaemonError::Bind {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent() {
        if !dir.as_os_str().is_empty() && !dir.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(bind_err)?;
            if let Some(gid) = group {
                // Members of the socket group may traverse it, not list it.
                std::os::unix::fs::chown(dir, None, Some(gid))
                    .and_then(|()| {
                        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o710))
                    })
                    .map_err(bind_err)?;
            }
        }
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            match std::os::unix::net::UnixStream::connect(path) {
                Ok(_) => return Err(DaemonError::AlreadyRunning(path.to_path_buf())),
                Err(e) => {
                    warn!(socket = %path.display(), error = %e, "removing a stale socket (a daemon that did not shut down cleanly?)");
                    std::fs::remove_file(path).map_err(bind_err)?;
                }
            }
        }
        Ok(_) => return Err(DaemonError::NotASocket(path.to_path_buf())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(bind_err(e)),
    }
    let std_listener = std::os::unix::net::UnixListener::bind(path).map_err(bind_err)?;
    // The parent directory is 0700 (systemd RuntimeDirectoryMode, or created
    // above), so the moment between bind and chmod exposes nothing.
    let mode = if group.is_some() { 0o660 } else { 0o600 };
    let secured = group
        .map_or(Ok(()), |gid| {
            std::os::unix::fs::chown(path, None, Some(gid))
        })
        .and_then(|()| std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)))
        .and_then(|()| std_listener.set_nonblocking(true))
        .and_then(|()| std::fs::metadata(path));
    let meta = match secured {
        Ok(m) => m,
        Err(e) => {
            let _ = std::fs::remove_file(path);
            return Err(bind_err(e));
        }
    };
    let listener = tokio::net::UnixListener::from_std(std_listener).map_err(bind_err)?;
    Ok((listener, (meta.dev(), meta.ino())))
}

/// Removes the socket file if it is still the one this daemon created;
/// `None` (a socket systemd passed) is never removed.
fn remove_socket(path: &Path, id: Option<(u64, u64)>) {
    let Some(id) = id else {
        return;
    };
    match std::fs::symlink_metadata(path) {
        Ok(m) if (m.dev(), m.ino()) == id => {
            if let Err(e) = std::fs::remove_file(path) {
                warn!(socket = %path.display(), error = %e, "cannot remove the socket");
            }
        }
        Ok(_) => {
            warn!(socket = %path.display(), "socket file was replaced by someone else; leaving it")
        }
        Err(_) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leftover_names_carry_the_pid() {
        assert_eq!(leftover_pid("hugemem-r12.4242.0"), Some(4242));
        assert_eq!(leftover_pid("hugemem-r12.4242"), None);
        assert_eq!(leftover_pid("hugemem-r12.4242.0.1"), None);
        assert_eq!(leftover_pid("other-r12.4242.0"), None);
        assert_eq!(leftover_pid("hugemem-rx.4242.0"), None);
    }

    #[test]
    fn stale_socket_is_replaced_and_a_file_is_not() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("s.sock");
        drop(std::os::unix::net::UnixListener::bind(&path).expect("bind"));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("rt");
        let _g = rt.enter();
        let (l, id) = bind_socket(&path, None).expect("stale socket replaced");
        let mode = std::fs::metadata(&path).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(matches!(
            bind_socket(&path, None),
            Err(DaemonError::AlreadyRunning(_))
        ));
        drop(l);
        remove_socket(&path, Some(id));
        assert!(!path.exists());
        std::fs::write(&path, b"x").expect("file");
        assert!(matches!(
            bind_socket(&path, None),
            Err(DaemonError::NotASocket(_))
        ));
    }
}
