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
//! The rooms, each receiving what it uses (no shared bag):
//!
//! * [`start`]: two builders over one core: a fresh start and an
//!   inherited one (a takeover, or systemd's fd store), then the
//!   components, their rooms and the control plane.
//! * [`lifecycle`]: shutdown, the takeover's phase (freeze, park, thaw),
//!   and the helper every background loop runs under.
//! * [`config`]: TOML configuration with small-machine defaults.
//! * [`server`]: accept loop, per-connection handlers, connection cap.
//! * [`session`]: one client's connection state; dispatches each request
//!   to its room.
//! * [`alloc`]: ALLOC served whole: plan, obtain, hand out.
//! * [`pool`]: the one owner of region state, with a small API: take regions
//!   for a request (the one rule for which region serves it), commit, release,
//!   the scrubbers' and the quarantine's verbs, trim; the clean-before-map check.
//! * [`scrub`]: pinned scrubber threads.
//! * [`quarantine`]: the holder scans ([`holders`]), the proofs before reuse
//!   ([`reuse`]) and the loop that re-checks released regions.
//! * [`peer`]: peer credentials and pidfds.
//! * [`metrics`]: counters; [`stats`]: the STATS document.
//! * [`exporter`]: the Prometheus endpoint (`prometheus-client` + `hyper`).
//! * [`systemd`]: readiness notification and socket activation.
//! * [`refill`]: refilling the pool to its targets while idle (`pool.refill`).
//! * [`rebalance`]: REBALANCE, per-region placement, the vCPU-affinity policy loop.
//! * [`takeover`], [`fdstore`]: restart and upgrade (below); each component
//!   saves and restores its own state ([`listeners`], [`lazy_allocs`], the
//!   pool's `persist`).
//! * `error`, `socket`, `hugetlbfs`, `orphans`, `handle`, `serve`: the
//!   daemon's errors, its socket file, the hugetlbfs mounts and leftover
//!   files, the orphan loop, [`DaemonHandle`] and [`serve`].
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
//! With [`takeover`], a successor (`hugemem serve --takeover`) takes the
//! listening socket, the pool, the allocations, the connections and the
//! lazy fault services over a control socket; this daemon freezes, sends a
//! versioned state document and the fds, and exits releasing nothing. With
//! [`fdstore`], under systemd (`--fd-store`), the same state and the region
//! fds live in the service manager's fd store, so a restart or a crash keeps
//! them; allocations come back orphaned until their VMM re-attaches.
//!
//! [`config`]: crate::daemon::config
//! [`server`]: crate::daemon::connections::server
//! [`session`]: crate::daemon::connections::session
//! [`alloc`]: crate::daemon::requests::alloc
//! [`pool`]: crate::daemon::pool
//! [`scrub`]: crate::daemon::background::scrub
//! [`holders`]: crate::daemon::peers::holders
//! [`reuse`]: crate::daemon::background::quarantine::reuse
//! [`quarantine`]: crate::daemon::background::quarantine
//! [`start`]: mod@crate::daemon::process::start
//! [`lifecycle`]: crate::daemon::lifecycle
//! [`stats`]: mod@crate::daemon::requests::stats
//! [`listeners`]: crate::daemon::restart::listeners
//! [`lazy_allocs`]: crate::daemon::requests::lazy_allocs
//! [`DaemonHandle`]: crate::daemon::DaemonHandle
//! [`serve`]: crate::daemon::serve()
//! [`peer`]: crate::daemon::peers::peer
//! [`metrics`]: crate::daemon::counters::metrics
//! [`exporter`]: crate::daemon::process::exporter
//! [`systemd`]: crate::daemon::process::systemd
//! [`refill`]: crate::daemon::background::refill
//! [`rebalance`]: crate::daemon::requests::rebalance
//! [`takeover`]: crate::daemon::restart::takeover
//! [`fdstore`]: crate::daemon::restart::fdstore
//! [`Daemon::start`]: crate::daemon::Daemon::start
//! [`DaemonHandle::shutdown`]: crate::daemon::DaemonHandle::shutdown

pub mod background;
pub mod config;
pub mod connections;
pub mod counters;
pub mod ids;
pub mod lifecycle;
pub mod peers;
pub mod persist;
pub mod pool;
pub mod process;
pub mod requests;
pub mod restart;

pub use config::{ByteSize, Config, ConfigError, Overrides, ValidationError};
pub use process::error::{DaemonError, Result};
pub use process::handle::DaemonHandle;
pub use process::serve::{serve, Start};
pub use process::start::Daemon;
