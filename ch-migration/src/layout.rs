//! What the snapshot directories share: their errors, size-bounded reads
//! of their files (a directory may be hostile as much as a peer), and the
//! slot table out of cloud-hypervisor's `MemoryManagerSnapshotData`
//! (`guest_ram_mappings`).

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::slots::{check_slots, SlotRange};
use super::ChMigrationError;

/// Why a snapshot directory could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotDirError {
    /// A file operation failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A file over its bound.
    #[error("{}: {length} bytes (at most {max})", path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its length.
        length: u64,
        /// The bound.
        max: u64,
    },
    /// A file that is not a regular file (a link, a device, a directory).
    #[error("{}: not a regular file", .0.display())]
    NotAFile(PathBuf),
    /// A JSON file that does not parse.
    #[error("{what} is not JSON: {source}")]
    Json {
        /// Which part.
        what: &'static str,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// A field missing or of the wrong type.
    #[error("{what}: no {field} (or not of its type)")]
    Field {
        /// Which part.
        what: &'static str,
        /// The field.
        field: &'static str,
    },
    /// A slot table, range table or memory file that cannot be right.
    #[error("{0}")]
    Invalid(String),
    /// A bad slot.
    #[error(transparent)]
    Slot(#[from] ChMigrationError),
    /// The directory to write to exists and is not empty.
    #[error("{}: exists and is not empty", .0.display())]
    NotEmpty(PathBuf),
}

impl SnapshotDirError {
    /// An [`SnapshotDirError::Io`] for `path`, for `map_err`.
    pub fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Self + '_ {
        move |source| Self::Io {
            path: path.to_owned(),
            source,
        }
    }
}

/// Opens `path` for reading without following a link, and checks that it
/// is a regular file; returns it and its length. `O_NONBLOCK`: a FIFO in
/// its place must not make the open wait for a writer (it is then refused
/// as not a regular file; on a regular file the flag changes nothing).
pub fn open_regular(path: &Path) -> Result<(std::fs::File, u64), SnapshotDirError> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
        .map_err(SnapshotDirError::io(path))?;
    let meta = file.metadata().map_err(SnapshotDirError::io(path))?;
    if !meta.is_file() {
        return Err(SnapshotDirError::NotAFile(path.to_owned()));
    }
    Ok((file, meta.len()))
}

/// Reads all of `path`, refusing more than `max` bytes (checked before a
/// byte is read, and again while reading: the file may grow).
pub(crate) fn read_bounded(path: &Path, max: u64) -> Result<Vec<u8>, SnapshotDirError> {
    let (file, length) = open_regular(path)?;
    let too_large = |length| SnapshotDirError::TooLarge {
        path: path.to_owned(),
        length,
        max,
    };
    if length > max {
        return Err(too_large(length));
    }
    let mut out = Vec::with_capacity(usize::try_from(length).unwrap_or(0));
    file.take(max.saturating_add(1))
        .read_to_end(&mut out)
        .map_err(SnapshotDirError::io(path))?;
    if out.len() as u64 > max {
        return Err(too_large(out.len() as u64));
    }
    Ok(out)
}

/// Parses JSON bytes.
pub(crate) fn parse_json(
    bytes: &[u8],
    what: &'static str,
) -> Result<serde_json::Value, SnapshotDirError> {
    serde_json::from_slice(bytes).map_err(|source| SnapshotDirError::Json { what, source })
}

/// The slot table in a `MemoryManagerSnapshotData` (its
/// `guest_ram_mappings`), checked by [`check_slots`] under `max_slots`.
///
/// # Errors
///
/// A missing field, a slot number over `u32`, a table [`check_slots`]
/// refuses.
pub fn guest_ram_mappings(
    memory_manager_data: &serde_json::Value,
    max_slots: usize,
) -> Result<Vec<SlotRange>, SnapshotDirError> {
    const WHAT: &str = "the memory manager's data";
    let field = |field| SnapshotDirError::Field { what: WHAT, field };
    let mappings = memory_manager_data
        .get("guest_ram_mappings")
        .and_then(|v| v.as_array())
        .ok_or(field("guest_ram_mappings"))?;
    if mappings.len() > max_slots {
        return Err(ChMigrationError::TooManyFds(max_slots).into());
    }
    let mut slots = Vec::with_capacity(mappings.len());
    for m in mappings {
        let number = |name| m.get(name).and_then(|v| v.as_u64()).ok_or(field(name));
        let slot = u32::try_from(number("slot")?).map_err(|_| field("slot"))?;
        slots.push(SlotRange {
            slot,
            gpa: number("gpa")?,
            size: number("size")?,
            file_offset: number("file_offset")?,
        });
    }
    check_slots(&slots, max_slots)?;
    Ok(slots)
}

/// The slot table of a migration configuration (cloud-hypervisor's
/// `VmMigrationConfig`, JSON): its `memory_manager_data.guest_ram_mappings`.
///
/// # Errors
///
/// As [`guest_ram_mappings`], and bytes that are not JSON.
pub fn migration_config_slots(
    config: &[u8],
    max_slots: usize,
) -> Result<Vec<SlotRange>, SnapshotDirError> {
    let value = parse_json(config, "the migration configuration")?;
    let data = value
        .get("memory_manager_data")
        .ok_or(SnapshotDirError::Field {
            what: "the migration configuration",
            field: "memory_manager_data",
        })?;
    guest_ram_mappings(data, max_slots)
}

/// The migration configuration `config` with every memory zone (and the
/// zone-less `memory` itself) declared as hugetlb memory of
/// `hugepage_size` bytes, and no backing file path: what a receiver must
/// be told when it gets hugetlb memfds. A receiver sizes its pages from
/// the zone's declaration, not from the fd it gets: a zone the source
/// backed by `file=/dev/fd/N` (as `hugemem launch` does) is sized by a
/// `statfs` of that path in the receiving process, where it names some
/// other fd or none, and a postcopy restore then resolves faults in base
/// pages on a hugetlb mapping, which the kernel refuses (`EINVAL` from
/// `UFFDIO_CONTINUE`). The fds sent with `MemoryFd` take precedence over
/// any file, so dropping the stale path changes nothing else.
///
/// # Errors
///
/// A configuration that is not JSON or has no `vm_config.memory`.
pub fn with_hugetlb_zones(config: &[u8], hugepage_size: u64) -> Result<Vec<u8>, SnapshotDirError> {
    const WHAT: &str = "the migration configuration";
    let mut value = parse_json(config, WHAT)?;
    let memory = value
        .pointer_mut("/vm_config/memory")
        .and_then(serde_json::Value::as_object_mut)
        .ok_or(SnapshotDirError::Field {
            what: WHAT,
            field: "vm_config.memory",
        })?;
    let declare = |m: &mut serde_json::Map<String, serde_json::Value>| {
        m.insert("hugepages".into(), true.into());
        m.insert("hugepage_size".into(), hugepage_size.into());
    };
    if memory.get("size").and_then(serde_json::Value::as_u64) != Some(0) {
        declare(memory);
    }
    if let Some(zones) = memory
        .get_mut("zones")
        .and_then(serde_json::Value::as_array_mut)
    {
        for zone in zones
            .iter_mut()
            .filter_map(serde_json::Value::as_object_mut)
        {
            declare(zone);
            zone.insert("file".into(), serde_json::Value::Null);
        }
    }
    serde_json::to_vec(&value).map_err(|source| SnapshotDirError::Json { what: WHAT, source })
}
