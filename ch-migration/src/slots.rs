//! Guest RAM slots as cloud-hypervisor describes them (its memory
//! manager's `guest_ram_mappings`: slot, guest address, size, offset in
//! the slot's file), and the checks every table of them passes before a
//! fault is mapped through it or a file is read for it: whoever wrote the
//! table (a peer, a directory on disk) is not trusted.

use super::ChMigrationError;

/// The granularity every slot and fault is aligned to (the base page).
pub const SLOT_ALIGN: u64 = 4096;

/// One guest RAM slot: `size` bytes at guest address `gpa`, held at
/// `file_offset` in the slot's memory file (or fd).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotRange {
    /// cloud-hypervisor's memory slot number (the `MemoryFd` slot).
    pub slot: u32,
    /// Guest physical address of the slot's first byte.
    pub gpa: u64,
    /// Bytes in the slot.
    pub size: u64,
    /// Where the slot's first byte lies in its memory file.
    pub file_offset: u64,
}

impl SlotRange {
    /// The guest address one past the slot's end (checked by
    /// [`check_slots`]).
    pub fn gpa_end(&self) -> u64 {
        self.gpa.saturating_add(self.size)
    }
}

/// Checks a slot table: at most `max_slots` slots, each non-empty, aligned
/// to [`SLOT_ALIGN`], without overflow of its guest range or its file
/// range, no slot number twice and no two slots overlapping in the guest.
///
/// # Errors
///
/// [`ChMigrationError::BadSlot`] naming the first slot that fails, or
/// [`ChMigrationError::TooManyFds`] for too many slots.
pub fn check_slots(slots: &[SlotRange], max_slots: usize) -> Result<(), ChMigrationError> {
    if slots.len() > max_slots {
        return Err(ChMigrationError::TooManyFds(max_slots));
    }
    let bad = |s: &SlotRange, why| ChMigrationError::BadSlot { slot: s.slot, why };
    for (i, s) in slots.iter().enumerate() {
        if s.size == 0 {
            return Err(bad(s, "it is empty"));
        }
        if (s.gpa | s.size | s.file_offset) % SLOT_ALIGN != 0 {
            return Err(bad(
                s,
                "its address, size or file offset is not page aligned",
            ));
        }
        if s.gpa.checked_add(s.size).is_none() || s.file_offset.checked_add(s.size).is_none() {
            return Err(bad(s, "its guest or file range overflows"));
        }
        for other in &slots[..i] {
            if other.slot == s.slot {
                return Err(bad(s, "its number is given twice"));
            }
            if s.gpa < other.gpa_end() && other.gpa < s.gpa_end() {
                return Err(bad(s, "it overlaps another slot in guest memory"));
            }
        }
    }
    Ok(())
}

/// The slot holding all of `gpa..gpa+length`, if one does.
pub fn slot_of(slots: &[SlotRange], gpa: u64, length: u64) -> Option<&SlotRange> {
    let end = gpa.checked_add(length)?;
    slots.iter().find(|s| gpa >= s.gpa && end <= s.gpa_end())
}
