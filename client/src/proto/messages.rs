//! Request and reply payloads: encoding and checked decoding.

use super::{
    Code, ProtoError, Status, MAX_MESSAGE, MAX_PATH, MAX_PAYLOAD, MAX_REGIONS, TOKEN_SIZE,
};

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
/// [`FEATURE_REATTACH`](super::FEATURE_REATTACH).
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
    /// NUMA node, or [`ANY_NODE`](super::ANY_NODE).
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
        /// The VMM's mappings of the allocation's regions (1..=[`MAX_REGIONS`]).
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
}

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
    /// NUMA node, or [`ANY_NODE`](super::ANY_NODE).
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
        /// connection negotiated [`FEATURE_REATTACH`](super::FEATURE_REATTACH).
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

/// The body of an ALLOC (or HANDOFF) reply: the region table, the paths
/// when the flag says so, the token when the flag says so.
fn decode_alloc_reply(r: &mut Reader<'_>) -> Result<ReplyBody, ProtoError> {
    let alloc_id = r.u64("alloc_id")?;
    let n = r.u32("n_regions")? as usize;
    let flags = r.u32("flags")?;
    if flags & !ALLOC_REPLY_FLAGS_KNOWN != 0 {
        return Err(bad(format!(
            "undefined ALLOC reply flag bits {:#x}",
            flags & !ALLOC_REPLY_FLAGS_KNOWN
        )));
    }
    let regions = r.regions(n)?;
    let mut paths = Vec::new();
    if flags & ALLOC_REPLY_FLAG_PATHS != 0 {
        // Each record is at least its 4-byte length.
        r.check_records(n, 4, MAX_REGIONS, "paths")?;
        paths.reserve(n);
        for _ in 0..n {
            paths.push(decode_path(r)?);
        }
    }
    // After the paths: the decoder needs no session state, the
    // flag says whether the token is there.
    let token = if flags & ALLOC_REPLY_FLAG_TOKEN != 0 {
        Some(r.token()?)
    } else {
        None
    };
    Ok(ReplyBody::Alloc {
        alloc_id,
        regions,
        paths,
        token,
    })
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

/// Little-endian payload writer.
#[derive(Default)]
struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.0.extend_from_slice(v);
        self
    }
    /// A region table: 40 bytes per region.
    fn regions(&mut self, regions: &[RegionInfo]) -> &mut Self {
        for g in regions {
            self.u64(g.region_id)
                .u64(g.guest_phys)
                .u64(g.size)
                .u64(g.page_size)
                .u32(g.node)
                .u32(g.flags);
        }
        self
    }
}

/// Little-endian payload reader that never reads past the end.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], ProtoError> {
        if self.buf.len() < n {
            return Err(ProtoError::Truncated {
                field,
                needed: n - self.buf.len(),
            });
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }
    fn u8(&mut self, field: &'static str) -> Result<u8, ProtoError> {
        Ok(self.take(1, field)?[0])
    }
    fn u32(&mut self, field: &'static str) -> Result<u32, ProtoError> {
        let b = self.take(4, field)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self, field: &'static str) -> Result<u64, ProtoError> {
        let b = self.take(8, field)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn token(&mut self) -> Result<[u8; TOKEN_SIZE], ProtoError> {
        let mut t = [0u8; TOKEN_SIZE];
        t.copy_from_slice(self.take(TOKEN_SIZE, "token")?);
        Ok(t)
    }
    /// `n` region-table entries, the count checked before allocating.
    fn regions(&mut self, n: usize) -> Result<Vec<RegionInfo>, ProtoError> {
        self.check_records(n, 40, MAX_REGIONS, "regions")?;
        let mut regions = Vec::with_capacity(n);
        for _ in 0..n {
            regions.push(RegionInfo {
                region_id: self.u64("region_id")?,
                guest_phys: self.u64("guest_phys")?,
                size: self.u64("size")?,
                page_size: self.u64("page_size")?,
                node: self.u32("node")?,
                flags: self.u32("flags")?,
            });
        }
        Ok(regions)
    }
    fn remaining(&self) -> usize {
        self.buf.len()
    }
    fn finish(self) -> Result<(), ProtoError> {
        match self.buf.len() {
            0 => Ok(()),
            n => Err(ProtoError::TrailingBytes(n)),
        }
    }
    /// Checks that `count` records of `record` bytes fit in what is left,
    /// before anything is allocated for them.
    fn check_records(
        &self,
        count: usize,
        record: usize,
        max: usize,
        what: &str,
    ) -> Result<(), ProtoError> {
        if count > max {
            return Err(ProtoError::OutOfBounds(format!(
                "{count} {what}, at most {max} allowed"
            )));
        }
        if count * record > self.remaining() {
            return Err(ProtoError::Truncated {
                field: "records",
                needed: count * record - self.remaining(),
            });
        }
        Ok(())
    }
}

fn bad(msg: impl Into<String>) -> ProtoError {
    ProtoError::OutOfBounds(msg.into())
}

impl Request {
    /// The request code.
    pub fn code(&self) -> Code {
        match self {
            Request::Handshake { .. } => Code::Handshake,
            Request::Alloc { .. } => Code::Alloc,
            Request::Free { .. } => Code::Free,
            Request::Lock { .. } => Code::Lock,
            Request::Unlock { .. } => Code::Unlock,
            Request::Rebalance { .. } => Code::Rebalance,
            Request::Stats => Code::Stats,
            Request::Uffd { .. } => Code::Uffd,
            Request::Reattach { .. } => Code::Reattach,
            Request::Handoff { .. } => Code::Handoff,
        }
    }

    /// How many fds must come with this request: 1 for UFFD, 0 otherwise.
    pub fn expected_fds(&self) -> usize {
        usize::from(matches!(self, Request::Uffd { .. }))
    }

    /// Payload bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        match self {
            Request::Handshake {
                min_version,
                max_version,
                features,
            } => {
                w.u32(*min_version).u32(*max_version).u64(*features);
            }
            Request::Alloc { req: a, wait_ms } => {
                let mut flags = if a.want_paths { ALLOC_FLAG_PATHS } else { 0 };
                if wait_ms.is_some() {
                    flags |= ALLOC_FLAG_WAIT;
                }
                w.u64(a.total_size)
                    .u8(a.page_policy as u8)
                    .u8(a.clear_mode as u8)
                    .u8(u8::from(a.lock))
                    .u8(flags)
                    .u32(u32::try_from(a.parts.len()).unwrap_or(u32::MAX));
                for p in &a.parts {
                    w.u32(p.node).u32(0).u64(p.size);
                }
                if let Some(ms) = wait_ms {
                    w.u32(*ms).u32(0);
                }
            }
            Request::Free { alloc_id } => {
                w.u64(*alloc_id);
            }
            Request::Lock { alloc_id, chunk } | Request::Unlock { alloc_id, chunk } => {
                w.u64(*alloc_id).u64(*chunk);
            }
            Request::Rebalance {
                region_id,
                offset,
                len,
                node,
            } => {
                w.u64(*region_id).u64(*offset).u64(*len).u32(*node).u32(0);
            }
            Request::Stats => {}
            Request::Uffd { alloc_id, ranges } => {
                w.u64(*alloc_id)
                    .u32(u32::try_from(ranges.len()).unwrap_or(u32::MAX))
                    .u32(0);
                for r in ranges {
                    w.u64(r.region_id).u64(r.offset).u64(r.vmm_addr).u64(r.len);
                }
            }
            Request::Reattach { alloc_id, token } => {
                w.u64(*alloc_id).bytes(token);
            }
            Request::Handoff {
                alloc_id,
                token,
                want_paths,
            } => {
                let flags = if *want_paths { HANDOFF_FLAG_PATHS } else { 0 };
                w.u64(*alloc_id).bytes(token).u32(flags).u32(0);
            }
        }
        w.0
    }

    /// Parses and validates a request payload.
    pub fn decode(code: Code, payload: &[u8]) -> Result<Self, ProtoError> {
        if payload.len() > MAX_PAYLOAD {
            return Err(ProtoError::PayloadTooLarge(payload.len()));
        }
        let mut r = Reader { buf: payload };
        let req = match code {
            Code::Handshake => Request::Handshake {
                min_version: r.u32("min_version")?,
                max_version: r.u32("max_version")?,
                features: r.u64("features")?,
            },
            Code::Alloc => {
                let (req, wait_ms) = decode_alloc(&mut r)?;
                Request::Alloc { req, wait_ms }
            }
            Code::Free => Request::Free {
                alloc_id: r.u64("alloc_id")?,
            },
            Code::Lock => Request::Lock {
                alloc_id: r.u64("alloc_id")?,
                chunk: r.u64("chunk")?,
            },
            Code::Unlock => Request::Unlock {
                alloc_id: r.u64("alloc_id")?,
                chunk: r.u64("chunk")?,
            },
            Code::Rebalance => {
                let req = Request::Rebalance {
                    region_id: r.u64("region_id")?,
                    offset: r.u64("offset")?,
                    len: r.u64("len")?,
                    node: r.u32("node")?,
                };
                if r.u32("reserved")? != 0 {
                    return Err(bad("reserved field must be zero"));
                }
                req
            }
            Code::Stats => Request::Stats,
            Code::Uffd => decode_uffd(&mut r)?,
            Code::Reattach => Request::Reattach {
                alloc_id: r.u64("alloc_id")?,
                token: r.token()?,
            },
            Code::Handoff => {
                let alloc_id = r.u64("alloc_id")?;
                let token = r.token()?;
                let flags = r.u32("flags")?;
                if flags & !HANDOFF_FLAGS_KNOWN != 0 {
                    return Err(bad(format!(
                        "undefined HANDOFF flag bits {:#x}",
                        flags & !HANDOFF_FLAGS_KNOWN
                    )));
                }
                if r.u32("reserved")? != 0 {
                    return Err(bad("reserved field must be zero"));
                }
                Request::Handoff {
                    alloc_id,
                    token,
                    want_paths: flags & HANDOFF_FLAG_PATHS != 0,
                }
            }
        };
        r.finish()?;
        Ok(req)
    }
}

fn decode_alloc(r: &mut Reader<'_>) -> Result<(AllocRequest, Option<u32>), ProtoError> {
    let total_size = r.u64("total_size")?;
    let page_policy = match r.u8("page_policy")? {
        0 => PagePolicy::Best,
        1 => PagePolicy::Huge1G,
        2 => PagePolicy::Huge2M,
        3 => PagePolicy::Base4K,
        v => return Err(bad(format!("unknown page policy {v}"))),
    };
    let clear_mode = match r.u8("clear_mode")? {
        0 => ClearMode::Eager,
        1 => ClearMode::Lazy,
        v => return Err(bad(format!("unknown clear mode {v}"))),
    };
    let lock = match r.u8("lock")? {
        0 => false,
        1 => true,
        v => return Err(bad(format!("lock must be 0 or 1, got {v}"))),
    };
    let flags = r.u8("flags")?;
    if flags & !ALLOC_FLAGS_KNOWN != 0 {
        return Err(bad(format!(
            "undefined ALLOC flag bits {:#x}",
            flags & !ALLOC_FLAGS_KNOWN
        )));
    }
    let want_paths = flags & ALLOC_FLAG_PATHS != 0;
    let n_parts = r.u32("n_parts")? as usize;
    r.check_records(n_parts, 16, MAX_REGIONS, "parts")?;
    if total_size == 0 {
        return Err(bad("total_size must be non-zero"));
    }
    let mut parts = Vec::with_capacity(n_parts);
    let mut sum: u64 = 0;
    for _ in 0..n_parts {
        let node = r.u32("part.node")?;
        if r.u32("part.reserved")? != 0 {
            return Err(bad("reserved field must be zero"));
        }
        let size = r.u64("part.size")?;
        if size == 0 {
            return Err(bad("part sizes must be non-zero"));
        }
        sum = sum
            .checked_add(size)
            .ok_or_else(|| bad("part sizes overflow"))?;
        parts.push(AllocPart { node, size });
    }
    if !parts.is_empty() && sum != total_size {
        return Err(bad(format!(
            "parts add up to {sum} bytes, total_size is {total_size}"
        )));
    }
    let wait_ms = if flags & ALLOC_FLAG_WAIT != 0 {
        let ms = r.u32("wait_ms")?;
        if r.u32("wait.reserved")? != 0 {
            return Err(bad("reserved field must be zero"));
        }
        Some(ms)
    } else {
        None
    };
    // A node may appear in several parts: several regions on one node are
    // what a VMM needs for several memory zones (guest NUMA nodes) on a host
    // with fewer nodes. Each part is obtained on its own.
    Ok((
        AllocRequest {
            total_size,
            page_policy,
            clear_mode,
            lock,
            parts,
            want_paths,
        },
        wait_ms,
    ))
}

fn decode_uffd(r: &mut Reader<'_>) -> Result<Request, ProtoError> {
    let alloc_id = r.u64("alloc_id")?;
    let n = r.u32("n_ranges")? as usize;
    if r.u32("reserved")? != 0 {
        return Err(bad("reserved field must be zero"));
    }
    if n == 0 {
        return Err(bad("UFFD needs at least one range"));
    }
    r.check_records(n, 32, MAX_REGIONS, "ranges")?;
    let mut ranges = Vec::with_capacity(n);
    for _ in 0..n {
        let range = UffdRange {
            region_id: r.u64("range.region_id")?,
            offset: r.u64("range.offset")?,
            vmm_addr: r.u64("range.vmm_addr")?,
            len: r.u64("range.len")?,
        };
        if range.len == 0 {
            return Err(bad("range lengths must be non-zero"));
        }
        if range.vmm_addr.checked_add(range.len).is_none()
            || range.offset.checked_add(range.len).is_none()
        {
            return Err(bad("a range wraps around"));
        }
        ranges.push(range);
    }
    let mut by_addr: Vec<&UffdRange> = ranges.iter().collect();
    by_addr.sort_unstable_by_key(|r| r.vmm_addr);
    // Both ends were checked not to wrap above.
    if by_addr
        .windows(2)
        .any(|w| w[0].vmm_addr + w[0].len > w[1].vmm_addr)
    {
        return Err(bad("VMM ranges overlap"));
    }
    Ok(Request::Uffd { alloc_id, ranges })
}

/// One path record: `u32 len` (1..=[`MAX_PATH`]) and that many bytes of
/// UTF-8 with no NUL, starting with `/`.
fn decode_path(r: &mut Reader<'_>) -> Result<String, ProtoError> {
    let len = r.u32("path_len")? as usize;
    if len == 0 || len > MAX_PATH {
        return Err(bad(format!(
            "path of {len} bytes, expected 1 to {MAX_PATH}"
        )));
    }
    let bytes = r.take(len, "path")?;
    let path = std::str::from_utf8(bytes).map_err(|_| bad("path is not UTF-8"))?;
    if !path.starts_with('/') || path.contains('\0') {
        return Err(bad("path must be absolute and contain no NUL byte"));
    }
    Ok(path.to_string())
}

impl Reply {
    /// Payload bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        let msg = self.message.as_bytes();
        let msg = &msg[..msg.len().min(MAX_MESSAGE)];
        w.u32(self.status as u32)
            .u32(u32::try_from(msg.len()).unwrap_or(0))
            .bytes(msg);
        if self.status != Status::Ok {
            return w.0;
        }
        match &self.body {
            ReplyBody::Handshake { version, features } => {
                w.u32(*version).u32(0).u64(*features);
            }
            ReplyBody::Alloc {
                alloc_id,
                regions,
                paths,
                token,
            } => {
                let mut flags = if paths.is_empty() {
                    0
                } else {
                    ALLOC_REPLY_FLAG_PATHS
                };
                if token.is_some() {
                    flags |= ALLOC_REPLY_FLAG_TOKEN;
                }
                w.u64(*alloc_id)
                    .u32(u32::try_from(regions.len()).unwrap_or(u32::MAX))
                    .u32(flags);
                w.regions(regions);
                // The decoder insists on one path per region; a mismatch here
                // is a daemon bug that the client reports as a protocol error.
                for p in paths {
                    w.u32(u32::try_from(p.len()).unwrap_or(u32::MAX))
                        .bytes(p.as_bytes());
                }
                if let Some(t) = token {
                    w.bytes(t);
                }
            }
            ReplyBody::Reattach { alloc_id, regions } => {
                w.u64(*alloc_id)
                    .u32(u32::try_from(regions.len()).unwrap_or(u32::MAX))
                    .u32(0);
                w.regions(regions);
            }
            ReplyBody::Lock { bytes, micros } => {
                w.u64(*bytes).u64(*micros);
            }
            ReplyBody::Rebalance {
                pages_moved,
                pages_failed,
            } => {
                w.u64(*pages_moved).u64(*pages_failed);
            }
            ReplyBody::Stats { json } => {
                w.u32(u32::try_from(json.len()).unwrap_or(u32::MAX))
                    .bytes(json.as_bytes());
            }
            ReplyBody::Empty => {}
        }
        w.0
    }

    /// Parses a reply to a request with `code`.
    pub fn decode(code: Code, payload: &[u8]) -> Result<Self, ProtoError> {
        if payload.len() > MAX_PAYLOAD {
            return Err(ProtoError::PayloadTooLarge(payload.len()));
        }
        let mut r = Reader { buf: payload };
        let raw = r.u32("status")?;
        let status = Status::from_u32(raw).ok_or(ProtoError::UnknownStatus(raw))?;
        let msg_len = r.u32("message_len")? as usize;
        if msg_len > MAX_MESSAGE {
            return Err(bad(format!(
                "message of {msg_len} bytes, at most {MAX_MESSAGE}"
            )));
        }
        let message = String::from_utf8_lossy(r.take(msg_len, "message")?).into_owned();
        if status != Status::Ok {
            r.finish()?;
            return Ok(Reply {
                status,
                message,
                body: ReplyBody::Empty,
            });
        }
        let body = match code {
            Code::Handshake => {
                let version = r.u32("version")?;
                r.u32("reserved")?;
                ReplyBody::Handshake {
                    version,
                    features: r.u64("features")?,
                }
            }
            // A HANDOFF reply is an ALLOC reply: the successor gets what
            // an ALLOC would have given it.
            Code::Alloc | Code::Handoff => decode_alloc_reply(&mut r)?,
            Code::Reattach => {
                let alloc_id = r.u64("alloc_id")?;
                let n = r.u32("n_regions")? as usize;
                if r.u32("reserved")? != 0 {
                    return Err(bad("reserved field must be zero"));
                }
                ReplyBody::Reattach {
                    alloc_id,
                    regions: r.regions(n)?,
                }
            }
            Code::Lock | Code::Unlock => ReplyBody::Lock {
                bytes: r.u64("bytes")?,
                micros: r.u64("micros")?,
            },
            Code::Rebalance => ReplyBody::Rebalance {
                pages_moved: r.u64("pages_moved")?,
                pages_failed: r.u64("pages_failed")?,
            },
            Code::Stats => {
                let n = r.u32("json_len")? as usize;
                let json = std::str::from_utf8(r.take(n, "json")?)
                    .map_err(|_| bad("STATS json is not UTF-8"))?;
                ReplyBody::Stats {
                    json: json.to_string(),
                }
            }
            Code::Free | Code::Uffd => ReplyBody::Empty,
        };
        r.finish()?;
        Ok(Reply {
            status,
            message,
            body,
        })
    }
}

#[cfg(test)]
#[path = "messages_tests.rs"]
mod tests;
