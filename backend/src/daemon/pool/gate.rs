//! The reservation gate: the daemon's hugetlb reservations of fresh pages,
//! and the punch of a released region's pages, one at a time.
//!
//! Detaching a released region (`crate::daemon::background::quarantine::reuse::detach_pages`)
//! punches every page out of its file; the pages are free, and unreserved,
//! until the region's file reserves them again a moment later. A fresh
//! region created in that moment (an ALLOC, a lazy ALLOC's demand-faulted
//! memory, a grown region, the refill) would take them, and the released
//! region, whose refault then finds no page, was given back to the kernel
//! as if its tenant had damaged it. Under the gate, the punch and
//! the re-reservation happen with no fresh reservation of the daemon in
//! between: the punched pages stay the region's, an ALLOC that needs them
//! waits for the region, and the only taker left is another process on the
//! host, in a window of microseconds, which the verdict then names.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// See the module docs. Held only across syscalls that reserve or punch,
/// never across populating or clearing.
#[derive(Debug, Default)]
pub struct ReserveGate(Mutex<()>);

impl ReserveGate {
    /// Runs `reserve` (a syscall that reserves fresh pages) under the gate.
    pub fn run<T>(&self, reserve: impl FnOnce() -> T) -> T {
        let _held = self.hold();
        reserve()
    }

    /// Holds the gate until the guard drops.
    pub fn hold(&self) -> MutexGuard<'_, ()> {
        // Nothing is guarded but the order of syscalls: a poisoned gate is
        // still a gate.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
