//! The hugemem wire protocol (specified byte by byte in `docs/protocol.md`).
//!
//! vhost-user style: a UNIX stream socket; every message is a 16-byte
//! little-endian header (request code, flags, payload size, request id)
//! followed by the payload; file descriptors travel with `SCM_RIGHTS` on the
//! header's bytes. The `vhost` crate's framing is private and its memory flows
//! from the VMM to the backend, so it cannot carry hugemem's region fds the
//! other way; this module is small enough to own.
//!
//! Decoding never trusts the peer: the header is checked (version, known code,
//! payload size ≤ [`MAX_PAYLOAD`]) before the payload is read, counts inside
//! payloads are checked against the payload length and the protocol limits
//! before anything is allocated, and trailing bytes are an error.
//!
//! [`MAX_PAYLOAD`]: crate::proto::MAX_PAYLOAD

mod fd_rules;
pub mod framing;
mod header;
pub mod messages;
pub mod socket;
pub mod validate;

pub use fd_rules::FdRule;
pub use framing::{Frame, FrameReader};
pub use header::{
    Code, Header, ProtoError, Status, ANY_NODE, FEATURE_CLONE, FEATURE_HANDOFF, FEATURE_LAZY,
    FEATURE_PARK, FEATURE_REATTACH, FEATURE_REBALANCE, FLAG_NEED_REPLY, FLAG_REPLY,
    FLAG_VERSION_MASK, HEADER_SIZE, MAX_FDS, MAX_MESSAGE, MAX_PATH, MAX_PAYLOAD, MAX_REGIONS,
    PROTOCOL_VERSION, TOKEN_SIZE,
};
pub use messages::{
    valid_park_name, AllocPart, AllocRequest, ClearMode, CloneMode, PagePolicy, RegionInfo, Reply,
    ReplyBody, Request, UffdRange, ALLOC_FLAG_PATHS, ALLOC_FLAG_WAIT, ALLOC_REPLY_FLAG_PATHS,
    ALLOC_REPLY_FLAG_TOKEN, HANDOFF_FLAG_PATHS, MAX_PARK_NAME, PARK_FLAG_ON_DEMAND,
    PARK_FLAG_VERIFY, RESTORE_FLAG_COPY, RESTORE_FLAG_PAUSED, RESTORE_FLAG_POSTCOPY,
};
pub use socket::{recv_message, send_message};
pub use validate::{check_uffd_ranges, UffdRangeError};
