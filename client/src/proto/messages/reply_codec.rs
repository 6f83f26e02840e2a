//! Replies as bytes: their encoding and checked decoding, the ALLOC (and
//! HANDOFF) reply's region table, paths and token included.

use super::super::{Code, ProtoError, Status, MAX_MESSAGE, MAX_REGIONS};
use super::wire::{bad, decode_path, Reader, Writer};
use super::*;

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
            ReplyBody::Parked {
                alloc_id,
                bytes,
                copied_bytes,
                slots,
            } => {
                w.u64(*alloc_id)
                    .u64(*bytes)
                    .u64(*copied_bytes)
                    .u32(*slots)
                    .u32(0);
            }
            ReplyBody::Exported {
                alloc_id,
                bytes,
                page_size,
                parked_at,
                slots,
            } => {
                w.u64(*alloc_id)
                    .u64(*bytes)
                    .u64(*page_size)
                    .u64(*parked_at)
                    .u32(*slots)
                    .u32(0);
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
            Code::Alloc | Code::Handoff | Code::Restore => decode_alloc_reply(&mut r)?,
            Code::Park => {
                let body = ReplyBody::Parked {
                    alloc_id: r.u64("alloc_id")?,
                    bytes: r.u64("bytes")?,
                    copied_bytes: r.u64("copied_bytes")?,
                    slots: r.u32("slots")?,
                };
                if r.u32("reserved")? != 0 {
                    return Err(bad("reserved field must be zero"));
                }
                body
            }
            Code::Export | Code::Clone => {
                let body = ReplyBody::Exported {
                    alloc_id: r.u64("alloc_id")?,
                    bytes: r.u64("bytes")?,
                    page_size: r.u64("page_size")?,
                    parked_at: r.u64("parked_at")?,
                    slots: r.u32("slots")?,
                };
                if r.u32("reserved")? != 0 {
                    return Err(bad("reserved field must be zero"));
                }
                body
            }
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
            Code::Free | Code::Uffd | Code::Unpark => ReplyBody::Empty,
        };
        r.finish()?;
        Ok(Reply {
            status,
            message,
            body,
        })
    }
}
