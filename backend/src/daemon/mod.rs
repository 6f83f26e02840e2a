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
//! [`server`]: crate::daemon::server
//! [`session`]: crate::daemon::session
//! [`alloc`]: crate::daemon::alloc
//! [`pool`]: crate::daemon::pool
//! [`scrub`]: crate::daemon::scrub
//! [`holders`]: crate::daemon::holders
//! [`reuse`]: crate::daemon::quarantine::reuse
//! [`quarantine`]: crate::daemon::quarantine
//! [`start`]: mod@crate::daemon::start
//! [`lifecycle`]: crate::daemon::lifecycle
//! [`stats`]: mod@crate::daemon::stats
//! [`listeners`]: crate::daemon::listeners
//! [`lazy_allocs`]: crate::daemon::lazy_allocs
//! [`DaemonHandle`]: crate::daemon::DaemonHandle
//! [`serve`]: crate::daemon::serve()
//! [`peer`]: crate::daemon::peer
//! [`metrics`]: crate::daemon::metrics
//! [`exporter`]: crate::daemon::exporter
//! [`systemd`]: crate::daemon::systemd
//! [`refill`]: crate::daemon::refill
//! [`rebalance`]: crate::daemon::rebalance
//! [`takeover`]: crate::daemon::takeover
//! [`fdstore`]: crate::daemon::fdstore
//! [`Daemon::start`]: crate::daemon::Daemon::start
//! [`DaemonHandle::shutdown`]: crate::daemon::DaemonHandle::shutdown

pub mod alloc;
pub mod config;
mod error;
pub mod exporter;
pub mod fdstore;
pub mod fill_record;
pub mod fills;
pub mod guest_check;
pub mod hand_out;
mod handle;
pub mod handoff;
pub mod holders;
mod hugetlbfs;
pub mod ids;
pub mod latency;
pub mod lazy_allocs;
pub mod lifecycle;
pub mod listeners;
mod locking;
pub mod metrics;
mod orphans;
pub mod outcome;
pub mod park;
pub mod park_record;
pub mod peer;
pub mod peer_log;
pub mod persist;
pub mod pool;
pub mod quarantine;
pub mod reattach;
pub mod rebalance;
pub mod refaulter;
pub mod refill;
pub mod refusals;
pub mod rooms;
pub mod saving;
pub mod scrub;
mod serve;
pub mod server;
pub mod session;
mod socket;
pub mod start;
pub mod stats;
pub mod systemd;
pub mod takeover;

pub use config::{ByteSize, Config, ConfigError, Overrides, ValidationError};
pub use error::{DaemonError, Result};
pub use handle::DaemonHandle;
pub use serve::{serve, Start};
pub use start::Daemon;
