//! The VMM-specific part of an update: moving the guest from the running
//! VMM to its successor. Each VMM's adapter implements it in its own
//! folder (QEMU: a migration that skips shared RAM,
//! `launch/vmm/qemu/switch.rs`; cloud-hypervisor: its local migration,
//! `launch/vmm/cloud_hypervisor/switch.rs`); the rest is shared
//! (`updater.rs`).

use std::ffi::OsString;
use std::os::fd::OwnedFd;
use std::process::Child;
use std::time::Duration;

use hugemem_client::client::Allocation;

use super::error::UpdateError;
use super::request::ParkReport;

/// What one kind of VMM does in a live update. Everything else — the
/// successor's memory, handing the daemon connection to the watcher,
/// supervising the successor, reaping the replaced VMM, the report — is
/// the same for every VMM and done by the updater.
///
/// The updater calls, in order: [`connect_running`](Self::connect_running),
/// [`successor`](Self::successor), then (the successor started)
/// [`switch`](Self::switch), and [`retire_old`](Self::retire_old) after a
/// switch or [`keep_old_running`](Self::keep_old_running) after a failed one.
pub trait VmmSwitch {
    /// The VMM's name in messages ("QEMU").
    fn name(&self) -> &'static str;

    /// The program the running VMM was started from: the successor's,
    /// unless the request names another.
    fn program(&self) -> &OsString;

    /// The successor maps memory of its own, which the daemon hands to a
    /// new connection (HANDOFF) and the successor inherits. False for a VMM
    /// whose migration passes the running VMM's descriptors to the
    /// successor itself: the allocation then stays on the launcher's
    /// connection and the successor inherits no memory.
    fn memory_by_handoff(&self) -> bool {
        true
    }

    /// Makes sure the running VMM can be asked to hand the guest over (the
    /// first update opens its control channel). Runs before any memory
    /// moves, so a running VMM that cannot be reached costs nothing.
    fn connect_running(&mut self) -> Result<(), UpdateError>;

    /// The successor's command line, for `program` on `memory`, and the
    /// descriptors it inherits besides the memory's. Keeps the launcher's
    /// ends of the successor's channels for [`switch`](Self::switch).
    fn successor(
        &mut self,
        program: &OsString,
        memory: &Allocation,
    ) -> Result<SuccessorCommand, UpdateError>;

    /// Moves the guest from the running VMM to `successor` (started from
    /// the last [`successor`](Self::successor) command) and returns once
    /// the successor runs it. On success the successor is the running VMM
    /// from then on; on an error the updater kills it.
    fn switch(&mut self, running: &Child, successor: &mut Child) -> Result<Switched, UpdateError>;

    /// After a failed switch, the successor killed: makes sure the running
    /// VMM runs the guest (it may have paused it for the switch).
    fn keep_old_running(&mut self);

    /// Whether the running VMM still answers on its control channel
    /// (asked after a failed park: one that does not has ended, or is
    /// ending).
    fn running_reachable(&mut self) -> bool {
        true
    }

    /// After a switch: asks the VMM that was replaced to exit. The updater
    /// reaps it, killing it if it does not exit in time.
    fn retire_old(&mut self);

    /// After the replaced VMM was reaped.
    fn retired(&mut self) {}

    /// Parks the running VM under `name` in the daemon at `daemon`, its
    /// memory `memory` (the launcher's descriptors); once the daemon has
    /// it, asks the VMM to exit. On an error the VMM runs the guest on.
    /// A VMM that parks otherwise (cloud-hypervisor, through its own API)
    /// answers that it does not park here.
    fn park(
        &mut self,
        memory: &Allocation,
        daemon: &std::path::Path,
        name: &str,
    ) -> Result<ParkReport, UpdateError> {
        let _ = (memory, daemon, name);
        Err(UpdateError::Migration {
            status: "not started".into(),
            detail: format!(
                "{} parks through its own API (`hugemem park NAME --api-socket PATH`)",
                self.name()
            ),
        })
    }
}

/// How to start a successor.
#[derive(Debug)]
pub struct SuccessorCommand {
    /// The full argument list, program first.
    pub argv: Vec<OsString>,
    /// Descriptors it inherits under their numbers besides the memory's
    /// (its ends of its channels); the launcher closes its copies once the
    /// successor started.
    pub inherit: Vec<OwnedFd>,
}

/// What a switch measured.
#[derive(Debug, Clone, Default)]
pub struct Switched {
    /// From the request to hand over to the successor running the guest.
    pub switch_time: Duration,
    /// `CLOCK_MONOTONIC` when the hand-over was asked for, ns.
    pub migrate_at_ns: u64,
    /// `CLOCK_MONOTONIC` when the successor ran the guest, ns.
    pub resumed_at_ns: u64,
    /// The VMM's own figures for the migration.
    pub figures: MigrationFigures,
}

/// What the VMM reports of its migration (zero where it reports nothing).
#[derive(Debug, Clone, Default)]
pub struct MigrationFigures {
    /// RAM bytes the migration stream carried.
    pub ram_transferred_bytes: u64,
    /// RAM the VMM counted as migratable.
    pub ram_total_bytes: u64,
    /// The VMM's downtime, ms.
    pub downtime_ms: u64,
    /// The VMM's migration time, ms.
    pub total_ms: u64,
}

/// `CLOCK_MONOTONIC` now, ns (0 if unreadable): comparable across the
/// processes of one host, so a bench can place the switch on its clock.
pub(crate) fn monotonic_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|t| {
            u64::try_from(t.tv_sec()).unwrap_or(0) * 1_000_000_000
                + u64::try_from(t.tv_nsec()).unwrap_or(0)
        })
        .unwrap_or(0)
}
