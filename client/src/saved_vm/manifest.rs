//! A saved VM's manifest (`hugemem-manifest.json`): what a save wrote, so
//! that a load can tell a whole, undamaged save from anything else.
//!
//! A save writes the manifest last, into a directory that gets its final
//! name only after every file and the directory were flushed (see
//! `staging`): a directory with a manifest was written whole. The manifest
//! then lets a load prove that nothing changed since: every file's size,
//! the CRC-32C of each small file, and the CRC-32C of each piece
//! ([`PIECE`], 2 MiB) of each memory file, holes included. The loader
//! checks the sizes and the small files before anything is parked; the
//! daemon checks each piece of memory as it reads it (`PARK` with
//! `VERIFY`), eagerly or on demand.
//!
//! It detects damage (a short write, a torn file, a flipped bit, a file
//! replaced by another of the same size); it is not a signature: whoever
//! can write the directory can write a matching manifest.
//!
//! The format (docs/protocol.md, "A saved VM's manifest"):
//!
//! ```json
//! {"format": "hugemem-saved-vm", "version": 1, "vmm": "cloud-hypervisor",
//!  "source": {"name": "g", "uid": 1000, "host": "h1", "hugemem": "0.1.0",
//!             "parked_at": 1764336000, "saved_at": 1764339600},
//!  "page_size": 2097152, "piece_bytes": 2097152,
//!  "files": [{"name": "migration_config.json", "size": 5120, "crc32c": 12345},
//!            {"name": "state.json", "size": 90210, "crc32c": 67890}],
//!  "memory": [{"name": "memory-0", "slot": 0, "size": 536870912,
//!              "crc32c": [2893318424, ...]}]}
//! ```

use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use ch_migration::layout::{open_regular, SnapshotDirError};

/// The manifest's file in a saved VM's directory.
pub const MANIFEST_FILE: &str = "hugemem-manifest.json";
/// The manifest's `format`.
pub const FORMAT: &str = "hugemem-saved-vm";
/// The manifest version this hugemem writes and reads.
pub const VERSION: u32 = 1;
/// The manifest's `vmm` for a cloud-hypervisor VM.
pub const VMM_CLOUD_HYPERVISOR: &str = "cloud-hypervisor";
/// The manifest's `vmm` for a QEMU VM (its configuration says
/// `"vmm": "qemu"`: `hugemem launch`'s QEMU park, docs/protocol.md, "A
/// QEMU VM's snapshot").
pub const VMM_QEMU: &str = "qemu";
/// Bytes per checksummed piece of a memory file (a multiple of every page
/// size but 4 KiB, and a divisor of 1 GiB: a piece never crosses a unit of
/// the fill engine).
pub const PIECE: u64 = 2 << 20;

/// Bytes a manifest may have for memory of `memory_bytes` in `files`
/// memory files: room for each piece's checksum (at most 11 bytes of JSON)
/// plus the fixed part. A reader bounds the file by this before reading it.
pub fn max_manifest_len(memory_bytes: u64, files: usize) -> u64 {
    let pieces = memory_bytes.div_ceil(PIECE);
    (64 << 10) + (files as u64).saturating_mul(1 << 10) + pieces.saturating_mul(11)
}

/// Where the saved VM came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Source {
    /// The name it was parked under.
    pub name: String,
    /// The uid that parked it.
    pub uid: u32,
    /// The host that saved it.
    pub host: String,
    /// The hugemem version that saved it.
    pub hugemem: String,
    /// When it was parked (seconds since the epoch).
    pub parked_at: u64,
    /// When it was saved.
    pub saved_at: u64,
}

/// A small file, checked whole.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WholeFile {
    /// Its name in the directory.
    pub name: String,
    /// Its size in bytes.
    pub size: u64,
    /// The CRC-32C of its bytes.
    pub crc32c: u32,
}

/// A memory file, checked piece by piece.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryFile {
    /// Its name in the directory (`memory-<slot>`).
    pub name: String,
    /// The memory slot it holds.
    pub slot: u32,
    /// Its size in bytes (the slot's).
    pub size: u64,
    /// The CRC-32C of each piece (holes read as zero), the last one ending
    /// at `size`.
    pub crc32c: Vec<u32>,
}

/// A saved VM's manifest (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: String,
    /// [`VERSION`].
    pub version: u32,
    /// The VMM whose snapshot this is: [`VMM_CLOUD_HYPERVISOR`] or
    /// [`VMM_QEMU`], as [`vmm_of`] its configuration.
    pub vmm: String,
    /// Where it came from.
    pub source: Source,
    /// The page size the VM was parked on, bytes.
    pub page_size: u64,
    /// Bytes per checksummed piece ([`PIECE`]).
    pub piece_bytes: u64,
    /// The configuration and the state.
    pub files: Vec<WholeFile>,
    /// The memory files.
    pub memory: Vec<MemoryFile>,
}

/// Why a saved VM's directory does not match its manifest, or the
/// manifest cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// A file could not be read.
    #[error(transparent)]
    Dir(#[from] SnapshotDirError),
    /// Not a manifest this version reads.
    #[error("{}: {why}", path.display())]
    Format {
        /// The manifest.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// A file the manifest lists is missing.
    #[error("{}: missing (the manifest lists it)", path.display())]
    Missing {
        /// The file.
        path: PathBuf,
    },
    /// A file of another size than the manifest says.
    #[error("{}: {found} bytes, the manifest says {expected}", path.display())]
    Size {
        /// The file.
        path: PathBuf,
        /// What the manifest says.
        expected: u64,
        /// What the file has.
        found: u64,
    },
    /// Bytes whose checksum is not the manifest's.
    #[error("{}: the {len} bytes at offset {offset:#x} have CRC-32C {found:#010x}, the manifest says {expected:#010x}", path.display())]
    Checksum {
        /// The file.
        path: PathBuf,
        /// Where the bytes start.
        offset: u64,
        /// How many.
        len: u64,
        /// What the manifest says.
        expected: u32,
        /// What the bytes have.
        found: u32,
    },
}

impl Manifest {
    /// Parses a manifest and checks that it is one this version reads and
    /// that it holds together: the format and version, names of the
    /// layout's files only (no path), a power-of-two piece size, one
    /// checksum per piece, each slot and name once, at most `max_slots`
    /// memory files. `path` names it in errors.
    ///
    /// # Errors
    ///
    /// [`ManifestError::Format`].
    pub fn parse(bytes: &[u8], path: &Path, max_slots: usize) -> Result<Self, ManifestError> {
        let refuse = |why: String| ManifestError::Format {
            path: path.to_owned(),
            why,
        };
        let m: Manifest = serde_json::from_slice(bytes)
            .map_err(|e| refuse(format!("not a saved VM's manifest: {e}")))?;
        if m.format != FORMAT {
            return Err(refuse(format!("format {:?}, not {FORMAT:?}", m.format)));
        }
        if m.version != VERSION {
            return Err(refuse(format!(
                "manifest version {} (this hugemem reads version {VERSION})",
                m.version
            )));
        }
        if !m.piece_bytes.is_power_of_two() || !(4096..=1 << 30).contains(&m.piece_bytes) {
            return Err(refuse(format!("piece size {}", m.piece_bytes)));
        }
        if m.memory.len() > max_slots {
            return Err(refuse(format!("more than {max_slots} memory files")));
        }
        let mut names: Vec<&str> = Vec::new();
        for name in m
            .files
            .iter()
            .map(|f| f.name.as_str())
            .chain(m.memory.iter().map(|f| f.name.as_str()))
        {
            if !plain_name(name) || names.contains(&name) {
                return Err(refuse(format!("file name {name:?}")));
            }
            names.push(name);
        }
        for (i, f) in m.memory.iter().enumerate() {
            if m.memory[..i].iter().any(|g| g.slot == f.slot) {
                return Err(refuse(format!("slot {} listed twice", f.slot)));
            }
            if f.crc32c.len() as u64 != f.size.div_ceil(m.piece_bytes) {
                return Err(refuse(format!(
                    "{}: {} checksums for {} bytes",
                    f.name,
                    f.crc32c.len(),
                    f.size
                )));
            }
        }
        Ok(m)
    }

    /// The manifest of the saved VM in `dir`, read under the bound of
    /// [`max_manifest_len`] for `memory_bytes` of memory in `files` files;
    /// `None` when the directory has none.
    ///
    /// # Errors
    ///
    /// As [`Manifest::parse`]; the file not regular, over its bound, or
    /// unreadable.
    pub fn read(
        dir: &Path,
        memory_bytes: u64,
        files: usize,
        max_slots: usize,
    ) -> Result<Option<Self>, ManifestError> {
        let path = dir.join(MANIFEST_FILE);
        let (file, _) = match open_regular(&path) {
            Ok(f) => f,
            Err(SnapshotDirError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                return Ok(None)
            }
            Err(e) => return Err(e.into()),
        };
        Self::from_file(
            file,
            &path,
            max_manifest_len(memory_bytes, files),
            max_slots,
        )
        .map(Some)
    }

    /// [`Manifest::parse`] of what `file` holds, at most `max` bytes;
    /// `path` names it in errors (the daemon reads a manifest a tenant
    /// opened, by its fd).
    ///
    /// # Errors
    ///
    /// As [`Manifest::parse`]; a file over `max` or unreadable.
    pub fn from_file(
        file: std::fs::File,
        path: &Path,
        max: u64,
        max_slots: usize,
    ) -> Result<Self, ManifestError> {
        let bytes = read_bounded(file, path, max)?;
        Self::parse(&bytes, path, max_slots)
    }

    /// The manifest's bytes, as a save writes them.
    pub fn to_bytes(&self) -> Vec<u8> {
        // Serializing plain strings and numbers cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// The memory file of `slot`.
    pub fn memory_of(&self, slot: u32) -> Option<&MemoryFile> {
        self.memory.iter().find(|f| f.slot == slot)
    }

    /// Checks `bytes`, read from the small file `name` of `dir`, against
    /// the manifest.
    ///
    /// # Errors
    ///
    /// [`ManifestError::Format`] when the manifest does not list it (a
    /// file that was not saved is not trusted), [`ManifestError::Size`],
    /// [`ManifestError::Checksum`].
    pub fn check_whole(&self, dir: &Path, name: &str, bytes: &[u8]) -> Result<(), ManifestError> {
        let path = dir.join(name);
        let Some(f) = self.files.iter().find(|f| f.name == name) else {
            return Err(ManifestError::Format {
                path: dir.join(MANIFEST_FILE),
                why: format!("it does not list {name}"),
            });
        };
        if f.size != bytes.len() as u64 {
            return Err(ManifestError::Size {
                path,
                expected: f.size,
                found: bytes.len() as u64,
            });
        }
        let found = crc32c::crc32c(bytes);
        if found != f.crc32c {
            return Err(ManifestError::Checksum {
                path,
                offset: 0,
                len: f.size,
                expected: f.crc32c,
                found,
            });
        }
        Ok(())
    }

    /// Checks that every file the manifest lists is in `dir` as a regular
    /// file of the size it says (the contents of the memory files are
    /// checked as they are read).
    ///
    /// # Errors
    ///
    /// [`ManifestError::Missing`], [`ManifestError::Size`], a file that is
    /// not a regular file.
    pub fn check_sizes(&self, dir: &Path) -> Result<(), ManifestError> {
        let listed = self
            .files
            .iter()
            .map(|f| (&f.name, f.size))
            .chain(self.memory.iter().map(|f| (&f.name, f.size)));
        for (name, expected) in listed {
            let path = dir.join(name);
            let found = match open_regular(&path) {
                Ok((_, len)) => len,
                Err(SnapshotDirError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::NotFound =>
                {
                    return Err(ManifestError::Missing { path })
                }
                Err(e) => return Err(e.into()),
            };
            if found != expected {
                return Err(ManifestError::Size {
                    path,
                    expected,
                    found,
                });
            }
        }
        Ok(())
    }

    /// Reads every memory file of `dir` and checks each piece against the
    /// manifest (`hugemem saved check`: without a daemon, with this user's
    /// rights). Calls `progress` with the bytes checked so far.
    ///
    /// # Errors
    ///
    /// The first mismatch, or a file that cannot be read.
    pub fn check_memory(
        &self,
        dir: &Path,
        progress: &mut dyn FnMut(u64),
    ) -> Result<u64, ManifestError> {
        let mut buf = vec![0u8; usize::try_from(self.piece_bytes).unwrap_or(PIECE as usize)];
        let mut done = 0;
        for f in &self.memory {
            let path = dir.join(&f.name);
            let (file, _) = open_regular(&path)?;
            for (k, expected) in f.crc32c.iter().enumerate() {
                let offset = k as u64 * self.piece_bytes;
                let len = self.piece_bytes.min(f.size - offset);
                let piece = &mut buf[..len as usize];
                std::os::unix::fs::FileExt::read_exact_at(&file, piece, offset)
                    .map_err(SnapshotDirError::io(&path))?;
                let found = crc32c::crc32c(piece);
                if found != *expected {
                    return Err(ManifestError::Checksum {
                        path,
                        offset,
                        len,
                        expected: *expected,
                        found,
                    });
                }
                done += len;
                progress(done);
            }
        }
        Ok(done)
    }
}

/// The VMM whose VM a migration configuration describes: a QEMU VM's
/// names itself (`"vmm": "qemu"`), a cloud-hypervisor VM's has no `vmm`.
/// `None` for a configuration that is not a JSON object, or names another
/// VMM.
pub fn vmm_of(config: &[u8]) -> Option<&'static str> {
    let value: serde_json::Value = serde_json::from_slice(config).ok()?;
    match value.as_object()?.get("vmm") {
        None => Some(VMM_CLOUD_HYPERVISOR),
        Some(v) if v.as_str() == Some(VMM_QEMU) => Some(VMM_QEMU),
        Some(_) => None,
    }
}

/// A file name of the layout: no path separator, not `.` or `..`, printable
/// ASCII.
fn plain_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name != "."
        && name != ".."
        && name.bytes().all(|b| b.is_ascii_graphic() && b != b'/')
}

/// Reads all of `file` (at `path`), refusing more than `max` bytes.
fn read_bounded(file: std::fs::File, path: &Path, max: u64) -> Result<Vec<u8>, ManifestError> {
    let mut out = Vec::new();
    file.take(max.saturating_add(1))
        .read_to_end(&mut out)
        .map_err(SnapshotDirError::io(path))?;
    if out.len() as u64 > max {
        return Err(SnapshotDirError::TooLarge {
            path: path.to_owned(),
            length: out.len() as u64,
            max,
        }
        .into());
    }
    Ok(out)
}
