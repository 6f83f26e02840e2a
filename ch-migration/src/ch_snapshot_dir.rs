//! cloud-hypervisor's own snapshot directory (`vm.snapshot
//! destination_url=file://DIR`), read into what a local-migration sender
//! needs to restore it into a new cloud-hypervisor:
//!
//! ```text
//! config.json     the VmConfig
//! state.json      the VM's Snapshot: the `vm` section's data (VmSnapshot:
//!                 clock, common CPUID) and its children, among them
//!                 `memory-manager`, whose data (MemoryManagerSnapshotData)
//!                 holds `memory_ranges` and `guest_ram_mappings`
//! memory-ranges   the guest RAM of `memory_ranges`, range after range
//! ```
//!
//! The migration `Config` payload is cloud-hypervisor's `VmMigrationConfig`
//! (`vm_config`, `common_cpuid`, `memory_manager_data`); all three are in
//! the directory: the VmConfig as is, the common CPUID from the `vm`
//! section and the memory manager's data from its section (both sections'
//! data are JSON inside a JSON string). The `State` payload is
//! `state.json` itself (the same `Snapshot` a live sender sends). Each
//! slot's bytes are found through `memory_ranges`: range `i` lies in
//! `memory-ranges` after the lengths of ranges `0..i`.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::layout::{guest_ram_mappings, open_regular, parse_json, read_bounded, SnapshotDirError};
use super::slots::SlotRange;
use super::Limits;

/// The VmConfig's file.
pub const CH_CONFIG_FILE: &str = "config.json";
/// The VM snapshot's file.
pub const CH_STATE_FILE: &str = "state.json";
/// The guest RAM's file.
pub const CH_MEMORY_RANGES_FILE: &str = "memory-ranges";
/// The most entries a `memory_ranges` table may have.
pub const MAX_MEMORY_RANGES: usize = 1 << 16;

/// A part of a slot held in `memory-ranges`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RangePiece {
    /// Where it starts in the slot.
    pub offset_in_slot: u64,
    /// Its length.
    pub length: u64,
    /// Where it starts in `memory-ranges`.
    pub file_offset: u64,
}

/// A slot and where its bytes are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChSlot {
    /// The slot (its `file_offset` is where it starts in the memory fd a
    /// restore sends).
    pub range: SlotRange,
    /// Its bytes in `memory-ranges`, in slot order, covering all of it.
    pub pieces: Vec<RangePiece>,
}

/// A cloud-hypervisor snapshot directory, converted for a local migration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChSnapshotDir {
    /// The migration configuration (`VmMigrationConfig`, JSON).
    pub migration_config: Vec<u8>,
    /// The state (`state.json`).
    pub state: Vec<u8>,
    /// `memory-ranges` (absent when the VM had no range to save).
    pub memory_ranges: PathBuf,
    /// The slots.
    pub slots: Vec<ChSlot>,
}

fn field(what: &'static str, field: &'static str) -> SnapshotDirError {
    SnapshotDirError::Field { what, field }
}

/// The data of a snapshot section: JSON inside the JSON string
/// `snapshot_data.state`.
fn section_data(section: &Value, what: &'static str) -> Result<Value, SnapshotDirError> {
    let text = section
        .pointer("/snapshot_data/state")
        .and_then(Value::as_str)
        .ok_or(field(what, "snapshot_data.state"))?;
    parse_json(text.as_bytes(), what)
}

/// The `memory_ranges` table: (gpa, length) in file order, checked.
fn memory_ranges(data: &Value) -> Result<Vec<(u64, u64)>, SnapshotDirError> {
    const WHAT: &str = "the memory manager's memory_ranges";
    let table = data
        .pointer("/memory_ranges/data")
        .and_then(Value::as_array)
        .ok_or(field(WHAT, "data"))?;
    if table.len() > MAX_MEMORY_RANGES {
        return Err(SnapshotDirError::Invalid(format!(
            "{} memory ranges (at most {MAX_MEMORY_RANGES})",
            table.len()
        )));
    }
    let mut out = Vec::with_capacity(table.len());
    for r in table {
        let gpa = r
            .get("gpa")
            .and_then(Value::as_u64)
            .ok_or(field(WHAT, "gpa"))?;
        let length = r
            .get("length")
            .and_then(Value::as_u64)
            .ok_or(field(WHAT, "length"))?;
        if length == 0 || (gpa | length) % 4096 != 0 || gpa.checked_add(length).is_none() {
            return Err(SnapshotDirError::Invalid(format!(
                "memory range {gpa:#x}+{length:#x} is empty, unaligned or overflows"
            )));
        }
        out.push((gpa, length));
    }
    let mut sorted = out.clone();
    sorted.sort_unstable();
    if sorted.windows(2).any(|w| w[0].0 + w[0].1 > w[1].0) {
        return Err(SnapshotDirError::Invalid("memory ranges overlap".into()));
    }
    Ok(out)
}

/// Where each slot's bytes lie in `memory-ranges`.
fn slot_pieces(
    slots: Vec<SlotRange>,
    ranges: &[(u64, u64)],
) -> Result<Vec<ChSlot>, SnapshotDirError> {
    let mut out = Vec::with_capacity(slots.len());
    for range in slots {
        let mut pieces = Vec::new();
        let mut file_at = 0u64;
        for &(gpa, length) in ranges {
            let (start, end) = (gpa.max(range.gpa), (gpa + length).min(range.gpa_end()));
            if start < end {
                pieces.push(RangePiece {
                    offset_in_slot: start - range.gpa,
                    length: end - start,
                    file_offset: file_at + (start - gpa),
                });
            }
            file_at += length;
        }
        pieces.sort_unstable_by_key(|p| p.offset_in_slot);
        let covered: u64 = pieces.iter().map(|p| p.length).sum();
        if covered != range.size {
            return Err(SnapshotDirError::Invalid(format!(
                "slot {}: memory-ranges holds {covered:#x} of its {:#x} bytes (cloud-hypervisor \
                 leaves out a zone whose shared backing file is linked on disk: its bytes are \
                 in that file, not in the snapshot)",
                range.slot, range.size
            )));
        }
        out.push(ChSlot { range, pieces });
    }
    Ok(out)
}

/// Reads cloud-hypervisor's snapshot directory `dir` under `limits`
/// (configuration and state sizes, slots) and converts it for a local
/// migration.
///
/// # Errors
///
/// [`SnapshotDirError`]: a file missing, over its bound or not a regular
/// file, a section or field missing, a range or slot table that cannot
/// be right, a slot not wholly in `memory-ranges`, a `memory-ranges` of
/// another length than its table.
pub fn read_ch_snapshot_dir(dir: &Path, limits: Limits) -> Result<ChSnapshotDir, SnapshotDirError> {
    let config = read_bounded(&dir.join(CH_CONFIG_FILE), limits.max_config)?;
    let state = read_bounded(&dir.join(CH_STATE_FILE), limits.max_state)?;
    let vm_config = parse_json(&config, "config.json")?;
    let snapshot = parse_json(&state, "state.json")?;
    let vm = section_data(&snapshot, "the vm section of state.json")?;
    let memory_manager = snapshot
        .pointer("/snapshots/memory-manager")
        .ok_or(field("state.json", "snapshots.memory-manager"))?;
    let mm_data = section_data(memory_manager, "the memory-manager section of state.json")?;
    let slots = guest_ram_mappings(&mm_data, limits.max_memory_fds)?;
    let ranges = memory_ranges(&mm_data)?;
    let total: u64 = ranges.iter().map(|r| r.1).sum();
    let memory_ranges = dir.join(CH_MEMORY_RANGES_FILE);
    if total > 0 {
        let (_, length) = open_regular(&memory_ranges)?;
        if length != total {
            return Err(SnapshotDirError::Invalid(format!(
                "{}: {length} bytes, its ranges add up to {total}",
                memory_ranges.display()
            )));
        }
    }
    let slots = slot_pieces(slots, &ranges)?;
    let mut migration = serde_json::Map::new();
    migration.insert("vm_config".into(), vm_config);
    // Only x86_64 KVM builds carry (and check) the common CPUID.
    if let Some(cpuid) = vm.get("common_cpuid") {
        migration.insert("common_cpuid".into(), cpuid.clone());
    }
    migration.insert("memory_manager_data".into(), mm_data);
    let migration_config =
        serde_json::to_vec(&Value::Object(migration)).map_err(|source| SnapshotDirError::Json {
            what: "the migration configuration",
            source,
        })?;
    if migration_config.len() as u64 > limits.max_config {
        return Err(SnapshotDirError::Invalid(format!(
            "the migration configuration is {} bytes (at most {})",
            migration_config.len(),
            limits.max_config
        )));
    }
    Ok(ChSnapshotDir {
        migration_config,
        state,
        memory_ranges,
        slots,
    })
}
