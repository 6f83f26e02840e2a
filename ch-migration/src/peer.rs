//! Either end of a local migration over a blocking UNIX stream socket:
//! [`receive_snapshot`] answers a cloud-hypervisor's `send-migration …,
//! local=on`, [`send_snapshot`] feeds a cloud-hypervisor's
//! `receive-migration`.
//!
//! Every read goes through `recvmsg` with room for fds (the `wire`
//! helpers), and every fd is owned the moment it arrives: one where none
//! belongs, or a `MemoryFd` without exactly one, fails the exchange and is
//! closed.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use super::wire::{read_exact, read_plain, request, respond};
use super::{ChMigrationError, Command, Limits, Next, RequestHeader, SnapshotReader, HEADER_SIZE};

/// A VM's snapshot as a local migration carries it: its memory as fds,
/// its configuration and its state.
#[derive(Debug)]
pub struct Snapshot {
    /// Memory slots and their fds, in the order they came.
    pub memory: Vec<(u32, OwnedFd)>,
    /// The VM's configuration (cloud-hypervisor's `VmConfig`, JSON).
    pub config: Vec<u8>,
    /// The VM's vCPU and device state.
    pub state: Vec<u8>,
    /// The sender ended with `CompletePaused` (its VM was paused).
    pub paused: bool,
}

/// Receives one snapshot from a cloud-hypervisor's local migration,
/// answering OK to each step, under `limits`. On an error the peer is
/// answered with an error response where it can still be, and every fd
/// received so far is closed.
///
/// # Errors
///
/// [`ChMigrationError`]: the first refusal or socket failure.
pub fn receive_snapshot(sock: &UnixStream, limits: Limits) -> Result<Snapshot, ChMigrationError> {
    let snapshot = receive_until_complete(sock, limits)?;
    answer_complete(sock, true)?;
    Ok(snapshot)
}

/// Answers the sender's `Complete`/`CompletePaused` after
/// [`receive_until_complete`]: OK when the snapshot was kept (the sender
/// then retires its VM), an error when it was not (the sender keeps it).
///
/// # Errors
///
/// The socket's failure (the sender is gone).
pub fn answer_complete(sock: &UnixStream, ok: bool) -> Result<(), ChMigrationError> {
    respond(sock, ok)
}

/// [`receive_snapshot`] up to the sender's `Complete` or
/// `CompletePaused`, which is left unanswered: a receiver that must finish
/// with the memory before the sender retires its VM (an offload daemon
/// copying it, or moving it under a lock) answers with
/// [`answer_complete`] when done.
///
/// # Errors
///
/// As [`receive_snapshot`].
pub fn receive_until_complete(
    sock: &UnixStream,
    limits: Limits,
) -> Result<Snapshot, ChMigrationError> {
    let mut reader = SnapshotReader::new(limits);
    let mut memory: Vec<(u32, OwnedFd)> = Vec::new();
    let (mut config, mut state) = (Vec::new(), Vec::new());
    loop {
        let step = (|| -> Result<Option<bool>, ChMigrationError> {
            let mut head = [0u8; HEADER_SIZE];
            read_plain(sock, &mut head, "before a request")?;
            let header = RequestHeader::decode(&head)?;
            match reader.take(&header)? {
                Next::Nothing => {}
                Next::MemoryFd => {
                    let mut slot = [0u8; 4];
                    let mut fds = Vec::new();
                    read_exact(sock, &mut slot, &mut fds, "inside a MemoryFd request")?;
                    if fds.len() != 1 {
                        return Err(ChMigrationError::FdCount(fds.len()));
                    }
                    let slot = u32::from_le_bytes(slot);
                    if memory.iter().any(|(s, _)| *s == slot) {
                        return Err(ChMigrationError::DuplicateSlot(slot));
                    }
                    memory.extend(fds.into_iter().map(|fd| (slot, fd)));
                }
                Next::Config(n) => {
                    config = vec![0; n];
                    read_plain(sock, &mut config, "inside the configuration")?;
                }
                Next::State(n) => {
                    state = vec![0; n];
                    read_plain(sock, &mut state, "inside the state")?;
                }
                Next::Done { paused } => return Ok(Some(paused)),
            }
            Ok(None)
        })();
        match step {
            Ok(None) => respond(sock, true)?,
            Ok(Some(paused)) => {
                return Ok(Snapshot {
                    memory,
                    config,
                    state,
                    paused,
                });
            }
            Err(e) => {
                // Best effort: the peer may be gone, and the error says more.
                let _ = respond(sock, false);
                return Err(e);
            }
        }
    }
}

/// Sends a snapshot to a cloud-hypervisor's `receive-migration`: the
/// memory slots' fds, `config` and `state`, then `Complete` (the VM
/// resumes there) or, with `paused`, `CompletePaused`.
///
/// # Errors
///
/// [`ChMigrationError::Refused`] naming the step the receiver refused, or
/// a socket failure.
pub fn send_snapshot(
    sock: &UnixStream,
    memory: &[(u32, BorrowedFd<'_>)],
    config: &[u8],
    state: &[u8],
    paused: bool,
) -> Result<(), ChMigrationError> {
    send_snapshot_with(sock, memory, config, state, paused, || Ok(()))
}

/// [`send_snapshot`], calling `before_state` once the configuration was
/// taken and before the state is sent: where a postcopy restore opens its
/// fault connection and starts serving it (cloud-hypervisor waits for that
/// connection when the state comes, and restoring the devices may already
/// fault), as [`postcopy::restore_postcopy`](super::postcopy::restore_postcopy)
/// does.
///
/// # Errors
///
/// As [`send_snapshot`], and whatever `before_state` returns (the state is
/// then not sent).
pub fn send_snapshot_with(
    sock: &UnixStream,
    memory: &[(u32, BorrowedFd<'_>)],
    config: &[u8],
    state: &[u8],
    paused: bool,
    before_state: impl FnOnce() -> Result<(), ChMigrationError>,
) -> Result<(), ChMigrationError> {
    send_snapshot_steps(
        sock,
        memory,
        (config, state),
        paused,
        (before_state, || Ok(())),
    )
}

/// [`send_snapshot_with`], calling `before_end` once the state was taken
/// and before `Complete` (or `CompletePaused`) is sent: where a postcopy
/// restore waits until the fault connection's requests are answered
/// ([`InFlight::wait_answered`](super::in_flight::InFlight::wait_answered)),
/// so the guest resumes on the pages it was given.
///
/// # Errors
///
/// As [`send_snapshot_with`], and whatever `before_end` returns (the last
/// step is then not sent).
pub fn send_snapshot_steps(
    sock: &UnixStream,
    memory: &[(u32, BorrowedFd<'_>)],
    (config, state): (&[u8], &[u8]),
    paused: bool,
    (before_state, before_end): (
        impl FnOnce() -> Result<(), ChMigrationError>,
        impl FnOnce() -> Result<(), ChMigrationError>,
    ),
) -> Result<(), ChMigrationError> {
    request(sock, Command::Start, &[], &[])?;
    for (slot, fd) in memory {
        request(sock, Command::MemoryFd, &slot.to_le_bytes(), &[*fd])?;
    }
    request(sock, Command::Config, config, &[])?;
    before_state()?;
    request(sock, Command::State, state, &[])?;
    before_end()?;
    let end = if paused {
        Command::CompletePaused
    } else {
        Command::Complete
    };
    request(sock, end, &[], &[])
}
