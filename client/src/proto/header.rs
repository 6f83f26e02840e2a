//! The frame header, the request codes and statuses, the protocol's
//! limits and feature bits: what every other part of the protocol builds on.

/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: u32 = 1;
/// Header length in bytes.
pub const HEADER_SIZE: usize = 16;
/// Largest payload accepted, in bytes.
pub const MAX_PAYLOAD: usize = 64 * 1024;
/// Most file descriptors in one message.
pub const MAX_FDS: usize = 64;
/// Most regions in one allocation (and parts in one ALLOC request).
pub const MAX_REGIONS: usize = 64;
/// Longest error message carried in a reply.
pub const MAX_MESSAGE: usize = 4096;
/// Longest hugetlbfs path in an ALLOC reply, in bytes: 64 of them plus the
/// region table and a maximal message still fit in [`MAX_PAYLOAD`].
pub const MAX_PATH: usize = 512;
const _: () =
    assert!(8 + MAX_MESSAGE + 16 + MAX_REGIONS * (40 + 4 + MAX_PATH) + TOKEN_SIZE <= MAX_PAYLOAD);
/// Length of a re-attach token (ALLOC reply with [`ALLOC_REPLY_FLAG_TOKEN`](crate::proto::ALLOC_REPLY_FLAG_TOKEN),
/// REATTACH request).
pub const TOKEN_SIZE: usize = 16;
/// Node id meaning "any node" in an ALLOC part.
pub const ANY_NODE: u32 = u32::MAX;

/// Flags bits 0-7: protocol version of the sender.
pub const FLAG_VERSION_MASK: u32 = 0xff;
/// Flags bit 8: this message is a reply.
pub const FLAG_REPLY: u32 = 1 << 8;
/// Flags bit 9: the sender wants a reply (always set on requests in version 1).
pub const FLAG_NEED_REPLY: u32 = 1 << 9;
/// All flag bits defined in version 1.
const FLAGS_KNOWN: u32 = FLAG_VERSION_MASK | FLAG_REPLY | FLAG_NEED_REPLY;

/// Feature bit: the daemon serves demand faults through a userfaultfd (lazy mode).
pub const FEATURE_LAZY: u64 = 1 << 0;
/// Feature bit: REBALANCE is implemented.
pub const FEATURE_REBALANCE: u64 = 1 << 1;
/// Feature bit: ALLOC replies carry a re-attach token and REATTACH is
/// implemented (a VMM takes its allocation back after a daemon restart).
pub const FEATURE_REATTACH: u64 = 1 << 2;
/// Feature bit: HANDOFF is implemented (an allocation passes from one VMM
/// connection to its successor, with a new token).
pub const FEATURE_HANDOFF: u64 = 1 << 3;
/// Feature bit: PARK, RESTORE and UNPARK are implemented (the daemon plays
/// cloud-hypervisor's offload daemon: a VM's memory parked under a name).
pub const FEATURE_PARK: u64 = 1 << 4;
/// Feature bit: CLONE is implemented (a new VM started from a parked VM,
/// which stays parked as its template).
pub const FEATURE_CLONE: u64 = 1 << 5;

/// Request codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Code {
    /// Version and feature negotiation; must come first.
    Handshake = 1,
    /// Allocate guest RAM; the reply carries one fd per region.
    Alloc = 2,
    /// Give an allocation back.
    Free = 3,
    /// `mlock` an allocation in batches.
    Lock = 4,
    /// `munlock` an allocation in batches.
    Unlock = 5,
    /// Move a region or range of it to another NUMA node.
    Rebalance = 6,
    /// Pool and session statistics.
    Stats = 7,
    /// Lazy mode: hand the daemon a userfaultfd registered over the VMM's
    /// mappings of an allocation (one fd).
    Uffd = 8,
    /// Take an orphaned allocation (one a restarted daemon restored) back
    /// with its token.
    Reattach = 9,
    /// Take a live allocation over from another connection of the same uid
    /// (a VMM's successor) with its token; the reply carries its fds.
    Handoff = 10,
    /// Park a VM's memory under a name: the daemon receives the VM's
    /// snapshot (cloud-hypervisor's local migration) on the one socket fd
    /// the request carries.
    Park = 11,
    /// Restore a parked VM: the daemon sends its snapshot on the one socket
    /// fd the request carries and hands the allocation to this connection.
    Restore = 12,
    /// Drop a parked VM: its memory goes back to the pool.
    Unpark = 13,
    /// Send a parked VM's snapshot on the one socket fd the request
    /// carries, for saving: the VM stays parked, held for this connection
    /// until it UNPARKs it or ends.
    Export = 14,
    /// Start a clone of a parked VM (its template, which stays parked):
    /// the daemon sends the template's snapshot on the one socket fd the
    /// request carries, with read-only memory fds in SHARED mode.
    Clone = 15,
}

impl Code {
    /// Every request code, in wire order. The decoder knows exactly these
    /// ([`Code::from_u32`]), and the fuzz targets pick their codes from
    /// here: a code left out would be refused on the wire, so it cannot
    /// be silently left out of either.
    pub const ALL: [Code; 15] = [
        Code::Handshake,
        Code::Alloc,
        Code::Free,
        Code::Lock,
        Code::Unlock,
        Code::Rebalance,
        Code::Stats,
        Code::Uffd,
        Code::Reattach,
        Code::Handoff,
        Code::Park,
        Code::Restore,
        Code::Unpark,
        Code::Export,
        Code::Clone,
    ];

    /// The code for a wire value.
    pub fn from_u32(v: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|code| *code as u32 == v)
    }
}

/// Reply status codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Status {
    /// Done.
    Ok = 0,
    /// The request was malformed or out of bounds.
    Invalid = 1,
    /// The daemon does not implement this request (or feature).
    Unsupported = 2,
    /// Not enough huge pages (or memory) for the request.
    NoMemory = 3,
    /// A NUMA node that does not exist or has no memory.
    BadNode = 4,
    /// An allocation or region id that this client does not own.
    NotFound = 5,
    /// The handshake has not been done, or versions do not overlap.
    Version = 6,
    /// The daemon failed; the message says why.
    Internal = 7,
}

impl Status {
    /// The status for a wire value.
    pub fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            0 => Status::Ok,
            1 => Status::Invalid,
            2 => Status::Unsupported,
            3 => Status::NoMemory,
            4 => Status::BadNode,
            5 => Status::NotFound,
            6 => Status::Version,
            7 => Status::Internal,
            _ => return None,
        })
    }
}

/// Errors decoding or transporting messages.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    /// Unknown request code.
    #[error("unknown request code {0}")]
    UnknownCode(u32),
    /// Unknown status code in a reply.
    #[error("unknown status code {0}")]
    UnknownStatus(u32),
    /// The peer speaks another protocol version.
    #[error("protocol version {0} is not supported (this side speaks {PROTOCOL_VERSION})")]
    BadVersion(u32),
    /// Flags with undefined bits set.
    #[error("undefined flag bits {0:#x}")]
    BadFlags(u32),
    /// Payload larger than the protocol allows.
    #[error("payload of {0} bytes exceeds the {MAX_PAYLOAD}-byte limit")]
    PayloadTooLarge(usize),
    /// The payload ended before a field.
    #[error("payload truncated: needed {needed} more bytes for {field}")]
    Truncated {
        /// What was being read.
        field: &'static str,
        /// Missing bytes.
        needed: usize,
    },
    /// Bytes left after the last field.
    #[error("{0} unexpected bytes after the payload")]
    TrailingBytes(usize),
    /// A count or value out of bounds.
    #[error("{0}")]
    OutOfBounds(String),
    /// More fds than the protocol allows (or than the message should carry).
    #[error("message carries {got} file descriptors, at most {max} allowed")]
    TooManyFds {
        /// Received.
        got: usize,
        /// Allowed.
        max: usize,
    },
    /// The peer closed the connection between messages.
    #[error("peer closed the connection")]
    Closed,
    /// The peer closed the connection in the middle of a message.
    #[error("peer closed the connection in the middle of a message")]
    UnexpectedEof,
    /// A socket call failed.
    #[error("socket I/O failed")]
    Io(#[from] std::io::Error),
}

/// A message header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Request code (replies repeat the request's code).
    pub code: Code,
    /// Flag bits (version, reply, need-reply).
    pub flags: u32,
    /// Payload length in bytes.
    pub size: u32,
    /// Request id chosen by the client; replies repeat it.
    pub id: u32,
}

impl Header {
    /// A request header.
    pub fn request(code: Code, id: u32, size: usize) -> Result<Self, ProtoError> {
        Ok(Self {
            code,
            flags: PROTOCOL_VERSION | FLAG_NEED_REPLY,
            size: checked_size(size)?,
            id,
        })
    }

    /// The reply header for request `req`.
    pub fn reply_to(req: &Header, size: usize) -> Result<Self, ProtoError> {
        Ok(Self {
            code: req.code,
            flags: PROTOCOL_VERSION | FLAG_REPLY,
            size: checked_size(size)?,
            id: req.id,
        })
    }

    /// True for replies.
    pub fn is_reply(&self) -> bool {
        self.flags & FLAG_REPLY != 0
    }

    /// Wire bytes.
    pub fn encode(&self) -> [u8; HEADER_SIZE] {
        let mut b = [0u8; HEADER_SIZE];
        b[0..4].copy_from_slice(&(self.code as u32).to_le_bytes());
        b[4..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..12].copy_from_slice(&self.size.to_le_bytes());
        b[12..16].copy_from_slice(&self.id.to_le_bytes());
        b
    }

    /// Parses and checks a header: known code, version 1, defined flags, size in bounds.
    pub fn decode(b: &[u8; HEADER_SIZE]) -> Result<Self, ProtoError> {
        let word = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let (code, flags, size, id) = (word(0), word(4), word(8), word(12));
        let code = Code::from_u32(code).ok_or(ProtoError::UnknownCode(code))?;
        if flags & !FLAGS_KNOWN != 0 {
            return Err(ProtoError::BadFlags(flags & !FLAGS_KNOWN));
        }
        let version = flags & FLAG_VERSION_MASK;
        if version != PROTOCOL_VERSION {
            return Err(ProtoError::BadVersion(version));
        }
        checked_size(size as usize)?;
        Ok(Self {
            code,
            flags,
            size,
            id,
        })
    }
}

fn checked_size(size: usize) -> Result<u32, ProtoError> {
    if size > MAX_PAYLOAD {
        return Err(ProtoError::PayloadTooLarge(size));
    }
    u32::try_from(size).map_err(|_| ProtoError::PayloadTooLarge(size))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        let h = Header::request(Code::Alloc, 7, 40).expect("header");
        assert_eq!(Header::decode(&h.encode()).expect("decode"), h);
        let r = Header::reply_to(&h, 0).expect("reply");
        assert!(r.is_reply());
        assert_eq!(r.id, 7);
        assert_eq!(r.code, Code::Alloc);
    }

    #[test]
    fn every_code_in_all_round_trips() {
        for (i, code) in Code::ALL.into_iter().enumerate() {
            // Wire values 1, 2, 3, … in order: none twice, none skipped.
            assert_eq!(code as usize, i + 1);
            assert_eq!(Code::from_u32(code as u32), Some(code));
            let h = Header::request(code, 3, 0).expect("header");
            assert_eq!(Header::decode(&h.encode()).expect("decode"), h);
        }
        assert_eq!(Code::from_u32(0), None);
        let past = u32::try_from(Code::ALL.len() + 1).expect("a few codes");
        assert_eq!(Code::from_u32(past), None);
    }

    #[test]
    fn header_checks_everything_before_the_payload() {
        let good = Header::request(Code::Stats, 1, 0).expect("header").encode();
        let mut b = good;
        b[0] = 99;
        assert!(matches!(
            Header::decode(&b),
            Err(ProtoError::UnknownCode(99))
        ));
        let mut b = good;
        b[4] = 2;
        assert!(matches!(Header::decode(&b), Err(ProtoError::BadVersion(2))));
        let mut b = good;
        b[7] = 0x80;
        assert!(matches!(Header::decode(&b), Err(ProtoError::BadFlags(_))));
        let mut b = good;
        b[8..12].copy_from_slice(&(MAX_PAYLOAD as u32 + 1).to_le_bytes());
        assert!(matches!(
            Header::decode(&b),
            Err(ProtoError::PayloadTooLarge(_))
        ));
        assert!(Header::request(Code::Stats, 1, MAX_PAYLOAD + 1).is_err());
    }
}
