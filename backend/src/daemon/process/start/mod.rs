//! Starting the daemon: two builders over one core, as Firecracker builds
//! a microVM for boot or from a snapshot.
//!
//! * `fresh.rs`: a daemon of its own (or on systemd's socket): it binds its
//!   sockets, and its pool starts empty;
//! * `inherited.rs`: a takeover, or systemd's fd store after a restart or a
//!   crash: the sockets, the regions, the allocations and the connections
//!   come from the predecessor's state document, each checked; the
//!   predecessor is answered once this daemon serves, or told why not
//!   (every error of the start refuses it, in one place);
//! * `core.rs`: what both share: the host (configuration, topology,
//!   hugetlbfs, counters, runtime), then the components and their rooms;
//! * `plane.rs`: the control plane the core runs on the daemon's thread.

mod core;
mod fresh;
mod inherited;
mod plane;

use crate::daemon::config::Config;
use crate::daemon::process::error::Result;
use crate::daemon::process::handle::DaemonHandle;
use crate::daemon::restart::takeover::Inherited;

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
    ///
    /// [`DaemonError::Config`]: crate::daemon::DaemonError::Config
    /// [`DaemonError::Topology`]: crate::daemon::DaemonError::Topology
    /// [`DaemonError::AlreadyRunning`]: crate::daemon::DaemonError::AlreadyRunning
    /// [`DaemonError::NotASocket`]: crate::daemon::DaemonError::NotASocket
    /// [`DaemonError::Bind`]: crate::daemon::DaemonError::Bind
    /// [`DaemonError::Metrics`]: crate::daemon::DaemonError::Metrics
    /// [`DaemonError::Threads`]: crate::daemon::DaemonError::Threads
    pub fn start(config: Config) -> Result<DaemonHandle> {
        fresh::start(config, None, false)
    }

    /// As [`Daemon::start`], on `listener` when given: a listening socket
    /// bound to `config.socket` by someone else (systemd's `hugemem.socket`,
    /// see [`crate::daemon::process::systemd::inherited_listener`]). The daemon then
    /// neither creates nor removes the socket file; peer checks apply
    /// unchanged.
    ///
    /// # Errors
    ///
    /// As [`Daemon::start`].
    pub fn start_on(
        config: Config,
        listener: Option<std::os::unix::net::UnixListener>,
    ) -> Result<DaemonHandle> {
        fresh::start(config, listener, false)
    }

    /// As [`Daemon::start`], on what a predecessor passed on
    /// ([`crate::daemon::restart::takeover::receive()`]): its listening sockets,
    /// regions, allocations and connections, each checked (see
    /// [`crate::daemon::restart::takeover`]). The predecessor is answered `OK` once
    /// this daemon serves, or told why not (it then serves on).
    ///
    /// # Errors
    ///
    /// As [`Daemon::start`]; a region that fails its checks is no error
    /// (it is quarantined or given back, and logged).
    pub fn start_inherited(config: Config, inherited: Inherited) -> Result<DaemonHandle> {
        inherited::start(config, None, inherited, false)
    }

    /// The general start: on a passed listener (systemd's socket), on what
    /// a predecessor or systemd's fd store passed on, and keeping state
    /// in systemd's fd store (`fd_store`, see [`crate::daemon::restart::fdstore`]).
    ///
    /// # Errors
    ///
    /// As [`Daemon::start`].
    pub fn start_with(
        config: Config,
        listener: Option<std::os::unix::net::UnixListener>,
        inherited: Option<Inherited>,
        fd_store: bool,
    ) -> Result<DaemonHandle> {
        match inherited {
            Some(inh) => inherited::start(config, listener, inh, fd_store),
            None => fresh::start(config, listener, fd_store),
        }
    }
}
