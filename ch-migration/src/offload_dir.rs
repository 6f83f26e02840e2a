//! cloud-hypervisor's reference offload daemon's snapshot directory
//! (`offload_daemon snapshot --output-dir`, `restore --input-dir`):
//!
//! ```text
//! migration_config.json   the VmMigrationConfig as the Config request carried it
//! state.json              the State request's payload
//! memory-<slot>           one per slot: `size` bytes, the slot's fd from its
//!                         `file_offset`, sparse (holes read as zero)
//! ```
//!
//! The slots (number, guest address, size, offset in the fd) are those of
//! `memory_manager_data.guest_ram_mappings` in the configuration. hugemem
//! saves parked VMs in exactly this layout plus a manifest
//! (`hugemem_client::saved_vm`), so either tool restores the other's output. A directory is read as untrusted: every file is bounded
//! ([`Limits`]), must be a regular file (no link followed) and every slot's
//! file must be exactly its size.

use std::path::{Path, PathBuf};

use super::layout::{migration_config_slots, open_regular, read_bounded, SnapshotDirError};
use super::slots::SlotRange;
use super::Limits;

/// The migration configuration's file.
pub const MIGRATION_CONFIG_FILE: &str = "migration_config.json";
/// The state's file.
pub const STATE_FILE: &str = "state.json";

/// The file of memory slot `slot` (the reference daemon's
/// `memory_slot_filename`).
pub fn memory_slot_filename(slot: u32) -> String {
    format!("memory-{slot}")
}

/// One slot of a directory: where it goes in the guest and in the memory
/// fd a restore sends, and the file holding its bytes (from the file's
/// start).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotFile {
    /// The slot.
    pub range: SlotRange,
    /// Its memory file (`memory-<slot>`), exactly `range.size` bytes.
    pub path: PathBuf,
}

/// A snapshot directory read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OffloadDir {
    /// The migration configuration (the `Config` payload).
    pub config: Vec<u8>,
    /// The state (the `State` payload).
    pub state: Vec<u8>,
    /// The slots, in the configuration's order.
    pub slots: Vec<SlotFile>,
}

/// Reads the snapshot directory `dir` under `limits`.
///
/// # Errors
///
/// [`SnapshotDirError`]: a file missing, over its bound or not a regular
/// file, a configuration without a valid slot table, a memory file of
/// another size than its slot.
pub fn read_offload_dir(dir: &Path, limits: Limits) -> Result<OffloadDir, SnapshotDirError> {
    let config = read_bounded(&dir.join(MIGRATION_CONFIG_FILE), limits.max_config)?;
    let state = read_bounded(&dir.join(STATE_FILE), limits.max_state)?;
    let ranges = migration_config_slots(&config, limits.max_memory_fds)?;
    let mut slots = Vec::with_capacity(ranges.len());
    for range in ranges {
        let path = dir.join(memory_slot_filename(range.slot));
        let (_, length) = open_regular(&path)?;
        if length != range.size {
            return Err(SnapshotDirError::Invalid(format!(
                "{}: {length} bytes, its slot has {}",
                path.display(),
                range.size
            )));
        }
        slots.push(SlotFile { range, path });
    }
    Ok(OffloadDir {
        config,
        state,
        slots,
    })
}
