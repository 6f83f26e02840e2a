//! A parked VM's record (`parked.rs`): what a restore sends besides the
//! memory. A leaf: the allocation table (`table.rs`) holds it.

use serde::{Deserialize, Serialize};

/// A parked VM: what a restore sends besides the memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParkedVm {
    /// Its name, unique per tenant.
    pub name: String,
    /// Memory slots in the order they came: the slot number and the index
    /// of the allocation's region that backs it.
    pub slots: Vec<ParkedSlot>,
    /// The VM's configuration, as the sender's `Config` carried it (JSON).
    pub config: String,
    /// The VM's state, as the sender's `State` carried it (JSON).
    pub state: String,
    /// Bytes copied into pool memory at park time (0: moved).
    pub copied_bytes: u64,
    /// When it was parked, seconds since the epoch.
    pub parked_at: u64,
}

/// One memory slot of a parked VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParkedSlot {
    /// cloud-hypervisor's slot number.
    pub slot: u32,
    /// Index in the allocation's regions.
    pub region: usize,
}
