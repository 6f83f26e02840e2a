//! Why an update failed.

use crate::launch::error::LaunchError;

/// Why an update failed.
#[derive(Debug, thiserror::Error)]
pub enum UpdateError {
    /// Getting the successor's memory or starting it failed.
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// An exchange on a VMM's control channel failed (QEMU's QMP
    /// monitor, cloud-hypervisor's REST API: each adapter's own error).
    #[error("{what}: {source}")]
    Control {
        /// Which VMM, doing what.
        what: String,
        /// The cause.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Socket pairs, pidfds.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The migration ended other than completed.
    #[error("the migration ended {status}: {detail}")]
    Migration {
        /// The VMM's status of it.
        status: String,
        /// `query-migrate`'s error text, if any.
        detail: String,
    },
}
