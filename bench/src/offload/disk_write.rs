//! The disk's write rate beside each save, on the file system the saves
//! go to, written three ways ([`Writer`]):
//!
//! * **one direct writer**, as `dd if=… of=FILE bs=1M oflag=direct
//!   conv=fsync` writes: 1 MiB `O_DIRECT` writes one after the other;
//! * **direct writers as the saver's**: [`SaveOptions`]' default count of
//!   threads (4), each taking the next [`CHUNK`] (8 MiB, the saver's
//!   chunk) of a file sized first (`ftruncate`, as the saver sizes its
//!   memory files) and writing it with one `O_DIRECT` `pwrite`: the
//!   saver's own writes, without its reading of guest memory, its
//!   checksums and its zero-page checks;
//! * **through the page cache**, as `dd bs=1M conv=fsync` writes.
//!
//! Each writes a new file, then `fsync`s it; the rate is the bytes over
//! the time from the open to the end of the `fsync`. The file stays: the
//! caller removes it (a round keeps its files until it ends, as the save's
//! files stay). The bytes are incompressible
//! (SplitMix64), each 4 KiB page stamped with its chunk's number so that
//! no two chunks are alike.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use hugemem_client::saved_vm::SaveOptions;
use serde::Serialize;

use super::dense::splitmix64;
use super::error::OffloadError;
use crate::vmm_update::error::io;

/// Bytes per write of the one-writer kinds (`dd bs=1M`).
pub(crate) const BLOCK: usize = 1 << 20;
/// Bytes per write of the parallel kind: the saver's chunk (4 pieces of
/// 2 MiB, `client/src/saved_vm/writer.rs`).
pub(crate) const CHUNK: usize = 8 << 20;
const PAGE: usize = 4096;

/// How a measurement writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Writer {
    /// One thread, `O_DIRECT`, [`BLOCK`] bytes a write (`dd oflag=direct`).
    Single,
    /// The saver's threads, `O_DIRECT`, [`CHUNK`] bytes a write.
    Parallel,
    /// One thread through the page cache, [`BLOCK`] bytes a write, then
    /// `fsync` (`dd conv=fsync`).
    Buffered,
}

impl Writer {
    fn direct(self) -> bool {
        self != Self::Buffered
    }

    fn block(self) -> usize {
        match self {
            Self::Parallel => CHUNK,
            Self::Single | Self::Buffered => BLOCK,
        }
    }

    fn threads(self) -> usize {
        match self {
            Self::Parallel => SaveOptions::default().threads.max(1),
            Self::Single | Self::Buffered => 1,
        }
    }
}

/// A buffer of `len` incompressible bytes, 4 KiB-aligned (`O_DIRECT`).
struct Block {
    buf: Vec<u8>,
    skip: usize,
    len: usize,
}

impl Block {
    fn new(len: usize, seed: u64) -> Self {
        let mut buf = vec![0u8; len + PAGE];
        let skip = buf.as_ptr().align_offset(PAGE);
        for (i, word) in buf[skip..skip + len].chunks_exact_mut(8).enumerate() {
            let x = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed;
            word.copy_from_slice(&splitmix64(x).to_le_bytes());
        }
        Self { buf, skip, len }
    }

    /// The block stamped with chunk number `number`.
    fn stamped(&mut self, number: u64) -> &[u8] {
        let bytes = &mut self.buf[self.skip..self.skip + self.len];
        for page in bytes.chunks_exact_mut(PAGE) {
            page[..8].copy_from_slice(&number.to_le_bytes());
        }
        bytes
    }
}

/// Writes chunks of `file` until none is left: the next chunk's number
/// from `next`, `block` bytes each, `bytes` in all.
fn write_chunks(file: &File, bytes: u64, writer: Writer, next: &AtomicU64) -> std::io::Result<()> {
    let block_len = writer.block();
    let mut block = Block::new(block_len, 0x6464_2d6c_696b_6521);
    loop {
        let number = next.fetch_add(1, Ordering::Relaxed);
        let offset = number.saturating_mul(block_len as u64);
        if offset >= bytes {
            return Ok(());
        }
        let len = block_len.min((bytes - offset) as usize);
        file.write_all_at(&block.stamped(number)[..len], offset)?;
    }
}

/// The rate of one write of `bytes` (rounded up to whole pages) into a
/// new file `path` by `writer`, GB/s; `None` when the writer is direct
/// and the file system refuses `O_DIRECT` (tmpfs: no file is left then).
/// The file stays.
pub(crate) fn write_gbps(
    path: &Path,
    bytes: u64,
    writer: Writer,
) -> Result<Option<f64>, OffloadError> {
    let bytes = bytes.next_multiple_of(PAGE as u64);
    let mut opts = OpenOptions::new();
    opts.write(true).create_new(true).mode(0o600);
    if writer.direct() {
        opts.custom_flags(libc::O_DIRECT);
    }
    let started = Instant::now();
    let file = match opts.open(path) {
        Ok(f) => f,
        Err(e) if writer.direct() && e.raw_os_error() == Some(libc::EINVAL) => return Ok(None),
        Err(e) => return Err(io(format!("create {}", path.display()))(e)),
    };
    let next = AtomicU64::new(0);
    let failed = Mutex::new(None);
    let written = (|| {
        if writer == Writer::Parallel {
            file.set_len(bytes)?;
        }
        std::thread::scope(|scope| {
            for _ in 0..writer.threads() {
                scope.spawn(|| {
                    if let Err(e) = write_chunks(&file, bytes, writer, &next) {
                        // The others stop at their next chunk.
                        next.store(u64::MAX / 4, Ordering::Relaxed);
                        failed
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .get_or_insert(e);
                    }
                });
            }
        });
        match failed
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
        {
            Some(e) => Err(e),
            None => file.sync_all(),
        }
    })();
    let seconds = started.elapsed().as_secs_f64();
    drop(file);
    match written {
        Ok(()) => Ok(Some(crate::stats::gbps(bytes, seconds))),
        Err(e) => {
            let _ = std::fs::remove_file(path);
            if writer.direct() && e.raw_os_error() == Some(libc::EINVAL) {
                Ok(None)
            } else {
                Err(io(format!("write {}", path.display()))(e))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_writer_is_measured_and_leaves_its_file_whole() {
        // /var/tmp: a disk, where /tmp may be tmpfs.
        let tmp = tempfile::tempdir_in("/var/tmp").expect("tempdir");
        let path = tmp.path().join("buffered");
        let buffered = write_gbps(&path, 1, Writer::Buffered).expect("buffered");
        assert!(buffered.is_some_and(|g| g > 0.0), "{buffered:?}");
        assert_eq!(std::fs::metadata(&path).expect("left").len(), PAGE as u64);
        // Direct where the file system takes it; a tail of part of a block.
        let bytes = 3 * CHUNK as u64 + 8192;
        for writer in [Writer::Single, Writer::Parallel] {
            let path = tmp.path().join(format!("{writer:?}"));
            let direct = write_gbps(&path, bytes, writer).expect("direct");
            assert!(direct.is_none_or(|g| g > 0.0), "{writer:?}: {direct:?}");
            let len = std::fs::metadata(&path).map(|m| m.len()).ok();
            assert_eq!(len, direct.map(|_| bytes), "{writer:?}");
        }
    }

    #[test]
    fn the_chunks_cover_the_file_once() {
        let tmp = tempfile::tempdir_in("/var/tmp").expect("tempdir");
        let path = tmp.path().join("f");
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .expect("create");
        let bytes = 2 * CHUNK as u64 + 3 * PAGE as u64;
        let next = AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| write_chunks(&file, bytes, Writer::Parallel, &next).expect("write"));
            }
        });
        assert_eq!(file.metadata().expect("stat").len(), bytes);
        let mut stamp = [0u8; 8];
        for chunk in 0..3u64 {
            file.read_exact_at(&mut stamp, chunk * CHUNK as u64)
                .expect("read");
            assert_eq!(
                u64::from_le_bytes(stamp),
                chunk,
                "chunk {chunk} at its place"
            );
        }
    }
}
