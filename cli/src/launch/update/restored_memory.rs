//! Where a restored VM's memory arrives for the updater (`launch --restore
//! --name`): the watcher thread puts it there once the daemon handed the
//! allocation over, which comes just after the VMM runs the guest, so an
//! update or a park asked for in between waits for it.

use std::sync::{Condvar, Mutex};
use std::time::Duration;

use hugemem_client::client::Allocation;

/// What the restore gave.
#[derive(Debug, Default)]
enum Arrival {
    /// Not yet.
    #[default]
    Pending,
    /// The restored allocation (the launcher's descriptors of it).
    Arrived(Allocation),
    /// Taken by the updater, or the restore failed.
    Gone,
}

/// A restored VM's memory, handed from the watcher to the updater once.
#[derive(Debug, Default)]
pub(crate) struct RestoredMemory {
    arrival: Mutex<Arrival>,
    changed: Condvar,
}

impl RestoredMemory {
    /// The restore handed `memory` over (`None`: it failed).
    pub(crate) fn put(&self, memory: Option<Allocation>) {
        let mut a = self.arrival.lock().unwrap_or_else(|p| p.into_inner());
        *a = memory.map_or(Arrival::Gone, Arrival::Arrived);
        self.changed.notify_all();
    }

    /// The memory, waiting up to `deadline` for the restore to hand it
    /// over; `None` when it failed, was taken, or did not come in time.
    pub(crate) fn take(&self, deadline: Duration) -> Option<Allocation> {
        let a = self.arrival.lock().unwrap_or_else(|p| p.into_inner());
        let (mut a, _) = self
            .changed
            .wait_timeout_while(a, deadline, |a| matches!(a, Arrival::Pending))
            .unwrap_or_else(|p| p.into_inner());
        match std::mem::replace(&mut *a, Arrival::Gone) {
            Arrival::Arrived(m) => Some(m),
            _ => None,
        }
    }
}
