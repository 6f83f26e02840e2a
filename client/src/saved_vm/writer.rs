//! Writes a parked VM's memory into files: sparse, in parallel, straight
//! to the device where the file system takes `O_DIRECT`, and with the
//! CRC-32C of each piece for the manifest.
//!
//! Each worker takes a chunk of a few pieces, finds whether the source has
//! data there (`SEEK_DATA`; a memfd or hugetlbfs hole is skipped without
//! reading), reads it with `pread` into a 4 KiB-aligned buffer (never a
//! mapping of the fd: on hugetlbfs a mapping would allocate every page it
//! touches), takes each piece's checksum, and writes only the 4 KiB pages
//! that are not all zero, so the files keep holes where the guest never
//! wrote. Writes go through a second, `O_DIRECT` open of the file when it
//! has one: the data goes from the buffer to the device with no page-cache
//! copy to fill and write back, and several workers keep several writes in
//! flight. A write the file system refuses direct (`EINVAL`), and a tail
//! that is not a whole page, go through the page cache; the caller flushes
//! every file before it counts as saved.

use std::fs::File;
use std::os::fd::BorrowedFd;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};

use nix::unistd::{lseek, Whence};

use super::manifest::PIECE;
use crate::sys::AlignedBuf;

/// One memory file to write: `len` bytes of `src` from `src_offset`, to
/// `dst` from offset 0 (`direct`: the same file opened with `O_DIRECT`).
pub(super) struct SlotWrite<'a> {
    pub src: BorrowedFd<'a>,
    pub src_offset: u64,
    pub len: u64,
    pub dst: &'a File,
    pub direct: Option<&'a File>,
}

/// What the writers did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriteStats {
    /// Bytes written (pages not all zero).
    pub written: u64,
    /// Of them, bytes written with `O_DIRECT`.
    pub written_direct: u64,
    /// Bytes left as holes (source holes and all-zero pages).
    pub holes: u64,
    /// Workers that wrote.
    pub threads: usize,
}

/// Pieces per chunk a worker takes: 8 MiB, large enough for long writes.
const CHUNK_PIECES: u64 = 4;
const PAGE: usize = 4096;
/// Workers by default: writes in flight matter more than CPUs here (each
/// worker mostly waits for its write).
pub(super) const DEFAULT_THREADS: usize = 4;
/// Bytes between progress calls.
const PROGRESS_EVERY: u64 = 1 << 30;

/// Writes `jobs` with up to `threads` workers; returns the stats and, per
/// job, the CRC-32C of each [`PIECE`] of its file (holes read as zero).
/// `progress` is called with the bytes done (serialized) about every GiB.
pub(super) fn write_slots(
    jobs: &[SlotWrite<'_>],
    threads: usize,
    progress: Option<&(dyn Fn(u64) + Sync)>,
) -> std::io::Result<(WriteStats, Vec<Vec<u32>>)> {
    let mut chunks = Vec::new();
    for (i, job) in jobs.iter().enumerate() {
        let pieces = job.len.div_ceil(PIECE);
        let mut k = 0;
        while k < pieces {
            chunks.push((i, k, CHUNK_PIECES.min(pieces - k)));
            k += CHUNK_PIECES;
        }
    }
    let threads = threads.clamp(1, 64).min(chunks.len().max(1));
    let shared = Shared {
        jobs,
        chunks: &chunks,
        next: AtomicUsize::new(0),
        direct_ok: AtomicBool::new(true),
        done: AtomicU64::new(0),
        progress,
        reporting: Mutex::new(()),
        crcs: Mutex::new(
            jobs.iter()
                .map(|j| vec![0; j.len.div_ceil(PIECE) as usize])
                .collect(),
        ),
        total: Mutex::new(Ok(WriteStats {
            threads,
            ..WriteStats::default()
        })),
    };
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| shared.work());
        }
    });
    let stats = shared
        .total
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner)?;
    let crcs = shared
        .crcs
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner);
    Ok((stats, crcs))
}

/// What the workers share.
struct Shared<'j, 'a> {
    jobs: &'j [SlotWrite<'a>],
    /// (job, first piece, pieces).
    chunks: &'j [(usize, u64, u64)],
    next: AtomicUsize,
    /// Cleared when a direct write was refused: the rest goes buffered.
    direct_ok: AtomicBool,
    done: AtomicU64,
    progress: Option<&'j (dyn Fn(u64) + Sync)>,
    reporting: Mutex<()>,
    crcs: Mutex<Vec<Vec<u32>>>,
    total: Mutex<std::io::Result<WriteStats>>,
}

impl Shared<'_, '_> {
    fn work(&self) {
        let mut mine = WriteStats::default();
        let result = AlignedBuf::zeroed((CHUNK_PIECES * PIECE) as usize).and_then(|mut buf| {
            while let Some(&(job, first, n)) =
                self.chunks.get(self.next.fetch_add(1, Ordering::Relaxed))
            {
                let crcs = self.chunk(&self.jobs[job], first, n, &mut buf, &mut mine)?;
                let mut all = self.crcs.lock().unwrap_or_else(PoisonError::into_inner);
                all[job][first as usize..][..crcs.len()].copy_from_slice(&crcs);
            }
            Ok(())
        });
        let mut total = self.total.lock().unwrap_or_else(PoisonError::into_inner);
        match (result, total.as_mut()) {
            (Err(e), Ok(_)) => {
                // The others stop at their next chunk.
                self.next.store(self.chunks.len(), Ordering::Relaxed);
                *total = Err(e);
            }
            (Ok(()), Ok(t)) => {
                t.written += mine.written;
                t.written_direct += mine.written_direct;
                t.holes += mine.holes;
            }
            (_, Err(_)) => {}
        }
    }

    /// Writes pieces `first..first + n` of `job`; their checksums.
    fn chunk(
        &self,
        job: &SlotWrite<'_>,
        first: u64,
        n: u64,
        buf: &mut AlignedBuf,
        stats: &mut WriteStats,
    ) -> std::io::Result<Vec<u32>> {
        let start = first * PIECE;
        let end = ((first + n) * PIECE).min(job.len);
        let len = (end - start) as usize;
        let crcs = if has_data(job.src, job.src_offset + start, job.src_offset + end)? {
            let bytes = &mut buf.as_mut_slice()[..len];
            let got = read_full(job.src, bytes, job.src_offset + start)?;
            // Past the source's end the memory reads as zero.
            bytes[got..].fill(0);
            let bytes = &buf.as_slice()[..len];
            self.write_nonzero(job, bytes, start, stats)?;
            bytes.chunks(PIECE as usize).map(crc32c::crc32c).collect()
        } else {
            stats.holes += len as u64;
            (0..n)
                .map(|k| zero_crc(PIECE.min(job.len - (first + k) * PIECE)))
                .collect()
        };
        self.advance(len as u64);
        Ok(crcs)
    }

    /// Writes the runs of `bytes`' pages that are not all zero at
    /// `offset` of the job's file.
    fn write_nonzero(
        &self,
        job: &SlotWrite<'_>,
        bytes: &[u8],
        offset: u64,
        stats: &mut WriteStats,
    ) -> std::io::Result<()> {
        let mut run: Option<usize> = None;
        for (i, page) in bytes.chunks(PAGE).enumerate() {
            let at = i * PAGE;
            let zero = is_zero(page);
            match (zero, run) {
                (false, None) => run = Some(at),
                (true, Some(from)) => {
                    self.write(job, &bytes[from..at], offset + from as u64, stats)?;
                    run = None;
                }
                _ => {}
            }
            if zero {
                stats.holes += page.len() as u64;
            }
        }
        if let Some(from) = run {
            self.write(job, &bytes[from..], offset + from as u64, stats)?;
        }
        Ok(())
    }

    /// One run: direct where it can be (whole pages from an aligned
    /// buffer), the rest through the page cache.
    fn write(
        &self,
        job: &SlotWrite<'_>,
        bytes: &[u8],
        offset: u64,
        stats: &mut WriteStats,
    ) -> std::io::Result<()> {
        let whole = bytes.len() / PAGE * PAGE;
        let mut done = 0;
        if let Some(direct) = job
            .direct
            .filter(|_| self.direct_ok.load(Ordering::Relaxed))
        {
            match direct.write_all_at(&bytes[..whole], offset) {
                Ok(()) => {
                    done = whole;
                    stats.written_direct += whole as u64;
                }
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    tracing::debug!(error = %e, "O_DIRECT write refused; writing through the page cache");
                    self.direct_ok.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(e),
            }
        }
        job.dst.write_all_at(&bytes[done..], offset + done as u64)?;
        stats.written += bytes.len() as u64;
        Ok(())
    }

    fn advance(&self, len: u64) {
        let before = self.done.fetch_add(len, Ordering::Relaxed);
        if let Some(f) = self.progress {
            if (before + len) / PROGRESS_EVERY > before / PROGRESS_EVERY {
                let _serial = self
                    .reporting
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                f(self.done.load(Ordering::Relaxed));
            }
        }
    }
}

/// True when `fd` has data somewhere in `from..end` (`SEEK_DATA`; a file
/// system without it reports everything as data).
fn has_data(fd: BorrowedFd<'_>, from: u64, end: u64) -> std::io::Result<bool> {
    let at = i64::try_from(from).map_err(|_| std::io::Error::other("offset over i64"))?;
    match lseek(fd, at, Whence::SeekData) {
        Ok(data) => Ok((data as u64) < end),
        Err(nix::errno::Errno::ENXIO) => Ok(false),
        Err(nix::errno::Errno::EINVAL) => Ok(true),
        Err(e) => Err(e.into()),
    }
}

/// `pread` until `buf` is full or the source ends; the bytes read.
fn read_full(fd: BorrowedFd<'_>, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        let at = i64::try_from(offset + got as u64)
            .map_err(|_| std::io::Error::other("offset over i64"))?;
        match nix::sys::uio::pread(fd, &mut buf[got..], at) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(got)
}

fn is_zero(page: &[u8]) -> bool {
    let (head, words, tail) = {
        // SAFETY: any bytes are valid u128s; align_to only splits the slice.
        unsafe { page.align_to::<u128>() }
    };
    head.iter().all(|b| *b == 0) && words.iter().all(|w| *w == 0) && tail.iter().all(|b| *b == 0)
}

/// The CRC-32C of `len` zero bytes (a hole), without reading the hole.
pub(super) fn zero_crc(len: u64) -> u32 {
    static ZERO: [u8; PAGE] = [0; PAGE];
    static WHOLE_PIECE: OnceLock<u32> = OnceLock::new();
    let compute = |len: u64| {
        let mut crc = 0;
        let mut left = len;
        while left > 0 {
            let n = left.min(PAGE as u64);
            crc = crc32c::crc32c_append(crc, &ZERO[..n as usize]);
            left -= n;
        }
        crc
    };
    if len == PIECE {
        *WHOLE_PIECE.get_or_init(|| compute(PIECE))
    } else {
        compute(len)
    }
}
