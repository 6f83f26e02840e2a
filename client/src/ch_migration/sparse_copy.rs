//! Copies memory fds into files sparsely and in parallel: only the data
//! extents of the source (`SEEK_DATA`/`SEEK_HOLE`; a file system without
//! them reports everything as data) are read, with `pread` into a buffer
//! (never a mapping of the fd: a mapping would fault in, and on hugetlbfs
//! allocate, every page it touches), and of those only the pages that are
//! not all zero are written (`pwrite`), so the files keep holes where the
//! guest never wrote. Chunks of all slots go to a few std threads.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use nix::unistd::{lseek, Whence};

/// One copy: `len` bytes of `src` from `src_offset` to `dst` at 0.
pub(super) struct CopyJob<'a> {
    pub src: BorrowedFd<'a>,
    pub src_offset: u64,
    pub len: u64,
    pub dst: &'a File,
}

/// What the copies wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CopyStats {
    /// Bytes written (pages not all zero).
    pub written: u64,
    /// Bytes left as holes (source holes and all-zero pages).
    pub skipped: u64,
    /// Threads that copied.
    pub threads: usize,
}

const CHUNK: u64 = 32 << 20;
const BUF: usize = 1 << 20;
const PAGE: usize = 4096;
const MAX_THREADS: usize = 8;

/// Runs `jobs`, split into chunks shared among up to eight threads.
pub(super) fn copy_sparse(jobs: &[CopyJob<'_>]) -> std::io::Result<CopyStats> {
    let mut chunks = Vec::new();
    for (i, job) in jobs.iter().enumerate() {
        let mut at = 0;
        while at < job.len {
            let len = CHUNK.min(job.len - at);
            chunks.push((i, at, len));
            at += len;
        }
    }
    let threads = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .clamp(1, MAX_THREADS)
        .min(chunks.len().max(1));
    let next = AtomicUsize::new(0);
    let total = Mutex::new(Ok(CopyStats {
        threads,
        ..CopyStats::default()
    }));
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                let mut buf = vec![0u8; BUF];
                let mut mine = CopyStats::default();
                let mut failed = None;
                while let Some(&(job, at, len)) = chunks.get(next.fetch_add(1, Ordering::Relaxed)) {
                    if let Err(e) = copy_chunk(&jobs[job], at, len, &mut buf, &mut mine) {
                        failed = Some(e);
                        // The others stop at their next chunk.
                        next.store(chunks.len(), Ordering::Relaxed);
                        break;
                    }
                }
                let mut total = total
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                match (failed, total.as_mut()) {
                    (Some(e), Ok(_)) => *total = Err(e),
                    (None, Ok(t)) => {
                        t.written += mine.written;
                        t.skipped += mine.skipped;
                    }
                    (_, Err(_)) => {}
                }
            });
        }
    });
    total
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The next data extent of `fd` in `from..end`, as (start, end); `None`
/// past the last one.
fn next_extent(fd: BorrowedFd<'_>, from: u64, end: u64) -> std::io::Result<Option<(u64, u64)>> {
    let to_off = |o: u64| i64::try_from(o).map_err(|_| std::io::Error::other("offset over i64"));
    let data = match lseek(fd, to_off(from)?, Whence::SeekData) {
        Ok(d) => d as u64,
        Err(nix::errno::Errno::ENXIO) => return Ok(None),
        // No SEEK_DATA here: all of it is data.
        Err(nix::errno::Errno::EINVAL) => return Ok((from < end).then_some((from, end))),
        Err(e) => return Err(e.into()),
    };
    if data >= end {
        return Ok(None);
    }
    let hole = match lseek(fd, to_off(data)?, Whence::SeekHole) {
        Ok(h) => h as u64,
        Err(nix::errno::Errno::ENXIO) => end,
        Err(e) => return Err(e.into()),
    };
    Ok(Some((data, hole.min(end))))
}

fn is_zero(page: &[u8]) -> bool {
    page.chunks_exact(16)
        .all(|c| u128::from_ne_bytes(c.try_into().unwrap_or([1; 16])) == 0)
        && page.chunks_exact(16).remainder().iter().all(|b| *b == 0)
}

/// Copies `at..at+len` of `job` (offsets in the destination).
fn copy_chunk(
    job: &CopyJob<'_>,
    at: u64,
    len: u64,
    buf: &mut [u8],
    stats: &mut CopyStats,
) -> std::io::Result<()> {
    let (start, end) = (job.src_offset + at, job.src_offset + at + len);
    let mut cursor = start;
    while let Some((data, data_end)) = next_extent(job.src.as_fd(), cursor, end)? {
        stats.skipped += data - cursor;
        let mut pos = data;
        while pos < data_end {
            let n = usize::try_from(data_end - pos).map_or(buf.len(), |r| r.min(buf.len()));
            let got = read_full(job.src, &mut buf[..n], pos)?;
            if got == 0 {
                // Past the source's end: the rest reads as zero.
                stats.skipped += data_end - pos;
                break;
            }
            write_nonzero_pages(job.dst, &buf[..got], pos - job.src_offset, stats)?;
            pos += got as u64;
        }
        cursor = data_end;
    }
    stats.skipped += end - cursor;
    Ok(())
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

/// Writes the runs of `bytes`' pages that are not all zero to `dst` at
/// `dst_offset`.
fn write_nonzero_pages(
    dst: &File,
    bytes: &[u8],
    dst_offset: u64,
    stats: &mut CopyStats,
) -> std::io::Result<()> {
    let mut run: Option<usize> = None;
    let flush = |from: usize, to: usize, stats: &mut CopyStats| {
        stats.written += (to - from) as u64;
        dst.write_all_at(&bytes[from..to], dst_offset + from as u64)
    };
    for (i, page) in bytes.chunks(PAGE).enumerate() {
        let at = i * PAGE;
        match (is_zero(page), run) {
            (false, None) => run = Some(at),
            (true, Some(from)) => {
                flush(from, at, stats)?;
                stats.skipped += page.len() as u64;
                run = None;
            }
            (true, None) => stats.skipped += page.len() as u64,
            (false, Some(_)) => {}
        }
    }
    if let Some(from) = run {
        flush(from, bytes.len(), stats)?;
    }
    Ok(())
}
