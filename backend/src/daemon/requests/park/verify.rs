//! PARK with VERIFY: a saved VM's manifest (the request's second fd, a
//! file the tenant opened) read under a bound its memory's size sets, and
//! matched to the snapshot's memory files, so that the fill engine checks
//! each piece of memory against it as it reads it (`fills::plan`).
//!
//! The manifest is the tenant's: it proves nothing to the daemon about
//! whose data this is (every park from files is copied onto pool memory of
//! the tenant's own). What it gives is that a damaged file is never taken
//! for the VM's memory: the tenant's own save checked, byte for byte, at
//! the moment the bytes are read.

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use hugemem_client::saved_vm::manifest::{max_manifest_len, Manifest, MANIFEST_FILE};

use super::snapshot::{invalid, Checked, Refusal};
use crate::daemon::requests::parked::loads::{SourceChecksums, SourceSpec};

/// Reads the manifest in `fd` for the snapshot `checked`: at most what a
/// manifest of its memory can need, a regular file, a manifest of this
/// version, listing exactly the snapshot's memory slots with the sizes of
/// their files.
///
/// # Errors
///
/// A refusal that says what does not match.
pub fn read_manifest(fd: OwnedFd, checked: &Checked) -> Result<Manifest, Refusal> {
    let kind =
        nix::sys::stat::fstat(fd.as_fd()).map_err(|e| invalid(format!("the manifest fd: {e}")))?;
    if kind.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(invalid("the manifest fd is not a regular file"));
    }
    let memory_bytes = checked
        .mappings
        .iter()
        .map(|m| m.size)
        .fold(0u64, u64::saturating_add);
    let max = max_manifest_len(memory_bytes, checked.memory.len());
    let manifest = Manifest::from_file(
        std::fs::File::from(fd),
        Path::new(MANIFEST_FILE),
        max,
        checked.memory.len(),
    )
    .map_err(|e| invalid(e.to_string()))?;
    if manifest.memory.len() != checked.memory.len() {
        return Err(invalid(format!(
            "the manifest lists {} memory files, the snapshot has {}",
            manifest.memory.len(),
            checked.memory.len()
        )));
    }
    for f in &checked.memory {
        let Some(listed) = manifest.memory_of(f.slot) else {
            return Err(invalid(format!(
                "the manifest does not list slot {}",
                f.slot
            )));
        };
        let size = nix::sys::stat::fstat(f.fd.as_fd())
            .map(|st| u64::try_from(st.st_size).unwrap_or(0))
            .map_err(|e| invalid(format!("memory fd of slot {}: {e}", f.slot)))?;
        if size != listed.size {
            return Err(invalid(format!(
                "{}: {size} bytes, the manifest says {}",
                listed.name, listed.size
            )));
        }
    }
    Ok(manifest)
}

/// The checksums of each fill source (`specs`, made from `checked`'s
/// mappings): a source must read its slot's whole file, as a save's
/// configuration has it (one mapping per slot, from offset 0).
///
/// # Errors
///
/// A slot whose mappings do not read its file whole.
pub fn source_checksums(
    manifest: &Manifest,
    checked: &Checked,
    specs: &[SourceSpec],
) -> Result<Vec<SourceChecksums>, Refusal> {
    let mut out = Vec::with_capacity(specs.len());
    for (i, spec) in specs.iter().enumerate() {
        let slot = checked.memory[spec.file].slot;
        let listed = manifest
            .memory_of(slot)
            .ok_or_else(|| invalid(format!("the manifest does not list slot {slot}")))?;
        if spec.file_offset != 0 || spec.len != listed.size {
            return Err(invalid(format!(
                "slot {slot}'s mapping reads {:#x}+{:#x} of {}, not the whole file the manifest checks",
                spec.file_offset, spec.len, listed.name
            )));
        }
        out.push(SourceChecksums {
            source: i,
            name: listed.name.clone(),
            piece: manifest.piece_bytes,
            file_len: listed.size,
            crc32c: listed.crc32c.clone(),
        });
    }
    Ok(out)
}
