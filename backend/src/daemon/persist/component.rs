//! The one interface every component of the state document saves and
//! restores through.

use super::error::SaveError;
use super::fds::{FdList, Fds};

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
