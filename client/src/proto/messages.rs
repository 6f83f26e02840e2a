//! Request and reply payloads: the messages and their fields. Encoding
//! and checked decoding are in `wire` (the byte-level reader and writer),
//! `request_codec` and `reply_codec`.

mod reply_codec;
mod request_codec;
mod wire;

use super::header::Status;
use super::header::MAX_MESSAGE;
use super::header::MAX_PAYLOAD;
use super::header::TOKEN_SIZE;

/// ALLOC request flag (byte 11, bit 0): create each region as a file on a
/// hugetlbfs mount and send its path (for VMMs that must open a path, e.g.
/// cloud-hypervisor under `--landlock`).
pub const ALLOC_FLAG_PATHS: u8 = 1;
/// ALLOC request flag (byte 11, bit 1): an 8-byte trailer follows the parts,
/// `wait_ms` (u32) and a reserved u32 (0): how long the ALLOC may wait for
/// pages the daemon holds but cannot hand out yet (quarantined, being
/// scrubbed, on their way back to the kernel). Without it the daemon's
/// default (`pool.alloc_wait_ms`) applies.
pub const ALLOC_FLAG_WAIT: u8 = 2;
/// Every ALLOC flag bit defined.
const ALLOC_FLAGS_KNOWN: u8 = ALLOC_FLAG_PATHS | ALLOC_FLAG_WAIT;
/// ALLOC reply flag (`u32` at body offset 12, bit 0): one path per region
/// follows the region table.
pub const ALLOC_REPLY_FLAG_PATHS: u32 = 1;
/// ALLOC reply flag (bit 1): a 16-byte re-attach token follows the region
/// table and the paths. Set only for a client that negotiated
/// [`FEATURE_REATTACH`](super::header::FEATURE_REATTACH).
pub const ALLOC_REPLY_FLAG_TOKEN: u32 = 2;
/// Every ALLOC reply flag bit defined.
/// HANDOFF flags bit 0: send each region's hugetlbfs path with its fd
/// (only for regions that are hugetlbfs files).
pub const HANDOFF_FLAG_PATHS: u32 = 1;
const HANDOFF_FLAGS_KNOWN: u32 = HANDOFF_FLAG_PATHS;
const ALLOC_REPLY_FLAGS_KNOWN: u32 = ALLOC_REPLY_FLAG_PATHS | ALLOC_REPLY_FLAG_TOKEN;

/// Page-size policy of an allocation (wire: u8).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PagePolicy {
    /// 1 GiB, then 2 MiB, then 4 KiB; the reply says what was used.
    Best = 0,
    /// Exactly 1 GiB pages.
    Huge1G = 1,
    /// Exactly 2 MiB pages.
    Huge2M = 2,
    /// 4 KiB shmem pages.
    Base4K = 3,
}

/// How the memory is made clean (wire: u8).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClearMode {
    /// Every page is clean before the reply is sent.
    Eager = 0,
    /// Pages are cleared on demand faults (userfaultfd) and by background scrubbers.
    Lazy = 1,
}

/// One per-node part of an allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllocPart {
    /// NUMA node, or [`ANY_NODE`](super::header::ANY_NODE).
    pub node: u32,
    /// Bytes.
    pub size: u64,
}

/// ALLOC request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocRequest {
    /// Total bytes; equals the sum of `parts` when there are parts.
    pub total_size: u64,
    /// Page-size policy.
    pub page_policy: PagePolicy,
    /// Clearing mode.
    pub clear_mode: ClearMode,
    /// `mlock` the memory (batched) before replying.
    pub lock: bool,
    /// Per-node sizes; empty = one region, placed by the daemon.
    pub parts: Vec<AllocPart>,
    /// Ask for hugetlbfs files with paths ([`ALLOC_FLAG_PATHS`]) instead of
    /// anonymous memfds; the reply then carries one path per region.
    pub want_paths: bool,
}

/// A request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Version range and the client's features.
    Handshake {
        /// Lowest version the client speaks.
        min_version: u32,
        /// Highest version the client speaks.
        max_version: u32,
        /// Features the client can use.
        features: u64,
    },
    /// Allocate guest RAM.
    Alloc {
        /// What to allocate.
        req: AllocRequest,
        /// How long the daemon may wait for pages it holds but cannot hand
        /// out yet, in ms ([`ALLOC_FLAG_WAIT`]); `None`: the daemon's
        /// default. 0: do not wait at all.
        wait_ms: Option<u32>,
    },
    /// Give an allocation back.
    Free {
        /// Allocation id from the ALLOC reply.
        alloc_id: u64,
    },
    /// Lock an allocation.
    Lock {
        /// Allocation id.
        alloc_id: u64,
        /// Batch size in bytes (0 = daemon default).
        chunk: u64,
    },
    /// Unlock an allocation.
    Unlock {
        /// Allocation id.
        alloc_id: u64,
        /// Batch size in bytes (0 = daemon default).
        chunk: u64,
    },
    /// Move a region (or a range of it) to a node.
    Rebalance {
        /// Region id from the ALLOC reply.
        region_id: u64,
        /// Start offset in the region.
        offset: u64,
        /// Length (0 = to the end).
        len: u64,
        /// Target node.
        node: u32,
    },
    /// Statistics.
    Stats,
    /// Lazy mode: serve faults of these VMM mappings; the message carries
    /// exactly one fd, the userfaultfd they are registered on (MINOR).
    Uffd {
        /// Allocation id from the ALLOC reply.
        alloc_id: u64,
        /// The VMM's mappings of the allocation's regions
        /// (1..=[`MAX_REGIONS`](super::header::MAX_REGIONS)).
        ranges: Vec<UffdRange>,
    },
    /// Take an orphaned allocation back (after a daemon restart) with the
    /// token its ALLOC reply carried.
    Reattach {
        /// Allocation id from the ALLOC reply.
        alloc_id: u64,
        /// The token from the ALLOC reply ([`ALLOC_REPLY_FLAG_TOKEN`]).
        token: [u8; TOKEN_SIZE],
    },
    /// Take a live allocation over from the connection that owns it (the
    /// VMM's predecessor process, same uid) with its current token; the
    /// reply is an ALLOC reply with fresh fds and a new token.
    Handoff {
        /// Allocation id.
        alloc_id: u64,
        /// Its current token (from the ALLOC, REATTACH-era or last HANDOFF reply).
        token: [u8; TOKEN_SIZE],
        /// Ask for the regions' hugetlbfs paths ([`HANDOFF_FLAG_PATHS`]).
        want_paths: bool,
    },
    /// Park a VM under `name` ([`valid_park_name`]): the one fd is a
    /// connected stream socket on which the daemon receives the VM's
    /// snapshot as cloud-hypervisor's local migration sends it.
    Park {
        /// The parked VM's name, unique per uid.
        name: String,
        /// Memory from elsewhere is not copied now: the daemon keeps the
        /// sender's files and fills the memory when the VM is restored
        /// ([`PARK_FLAG_ON_DEMAND`]).
        on_demand: bool,
        /// A second fd is the saved VM's manifest: the daemon checks every
        /// piece of memory it reads against it ([`PARK_FLAG_VERIFY`]).
        verify: bool,
    },
    /// Restore the VM parked under `name`: the one fd is a connected
    /// stream socket on which the daemon sends the snapshot as a
    /// local-migration sender; the reply is an ALLOC reply (the allocation
    /// now belongs to this connection).
    Restore {
        /// The parked VM's name.
        name: String,
        /// End with `CompletePaused` (the VM stays paused) instead of `Complete`.
        paused: bool,
        /// The receiver runs `receive-migration …,memory_mode=postcopy`: a
        /// second fd, a connection to the same receiver, is its fault
        /// connection, and memory not filled yet is filled as it asks
        /// ([`RESTORE_FLAG_POSTCOPY`]).
        postcopy: bool,
        /// A copy clone ([`RESTORE_FLAG_COPY`]): the VM stays parked (a
        /// template), and the receiver gets fresh pool memory filled from it.
        copy: bool,
    },
    /// Drop the VM parked under `name`: its memory returns to the pool.
    Unpark {
        /// The parked VM's name.
        name: String,
    },
    /// Send the VM parked under `name` on the one fd (a connected stream
    /// socket), as RESTORE with PAUSED would, for a saver: the memory fds
    /// are read-only, the VM stays parked, and the daemon holds it for
    /// this connection (no other RESTORE, EXPORT or UNPARK of it) until the
    /// connection UNPARKs it or ends.
    Export {
        /// The parked VM's name.
        name: String,
    },
    /// Start a clone of the VM parked under `name` (its template): the
    /// daemon sends the template's snapshot on the one fd (a connected
    /// stream socket) to the clone's launcher, and the template stays
    /// parked. In [`CloneMode::Shared`] the memory fds are read-only (the
    /// clone maps them privately), and the clone counts against the
    /// template while this connection lasts.
    Clone {
        /// The template's name.
        name: String,
        /// How the clone gets its memory.
        mode: CloneMode,
    },
}

/// How a clone gets its memory (CLONE's `mode` word).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum CloneMode {
    /// Its own memory from the pool, filled from the template (0).
    Copy = 0,
    /// The template's memory mapped privately: copy-on-write (1).
    Shared = 1,
}

impl CloneMode {
    /// The mode for a wire value.
    pub fn from_u32(v: u32) -> Option<Self> {
        match v {
            0 => Some(Self::Copy),
            1 => Some(Self::Shared),
            _ => None,
        }
    }

    /// Its name, as `hugemem launch --clone-mode` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Copy => "copy",
            Self::Shared => "shared",
        }
    }
}

/// The longest parked VM name, in bytes.
pub const MAX_PARK_NAME: usize = 64;

/// Whether `name` can name a parked VM: 1 to [`MAX_PARK_NAME`] bytes of
/// ASCII letters, digits, `.`, `_` and `-`, starting with a letter or
/// digit (it appears in logs, metrics labels and file names).
pub fn valid_park_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_PARK_NAME
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// RESTORE flags bit 0: end the sequence with `CompletePaused`.
pub const RESTORE_FLAG_PAUSED: u32 = 1;
/// RESTORE flags bit 1: a postcopy restore; the request carries two fds,
/// the migration connection and the fault connection.
pub const RESTORE_FLAG_POSTCOPY: u32 = 2;
/// RESTORE flags bit 2: a copy clone: the VM stays parked, and the
/// receiver gets a fresh allocation filled from it (CLONE in copy mode).
pub const RESTORE_FLAG_COPY: u32 = 4;
/// PARK flags bit 0: keep the memory files of memory from elsewhere and
/// fill the memory at restore time (on demand with a postcopy RESTORE).
pub const PARK_FLAG_ON_DEMAND: u32 = 1;
/// PARK flags bit 1: the request carries a second fd, the saved VM's
/// manifest (`hugemem_client::saved_vm::manifest`), and the daemon checks
/// each piece of memory it reads from the files against its checksums.
pub const PARK_FLAG_VERIFY: u32 = 2;

/// One VMM mapping in a UFFD request (32 bytes on the wire): `len` bytes of
/// region `region_id` from `offset`, mapped at `vmm_addr` in the VMM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UffdRange {
    /// Region id from the ALLOC reply.
    pub region_id: u64,
    /// Offset in the region (page aligned).
    pub offset: u64,
    /// Start of the mapping in the VMM (page aligned).
    pub vmm_addr: u64,
    /// Bytes (a multiple of the page size).
    pub len: u64,
}

/// One region of an allocation (40 bytes on the wire); its fd travels at the
/// same index in the reply's `SCM_RIGHTS` array.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionInfo {
    /// Region id (for REBALANCE).
    pub region_id: u64,
    /// Suggested guest-physical address (regions laid out back to back).
    pub guest_phys: u64,
    /// Bytes.
    pub size: u64,
    /// Page size in bytes actually used.
    pub page_size: u64,
    /// NUMA node, or [`ANY_NODE`](super::header::ANY_NODE).
    pub node: u32,
    /// [`RegionInfo::FLAG_CLEAN`] | [`RegionInfo::FLAG_LAZY`] | [`RegionInfo::FLAG_LOCKED`].
    pub flags: u32,
}

impl RegionInfo {
    /// Every page was clean when the reply was sent.
    pub const FLAG_CLEAN: u32 = 1;
    /// Pages are cleared on demand: the VMM must hand over a userfaultfd.
    pub const FLAG_LAZY: u32 = 2;
    /// The memory is locked.
    pub const FLAG_LOCKED: u32 = 4;
}

/// The body of a successful reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplyBody {
    /// HANDSHAKE.
    Handshake {
        /// Version chosen.
        version: u32,
        /// Features both sides have.
        features: u64,
    },
    /// ALLOC.
    Alloc {
        /// Allocation id.
        alloc_id: u64,
        /// Regions; fds in the same order.
        regions: Vec<RegionInfo>,
        /// Empty, or (when the request set [`ALLOC_FLAG_PATHS`]) one absolute
        /// hugetlbfs path per region, same order.
        paths: Vec<String>,
        /// The re-attach token ([`ALLOC_REPLY_FLAG_TOKEN`]): present when the
        /// connection negotiated [`FEATURE_REATTACH`](super::header::FEATURE_REATTACH).
        token: Option<[u8; TOKEN_SIZE]>,
    },
    /// REATTACH: the allocation's region table as it is now (no fds: the
    /// VMM still has them), so the VMM can check it is what it mapped.
    Reattach {
        /// Allocation id.
        alloc_id: u64,
        /// Regions, in guest-physical order, as in the ALLOC reply (flags
        /// as they are now).
        regions: Vec<RegionInfo>,
    },
    /// LOCK / UNLOCK.
    Lock {
        /// Bytes locked or unlocked.
        bytes: u64,
        /// Microseconds taken.
        micros: u64,
    },
    /// REBALANCE.
    Rebalance {
        /// Pages moved.
        pages_moved: u64,
        /// Pages that could not move.
        pages_failed: u64,
    },
    /// PARK: what was parked.
    Parked {
        /// The allocation that now holds the parked VM's memory.
        alloc_id: u64,
        /// Bytes of guest memory parked.
        bytes: u64,
        /// Of them, bytes copied into pool memory (0 when the memory came
        /// from this daemon and was moved).
        copied_bytes: u64,
        /// Memory slots.
        slots: u32,
    },
    /// EXPORT and CLONE: the parked VM that was sent.
    Exported {
        /// The allocation that holds its memory.
        alloc_id: u64,
        /// Bytes of guest memory.
        bytes: u64,
        /// The page size of that memory, bytes.
        page_size: u64,
        /// When it was parked (seconds since the epoch).
        parked_at: u64,
        /// Memory slots.
        slots: u32,
    },
    /// STATS: a JSON document.
    Stats {
        /// UTF-8 JSON.
        json: String,
    },
    /// FREE and errors.
    Empty,
}

/// A reply: status, a human-readable message (empty on success), and a body
/// (only when the status is `Ok`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// Status.
    pub status: Status,
    /// Why, for errors.
    pub message: String,
    /// Body.
    pub body: ReplyBody,
}

impl Reply {
    /// A successful reply.
    pub fn ok(body: ReplyBody) -> Self {
        Self {
            status: Status::Ok,
            message: String::new(),
            body,
        }
    }

    /// An error reply; the message is cut to [`MAX_MESSAGE`] bytes.
    pub fn error(status: Status, message: impl Into<String>) -> Self {
        let mut message = message.into();
        if message.len() > MAX_MESSAGE {
            let mut end = MAX_MESSAGE;
            while !message.is_char_boundary(end) {
                end -= 1;
            }
            message.truncate(end);
        }
        Self {
            status,
            message,
            body: ReplyBody::Empty,
        }
    }
}

#[cfg(test)]
#[path = "messages_tests.rs"]
mod tests;
