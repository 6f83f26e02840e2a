//! The byte level of every payload: a little-endian writer and a checked
//! reader (bounds, record counts, trailing bytes), and the one record both
//! requests and replies carry, a path.

use super::super::{ProtoError, MAX_PATH, MAX_REGIONS, TOKEN_SIZE};
use super::RegionInfo;

/// Little-endian payload writer.
#[derive(Default)]
pub(super) struct Writer(pub(super) Vec<u8>);

impl Writer {
    pub(super) fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    pub(super) fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(super) fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(super) fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.0.extend_from_slice(v);
        self
    }
    /// A region table: 40 bytes per region.
    pub(super) fn regions(&mut self, regions: &[RegionInfo]) -> &mut Self {
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
pub(super) struct Reader<'a> {
    pub(super) buf: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(super) fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], ProtoError> {
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
    pub(super) fn u8(&mut self, field: &'static str) -> Result<u8, ProtoError> {
        Ok(self.take(1, field)?[0])
    }
    pub(super) fn u32(&mut self, field: &'static str) -> Result<u32, ProtoError> {
        let b = self.take(4, field)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub(super) fn u64(&mut self, field: &'static str) -> Result<u64, ProtoError> {
        let b = self.take(8, field)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    pub(super) fn token(&mut self) -> Result<[u8; TOKEN_SIZE], ProtoError> {
        let mut t = [0u8; TOKEN_SIZE];
        t.copy_from_slice(self.take(TOKEN_SIZE, "token")?);
        Ok(t)
    }
    /// `n` region-table entries, the count checked before allocating.
    pub(super) fn regions(&mut self, n: usize) -> Result<Vec<RegionInfo>, ProtoError> {
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
    pub(super) fn remaining(&self) -> usize {
        self.buf.len()
    }
    pub(super) fn finish(self) -> Result<(), ProtoError> {
        match self.buf.len() {
            0 => Ok(()),
            n => Err(ProtoError::TrailingBytes(n)),
        }
    }
    /// Checks that `count` records of `record` bytes fit in what is left,
    /// before anything is allocated for them.
    pub(super) fn check_records(
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

pub(super) fn bad(msg: impl Into<String>) -> ProtoError {
    ProtoError::OutOfBounds(msg.into())
}

/// One path record: `u32 len` (1..=[`MAX_PATH`]) and that many bytes of
/// UTF-8 with no NUL, starting with `/`.
pub(super) fn decode_path(r: &mut Reader<'_>) -> Result<String, ProtoError> {
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
