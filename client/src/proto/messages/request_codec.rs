//! Requests as bytes: each request's code and fd count, its encoding, and
//! its checked decoding (ALLOC's parts and flags, the userfaultfd ranges).

use super::super::{Code, ProtoError, MAX_REGIONS};
use super::wire::{bad, Reader, Writer};
use super::*;

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
            Request::Park { .. } => Code::Park,
            Request::Restore { .. } => Code::Restore,
            Request::Unpark { .. } => Code::Unpark,
            Request::Export { .. } => Code::Export,
            Request::Clone { .. } => Code::Clone,
        }
    }

    /// How many fds must come with this request: 1 for UFFD (the
    /// userfaultfd), PARK, RESTORE and EXPORT (the migration socket), 2 for
    /// a postcopy RESTORE (and its fault connection) and a PARK with VERIFY
    /// (and the manifest), 0 otherwise. Always
    /// what the protocol's table says, [`Code::request_fds`] applied to
    /// [`Request::flags`] (the fuzz targets and the tests hold it to that).
    pub fn expected_fds(&self) -> usize {
        match self {
            Request::Restore { postcopy: true, .. } | Request::Park { verify: true, .. } => 2,
            Request::Uffd { .. }
            | Request::Park { .. }
            | Request::Restore { .. }
            | Request::Export { .. }
            | Request::Clone { .. } => 1,
            _ => 0,
        }
    }

    /// The flags word the payload carries: ALLOC's flags byte, HANDOFF's,
    /// PARK's and RESTORE's flags; 0 for a request without one.
    pub fn flags(&self) -> u32 {
        match self {
            Request::Alloc { req, wait_ms } => {
                let mut flags = if req.want_paths { ALLOC_FLAG_PATHS } else { 0 };
                if wait_ms.is_some() {
                    flags |= ALLOC_FLAG_WAIT;
                }
                u32::from(flags)
            }
            Request::Handoff { want_paths, .. } => {
                if *want_paths {
                    HANDOFF_FLAG_PATHS
                } else {
                    0
                }
            }
            Request::Park {
                on_demand, verify, ..
            } => {
                let mut flags = if *on_demand { PARK_FLAG_ON_DEMAND } else { 0 };
                if *verify {
                    flags |= PARK_FLAG_VERIFY;
                }
                flags
            }
            Request::Restore {
                paused,
                postcopy,
                copy,
                ..
            } => {
                let mut flags = if *paused { RESTORE_FLAG_PAUSED } else { 0 };
                if *postcopy {
                    flags |= RESTORE_FLAG_POSTCOPY;
                }
                if *copy {
                    flags |= RESTORE_FLAG_COPY;
                }
                flags
            }
            Request::Handshake { .. }
            | Request::Free { .. }
            | Request::Lock { .. }
            | Request::Unlock { .. }
            | Request::Rebalance { .. }
            | Request::Stats
            | Request::Uffd { .. }
            | Request::Reattach { .. }
            | Request::Unpark { .. }
            | Request::Export { .. }
            | Request::Clone { .. } => 0,
        }
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
                // The flags are ALLOC_FLAG_* bits, all below 0x100.
                let flags = u8::try_from(self.flags()).unwrap_or(u8::MAX);
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
                alloc_id, token, ..
            } => {
                w.u64(*alloc_id).bytes(token).u32(self.flags()).u32(0);
            }
            Request::Park { name, .. } => {
                encode_name(&mut w, name);
                w.u32(self.flags());
            }
            Request::Unpark { name } | Request::Export { name } => {
                encode_name(&mut w, name);
                w.u32(0);
            }
            Request::Restore { name, .. } => {
                encode_name(&mut w, name);
                w.u32(self.flags());
            }
            Request::Clone { name, mode } => {
                encode_name(&mut w, name);
                w.u32(*mode as u32);
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
            Code::Park => {
                let name = decode_name(&mut r)?;
                let flags = r.u32("flags")?;
                let known = PARK_FLAG_ON_DEMAND | PARK_FLAG_VERIFY;
                if flags & !known != 0 {
                    return Err(bad(format!(
                        "undefined PARK flag bits {:#x}",
                        flags & !known
                    )));
                }
                Request::Park {
                    name,
                    on_demand: flags & PARK_FLAG_ON_DEMAND != 0,
                    verify: flags & PARK_FLAG_VERIFY != 0,
                }
            }
            Code::Unpark | Code::Export => {
                let name = decode_name(&mut r)?;
                if r.u32("reserved")? != 0 {
                    return Err(bad("reserved field must be zero"));
                }
                if code == Code::Export {
                    Request::Export { name }
                } else {
                    Request::Unpark { name }
                }
            }
            Code::Clone => {
                let name = decode_name(&mut r)?;
                let mode = r.u32("mode")?;
                let mode = CloneMode::from_u32(mode)
                    .ok_or_else(|| bad(format!("unknown CLONE mode {mode}")))?;
                Request::Clone { name, mode }
            }
            Code::Restore => {
                let name = decode_name(&mut r)?;
                let flags = r.u32("flags")?;
                let known = RESTORE_FLAG_PAUSED | RESTORE_FLAG_POSTCOPY | RESTORE_FLAG_COPY;
                if flags & !known != 0 {
                    return Err(bad(format!(
                        "undefined RESTORE flag bits {:#x}",
                        flags & !known
                    )));
                }
                Request::Restore {
                    name,
                    paused: flags & RESTORE_FLAG_PAUSED != 0,
                    postcopy: flags & RESTORE_FLAG_POSTCOPY != 0,
                    copy: flags & RESTORE_FLAG_COPY != 0,
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

/// A parked VM's name on the wire: `u32` length and the bytes.
fn encode_name(w: &mut Writer, name: &str) {
    w.u32(u32::try_from(name.len()).unwrap_or(u32::MAX))
        .bytes(name.as_bytes());
}

/// A parked VM's name, checked ([`valid_park_name`]) before it is used
/// anywhere.
fn decode_name(r: &mut Reader<'_>) -> Result<String, ProtoError> {
    let len = r.u32("name_len")? as usize;
    if len == 0 || len > MAX_PARK_NAME {
        return Err(bad(format!(
            "name of {len} bytes, expected 1 to {MAX_PARK_NAME}"
        )));
    }
    let bytes = r.take(len, "name")?;
    match std::str::from_utf8(bytes) {
        Ok(name) if valid_park_name(name) => Ok(name.to_string()),
        _ => Err(bad(
            "a parked VM's name is ASCII letters, digits, '.', '_' and '-', starting with a letter or digit",
        )),
    }
}
