//! The floor side's memory: one resident hugetlb memfd per launch at once,
//! each lent to one launch at a time and zeroed again before the next, off
//! the clock.

use std::sync::{Mutex, PoisonError};

use crate::floor::FloorMemory;

use super::process::chain;

/// A memfd and whether a guest has written it since it was last zeroed.
#[derive(Debug)]
struct Slot {
    memory: FloorMemory,
    written: bool,
}

/// The floor's memfds not lent to a launch.
#[derive(Debug)]
pub(super) struct FloorPool {
    free: Mutex<Vec<Slot>>,
}

impl FloorPool {
    /// `memory`: populated memfds, as many as launches run at once.
    pub(super) fn new(memory: Vec<FloorMemory>) -> Self {
        let free = memory
            .into_iter()
            .map(|memory| Slot {
                memory,
                written: false,
            })
            .collect();
        Self {
            free: Mutex::new(free),
        }
    }

    /// Runs `launch` on a memfd no other launch holds, all zero: one a
    /// guest wrote is punched and populated again first
    /// ([`FloorMemory::rezero`]), before `launch` starts its clock. The
    /// memfd goes back to the pool afterwards, as written.
    pub(super) fn lend<T>(&self, launch: impl FnOnce(&FloorMemory) -> T) -> Result<T, String> {
        let slot = self
            .free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        let mut slot = slot.ok_or("no floor memfd is free (more launches at once than memfds)")?;
        if slot.written {
            slot.memory
                .rezero()
                .map_err(|e| format!("zeroing the floor's memfd again: {}", chain(&e)))?;
        }
        slot.written = true;
        let out = launch(&slot.memory);
        self.free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(slot);
        Ok(out)
    }
}
