//! The disk's write rate, measured as `dd` measures it, beside each save:
//! `dd if=… of=FILE bs=1M count=N oflag=direct conv=fsync`. One writer
//! writes a new file in the directory the saves go to (the same file
//! system), [`BLOCK`] bytes at a time, then `fsync`s it; the rate is the
//! bytes over the time from the open to the end of the `fsync`, and the
//! file is removed after. Direct (`O_DIRECT`: from the buffer to the
//! device, no page cache), or through the page cache (`conv=fsync` alone).
//!
//! 1 MiB blocks: what `dd bs=1M` (the usual way to measure a disk's
//! sequential rate with `dd`; its own default, 512 bytes, measures system
//! calls) and `fio --bs=1M` sequential jobs use. The bytes are
//! incompressible (SplitMix64), each 4 KiB page stamped with its block's
//! number so that no two blocks are alike.

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::time::Instant;

use super::dense::splitmix64;
use super::OffloadError;
use crate::vmm_update::error::io;

/// Bytes per write.
pub(crate) const BLOCK: usize = 1 << 20;
/// The least a measurement writes.
pub(crate) const LEAST: u64 = 256 << 20;
const PAGE: usize = 4096;

/// The rate of one `dd`-like write of `bytes` (at least [`LEAST`], in
/// whole pages) into a new file in `dir`, GB/s; `None` when `direct` and
/// the file system refuses `O_DIRECT` (tmpfs).
pub(crate) fn write_gbps(dir: &Path, bytes: u64, direct: bool) -> Result<Option<f64>, OffloadError> {
    write_exactly(dir, bytes.max(LEAST), direct)
}

/// [`write_gbps`] of `bytes` (in whole pages), however few.
fn write_exactly(dir: &Path, bytes: u64, direct: bool) -> Result<Option<f64>, OffloadError> {
    let bytes = bytes.next_multiple_of(PAGE as u64);
    let path = dir.join(format!(
        "disk-write-{}",
        if direct { "direct" } else { "buffered" }
    ));
    let mut buf = vec![0u8; BLOCK + PAGE];
    let skip = buf.as_ptr().align_offset(PAGE);
    let block = &mut buf[skip..skip + BLOCK];
    for (i, word) in block.chunks_exact_mut(8).enumerate() {
        let x = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x6464_2d6c_696b_6521;
        word.copy_from_slice(&splitmix64(x).to_le_bytes());
    }
    let mut opts = OpenOptions::new();
    opts.write(true).create_new(true).mode(0o600);
    if direct {
        opts.custom_flags(libc::O_DIRECT);
    }
    let started = Instant::now();
    let file = match opts.open(&path) {
        Ok(f) => f,
        Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => return Ok(None),
        Err(e) => return Err(io(format!("create {}", path.display()))(e)),
    };
    let written = (|| {
        let mut offset = 0u64;
        let mut number = 0u64;
        while offset < bytes {
            for page in block.chunks_exact_mut(PAGE) {
                page[..8].copy_from_slice(&number.to_le_bytes());
            }
            let len = BLOCK.min((bytes - offset) as usize);
            file.write_all_at(&block[..len], offset)?;
            offset += len as u64;
            number += 1;
        }
        file.sync_all()
    })();
    let seconds = started.elapsed().as_secs_f64();
    drop(file);
    let removed = std::fs::remove_file(&path);
    match written {
        Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => return Ok(None),
        Err(e) => return Err(io(format!("write {}", path.display()))(e)),
        Ok(()) => {}
    }
    removed.map_err(io(format!("remove {}", path.display())))?;
    Ok(Some(crate::stats::gbps(bytes, seconds)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_is_measured_and_its_file_removed() {
        // /var/tmp: a disk, where /tmp may be tmpfs.
        let tmp = tempfile::tempdir_in("/var/tmp").expect("tempdir");
        let buffered = write_exactly(tmp.path(), 1, false).expect("buffered");
        assert!(buffered.is_some_and(|g| g > 0.0), "{buffered:?}");
        // Direct where the file system takes it; a tail of part of a block.
        let direct = write_exactly(tmp.path(), 3 * BLOCK as u64 + 8192, true).expect("direct");
        assert!(direct.is_none_or(|g| g > 0.0), "{direct:?}");
        let left: Vec<_> = std::fs::read_dir(tmp.path()).expect("list").collect();
        assert!(left.is_empty(), "the files are removed");
    }
}
