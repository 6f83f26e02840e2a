//! A received snapshot, checked: the configuration's guest RAM mappings,
//! each memory fd a regular file holding what its mappings name, and what
//! a park produced. Pure checks: no socket, no pool.

use std::os::fd::{AsFd, OwnedFd};
use std::time::{SystemTime, UNIX_EPOCH};

use ch_migration::peer::Snapshot;
use ch_migration::Limits;
use serde_json::Value;

use crate::daemon::pool::{AllocId, SessionId};
use crate::proto::Status;

/// Who asks for the park.
#[derive(Debug, Clone)]
pub struct ParkRequest {
    /// The requesting connection.
    pub session: SessionId,
    /// Its uid (the tenant).
    pub uid: u32,
    /// Its gid.
    pub gid: u32,
    /// The name to park under.
    pub name: String,
    /// Memory from elsewhere is filled at restore time, not copied now.
    pub on_demand: bool,
    /// The request's second fd is a saved VM's manifest to check the
    /// memory against.
    pub verify: bool,
}

/// One guest RAM mapping of the VM's configuration
/// (`memory_manager_data.guest_ram_mappings`): slot `slot`'s `size` bytes
/// at guest address `gpa` are its memory file's bytes from `file_offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapping {
    /// The memory slot.
    pub slot: u32,
    /// Guest-physical address.
    pub gpa: u64,
    /// Bytes.
    pub size: u64,
    /// Where in the slot's file.
    pub file_offset: u64,
}

/// One memory fd of a snapshot, with what its file is.
#[derive(Debug)]
pub struct MemoryFile {
    /// The slot it came for.
    pub slot: u32,
    /// The fd.
    pub fd: OwnedFd,
    /// The file's identity (device, inode).
    pub identity: (u64, u64),
}

/// A snapshot whose every part passed its checks.
#[derive(Debug)]
pub struct Checked {
    /// Memory fds in the order they came.
    pub memory: Vec<MemoryFile>,
    /// The configuration's guest RAM mappings.
    pub mappings: Vec<Mapping>,
    /// The configuration (JSON).
    pub config: String,
    /// The state (JSON).
    pub state: String,
}

/// A refusal: the status and the reason the requester reads.
pub type Refusal = (Status, String);

/// A refusal of the snapshot: `Invalid` and why.
pub fn invalid(msg: impl Into<String>) -> Refusal {
    (Status::Invalid, msg.into())
}

/// The guest RAM mappings of a configuration.
///
/// # Errors
///
/// A configuration that is not JSON or has no well-formed mappings.
pub fn mappings(config: &str, max: usize) -> Result<Vec<Mapping>, Refusal> {
    let v: Value = serde_json::from_str(config)
        .map_err(|e| invalid(format!("the VM's configuration is not JSON: {e}")))?;
    let list = v
        .get("memory_manager_data")
        .and_then(|m| m.get("guest_ram_mappings"))
        .and_then(Value::as_array)
        .ok_or_else(|| {
            invalid("the VM's configuration has no memory_manager_data.guest_ram_mappings")
        })?;
    if list.is_empty() || list.len() > max {
        return Err(invalid(format!(
            "the VM's configuration has {} guest RAM mappings (1 to {max})",
            list.len()
        )));
    }
    list.iter()
        .map(|m| {
            let field = |name: &str| {
                m.get(name)
                    .and_then(Value::as_u64)
                    .ok_or_else(|| invalid(format!("a guest RAM mapping without {name}")))
            };
            let mapping = Mapping {
                slot: u32::try_from(field("slot")?)
                    .map_err(|_| invalid("a guest RAM mapping's slot is over u32"))?,
                gpa: field("gpa")?,
                size: field("size")?,
                file_offset: field("file_offset")?,
            };
            if mapping.size == 0
                || mapping.file_offset.checked_add(mapping.size).is_none()
                || mapping.gpa.checked_add(mapping.size).is_none()
            {
                return Err(invalid(format!(
                    "guest RAM mapping of slot {} is empty or overflows",
                    mapping.slot
                )));
            }
            Ok(mapping)
        })
        .collect()
}

/// Checks a received snapshot: the configuration and state are UTF-8
/// (cloud-hypervisor sends JSON), every mapping's slot came with an fd and
/// every fd is used, each fd is a regular file (a memfd, a hugetlbfs or
/// disk file) holding every byte its mappings name.
///
/// # Errors
///
/// The first check that fails.
pub fn check(snapshot: Snapshot, limits: &Limits) -> Result<Checked, Refusal> {
    let config = String::from_utf8(snapshot.config)
        .map_err(|_| invalid("the VM's configuration is not UTF-8"))?;
    let state =
        String::from_utf8(snapshot.state).map_err(|_| invalid("the VM's state is not UTF-8"))?;
    let mappings = mappings(&config, limits.max_memory_fds)?;
    let mut memory = Vec::new();
    for (slot, fd) in snapshot.memory {
        let st = nix::sys::stat::fstat(fd.as_fd())
            .map_err(|e| invalid(format!("memory fd of slot {slot}: {e}")))?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(invalid(format!(
                "memory fd of slot {slot} is not a regular file (a memfd, hugetlbfs or disk file)"
            )));
        }
        let size = u64::try_from(st.st_size).unwrap_or(0);
        let used: Vec<&Mapping> = mappings.iter().filter(|m| m.slot == slot).collect();
        if used.is_empty() {
            return Err(invalid(format!(
                "memory fd of slot {slot}, which no mapping uses"
            )));
        }
        if let Some(m) = used.iter().find(|m| m.file_offset + m.size > size) {
            return Err(invalid(format!(
                "memory fd of slot {slot} has {size} bytes; its mapping needs {} from offset {}",
                m.size, m.file_offset
            )));
        }
        memory.push(MemoryFile {
            slot,
            fd,
            identity: (st.st_dev, st.st_ino),
        });
    }
    if let Some(m) = mappings
        .iter()
        .find(|m| memory.iter().all(|f| f.slot != m.slot))
    {
        return Err(invalid(format!(
            "slot {} has a mapping but no memory fd",
            m.slot
        )));
    }
    Ok(Checked {
        memory,
        mappings,
        config,
        state,
    })
}

/// Seconds since the epoch.
pub fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// What a park produced.
#[derive(Debug, Clone, Copy)]
pub struct ParkedOk {
    /// The allocation holding it.
    pub alloc: AllocId,
    /// Bytes of memory.
    pub bytes: u64,
    /// Bytes copied (0: moved).
    pub copied: u64,
    /// Slots.
    pub slots: u32,
}
