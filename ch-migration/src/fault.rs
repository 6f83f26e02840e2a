//! The fault connection of a postcopy (on-demand) restore: a
//! cloud-hypervisor running `receive-migration …,memory_mode=postcopy`
//! takes a second connection from the sender, announced by the 2-byte
//! role `ConnectionRole::Fault` (`u16` 2, little-endian), and sends on it
//! one `PageFault` request (header, payload one `MemoryRange {gpa: u64,
//! length: u64}`) per page its guest touches, and in the background per
//! page it has not had yet. With the memory shared (the slots' fds sent
//! by `MemoryFd`) the sender writes the page into the fd and answers OK
//! with no payload; cloud-hypervisor then maps it (`UFFDIO_CONTINUE`,
//! userfaultfd's minor mode). `Abandon` ends the connection, and so does
//! cloud-hypervisor closing it once every page was served.
//!
//! [`FaultDecoder`] is the pure part (header and range in, the slot and
//! file offset to fill out), driven by the fuzz target as by
//! [`serve_page_faults`]: every range is checked against the slot table
//! before anyone touches memory for it.

use std::os::unix::net::UnixStream;

use super::in_flight::{EndOnDrop, InFlight};
use super::slots::{check_slots, slot_of, SlotRange, SLOT_ALIGN};
use super::wire::{read_header_or_end, read_plain, respond, write_all};
use super::{ChMigrationError, Command, RequestHeader};

/// The role a fault connection announces first (cloud-hypervisor's
/// `ConnectionRole::Fault`).
pub const FAULT_CONNECTION_ROLE: u16 = 2;
/// Bytes of a `PageFault` payload (one `MemoryRange`).
pub const MEMORY_RANGE_SIZE: usize = 16;
/// The largest range one fault may ask for (a 1 GiB page; cloud-hypervisor
/// asks for one page of the zone's page size).
pub const MAX_FAULT_LENGTH: u64 = 1 << 30;
/// The most slots a fault connection serves.
pub const MAX_FAULT_SLOTS: usize = 64;

/// One page asked for, mapped onto its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultRequest {
    /// The slot holding the range.
    pub slot: u32,
    /// The range's guest address.
    pub gpa: u64,
    /// Its length (cloud-hypervisor: the zone's page size).
    pub length: u64,
    /// Where the range starts inside the slot (`gpa - slot.gpa`).
    pub offset_in_slot: u64,
    /// Where the range starts in the slot's memory fd
    /// (`slot.file_offset + offset_in_slot`): where to write the page.
    pub file_offset: u64,
}

/// What follows a header the decoder took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultStep {
    /// A `MemoryRange` of [`MEMORY_RANGE_SIZE`] bytes: read it and pass it
    /// to [`FaultDecoder::take_range`].
    Range,
    /// `Abandon`: answer OK, then nothing more comes.
    Abandon,
}

/// The fault connection's requests, checked: headers and ranges in order,
/// each range page aligned, at most [`MAX_FAULT_LENGTH`] and inside one
/// slot.
#[derive(Debug)]
pub struct FaultDecoder {
    slots: Vec<SlotRange>,
    awaiting_range: bool,
    ended: bool,
}

impl FaultDecoder {
    /// A decoder serving `slots`.
    ///
    /// # Errors
    ///
    /// A slot table [`check_slots`] refuses (at most [`MAX_FAULT_SLOTS`]).
    pub fn new(slots: &[SlotRange]) -> Result<Self, ChMigrationError> {
        check_slots(slots, MAX_FAULT_SLOTS)?;
        Ok(Self {
            slots: slots.to_vec(),
            awaiting_range: false,
            ended: false,
        })
    }

    /// True once `Abandon` was taken.
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// Takes a request header.
    ///
    /// # Errors
    ///
    /// A command other than `PageFault` or `Abandon`, a payload of the
    /// wrong size, anything after `Abandon` or where a range is due.
    pub fn take_header(&mut self, header: &RequestHeader) -> Result<FaultStep, ChMigrationError> {
        let out_of_order = |expected| ChMigrationError::OutOfOrder {
            command: header.command,
            expected,
        };
        if self.ended {
            return Err(out_of_order("nothing (Abandon ended the fault connection)"));
        }
        if self.awaiting_range {
            return Err(out_of_order("the MemoryRange of the last PageFault"));
        }
        let wrong_size = |what, max: u64| ChMigrationError::TooLarge {
            what,
            length: header.length,
            max,
        };
        match header.command {
            Command::PageFault if header.length == MEMORY_RANGE_SIZE as u64 => {
                self.awaiting_range = true;
                Ok(FaultStep::Range)
            }
            Command::PageFault => Err(wrong_size(
                "a PageFault payload (one MemoryRange, exactly)",
                MEMORY_RANGE_SIZE as u64,
            )),
            Command::Abandon if header.length == 0 => {
                self.ended = true;
                Ok(FaultStep::Abandon)
            }
            Command::Abandon => Err(wrong_size("an Abandon payload", 0)),
            _ => Err(out_of_order("PageFault or Abandon on the fault connection")),
        }
    }

    /// Takes the `MemoryRange` of the `PageFault` just taken.
    ///
    /// # Errors
    ///
    /// [`ChMigrationError::BadFault`]: a range that is empty, over
    /// [`MAX_FAULT_LENGTH`], not page aligned, overflowing, or not inside
    /// one slot; [`ChMigrationError::OutOfOrder`] when no range is due.
    pub fn take_range(
        &mut self,
        bytes: &[u8; MEMORY_RANGE_SIZE],
    ) -> Result<FaultRequest, ChMigrationError> {
        if !self.awaiting_range {
            return Err(ChMigrationError::OutOfOrder {
                command: Command::PageFault,
                expected: "a request header (no MemoryRange is due)",
            });
        }
        self.awaiting_range = false;
        let mut word = [0u8; 8];
        word.copy_from_slice(&bytes[..8]);
        let gpa = u64::from_le_bytes(word);
        word.copy_from_slice(&bytes[8..]);
        let length = u64::from_le_bytes(word);
        let bad = |why| ChMigrationError::BadFault { gpa, length, why };
        if length == 0 {
            return Err(bad("an empty range"));
        }
        if length > MAX_FAULT_LENGTH {
            return Err(bad("longer than the largest page"));
        }
        if (gpa | length) % SLOT_ALIGN != 0 {
            return Err(bad("not page aligned"));
        }
        if gpa.checked_add(length).is_none() {
            return Err(bad("the range overflows"));
        }
        let slot = slot_of(&self.slots, gpa, length).ok_or_else(|| bad("not inside one slot"))?;
        let offset_in_slot = gpa - slot.gpa;
        Ok(FaultRequest {
            slot: slot.slot,
            gpa,
            length,
            offset_in_slot,
            // Checked by check_slots: file_offset + size does not overflow.
            file_offset: slot.file_offset + offset_in_slot,
        })
    }
}

/// How a fault connection ended, and what it served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FaultServeStats {
    /// Faults served.
    pub faults: u64,
    /// Bytes they asked for.
    pub bytes: u64,
    /// The smallest and largest range asked for (0 when none came).
    pub min_length: u64,
    /// See `min_length`.
    pub max_length: u64,
    /// It ended with `Abandon` (otherwise the peer closed it).
    pub abandoned: bool,
}

/// Why serving a fault connection failed.
#[derive(Debug, thiserror::Error)]
pub enum FaultServeError<E: std::error::Error + 'static> {
    /// The peer's request was refused, or the socket failed.
    #[error("fault connection: {0}")]
    Protocol(#[from] ChMigrationError),
    /// The callback could not fill a page.
    #[error("filling {length:#x} bytes at guest address {gpa:#x}: {source}")]
    Fill {
        /// The fault's guest address.
        gpa: u64,
        /// Its length.
        length: u64,
        /// The callback's error.
        #[source]
        source: E,
    },
}

/// What the next request on a fault connection is.
enum Incoming {
    Fault(FaultRequest),
    Abandon,
    /// The peer closed the connection between requests.
    End,
}

/// Announces `sock`, a new connection to a receiving cloud-hypervisor's
/// migration socket, as the fault connection.
///
/// # Errors
///
/// A socket failure.
pub fn announce_fault_connection(sock: &UnixStream) -> Result<(), ChMigrationError> {
    write_all(sock, &FAULT_CONNECTION_ROLE.to_le_bytes(), &[])
}

/// Serves the `PageFault` requests on `sock` (a connection already
/// announced as the fault connection) until the peer closes it or sends
/// `Abandon`: each range is checked and mapped onto `slots`, `on_fault`
/// fills it (writes the page into the slot's memory fd at
/// [`FaultRequest::file_offset`]), and the peer is answered OK with no
/// payload. A refused request or a failed fill is answered with an error
/// and ends the loop.
///
/// # Errors
///
/// [`FaultServeError`]: the first refusal, socket failure or failed fill.
pub fn serve_page_faults<E: std::error::Error + 'static>(
    sock: &UnixStream,
    slots: &[SlotRange],
    on_fault: impl FnMut(FaultRequest) -> Result<(), E>,
) -> Result<FaultServeStats, FaultServeError<E>> {
    serve_page_faults_tracked(sock, slots, &InFlight::default(), on_fault)
}

/// [`serve_page_faults`], keeping `in_flight` up to date: a request in
/// hand from its header to its answer, and the end of the loop (however
/// it returns), so that another thread can wait until every request the
/// receiver sent is answered ([`InFlight::wait_answered`]).
///
/// # Errors
///
/// As [`serve_page_faults`].
pub fn serve_page_faults_tracked<E: std::error::Error + 'static>(
    sock: &UnixStream,
    slots: &[SlotRange],
    in_flight: &InFlight,
    mut on_fault: impl FnMut(FaultRequest) -> Result<(), E>,
) -> Result<FaultServeStats, FaultServeError<E>> {
    let _end = EndOnDrop(in_flight);
    let mut decoder = FaultDecoder::new(slots)?;
    let mut stats = FaultServeStats::default();
    loop {
        let step = (|| -> Result<Incoming, ChMigrationError> {
            let Some(head) = read_header_or_end(sock)? else {
                return Ok(Incoming::End);
            };
            in_flight.started();
            match decoder.take_header(&RequestHeader::decode(&head)?)? {
                FaultStep::Abandon => Ok(Incoming::Abandon),
                FaultStep::Range => {
                    let mut range = [0u8; MEMORY_RANGE_SIZE];
                    read_plain(sock, &mut range, "inside a PageFault")?;
                    decoder.take_range(&range).map(Incoming::Fault)
                }
            }
        })();
        let fault = match step {
            Ok(Incoming::Fault(fault)) => fault,
            Ok(Incoming::Abandon) => {
                respond(sock, true)?;
                stats.abandoned = true;
                return Ok(stats);
            }
            Ok(Incoming::End) => return Ok(stats),
            Err(e) => {
                // Best effort: the peer may be gone, and the error says more.
                let _ = respond(sock, false);
                return Err(e.into());
            }
        };
        if let Err(source) = on_fault(fault) {
            let _ = respond(sock, false);
            return Err(FaultServeError::Fill {
                gpa: fault.gpa,
                length: fault.length,
                source,
            });
        }
        respond(sock, true)?;
        in_flight.answered();
        stats.faults += 1;
        stats.bytes += fault.length;
        stats.max_length = stats.max_length.max(fault.length);
        stats.min_length = match stats.min_length {
            0 => fault.length,
            m => m.min(fault.length),
        };
    }
}
