//! Reading a saved VM's directory for a load: which kind it is, its files,
//! and every check that can be made before anything is parked.
//!
//! * hugemem's own save (the reference offload daemon's layout with a
//!   manifest): every file's size, the configuration's and the state's
//!   checksums, that the manifest's memory files are the configuration's
//!   slots and its `vmm` the configuration's (a cloud-hypervisor VM or a
//!   QEMU VM); the memory's checksums go to the daemon.
//! * The reference offload daemon's directory (no manifest): each slot's
//!   file covers its slot, the configuration and the state parse to their
//!   end. No checksums: damage to the memory's bytes cannot be seen.
//! * cloud-hypervisor's own `file://` snapshot: the same, and
//!   `memory-ranges` matches its table. No checksums either.

use std::path::{Path, PathBuf};

use ch_migration::ch_snapshot_dir::{read_ch_snapshot_dir, CH_CONFIG_FILE};
use ch_migration::layout::open_regular;
use ch_migration::offload_dir::{read_offload_dir, MIGRATION_CONFIG_FILE, STATE_FILE};
use ch_migration::Limits;

use super::error::SavedVmError;
use super::manifest::{vmm_of, Manifest, MANIFEST_FILE};

/// What kind of directory a load read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirKind {
    /// hugemem's save, with its manifest: checked throughout.
    Saved,
    /// The reference offload daemon's layout without a manifest.
    OffloadDaemon,
    /// cloud-hypervisor's `snapshot destination_url=file://`.
    CloudHypervisor,
}

impl DirKind {
    /// How a user reads it: what was and was not checked.
    pub fn describe(self) -> &'static str {
        match self {
            DirKind::Saved => "a hugemem save; every file checked against its manifest",
            DirKind::OffloadDaemon => {
                "an offload daemon's snapshot without a manifest: its files were checked for shape \
                 only, and it carries no checksums, so damage to its memory cannot be detected"
            }
            DirKind::CloudHypervisor => {
                "a cloud-hypervisor file:// snapshot: its files were checked for shape only, and it \
                 carries no checksums, so damage to its memory cannot be detected"
            }
        }
    }
}

/// A snapshot read from a directory: each slot's file, the configuration
/// (its slots' `file_offset`s where each slot's bytes are in its file), the
/// state, and the manifest with the file it was read from.
pub(super) struct Loaded {
    pub memory: Vec<(u32, std::fs::File)>,
    pub config: Vec<u8>,
    pub state: Vec<u8>,
    pub kind: DirKind,
    pub manifest: Option<(Manifest, std::fs::File)>,
}

/// Reads the saved VM in `dir` and checks what can be checked without
/// reading its memory.
pub(super) fn load(dir: &Path) -> Result<Loaded, SavedVmError> {
    let limits = Limits::default();
    std::fs::read_dir(dir).map_err(ch_migration::layout::SnapshotDirError::io(dir))?;
    if dir.join(MIGRATION_CONFIG_FILE).exists() {
        return load_offload(dir, limits);
    }
    if dir.join(CH_CONFIG_FILE).exists() {
        return load_ch(dir, limits);
    }
    Err(SavedVmError::Unsupported(format!(
        "{} holds neither {MIGRATION_CONFIG_FILE} (a hugemem save or an offload daemon's \
         snapshot) nor {CH_CONFIG_FILE} (cloud-hypervisor's)",
        dir.display()
    )))
}

fn load_offload(dir: &Path, limits: Limits) -> Result<Loaded, SavedVmError> {
    let d = read_offload_dir(dir, limits)?;
    let memory_bytes: u64 = d.slots.iter().map(|s| s.range.size).sum();
    let manifest = match Manifest::read(dir, memory_bytes, d.slots.len(), limits.max_memory_fds)? {
        Some(m) => {
            check_against_manifest(dir, &m, &d)?;
            let (file, _) = open_regular(&dir.join(MANIFEST_FILE))?;
            Some((m, file))
        }
        None => {
            state_parses(dir.join(STATE_FILE), &d.state)?;
            None
        }
    };
    check_vmm(dir, manifest.as_ref().map(|(m, _)| m), &d)?;
    let mut memory = Vec::new();
    for s in &d.slots {
        memory.push((s.range.slot, open_regular(&s.path)?.0));
    }
    // Each slot's file holds its bytes from offset 0; the configuration
    // still names where they were in the saved VM's fd (a slot above
    // the 32-bit hole shares its zone's fd at an offset).
    let offsets: Vec<(u32, u64)> = d.slots.iter().map(|s| (s.range.slot, 0)).collect();
    Ok(Loaded {
        memory,
        config: with_file_offsets(&d.config, &offsets)?,
        state: d.state,
        kind: if manifest.is_some() {
            DirKind::Saved
        } else {
            DirKind::OffloadDaemon
        },
        manifest,
    })
}

/// The manifest against what the directory holds: the configuration and
/// the state byte for byte, every file's size, and the memory files are
/// the configuration's slots.
fn check_against_manifest(
    dir: &Path,
    m: &Manifest,
    d: &ch_migration::offload_dir::OffloadDir,
) -> Result<(), SavedVmError> {
    m.check_sizes(dir)?;
    m.check_whole(dir, MIGRATION_CONFIG_FILE, &d.config)?;
    m.check_whole(dir, STATE_FILE, &d.state)?;
    let listed = |slot| m.memory_of(slot).map(|f| (f.name.clone(), f.size));
    for s in &d.slots {
        let name = s
            .path
            .file_name()
            .and_then(|n| n.to_str())
            .map(str::to_owned);
        if listed(s.range.slot) != name.map(|n| (n, s.range.size)) {
            return Err(SavedVmError::Unsupported(format!(
                "{}: slot {} ({} bytes) is not the manifest's",
                dir.join(MANIFEST_FILE).display(),
                s.range.slot,
                s.range.size
            )));
        }
    }
    if m.memory.len() != d.slots.len() {
        return Err(SavedVmError::Unsupported(format!(
            "{}: {} memory files, the configuration has {} slots",
            dir.join(MANIFEST_FILE).display(),
            m.memory.len(),
            d.slots.len()
        )));
    }
    Ok(())
}

/// The configuration is a VM's that hugemem restores, and the manifest's
/// `vmm` (if any) names its VMM. (A QEMU VM of several memory regions
/// loads too: the daemon gives each slot a region of its own, its file
/// from the start, as QEMU maps it.)
fn check_vmm(
    dir: &Path,
    manifest: Option<&Manifest>,
    d: &ch_migration::offload_dir::OffloadDir,
) -> Result<(), SavedVmError> {
    let config = dir.join(MIGRATION_CONFIG_FILE);
    let Some(vmm) = vmm_of(&d.config) else {
        return Err(SavedVmError::Unsupported(format!(
            "{}: neither a cloud-hypervisor VM's configuration nor a QEMU VM's",
            config.display()
        )));
    };
    if let Some(m) = manifest.filter(|m| m.vmm != vmm) {
        return Err(SavedVmError::Unsupported(format!(
            "{}: it says a {:?} VM, {} is a {vmm:?} VM's",
            dir.join(MANIFEST_FILE).display(),
            m.vmm,
            config.display()
        )));
    }
    Ok(())
}

/// The state parses as JSON to its end (a torn write leaves it short).
fn state_parses(path: PathBuf, state: &[u8]) -> Result<(), SavedVmError> {
    serde_json::from_slice::<serde::de::IgnoredAny>(state)
        .map(|_| ())
        .map_err(|e| SavedVmError::Unsupported(format!("{}: not whole JSON: {e}", path.display())))
}

fn load_ch(dir: &Path, limits: Limits) -> Result<Loaded, SavedVmError> {
    let d = read_ch_snapshot_dir(dir, limits)?;
    // Each slot's bytes must be one run of `memory-ranges` (a full
    // snapshot's are): its `file_offset` is then where that run starts.
    let mut offsets = Vec::new();
    for s in &d.slots {
        let [piece] = s.pieces.as_slice() else {
            return Err(SavedVmError::Unsupported(format!(
                "slot {}'s memory is in {} pieces of memory-ranges; only whole slots load",
                s.range.slot,
                s.pieces.len()
            )));
        };
        offsets.push((s.range.slot, piece.file_offset));
    }
    let config = with_file_offsets(&d.migration_config, &offsets)?;
    let file = open_regular(&d.memory_ranges)?.0;
    let mut memory = Vec::new();
    for s in &d.slots {
        memory.push((s.range.slot, file.try_clone()?));
    }
    Ok(Loaded {
        memory,
        config,
        state: d.state,
        kind: DirKind::CloudHypervisor,
        manifest: None,
    })
}

/// `config` (a migration configuration) with the `file_offset` of each
/// slot in `offsets` in its `guest_ram_mappings` set: where that slot's
/// bytes are in the file the load sends for it.
pub(super) fn with_file_offsets(
    config: &[u8],
    offsets: &[(u32, u64)],
) -> Result<Vec<u8>, SavedVmError> {
    let mut config: serde_json::Value = serde_json::from_slice(config)
        .map_err(|e| SavedVmError::Unsupported(format!("the configuration: {e}")))?;
    let mappings = config
        .pointer_mut("/memory_manager_data/guest_ram_mappings")
        .and_then(serde_json::Value::as_array_mut)
        .ok_or_else(|| SavedVmError::Unsupported("no guest_ram_mappings".into()))?;
    for m in mappings.iter_mut() {
        let slot = m.get("slot").and_then(serde_json::Value::as_u64);
        if let Some((_, offset)) = offsets.iter().find(|(s, _)| Some(u64::from(*s)) == slot) {
            m["file_offset"] = (*offset).into();
        }
    }
    serde_json::to_vec(&config)
        .map_err(|e| SavedVmError::Unsupported(format!("the configuration: {e}")))
}
