//! Starting the daemon: [`Daemon::start`] and its variants build the
//! daemon's parts and run the control plane on threads of its own.
//!
//! [`Daemon::start`]: crate::daemon::Daemon::start

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use numa::Topology;
use tokio::sync::Notify;
use tracing::{info, warn};

use super::config::Config;
use super::context::Shared;
use super::error::{DaemonError, Result};
use super::handle::DaemonHandle;
use super::hugetlbfs::{hugetlbfs_dirs, recover_leftovers};
use super::lifecycle::{Lifecycle, Phase};
use super::metrics::Metrics;
use super::orphans::orphans_loop;
use super::pool::{self, Pool};
use super::scrub::Scrubbers;
use super::socket::{bind_socket, remove_socket};
use super::{exporter, fdstore, handover, quarantine, rebalance, refill, server};

/// The daemon (see the module docs); [`Daemon::start`] is the entry point.
#[derive(Debug)]
pub struct Daemon;

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
    /// see [`crate::daemon::systemd::inherited_listener`]). The daemon then neither creates
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
        let lifecycle = Arc::new(Lifecycle::default());
        let pool = Arc::new(Pool::new(
            config.pool.clone(),
            Arc::clone(&metrics),
            pool::Sources {
                topology: Arc::clone(&topology),
                hugetlbfs: hugetlbfs.clone(),
                quarantine_kick: Arc::clone(&quarantine_kick),
                predecessor: Arc::clone(lifecycle.predecessor()),
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
            handover::adopt_into(&topology, &pool, lifecycle.predecessor(), inh);
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
            lifecycle,
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
            .lifecycle
            .tracker()
            .spawn(handover::control_loop(Arc::clone(&shared), c));
    }
    shared
        .lifecycle
        .tracker()
        .spawn(quarantine::quarantine_loop(Arc::clone(&shared)));
    shared
        .lifecycle
        .tracker()
        .spawn(rebalance::policy_loop(Arc::clone(&shared)));
    shared
        .lifecycle
        .tracker()
        .spawn(fdstore::sync_loop(Arc::clone(&shared)));
    shared
        .lifecycle
        .tracker()
        .spawn(orphans_loop(Arc::clone(&shared)));
    if shared.cfg.pool.refill {
        shared
            .lifecycle
            .tracker()
            .spawn(refill::refill_loop(Arc::clone(&shared)));
    }
    if let Some(l) = metrics_listener {
        let registry = exporter::registry(Arc::clone(&shared));
        shared.lifecycle.tracker().spawn(exporter::serve(
            l,
            registry,
            shared.lifecycle.cancel().clone(),
        ));
    }
    server::Listener::new(listener, Arc::clone(&shared))
        .run()
        .await;
    if shared.lifecycle.phase() == Phase::Gone {
        // The successor serves on the same socket file.
        info!("handed over: leaving the socket to the successor");
    } else {
        remove_socket(&shared.socket, socket_id);
    }
    // The control socket, unless a successor bound its own there.
    if let (Some(p), Some(id)) = (control_path, control_id) {
        remove_socket(&p, Some(id));
    }
    shared.lifecycle.tracker().close();
    if tokio::time::timeout(Duration::from_secs(30), shared.lifecycle.tracker().wait())
        .await
        .is_err()
    {
        warn!("some daemon tasks did not finish within 30 s of shutdown");
    }
}
