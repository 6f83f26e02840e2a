//! What every component saves into the state document (a takeover's, the
//! fd store's) and restores from it, below the takeover and every
//! component: the compact encodings inside the JSON and the fd list the
//! document names its fds by.

pub mod encoding;
pub mod fds;

use std::io;

use fds::{FdList, Fds};

/// What every component's save gets: where the document numbers its fds,
/// and whether it is for systemd's fd store (`to_store`: no connection
/// survives, so allocations are saved orphaned and connections not at all,
/// and a socket systemd keeps is not saved) or for a successor.
#[derive(Debug)]
pub struct SaveContext<'a> {
    /// The document's fds.
    pub fds: &'a mut FdList,
    /// For systemd's fd store.
    pub to_store: bool,
}

/// What every component's restore gets: the fds the document came with
/// (each taken once) and the host it is restored onto.
#[derive(Debug)]
pub struct RestoreContext<'a> {
    /// The document's fds, by index.
    pub fds: &'a mut Fds,
    /// The host's nodes (a region is adopted onto the node it was bound to).
    pub topology: &'a numa::Topology,
}

/// One component of the state document, in the manner of Firecracker's
/// `Persist`: [`save`](Persist::save) turns what the daemon holds into the
/// component's typed record (its fds numbered in the document), and
/// [`restore`](Persist::restore) builds, from a record, what the successor
/// takes over, or says why it cannot. Every part of the document goes
/// through this one interface (the takeover's `document.rs` saves them,
/// its `adopt.rs` and the start restore them).
pub trait Persist {
    /// The component's record in the document (serde, version 1).
    type State;
    /// What the successor gets from a record.
    type Restored;
    /// Why a record does not restore.
    type RestoreError;

    /// The component's record.
    ///
    /// # Errors
    ///
    /// An fd that cannot be duplicated for the successor.
    fn save(&self, ctx: &mut SaveContext<'_>) -> Result<Self::State, SaveError>;

    /// What `state` describes, its fds taken from `ctx`.
    ///
    /// # Errors
    ///
    /// [`Persist::RestoreError`].
    fn restore(
        state: Self::State,
        ctx: &mut RestoreContext<'_>,
    ) -> Result<Self::Restored, Self::RestoreError>;
}

/// Why a component's part could not be written into a state document.
#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    /// An fd the document names could not be duplicated for the successor.
    #[error("cannot duplicate an fd for the state document")]
    DupFd(#[source] io::Error),
}

/// Why a field of a state document does not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// A character that is not a page state.
    #[error("page state {0:?}")]
    PageState(char),
    /// Hex of odd length.
    #[error("odd-length hex")]
    OddHex,
    /// A character that is not a hex digit.
    #[error("bad hex")]
    BadHex,
}
