//! A parked VM to disk and back: `hugemem unpark NAME --save DIR` writes
//! it to a directory and drops it; `hugemem park NAME --from-dir DIR`
//! parks a VM from such a directory, from cloud-hypervisor's reference
//! offload daemon's, or from cloud-hypervisor's own `snapshot
//! destination_url=file://DIR`, onto pool memory.
//!
//! A parked QEMU VM saves and loads the same way: the daemon keeps it in
//! the same documents (a configuration that says `"vmm": "qemu"`, a state
//! holding QEMU's migration stream), which a save writes as they are and
//! its manifest names (`"vmm": "qemu"`).
//!
//! A save is whole or absent, and proves itself:
//!
//! * It is written into a temporary sibling of `DIR` and renamed into
//!   place as its last step, after every file and the directory were
//!   flushed (`staging`); a failure removes the temporary, and a SIGKILL
//!   or a power cut leaves only a temporary that the next save to `DIR`
//!   removes. An existing `DIR` with files is never written into.
//! * The VM stays parked while it is saved: the daemon sends it with
//!   EXPORT (read-only memory fds) and holds it for this connection, and it
//!   is dropped (UNPARK) only once the directory is in place. The daemon is
//!   asked whether it still holds the VM before the rename: a save whose
//!   daemon died or changed meanwhile is not put in place.
//! * The manifest, written last, lists every file's size and checksums
//!   ([`manifest`]); a load checks the files against it before anything is
//!   parked, and the daemon checks every piece of memory as it reads it.
//! * The memory is written sparse, in parallel and with `O_DIRECT` where
//!   the file system takes it (`writer`).
//!
//! Both run through the daemon's own requests over a socket pair: this
//! process plays the cloud-hypervisor. Files are read and written with this
//! user's rights, never the daemon's.

mod error;
mod load;
pub mod manifest;
mod staging;
mod writer;

use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crate::client::Client;
use crate::park::{Exported, Parked};
use ch_migration::layout::{migration_config_slots, SnapshotDirError};
use ch_migration::offload_dir::{memory_slot_filename, MIGRATION_CONFIG_FILE, STATE_FILE};
use ch_migration::peer::{receive_snapshot, send_snapshot, Snapshot};
use ch_migration::Limits;

pub use error::SavedVmError;
pub use load::DirKind;
use manifest::{Manifest, MemoryFile, Source, WholeFile, FORMAT, PIECE, VERSION};
pub use writer::WriteStats;

/// How a save runs.
#[derive(Clone, Copy)]
pub struct SaveOptions<'a> {
    /// Writers (each keeps one write in flight).
    pub threads: usize,
    /// Called with the bytes of memory done, about every GiB.
    pub progress: Option<&'a (dyn Fn(u64) + Sync)>,
}

impl Default for SaveOptions<'_> {
    fn default() -> Self {
        Self {
            threads: writer::DEFAULT_THREADS,
            progress: None,
        }
    }
}

impl std::fmt::Debug for SaveOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SaveOptions")
            .field("threads", &self.threads)
            .field("progress", &self.progress.map(|_| "Fn(u64)"))
            .finish()
    }
}

/// What a save wrote.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SaveReport {
    /// Memory files written.
    pub slots: usize,
    /// Guest memory bytes the files hold (their sizes).
    pub memory_bytes: u64,
    /// How the memory was written.
    pub write: WriteStats,
    /// Seconds from the first byte to the directory in place (flushes
    /// included).
    pub seconds: f64,
}

/// Who and what a save is of, for the manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SaveInfo {
    /// The name it was parked under.
    pub name: String,
    /// The uid that parked it.
    pub uid: u32,
    /// When it was parked (seconds since the epoch).
    pub parked_at: u64,
    /// The page size it was parked on.
    pub page_size: u64,
}

/// Writes the VM parked under `name` in the daemon at `socket` to `dir`
/// (created, or an empty directory), whole or not at all (see the module
/// docs), then drops it when `drop_after` (`hugemem unpark --save`). The
/// VM stays parked until the directory is in place; on any failure it
/// stays parked and nothing is left under `dir`.
///
/// # Errors
///
/// [`SavedVmError`]: `dir` taken, the daemon's refusal, a write that
/// failed (a full disk, EIO), [`SavedVmError::Lost`] when the daemon went
/// away or lost the VM meanwhile, [`SavedVmError::SavedNotDropped`].
pub fn save_parked(
    socket: &Path,
    name: &str,
    dir: &Path,
    drop_after: bool,
    opts: &SaveOptions<'_>,
) -> Result<SaveReport, SavedVmError> {
    let staging = staging::Staging::begin(dir)?;
    let mut client = Client::connect(socket)?;
    let saved = save_on(&mut client, staging, name, dir, drop_after, opts);
    // The hold on the VM ends with this connection: once this returns, a
    // RESTORE or another save of it is served (the daemon does not refuse
    // it as still being saved).
    if let Err(e) = client.close() {
        tracing::debug!(error = %crate::diag::chain(&e), "closing the saver's connection");
    }
    saved
}

/// [`save_parked`] on its connection `client`.
fn save_on(
    client: &mut Client,
    staging: staging::Staging,
    name: &str,
    dir: &Path,
    drop_after: bool,
    opts: &SaveOptions<'_>,
) -> Result<SaveReport, SavedVmError> {
    let (exported, snapshot) = export(client, name)?;
    let info = SaveInfo {
        name: name.to_string(),
        uid: nix::unistd::Uid::current().as_raw(),
        parked_at: exported.parked_at,
        page_size: exported.page_size,
    };
    let started = Instant::now();
    let (slots, write) = write_into(staging.dir(), &snapshot, &info, opts)?;
    drop(snapshot);
    still_held(client, name, &exported)?;
    staging.commit()?;
    if drop_after {
        client
            .unpark(name)
            .map_err(|source| SavedVmError::SavedNotDropped {
                name: name.to_string(),
                dir: dir.display().to_string(),
                source,
            })?;
    }
    Ok(SaveReport {
        slots,
        memory_bytes: exported.bytes,
        write,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// Writes `snapshot` to `dir` as a save, whole or not at all, without a
/// daemon: for a snapshot this process holds (tests, conversions).
///
/// # Errors
///
/// As [`save_parked`]'s writing part.
pub fn write_saved_dir(
    dir: &Path,
    snapshot: &Snapshot,
    info: &SaveInfo,
    opts: &SaveOptions<'_>,
) -> Result<SaveReport, SavedVmError> {
    let staging = staging::Staging::begin(dir)?;
    let started = Instant::now();
    let (slots, write) = write_into(staging.dir(), snapshot, info, opts)?;
    staging.commit()?;
    Ok(SaveReport {
        slots,
        memory_bytes: migration_config_slots(&snapshot.config, Limits::default().max_memory_fds)?
            .iter()
            .map(|r| r.size)
            .sum(),
        write,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// EXPORT over a socket pair: the snapshot, this process receiving it.
fn export(client: &mut Client, name: &str) -> Result<(Exported, Snapshot), SavedVmError> {
    let (ours, theirs) = UnixStream::pair()?;
    let (exported, snapshot) = std::thread::scope(|s| {
        let receiver = s.spawn(|| receive_snapshot(&ours, Limits::default()));
        let exported = client.export(name, &theirs);
        drop(theirs);
        let snapshot = receiver
            .join()
            .map_err(|_| SavedVmError::Unsupported("the receiver thread panicked".into()));
        (exported, snapshot)
    });
    let exported = exported?;
    Ok((exported, snapshot??))
}

/// The daemon still holds `name` as it was exported: the save is of the
/// VM that stays (or is dropped) there.
fn still_held(client: &mut Client, name: &str, exported: &Exported) -> Result<(), SavedVmError> {
    let lost = |why: String| SavedVmError::Lost {
        name: name.to_string(),
        why,
    };
    let stats = client
        .stats()
        .map_err(|e| lost(format!("the daemon did not answer: {e}")))?;
    if stats
        .parked
        .iter()
        .any(|p| p.name == name && p.alloc == exported.alloc_id)
    {
        Ok(())
    } else {
        Err(lost("it is no longer parked there".into()))
    }
}

/// Writes the configuration, the state and the memory of `snapshot` into
/// `dir` (the save's temporary), flushes them, then writes and flushes the
/// manifest. Returns the memory files written and how.
fn write_into(
    dir: &Path,
    snapshot: &Snapshot,
    info: &SaveInfo,
    opts: &SaveOptions<'_>,
) -> Result<(usize, WriteStats), SavedVmError> {
    let ranges = migration_config_slots(&snapshot.config, Limits::default().max_memory_fds)?;
    let vmm = manifest::vmm_of(&snapshot.config).ok_or_else(|| {
        SavedVmError::Unsupported(
            "the parked VM's configuration is neither a cloud-hypervisor VM's nor a QEMU VM's"
                .into(),
        )
    })?;
    for (slot, _) in &snapshot.memory {
        if !ranges.iter().any(|r| r.slot == *slot) {
            return Err(SavedVmError::Unsupported(format!(
                "memory fd for slot {slot}, which the configuration does not have"
            )));
        }
    }
    let mut sources = Vec::with_capacity(ranges.len());
    for range in &ranges {
        let fd = snapshot
            .memory
            .iter()
            .find(|(s, _)| *s == range.slot)
            .map(|(_, fd)| fd.as_fd())
            .ok_or_else(|| {
                SavedVmError::Unsupported(format!("slot {} came without its fd", range.slot))
            })?;
        sources.push(fd);
    }
    let files = [
        write_small(dir, MIGRATION_CONFIG_FILE, &snapshot.config)?,
        write_small(dir, STATE_FILE, &snapshot.state)?,
    ];
    let mut outputs = Vec::with_capacity(ranges.len());
    for range in &ranges {
        let path = dir.join(memory_slot_filename(range.slot));
        let file = staging::create_file(&path)?;
        file.set_len(range.size)
            .map_err(SnapshotDirError::io(&path))?;
        let direct = staging::open_direct(&path);
        outputs.push((path, file, direct));
    }
    let jobs: Vec<writer::SlotWrite<'_>> = ranges
        .iter()
        .zip(&sources)
        .zip(&outputs)
        .map(|((range, src), (_, dst, direct))| writer::SlotWrite {
            src: *src,
            src_offset: range.file_offset,
            len: range.size,
            dst,
            direct: direct.as_ref(),
        })
        .collect();
    let (stats, crcs) = writer::write_slots(&jobs, opts.threads, opts.progress)
        .map_err(SnapshotDirError::io(dir))?;
    for (path, file, _) in &outputs {
        file.sync_all().map_err(SnapshotDirError::io(path))?;
    }
    let memory = ranges
        .iter()
        .zip(crcs)
        .map(|(range, crc32c)| MemoryFile {
            name: memory_slot_filename(range.slot),
            slot: range.slot,
            size: range.size,
            crc32c,
        })
        .collect();
    let manifest = Manifest {
        format: FORMAT.into(),
        version: VERSION,
        vmm: vmm.into(),
        source: Source {
            name: info.name.clone(),
            uid: info.uid,
            host: hostname(),
            hugemem: env!("CARGO_PKG_VERSION").into(),
            parked_at: info.parked_at,
            saved_at: now_secs(),
        },
        page_size: info.page_size,
        piece_bytes: PIECE,
        files: files.to_vec(),
        memory,
    };
    write_small(dir, manifest::MANIFEST_FILE, &manifest.to_bytes())?;
    Ok((ranges.len(), stats))
}

/// Writes and flushes a small file of a save; its manifest entry.
fn write_small(dir: &Path, name: &str, bytes: &[u8]) -> Result<WholeFile, SnapshotDirError> {
    use std::io::Write;
    let path = dir.join(name);
    let mut file = staging::create_file(&path)?;
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .map_err(SnapshotDirError::io(&path))?;
    Ok(WholeFile {
        name: name.to_string(),
        size: bytes.len() as u64,
        crc32c: crc32c::crc32c(bytes),
    })
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default()
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// What a load parked, and what it checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadReport {
    /// The daemon's reply.
    pub parked: Parked,
    /// What the directory was (and so what was checked).
    pub kind: DirKind,
    /// Parked on demand: the files are read when the VM is restored.
    pub on_demand: bool,
}

/// Parks the VM in `dir` under `name` in the daemon at `socket`, after
/// checking it (see [`DirKind`]); with `on_demand`, the daemon keeps the
/// files and reads them when the VM is restored. A save's memory is
/// checked against its manifest piece by piece as the daemon reads it.
///
/// # Errors
///
/// [`SavedVmError`]; nothing is parked then.
pub fn park_from_dir(
    socket: &Path,
    name: &str,
    dir: &Path,
    on_demand: bool,
) -> Result<LoadReport, SavedVmError> {
    let loaded = load::load(dir)?;
    let mut client = Client::connect(socket)?;
    let memory: Vec<(u32, BorrowedFd<'_>)> =
        loaded.memory.iter().map(|(s, f)| (*s, f.as_fd())).collect();
    let manifest = loaded.manifest.as_ref().map(|(_, f)| f.as_fd());
    let parked = park_snapshot(
        &mut client,
        name,
        &memory,
        (&loaded.config, &loaded.state),
        manifest,
        on_demand,
    )?;
    Ok(LoadReport {
        parked,
        kind: loaded.kind,
        on_demand,
    })
}

/// Checks the save in `dir` without a daemon: its files against the
/// manifest, and every piece of memory read back (`hugemem saved-check`).
/// Calls `progress` with the bytes of memory checked so far. Returns the
/// manifest and the bytes checked.
///
/// # Errors
///
/// A directory without a manifest (nothing to check against), and every
/// error of a load's checks, the first piece that does not match included.
pub fn check_saved_dir(
    dir: &Path,
    progress: &mut dyn FnMut(u64),
) -> Result<(Manifest, u64), SavedVmError> {
    let loaded = load::load(dir)?;
    let Some((manifest, _)) = loaded.manifest else {
        return Err(SavedVmError::Unsupported(format!(
            "{} has no manifest: it is {}",
            dir.display(),
            loaded.kind.describe()
        )));
    };
    let bytes = manifest.check_memory(dir, progress)?;
    Ok((manifest, bytes))
}

/// Sends `memory`, the configuration and the state to a PARK of `name`
/// over a socket pair, this process playing the cloud-hypervisor.
fn park_snapshot(
    client: &mut Client,
    name: &str,
    memory: &[(u32, BorrowedFd<'_>)],
    (config, state): (&[u8], &[u8]),
    manifest: Option<BorrowedFd<'_>>,
    on_demand: bool,
) -> Result<Parked, SavedVmError> {
    let (ours, theirs) = UnixStream::pair()?;
    std::thread::scope(|s| {
        let sender = s.spawn(|| send_snapshot(&ours, memory, config, state, true));
        let parked = match manifest {
            Some(m) => client.park_verified(name, &theirs, m, on_demand),
            None => client.park_with(name, &theirs, on_demand),
        };
        drop(theirs);
        let sent = sender
            .join()
            .map_err(|_| SavedVmError::Unsupported("the sender thread panicked".into()))?;
        let parked = parked?;
        sent?;
        Ok(parked)
    })
}

#[cfg(test)]
mod tests;
