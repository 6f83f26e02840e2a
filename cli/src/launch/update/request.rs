//! What travels on the control socket: the request, its reply, and the
//! report of one update. The wire format is one JSON line each way
//! (`control.rs`); `hugemem update --json` prints the report as it comes.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// What one live update did, as the launcher measured it and QEMU reported.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UpdateReport {
    /// The VMM kind: `QEMU` or `cloud-hypervisor` (empty from a launcher
    /// that predates the field, which updated QEMU only).
    #[serde(default)]
    pub vmm: String,
    /// The QEMU that ran the guest before.
    pub old_pid: u32,
    /// The QEMU that runs it now.
    pub new_pid: u32,
    /// The program started.
    pub program: String,
    /// The new QEMU got the memory through a daemon HANDOFF on a connection
    /// of its own (false: the launcher's own descriptors, duplicated).
    pub handoff: bool,
    /// RAM bytes the migration stream carried (QEMU's `ram.transferred`;
    /// cloud-hypervisor reports none: what the old process wrote during
    /// the switch, `/proc/PID/io` `wchar`, which bounds it).
    pub ram_transferred_bytes: u64,
    /// RAM QEMU counted as migratable (`ram.total`; shared RAM blocks that
    /// `x-ignore-shared` skips are not in it).
    pub ram_total_bytes: u64,
    /// Bytes of guest RAM the VM has (the allocation).
    pub guest_ram_bytes: u64,
    /// QEMU's own downtime figure, ms (`query-migrate` `downtime`).
    pub qemu_downtime_ms: u64,
    /// QEMU's migration time, ms (`total-time`).
    pub qemu_total_ms: u64,
    /// From the request to the old QEMU gone, ms (launcher's clock).
    pub update_ms: f64,
    /// From `migrate` to the new QEMU's RESUME event, ms.
    pub switch_ms: f64,
    /// `CLOCK_MONOTONIC` when `migrate` was sent, ns.
    pub migrate_at_ns: u64,
    /// `CLOCK_MONOTONIC` when the new QEMU's RESUME arrived, ns.
    pub resumed_at_ns: u64,
}

/// What one park did (`hugemem park NAME` of a launched QEMU).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParkReport {
    /// The VMM kind (`QEMU`).
    pub vmm: String,
    /// The name the VM is parked under.
    pub name: String,
    /// The allocation that holds it in the daemon.
    pub alloc_id: u64,
    /// Bytes of guest memory parked.
    pub bytes: u64,
    /// Of them, bytes the daemon copied (0: moved).
    pub copied_bytes: u64,
    /// Memory slots.
    pub slots: u32,
    /// Bytes of the VMM's device state the daemon keeps.
    pub state_bytes: u64,
    /// RAM bytes the VMM's migration stream carried (QEMU ended before it
    /// could be asked: the stream's length, a bound).
    pub ram_transferred_bytes: u64,
    /// From the request to the daemon's answer, ms.
    pub park_ms: f64,
    /// The VMM's migration of its device state, ms.
    pub migrate_ms: f64,
}

/// A request on the control socket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Request {
    /// Update QEMU under the running guest.
    Update {
        /// The new QEMU binary; `None`: the one running now.
        qemu: Option<PathBuf>,
    },
    /// Park the VM in the daemon under `name`; the VMM exits once the
    /// daemon has it.
    Park {
        /// The parked VM's name.
        name: String,
    },
}

/// The reply to a [`Request`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reply {
    /// It worked.
    Ok(UpdateReport),
    /// The VM is parked.
    Parked(ParkReport),
    /// It did not; the old QEMU runs the guest still, unless the text says otherwise.
    Error(String),
}
