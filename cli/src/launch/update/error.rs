//! Why an update failed.

use crate::launch::ch_api::ChApiError;
use crate::launch::error::LaunchError;
use crate::launch::qmp::QmpError;

/// Why an update failed.
#[derive(Debug, thiserror::Error)]
pub enum UpdateError {
    /// Getting the successor's memory or starting it failed.
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// A QMP exchange failed.
    #[error("{what}: {source}")]
    Qmp {
        /// Which QEMU, doing what.
        what: String,
        /// The cause.
        #[source]
        source: QmpError,
    },
    /// A request to a cloud-hypervisor's API failed.
    #[error("{what}: {source}")]
    ChApi {
        /// Which cloud-hypervisor, doing what.
        what: String,
        /// The cause.
        #[source]
        source: ChApiError,
    },
    /// Socket pairs, pidfds.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The migration ended other than completed.
    #[error("the migration ended {status}: {detail}")]
    Migration {
        /// QEMU's status.
        status: String,
        /// `query-migrate`'s error text, if any.
        detail: String,
    },
}
