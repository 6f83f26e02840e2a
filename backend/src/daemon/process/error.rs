//! The errors of starting and stopping the daemon.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;

use crate::daemon::config::ValidationError;
use crate::daemon::restart::takeover;

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
    Takeover(#[from] takeover::TakeoverError),
    /// The socket systemd passed (socket activation) cannot be used.
    #[error("socket activation: {0}")]
    Activation(String),
    /// The daemon thread panicked.
    #[error("the daemon thread panicked")]
    Panicked,
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, DaemonError>;
