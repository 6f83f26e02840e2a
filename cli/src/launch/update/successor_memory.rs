//! The successor's guest RAM: the same allocation, on a daemon connection
//! of the successor's own (HANDOFF). The same for every VMM kind.

use std::path::PathBuf;
use std::sync::Arc;

use hugemem_client::client::{Allocation, Client, ClientError};
use hugemem_client::proto::Status;
use tracing::warn;

use super::error::UpdateError;
use super::mailbox::SuccessorMailbox;
use crate::launch::allocation::HeldAllocation;
use crate::launch::error::LaunchError;

/// The launcher's link to the daemon for updates: where HANDOFF goes, what
/// it names, and where the connection that owns the allocation afterwards
/// goes (the daemon watcher, through the mailbox).
pub(crate) struct DaemonLink {
    /// The daemon's socket.
    pub(crate) socket: PathBuf,
    /// The allocation as the watcher knows it (its token changes with each
    /// HANDOFF).
    pub(crate) held: HeldAllocation,
    /// Ask for hugetlbfs paths.
    pub(crate) want_paths: bool,
    /// Where the new owning connection goes (the daemon watcher).
    pub(crate) mailbox: Arc<SuccessorMailbox>,
}

impl DaemonLink {
    /// The allocation on a new daemon connection (HANDOFF), which the
    /// daemon watcher takes over at once; from a daemon without HANDOFF,
    /// duplicates of `current`'s descriptors. The flag says which.
    pub(crate) fn successor_memory(
        &mut self,
        current: &Allocation,
    ) -> Result<(Allocation, bool), UpdateError> {
        let Some(token) = self.held.token else {
            return Ok((current.try_clone()?, false));
        };
        let mut client = Client::connect(&self.socket).map_err(LaunchError::from)?;
        let alloc = match client.handoff(self.held.id, token, self.want_paths) {
            Ok(alloc) => alloc,
            Err(ClientError::Refused {
                status: Status::Unsupported,
                message,
            }) => {
                warn!(%message, "the daemon cannot hand the allocation over; the new VMM gets the launcher's descriptors");
                return Ok((current.try_clone()?, false));
            }
            Err(e) => return Err(LaunchError::from(e).into()),
        };
        let held = HeldAllocation::of(&alloc);
        // The new connection owns the allocation from here on, whatever
        // happens to the update.
        self.held = held.clone();
        self.mailbox.offer(client, held);
        Ok((alloc, true))
    }
}
