//! `ch-migration`: cloud-hypervisor's migration protocol, the local
//! flavour, as hugemem speaks it: what a cloud-hypervisor sends to
//! `send-migration destination_url=unix:…,local=on` and what it takes from
//! whoever answers its `receive-migration`. cloud-hypervisor keeps its own
//! side in its `vm-migration` crate; this crate is hugemem's, and it does
//! not depend on hugemem's own socket protocol (`hugemem-client`, which
//! depends on this one for its saved VMs).
//!
//! # The version it speaks
//!
//! The protocol of cloud-hypervisor [`version::CLOUD_HYPERVISOR_RELEASE`]
//! at commit [`version::CLOUD_HYPERVISOR_COMMIT`] (the tree
//! `scripts/build-cloud-hypervisor` builds), migration protocol version
//! [`PROTOCOL_VERSION`], memory passed as fds with `local=on`
//! ([`version::MEMORY_FDS_OPTION`]). Newer cloud-hypervisor releases moved:
//! `local=on` is deprecated in favour of `memory_mode=memfds`, and the
//! memory mode travels inside the protocol rather than as a
//! `receive-migration` option. Where a peer refuses or sends what this
//! version does not know, the error says which version hugemem speaks and
//! what a newer cloud-hypervisor expects ([`version`]).
//!
//! # The protocol
//!
//! The protocol (cloud-hypervisor's `vm-migration/src/protocol.rs`, its
//! module docs "Local Migration" and the receiver's state machine on
//! `Command`) is a sequence of requests, each a 16-byte header (`u16`
//! command, 6 header bytes of which `Start` uses the first two for the
//! sender's protocol version, `u64` payload length, little-endian) and its
//! payload, each answered by a 16-byte response (`u16` status: 1 OK, 2
//! error; 6 padding bytes; `u64` length, 0 here):
//!
//! ```text
//! Start → MemoryFd (× one per memory slot: payload u32 slot, the fd by SCM_RIGHTS)
//!       → Config (the VM's configuration, JSON) → State (vCPUs and devices)
//!       → Complete (resume on the destination) | CompletePaused
//! ```
//!
//! A hugemem daemon plays either end: it receives a VM's snapshot (a VM
//! parked in its pool) and sends it to a new cloud-hypervisor (a restore
//! onto the same pages, nothing copied). Everything it receives comes from
//! a process it must not trust: [`SnapshotReader`] takes the sequence in
//! order only and bounds every part ([`Limits`]) before a byte of it is
//! read or allocated, and the fds are owned from the moment they arrive.
//! The reader is pure (header bytes in, what to read next out), so the
//! fuzz targets drive exactly the code the socket side ([`peer`]) runs.
//!
//! - [`peer`]: both ends over a socket; [`postcopy`] and [`fault`]: a
//!   restore whose pages are filled on demand (`PageFault`s on a second
//!   connection); [`in_flight`]: whether every `PageFault` the receiver
//!   sent is answered (a postcopy sender holds `Complete` until it is);
//! - [`offload_dir`] and [`ch_snapshot_dir`]: the reference offload
//!   daemon's snapshot directory, and cloud-hypervisor's own `vm.snapshot`
//!   directory, read as untrusted; [`layout`] and [`slots`]: the memory
//!   slots a configuration describes;
//! - [`clone`]: a parked VM's configuration rewritten for a clone that
//!   maps the template's memory privately (copy-on-write);
//! - [`sys`]: the socket's raw syscalls.

#![deny(missing_docs)]

pub mod ch_snapshot_dir;
pub mod clone;
#[cfg(test)]
mod dir_tests;
pub mod fault;
#[cfg(test)]
mod fault_tests;
#[cfg(any(test, feature = "fixtures"))]
pub mod fixtures;
pub mod in_flight;
pub mod layout;
pub mod offload_dir;
pub mod peer;
pub mod postcopy;
pub mod slots;
pub mod sys;
#[cfg(test)]
mod tests;
pub mod version;
#[cfg(test)]
mod version_tests;
mod wire;

/// Bytes of a request or response header.
pub const HEADER_SIZE: usize = 16;
pub use version::PROTOCOL_VERSION;
use version::{NEWER_EXPECTS, SPOKEN};

/// Why a peer's bytes were refused, or the exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum ChMigrationError {
    /// A command number the protocol does not have (a newer peer's, or
    /// garbage).
    #[error("unknown migration command {0}; {SPOKEN}")]
    UnknownCommand(u16),
    /// A response status the protocol does not have.
    #[error("unknown migration response status {0}; {SPOKEN}")]
    UnknownStatus(u16),
    /// A command that is not the next step of the sequence.
    #[error("{command:?} where {expected} was expected")]
    OutOfOrder {
        /// What came.
        command: Command,
        /// What may come now.
        expected: &'static str,
    },
    /// A command a snapshot never carries (RAM contents, page faults).
    #[error("{0:?} is not part of a local migration's snapshot (memory moves as fds)")]
    Unsupported(Command),
    /// A payload over its bound or of the wrong size.
    #[error("{what} of {length} bytes (at most {max})")]
    TooLarge {
        /// Which part.
        what: &'static str,
        /// Its announced length.
        length: u64,
        /// The bound.
        max: u64,
    },
    /// More memory slots than the bound.
    #[error("more than {0} memory fds")]
    TooManyFds(usize),
    /// A memory slot sent twice.
    #[error("memory slot {0} sent twice")]
    DuplicateSlot(u32),
    /// A `MemoryFd` request whose message carried no fd (or more than one).
    #[error("a MemoryFd request carried {0} fds, not one")]
    FdCount(usize),
    /// A protocol version this side does not speak.
    #[error("migration protocol version {0}; {SPOKEN}")]
    Version(u16),
    /// The peer answered a request with an error; for the requests that
    /// open a local migration, the message says which protocol this side
    /// speaks and what a newer cloud-hypervisor expects.
    #[error("the peer refused {0:?}{hint}", hint = refusal_hint(*.0))]
    Refused(Command),
    /// The connection ended mid-sequence.
    #[error("the peer closed the connection {0}")]
    Closed(&'static str),
    /// A memory slot table entry that cannot be right.
    #[error("memory slot {slot}: {why}")]
    BadSlot {
        /// The slot.
        slot: u32,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A `PageFault` asking for a range no page can be served for.
    #[error("a PageFault for {length:#x} bytes at guest address {gpa:#x}: {why}")]
    BadFault {
        /// The range's guest address.
        gpa: u64,
        /// Its length.
        length: u64,
        /// What is wrong with it.
        why: &'static str,
    },
    /// Socket errors.
    #[error("migration socket: {0}")]
    Io(#[from] std::io::Error),
}

/// The sentence a refusal of `command` by the peer gets after its own
/// words: the requests that open a local migration (`Start`, `MemoryFd`)
/// are where a cloud-hypervisor that expects another memory mode or
/// protocol says no; a refusal later in the sequence is about the VM (its
/// configuration, its state), not the protocol.
fn refusal_hint(command: Command) -> String {
    match command {
        Command::Start | Command::MemoryFd => format!("; {SPOKEN}; {NEWER_EXPECTS}"),
        _ => String::new(),
    }
}

/// The commands of the protocol (cloud-hypervisor's `Command`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum Command {
    /// Opens the sequence; carries the sender's protocol version.
    Start = 1,
    /// The VM's configuration.
    Config = 2,
    /// The VM's vCPU and device state.
    State = 3,
    /// RAM contents (a copying migration; never in a snapshot here).
    Memory = 4,
    /// Ends the sequence; the receiver resumes the VM.
    Complete = 5,
    /// The sender gives up.
    Abandon = 6,
    /// One memory slot's fd.
    MemoryFd = 7,
    /// Ends the sequence; the VM stays paused.
    CompletePaused = 8,
    /// A page asked for on demand (postcopy).
    PageFault = 9,
}

impl Command {
    /// The command numbered `n`.
    ///
    /// # Errors
    ///
    /// [`ChMigrationError::UnknownCommand`].
    pub fn from_u16(n: u16) -> Result<Self, ChMigrationError> {
        Ok(match n {
            1 => Self::Start,
            2 => Self::Config,
            3 => Self::State,
            4 => Self::Memory,
            5 => Self::Complete,
            6 => Self::Abandon,
            7 => Self::MemoryFd,
            8 => Self::CompletePaused,
            9 => Self::PageFault,
            other => return Err(ChMigrationError::UnknownCommand(other)),
        })
    }
}

/// A request's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    /// The command.
    pub command: Command,
    /// The command's header bytes (`Start`: the version in the first two).
    pub headers: [u8; 6],
    /// Payload bytes that follow.
    pub length: u64,
}

impl RequestHeader {
    /// A request of `command` with `length` payload bytes.
    pub fn new(command: Command, length: u64) -> Self {
        let mut headers = [0; 6];
        if command == Command::Start {
            headers[..2].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        }
        Self {
            command,
            headers,
            length,
        }
    }

    /// Decodes a header.
    ///
    /// # Errors
    ///
    /// [`ChMigrationError::UnknownCommand`].
    pub fn decode(bytes: &[u8; HEADER_SIZE]) -> Result<Self, ChMigrationError> {
        let command = Command::from_u16(u16::from_le_bytes([bytes[0], bytes[1]]))?;
        let mut headers = [0; 6];
        headers.copy_from_slice(&bytes[2..8]);
        let mut length = [0; 8];
        length.copy_from_slice(&bytes[8..16]);
        Ok(Self {
            command,
            headers,
            length: u64::from_le_bytes(length),
        })
    }

    /// The header's bytes.
    pub fn encode(&self) -> [u8; HEADER_SIZE] {
        let mut out = [0; HEADER_SIZE];
        out[..2].copy_from_slice(&(self.command as u16).to_le_bytes());
        out[2..8].copy_from_slice(&self.headers);
        out[8..].copy_from_slice(&self.length.to_le_bytes());
        out
    }
}

/// A response: OK or error, no payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Response {
    /// OK.
    pub ok: bool,
}

impl Response {
    /// Decodes a response header.
    ///
    /// # Errors
    ///
    /// [`ChMigrationError::UnknownStatus`].
    pub fn decode(bytes: &[u8; HEADER_SIZE]) -> Result<Self, ChMigrationError> {
        match u16::from_le_bytes([bytes[0], bytes[1]]) {
            1 => Ok(Self { ok: true }),
            2 => Ok(Self { ok: false }),
            other => Err(ChMigrationError::UnknownStatus(other)),
        }
    }

    /// The response's bytes.
    pub fn encode(&self) -> [u8; HEADER_SIZE] {
        let mut out = [0; HEADER_SIZE];
        let status: u16 = if self.ok { 1 } else { 2 };
        out[..2].copy_from_slice(&status.to_le_bytes());
        out
    }
}

/// Bounds on what a received snapshot may carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The configuration's bytes.
    pub max_config: u64,
    /// The state's bytes.
    pub max_state: u64,
    /// Memory slots.
    pub max_memory_fds: usize,
}

impl Default for Limits {
    /// A VM's configuration is some KiB and its state some hundreds of KiB
    /// per vCPU set (a 1-vCPU micro-guest's: under 100 KiB); the bounds
    /// leave room for large VMs and stop a peer from making the receiver
    /// allocate what it likes.
    fn default() -> Self {
        Self {
            max_config: 1 << 20,
            max_state: 64 << 20,
            max_memory_fds: 64,
        }
    }
}

/// What the receiver reads after a header: the payload it must take
/// before it answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// No payload (`Start`).
    Nothing,
    /// A memory slot number (`u32`) with one fd.
    MemoryFd,
    /// The configuration, this many bytes.
    Config(usize),
    /// The state, this many bytes.
    State(usize),
    /// The end of the sequence: resume the VM (`false`) or keep it paused.
    Done {
        /// `CompletePaused`.
        paused: bool,
    },
}

/// Where the receive sequence stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Step {
    #[default]
    Expecting,
    Started,
    Configured,
    StateReceived,
    Finished,
}

/// The receiver's state machine: checks each header against the sequence
/// and the limits and says what to read next. Pure: the socket side
/// ([`peer`]) and the fuzz targets drive the same code.
#[derive(Debug, Default)]
pub struct SnapshotReader {
    limits: Limits,
    step: Step,
    memory_fds: usize,
}

impl SnapshotReader {
    /// A reader under `limits`.
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            ..Self::default()
        }
    }

    /// True once `Complete` or `CompletePaused` was taken.
    pub fn finished(&self) -> bool {
        self.step == Step::Finished
    }

    /// Takes the next header.
    ///
    /// # Errors
    ///
    /// A command out of order, one a snapshot never has, a payload over
    /// its limit or of the wrong size, too many slots, an unknown version,
    /// `Abandon`.
    pub fn take(&mut self, header: &RequestHeader) -> Result<Next, ChMigrationError> {
        use Command::*;
        let out_of_order = |expected| ChMigrationError::OutOfOrder {
            command: header.command,
            expected,
        };
        let bounded = |what, max: u64| -> Result<usize, ChMigrationError> {
            if header.length > max {
                return Err(ChMigrationError::TooLarge {
                    what,
                    length: header.length,
                    max,
                });
            }
            usize::try_from(header.length).map_err(|_| ChMigrationError::TooLarge {
                what,
                length: header.length,
                max,
            })
        };
        match (self.step, header.command) {
            (_, Memory | PageFault) => Err(ChMigrationError::Unsupported(header.command)),
            (_, Abandon) => Err(ChMigrationError::Closed("with Abandon")),
            (Step::Expecting, Start) => {
                let version = u16::from_le_bytes([header.headers[0], header.headers[1]]);
                if version != PROTOCOL_VERSION {
                    return Err(ChMigrationError::Version(version));
                }
                if header.length != 0 {
                    return Err(ChMigrationError::TooLarge {
                        what: "a Start payload",
                        length: header.length,
                        max: 0,
                    });
                }
                self.step = Step::Started;
                Ok(Next::Nothing)
            }
            (Step::Expecting, _) => Err(out_of_order("Start")),
            (Step::Started, MemoryFd) => {
                if header.length != 4 {
                    return Err(ChMigrationError::TooLarge {
                        what: "a MemoryFd payload (a u32 slot)",
                        length: header.length,
                        max: 4,
                    });
                }
                if self.memory_fds >= self.limits.max_memory_fds {
                    return Err(ChMigrationError::TooManyFds(self.limits.max_memory_fds));
                }
                self.memory_fds += 1;
                Ok(Next::MemoryFd)
            }
            (Step::Started, Config) => {
                let n = bounded("a configuration", self.limits.max_config)?;
                self.step = Step::Configured;
                Ok(Next::Config(n))
            }
            (Step::Started, _) => Err(out_of_order("MemoryFd or Config")),
            (Step::Configured, State) => {
                let n = bounded("a state", self.limits.max_state)?;
                self.step = Step::StateReceived;
                Ok(Next::State(n))
            }
            (Step::Configured, _) => Err(out_of_order("State")),
            (Step::StateReceived, Complete | CompletePaused) => {
                if header.length != 0 {
                    return Err(ChMigrationError::TooLarge {
                        what: "a Complete payload",
                        length: header.length,
                        max: 0,
                    });
                }
                self.step = Step::Finished;
                Ok(Next::Done {
                    paused: header.command == CompletePaused,
                })
            }
            (Step::StateReceived, _) => Err(out_of_order("Complete or CompletePaused")),
            (Step::Finished, _) => Err(out_of_order("nothing (the sequence is complete)")),
        }
    }
}
