//! Why a save or a load failed.

use crate::client::ClientError;
use ch_migration::layout::SnapshotDirError;
use ch_migration::ChMigrationError;

use super::manifest::ManifestError;

/// Why a save or a load failed.
#[derive(Debug, thiserror::Error)]
pub enum SavedVmError {
    /// The daemon refused or failed.
    #[error(transparent)]
    Daemon(#[from] ClientError),
    /// A file or the directory.
    #[error(transparent)]
    Dir(#[from] SnapshotDirError),
    /// The directory does not match its manifest.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// The exchange over the socket pair.
    #[error("the snapshot exchange: {0}")]
    Exchange(#[from] ChMigrationError),
    /// The socket pair or a thread.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// A layout this version cannot load.
    #[error("{0}")]
    Unsupported(String),
    /// The daemon no longer holds the VM the save wrote: nothing was put in
    /// place.
    #[error("the daemon no longer holds {name} as it was sent ({why}); nothing was saved")]
    Lost {
        /// The VM.
        name: String,
        /// What happened.
        why: String,
    },
    /// The save is in place but the VM could not be dropped.
    #[error("{name} was saved to {dir} but is still parked: UNPARK failed: {source}")]
    SavedNotDropped {
        /// The VM.
        name: String,
        /// Where it was saved.
        dir: String,
        /// Why UNPARK failed.
        #[source]
        source: ClientError,
    },
}
