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
//! writes parked VMs in exactly this layout, so either tool restores the
//! other's output. A directory is read as untrusted: every file is bounded
//! ([`Limits`]), must be a regular file (no link followed) and every slot's
//! file must be exactly its size.

use std::fs::{DirBuilder, File, OpenOptions};
use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::layout::{migration_config_slots, open_regular, read_bounded, SnapshotDirError};
use super::peer::Snapshot;
use super::slots::SlotRange;
pub use super::sparse_copy::CopyStats;
use super::sparse_copy::{copy_sparse, CopyJob};
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

/// What [`write_offload_dir`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteReport {
    /// Memory files written.
    pub slots: usize,
    /// Guest RAM bytes the memory files hold (their sizes).
    pub memory_bytes: u64,
    /// How the memory was copied (bytes written, left as holes, threads).
    pub copy: CopyStats,
}

/// Creates `dir` (mode 0700), or takes it when it exists and is empty.
fn claim_dir(dir: &Path) -> Result<(), SnapshotDirError> {
    match DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let mut entries = std::fs::read_dir(dir).map_err(SnapshotDirError::io(dir))?;
            if entries.next().is_some() {
                return Err(SnapshotDirError::NotEmpty(dir.to_owned()));
            }
            Ok(())
        }
        Err(e) => Err(SnapshotDirError::io(dir)(e)),
    }
}

/// A new file (`O_EXCL`, mode 0600) in the claimed directory.
fn create_file(path: &Path) -> Result<File, SnapshotDirError> {
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
        .open(path)
        .map_err(SnapshotDirError::io(path))
}

fn write_small(path: &Path, bytes: &[u8]) -> Result<(), SnapshotDirError> {
    let mut file = create_file(path)?;
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .map_err(SnapshotDirError::io(path))
}

/// Writes `snapshot` (a parked VM: its slots' fds, configuration and
/// state) to the directory `dir` in the reference daemon's layout. `dir`
/// is created, or must exist empty; every file is new (`O_EXCL`, 0600).
/// The memory files are copied sparsely and in parallel (see
/// `sparse_copy`); every file and the directory are fsynced before this
/// returns.
///
/// # Errors
///
/// [`SnapshotDirError`]: `dir` not empty, a configuration without a valid
/// slot table, a slot without its fd (or an fd without its slot), an I/O
/// failure (the files written so far stay: the directory is the caller's).
pub fn write_offload_dir(dir: &Path, snapshot: &Snapshot) -> Result<WriteReport, SnapshotDirError> {
    let limits = Limits::default();
    let ranges = migration_config_slots(&snapshot.config, limits.max_memory_fds)?;
    for (slot, _) in &snapshot.memory {
        if !ranges.iter().any(|r| r.slot == *slot) {
            return Err(SnapshotDirError::Invalid(format!(
                "memory fd for slot {slot}, which the configuration does not have"
            )));
        }
    }
    let mut fds = Vec::with_capacity(ranges.len());
    for range in &ranges {
        let fd = snapshot
            .memory
            .iter()
            .find(|(s, _)| *s == range.slot)
            .map(|(_, fd)| fd.as_fd())
            .ok_or_else(|| {
                SnapshotDirError::Invalid(format!("slot {} came without its fd", range.slot))
            })?;
        fds.push(fd);
    }
    claim_dir(dir)?;
    write_small(&dir.join(MIGRATION_CONFIG_FILE), &snapshot.config)?;
    write_small(&dir.join(STATE_FILE), &snapshot.state)?;
    let mut files = Vec::with_capacity(ranges.len());
    for range in &ranges {
        let path = dir.join(memory_slot_filename(range.slot));
        let file = create_file(&path)?;
        file.set_len(range.size)
            .map_err(SnapshotDirError::io(&path))?;
        files.push((path, file));
    }
    let jobs: Vec<_> = ranges
        .iter()
        .zip(&fds)
        .zip(&files)
        .map(|((range, fd), (_, file))| CopyJob {
            src: *fd,
            src_offset: range.file_offset,
            len: range.size,
            dst: file,
        })
        .collect();
    let copy = copy_sparse(&jobs).map_err(SnapshotDirError::io(dir))?;
    for (path, file) in &files {
        file.sync_all().map_err(SnapshotDirError::io(path))?;
    }
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(SnapshotDirError::io(dir))?;
    Ok(WriteReport {
        slots: ranges.len(),
        memory_bytes: ranges.iter().map(|r| r.size).sum(),
        copy,
    })
}
