//! A parked VM to disk and back: `hugemem unpark NAME --save DIR` writes
//! it in the layout of cloud-hypervisor's reference offload daemon and
//! drops it (its memory returns to the pool); `hugemem park NAME --from-dir
//! DIR` parks a VM from such a directory, or from cloud-hypervisor's own
//! `snapshot destination_url=file://DIR`, onto pool memory.
//!
//! Both run through the daemon's own requests over a socket pair: this
//! process plays the cloud-hypervisor. For a save it is the receiver of a
//! RESTORE (it gets the memory's fds, the configuration and the state, and
//! owns the allocation until it FREEs it); for a load it is the sender of
//! a PARK whose memory fds are the directory's files (the daemon copies
//! them onto pool memory with its fill engine, reading each with `pread`:
//! bytes the files hold are not zeroed first, their holes are zero). Files
//! are read and written with this user's rights, never the daemon's.

use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;

use crate::ch_migration::ch_snapshot_dir::{read_ch_snapshot_dir, CH_CONFIG_FILE};
use crate::ch_migration::layout::{open_regular, SnapshotDirError};
use crate::ch_migration::offload_dir::{
    read_offload_dir, write_offload_dir, WriteReport, MIGRATION_CONFIG_FILE,
};
use crate::ch_migration::peer::{receive_snapshot, send_snapshot};
use crate::ch_migration::{ChMigrationError, Limits};
use crate::client::{Client, ClientError};
use crate::park::Parked;

/// Why a save or a load failed.
#[derive(Debug, thiserror::Error)]
pub enum ParkDirError {
    /// The daemon refused or failed.
    #[error(transparent)]
    Daemon(#[from] ClientError),
    /// The directory.
    #[error(transparent)]
    Dir(#[from] SnapshotDirError),
    /// The exchange over the socket pair.
    #[error("the snapshot exchange: {0}")]
    Exchange(#[from] ChMigrationError),
    /// The socket pair or a thread.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// A layout this version cannot load.
    #[error("{0}")]
    Unsupported(String),
}

/// A snapshot read from a directory: each slot's file, the configuration
/// (its slots' `file_offset`s where each slot's bytes are in its file) and
/// the state.
struct Loaded {
    memory: Vec<(u32, std::fs::File)>,
    config: Vec<u8>,
    state: Vec<u8>,
}

fn load(dir: &Path) -> Result<Loaded, ParkDirError> {
    let limits = Limits::default();
    if dir.join(MIGRATION_CONFIG_FILE).exists() {
        let d = read_offload_dir(dir, limits)?;
        let mut memory = Vec::new();
        for s in &d.slots {
            memory.push((s.range.slot, open_regular(&s.path)?.0));
        }
        // Each slot's file holds its bytes from offset 0; the configuration
        // still names where they were in the saved VM's fd (a slot above
        // the 32-bit hole shares its zone's fd at an offset).
        let offsets: Vec<(u32, u64)> = d.slots.iter().map(|s| (s.range.slot, 0)).collect();
        return Ok(Loaded {
            memory,
            config: with_file_offsets(&d.config, &offsets)?,
            state: d.state,
        });
    }
    if dir.join(CH_CONFIG_FILE).exists() {
        let d = read_ch_snapshot_dir(dir, limits)?;
        // Each slot's bytes must be one run of `memory-ranges` (a full
        // snapshot's are): its `file_offset` is then where that run starts.
        let mut offsets = Vec::new();
        for s in &d.slots {
            let [piece] = s.pieces.as_slice() else {
                return Err(ParkDirError::Unsupported(format!(
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
        return Ok(Loaded {
            memory,
            config,
            state: d.state,
        });
    }
    Err(ParkDirError::Unsupported(format!(
        "{} holds neither {MIGRATION_CONFIG_FILE} (an offload daemon's snapshot) nor {CH_CONFIG_FILE} (cloud-hypervisor's)",
        dir.display()
    )))
}

/// `config` (a migration configuration) with the `file_offset` of each
/// slot in `offsets` in its `guest_ram_mappings` set: where that slot's
/// bytes are in the file the load sends for it.
fn with_file_offsets(config: &[u8], offsets: &[(u32, u64)]) -> Result<Vec<u8>, ParkDirError> {
    let mut config: serde_json::Value = serde_json::from_slice(config)
        .map_err(|e| ParkDirError::Unsupported(format!("the configuration: {e}")))?;
    let mappings = config
        .pointer_mut("/memory_manager_data/guest_ram_mappings")
        .and_then(serde_json::Value::as_array_mut)
        .ok_or_else(|| ParkDirError::Unsupported("no guest_ram_mappings".into()))?;
    for m in mappings.iter_mut() {
        let slot = m.get("slot").and_then(serde_json::Value::as_u64);
        if let Some((_, offset)) = offsets.iter().find(|(s, _)| Some(u64::from(*s)) == slot) {
            m["file_offset"] = (*offset).into();
        }
    }
    serde_json::to_vec(&config)
        .map_err(|e| ParkDirError::Unsupported(format!("the configuration: {e}")))
}

/// Sends `memory`, `config` and `state` to a PARK of `name` over a socket
/// pair, this process playing the cloud-hypervisor.
fn park_snapshot(
    client: &mut Client,
    name: &str,
    memory: &[(u32, BorrowedFd<'_>)],
    config: &[u8],
    state: &[u8],
    on_demand: bool,
) -> Result<Parked, ParkDirError> {
    let (ours, theirs) = UnixStream::pair()?;
    std::thread::scope(|s| {
        let sender = s.spawn(|| send_snapshot(&ours, memory, config, state, true));
        let parked = client.park_with(name, &theirs, on_demand);
        drop(theirs);
        let sent = sender
            .join()
            .map_err(|_| ParkDirError::Unsupported("the sender thread panicked".into()))?;
        let parked = parked?;
        sent?;
        Ok(parked)
    })
}

/// Parks the VM in `dir` under `name` in the daemon at `socket`; with
/// `on_demand`, the daemon keeps the files and reads them when the VM is
/// restored.
///
/// # Errors
///
/// [`ParkDirError`]; nothing is parked then.
pub fn park_from_dir(
    socket: &Path,
    name: &str,
    dir: &Path,
    on_demand: bool,
) -> Result<Parked, ParkDirError> {
    let loaded = load(dir)?;
    let mut client = Client::connect(socket)?;
    let memory: Vec<(u32, BorrowedFd<'_>)> =
        loaded.memory.iter().map(|(s, f)| (*s, f.as_fd())).collect();
    park_snapshot(
        &mut client,
        name,
        &memory,
        &loaded.config,
        &loaded.state,
        on_demand,
    )
}

/// Writes the VM parked under `name` to `dir` (created, or empty) and
/// drops it: its memory returns to the pool. When the write fails the VM
/// is parked again, unchanged.
///
/// # Errors
///
/// [`ParkDirError`].
pub fn unpark_to_dir(socket: &Path, name: &str, dir: &Path) -> Result<WriteReport, ParkDirError> {
    let mut client = Client::connect(socket)?;
    let (ours, theirs) = UnixStream::pair()?;
    let (alloc, snapshot) = std::thread::scope(|s| {
        let receiver = s.spawn(|| receive_snapshot(&ours, Limits::default()));
        let alloc = client.restore(name, &theirs, true);
        drop(theirs);
        let snapshot = receiver
            .join()
            .map_err(|_| ParkDirError::Unsupported("the receiver thread panicked".into()));
        (alloc, snapshot)
    });
    let alloc = alloc?;
    let snapshot = snapshot??;
    match write_offload_dir(dir, &snapshot) {
        Ok(report) => {
            drop(snapshot);
            let id = alloc.id;
            drop(alloc);
            client.free(id)?;
            Ok(report)
        }
        Err(e) => {
            let memory: Vec<(u32, BorrowedFd<'_>)> = snapshot
                .memory
                .iter()
                .map(|(s, f)| (*s, f.as_fd()))
                .collect();
            park_snapshot(
                &mut client,
                name,
                &memory,
                &snapshot.config,
                &snapshot.state,
                false,
            )?;
            Err(e.into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_above_the_hole_is_read_from_the_start_of_its_file() {
        // A 4 GiB cloud-hypervisor VM: slot 0 below the 32-bit hole, slot
        // 1 above it, both from one zone's fd (slot 1 at 3 GiB in it).
        let config = serde_json::json!({
            "memory_manager_data": { "guest_ram_mappings": [
                { "slot": 0, "gpa": 0, "size": 3u64 << 30, "file_offset": 0 },
                { "slot": 1, "gpa": 4u64 << 30, "size": 1u64 << 30, "file_offset": 3u64 << 30 },
            ]},
            "other": "kept",
        });
        let out = with_file_offsets(
            &serde_json::to_vec(&config).expect("json"),
            &[(0, 0), (1, 0)],
        )
        .expect("rewritten");
        let out: serde_json::Value = serde_json::from_slice(&out).expect("json");
        let mappings = &out["memory_manager_data"]["guest_ram_mappings"];
        assert_eq!(mappings[1]["file_offset"], 0);
        assert_eq!(mappings[1]["gpa"], 4u64 << 30);
        assert_eq!(mappings[0]["file_offset"], 0);
        assert_eq!(out["other"], "kept");
    }
}
