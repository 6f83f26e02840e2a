//! Batched `mlock`/`munlock`: lock or unlock guest RAM in chunks, per NUMA
//! node in parallel, with progress and cancellation.
//!
//! # Why batch
//! One `mlock(2)` over a large region holds the process's `mmap_lock` for the
//! whole call. The kernel first takes it for writing to set `VM_LOCKED` on the
//! VMAs (`apply_vma_lock_flags`), then for reading while `__mm_populate`
//! faults in every page of the range: for 4 KiB shmem that means allocating,
//! zeroing and inserting each page into the page cache, about 2.4 GB/s on
//! this project's test machine.
//! While a reader holds the lock, every writer queues behind it, and `mmap`,
//! `munmap` and `mprotect` are writers: any other VMM thread that maps a
//! buffer, or whose allocator grows or trims an arena, waits for the whole
//! call: 1.0-1.4 s for 2 GiB of 4 KiB shmem there (`hugemem bench mlock`).
//! `munlock(2)` is worse in kind: it walks the pages with the lock held for
//! writing from start to end.
//!
//! Here each system call covers at most one chunk ([`LockOptions::chunk`],
//! default 8 MiB), so the lock is released between chunks and a waiting
//! writer gets in after a few chunks' work (the running locker often takes
//! the lock back before the woken writer is scheduled; the worst stall
//! measured was 16-25 ms with 8 MiB chunks, against 1.2 s for one call). The
//! total work is the same; the extra cost is one system call and one VMA
//! split and merge per chunk (a chunk locked next to an already locked
//! neighbour splits the unlocked rest off and merges back into the locked
//! part, so the VMA count stays small), plus a lock hand-over per chunk when
//! another thread is waiting. On 2 MiB hugetlb a chunk is ~4x less work per
//! byte than on 4 KiB shmem, and with a thread mapping in a tight loop 8 MiB
//! chunks made the hugetlb lock much slower in an earlier, loaded run (not
//! kept) while 32 MiB chunks did not. `docs/benchmarks.md` (`hugemem bench
//! mlock`, with the default chunks and with `--chunk 8M`) has the figures of
//! the runs kept there.
//!
//! Chunks come from the `clearing` job runner ([`clearing::run_jobs`]): one
//! job per range, each range usually the part of guest RAM on one node, with
//! its workers pinned to that node's CPUs so pages that locking allocates come
//! from the local node under the default policy. `RunOptions::max_chunk` is
//! set to the chunk size, which is what bounds every call.
//!
//! The alternative, `mlock2(MLOCK_ONFAULT)` over the whole region (cheap: it
//! only sets VMA flags on an unpopulated range) followed by a chunked
//! `MADV_POPULATE_WRITE`, gives the same pinning for new memory but still
//! walks already present pages under the write lock; [`LockOptions::with_on_fault`]
//! offers `MLOCK_ONFAULT` itself, chunked like the rest.
//!
//! # Kernel behaviour worth knowing
//! * `VmLck` in `/proc/self/status` grows by the whole range at `mlock`, for
//!   `MLOCK_ONFAULT` too, although on-fault locking populates nothing.
//! * hugetlb mappings are never marked `VM_LOCKED` (`mlock_fixup` skips them):
//!   their pages are not on the LRU and cannot be swapped anyway. `mlock` on
//!   them only populates the range (taking pages from the pool), `VmLck` does
//!   not change, and `munlock` does nothing.
//! * A failed `mlock` leaves its own range marked locked: the kernel sets
//!   `VM_LOCKED` before it populates and does not undo it when populating
//!   fails.
//!
//! # Partial results
//! When a run is cancelled or a call fails, the chunks done so far stay locked
//! (or unlocked) and the error says how many bytes that was. Undoing them
//! would take as long as doing them and would hold the same lock; the caller
//! decides. [`unlock_ranges`] over the same ranges undoes a partial lock:
//! unlocking memory that is not locked is not an error.

use std::fmt;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use clearing::{Chunk, Job, NodeStats, RunError, RunOptions};
use numa::{NodeId, Topology};

use crate::mapping::{AnonMapping, PageSize, SharedMapping};
use crate::sys;

/// Default bytes per system call on 4 KiB pages: 8 MiB, about 3.5 ms of shmem
/// locking at the rates measured on the test machine.
pub const DEFAULT_LOCK_CHUNK: usize = 8 << 20;

/// Default bytes per system call on huge pages: 32 MiB. 8 MiB of 2 MiB hugetlb
/// is little work, and handing `mmap_lock` over 256 times per 2 GiB to a
/// thread that wants it cost much extra total time in an earlier, loaded run;
/// 32 MiB met both of the bench's expectations there (worst stall at least
/// 10x shorter, at most +10 % time). `docs/benchmarks.md` has the kept runs.
pub const DEFAULT_HUGE_LOCK_CHUNK: usize = 32 << 20;

/// Base page size: chunk sizes must be multiples of it.
const BASE_PAGE: usize = 4096;

/// Result of this module's operations.
pub type Result<T> = std::result::Result<T, LockError>;

/// Which operation a run performs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockOp {
    /// `mlock`: populate and pin.
    Lock,
    /// `mlock2(MLOCK_ONFAULT)`: pin pages as they are faulted in.
    LockOnFault,
    /// `munlock`.
    Unlock,
}

impl fmt::Display for LockOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LockOp::Lock => "lock",
            LockOp::LockOnFault => "lock on fault",
            LockOp::Unlock => "unlock",
        })
    }
}

/// Errors of batched locking.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// The chunk size is zero or not a multiple of 4 KiB.
    #[error("lock chunk of {0} bytes is not a non-zero multiple of 4096")]
    BadChunk(usize),
    /// Zero threads per node.
    #[error("threads per node must be at least 1")]
    BadThreads,
    /// A range is empty, overflows, or is not aligned to its page size.
    #[error("range {start:#x}+{len} is empty or not aligned to its {page_size} pages")]
    BadRange {
        /// Start address.
        start: usize,
        /// Length.
        len: usize,
        /// Page size of the range.
        page_size: PageSize,
    },
    /// `mlock` failed with `ENOMEM` or `EPERM`.
    #[error(
        "cannot {op} {len} bytes at {start:#x} after {done_bytes} bytes: over RLIMIT_MEMLOCK \
         without CAP_IPC_LOCK, part of the range not mapped, or a page that cannot be faulted \
         in (empty hugetlb pool, memfd shorter than the mapping)"
    )]
    Limit {
        /// Lock or lock on fault.
        op: LockOp,
        /// Start of the failed chunk.
        start: usize,
        /// Length of the failed chunk.
        len: usize,
        /// Bytes in chunks that succeeded before the run stopped.
        done_bytes: u64,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// `mlock` failed with `EAGAIN`: the kernel could not allocate or pin every page.
    #[error("cannot {op} {len} bytes at {start:#x} after {done_bytes} bytes: out of memory")]
    NoMemory {
        /// Lock or lock on fault.
        op: LockOp,
        /// Start of the failed chunk.
        start: usize,
        /// Length of the failed chunk.
        len: usize,
        /// Bytes in chunks that succeeded before the run stopped.
        done_bytes: u64,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Any other failed call (`munlock` fails with `ENOMEM` on unmapped memory).
    #[error("cannot {op} {len} bytes at {start:#x} after {done_bytes} bytes")]
    Syscall {
        /// The operation.
        op: LockOp,
        /// Start of the failed chunk.
        start: usize,
        /// Length of the failed chunk.
        len: usize,
        /// Bytes in chunks that succeeded before the run stopped.
        done_bytes: u64,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The cancel token fired; the bytes done stay as they are.
    #[error("{op} cancelled after {done_bytes} of {total_bytes} bytes")]
    Cancelled {
        /// The operation.
        op: LockOp,
        /// Bytes in chunks finished before the workers stopped.
        done_bytes: u64,
        /// Bytes asked for.
        total_bytes: u64,
    },
    /// The job runner could not run the work (pinning, thread creation, a panic,
    /// a node the topology does not have).
    #[error("the job runner failed after {done_bytes} bytes: {message}")]
    Runner {
        /// What went wrong.
        message: String,
        /// Bytes in chunks finished before the run stopped.
        done_bytes: u64,
    },
}

/// How to lock: bytes per call, `MLOCK_ONFAULT`, workers per node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LockOptions {
    chunk: Option<usize>,
    on_fault: bool,
    threads_per_node: usize,
}

impl Default for LockOptions {
    fn default() -> Self {
        Self {
            chunk: None,
            on_fault: false,
            threads_per_node: 1,
        }
    }
}

impl LockOptions {
    /// Default chunks ([`DEFAULT_LOCK_CHUNK`] on 4 KiB pages,
    /// [`DEFAULT_HUGE_LOCK_CHUNK`] on huge pages), populate-and-lock, one
    /// worker per node.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes per system call: a non-zero multiple of 4 KiB. On huge-page
    /// ranges it is rounded up to a multiple of the page size.
    ///
    /// # Errors
    /// [`LockError::BadChunk`] for 0 or a size that is not a multiple of 4 KiB.
    pub fn with_chunk(mut self, chunk: usize) -> Result<Self> {
        if chunk == 0 || !chunk.is_multiple_of(BASE_PAGE) {
            return Err(LockError::BadChunk(chunk));
        }
        self.chunk = Some(chunk);
        Ok(self)
    }

    /// Lock with `mlock2(MLOCK_ONFAULT)`: mark the range locked without
    /// populating it; pages are pinned as they are first touched. No effect on
    /// unlocking.
    pub fn with_on_fault(mut self, on_fault: bool) -> Self {
        self.on_fault = on_fault;
        self
    }

    /// Workers per range (per node part). One is usually right: on one node,
    /// two workers locking halves were no faster (they share the `mmap_lock`
    /// and the shmem page cache).
    ///
    /// # Errors
    /// [`LockError::BadThreads`] for 0.
    pub fn with_threads_per_node(mut self, threads: usize) -> Result<Self> {
        if threads == 0 {
            return Err(LockError::BadThreads);
        }
        self.threads_per_node = threads;
        Ok(self)
    }

    /// Bytes per system call (before rounding to huge pages); `None` = the
    /// default for the ranges' page size.
    pub fn chunk(&self) -> Option<usize> {
        self.chunk
    }

    /// True for `MLOCK_ONFAULT`.
    pub fn on_fault(&self) -> bool {
        self.on_fault
    }

    /// Workers per range.
    pub fn threads_per_node(&self) -> usize {
        self.threads_per_node
    }
}

/// One range to lock: usually the part of a guest RAM region on one node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LockRange {
    /// Start address, aligned to `page_size`.
    pub start: usize,
    /// Length, a non-zero multiple of `page_size`.
    pub len: usize,
    /// Page size of the mapping; chunk boundaries stay on these pages.
    pub page_size: PageSize,
    /// Node whose CPUs run the workers for this range; `None` leaves them unpinned.
    pub node: Option<NodeId>,
}

/// What a run did.
#[derive(Debug, Clone, PartialEq)]
pub struct LockReport {
    /// The operation.
    pub op: LockOp,
    /// Bytes locked or unlocked.
    pub bytes: u64,
    /// Wall time of the whole call, seconds.
    pub seconds: f64,
    /// System calls made (one per chunk).
    pub chunks: u64,
    /// Chunk size used, after rounding to the largest page size of the ranges.
    pub chunk_bytes: usize,
    /// Per node (per range node; `None` for unpinned), from the job runner.
    pub nodes: Vec<NodeStats>,
}

/// The mapping types of this crate that can be locked safely: the borrow
/// keeps the mapping alive and in place while the run uses its addresses.
pub trait Lockable: sealed::Sealed {
    /// The whole mapping as one range, its workers on `node` (or unpinned).
    fn lock_range(&self, node: Option<NodeId>) -> LockRange;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for crate::mapping::AnonMapping {}
    impl Sealed for crate::mapping::SharedMapping {}
}

impl Lockable for AnonMapping {
    fn lock_range(&self, node: Option<NodeId>) -> LockRange {
        LockRange {
            start: self.addr().expose_provenance(),
            len: self.len(),
            page_size: self.page_size(),
            node,
        }
    }
}

impl Lockable for SharedMapping {
    fn lock_range(&self, node: Option<NodeId>) -> LockRange {
        LockRange {
            start: self.addr().expose_provenance(),
            len: self.len(),
            page_size: self.page_size(),
            node,
        }
    }
}

/// Locks every range in chunks of at most `opts.chunk()` bytes, ranges in
/// parallel, `opts.threads_per_node()` workers each. `run_opts` supplies the
/// cancel token and progress callback; its `max_chunk` is replaced by the
/// chunk size. With `opts.on_fault()` it uses `mlock2(MLOCK_ONFAULT)`.
///
/// # Safety
/// Every range must lie in mappings owned by the caller that nobody unmaps or
/// remaps until this returns: locking faults every page in, and on an address
/// range that changed hands it would pin (and populate) someone else's memory.
///
/// # Errors
/// Validation errors before any call ([`LockError::BadRange`]); the first failed
/// call ([`LockError::Limit`], [`LockError::NoMemory`], [`LockError::Syscall`]),
/// cancellation ([`LockError::Cancelled`]) and runner failures, each with the
/// bytes done. What was locked stays locked (see the module docs).
pub unsafe fn lock_ranges(
    topology: &Topology,
    ranges: &[LockRange],
    opts: &LockOptions,
    run_opts: &RunOptions<'_>,
) -> Result<LockReport> {
    let op = if opts.on_fault {
        LockOp::LockOnFault
    } else {
        LockOp::Lock
    };
    // SAFETY: the caller's contract is this function's contract.
    unsafe { run(topology, ranges, opts, run_opts, op) }
}

/// Unlocks every range in chunks, as [`lock_ranges`] locks them.
///
/// # Safety
/// As for [`lock_ranges`].
///
/// # Errors
/// As for [`lock_ranges`]; `munlock` fails only on unmapped memory
/// ([`LockError::Syscall`] with `ENOMEM`).
pub unsafe fn unlock_ranges(
    topology: &Topology,
    ranges: &[LockRange],
    opts: &LockOptions,
    run_opts: &RunOptions<'_>,
) -> Result<LockReport> {
    // SAFETY: the caller's contract is this function's contract.
    unsafe { run(topology, ranges, opts, run_opts, LockOp::Unlock) }
}

/// Locks a whole mapping of this crate, in chunks, its workers unpinned.
///
/// # Errors
/// As for [`lock_ranges`].
pub fn lock_mapping<M: Lockable>(
    topology: &Topology,
    mapping: &M,
    opts: &LockOptions,
    run_opts: &RunOptions<'_>,
) -> Result<LockReport> {
    let range = mapping.lock_range(None);
    // SAFETY: the range is exactly the mapping, which the borrow keeps mapped
    // and owned by `mapping` until this returns.
    unsafe { lock_ranges(topology, &[range], opts, run_opts) }
}

/// Unlocks a whole mapping of this crate, in chunks.
///
/// # Errors
/// As for [`unlock_ranges`].
pub fn unlock_mapping<M: Lockable>(
    topology: &Topology,
    mapping: &M,
    opts: &LockOptions,
    run_opts: &RunOptions<'_>,
) -> Result<LockReport> {
    let range = mapping.lock_range(None);
    // SAFETY: as in `lock_mapping`.
    unsafe { unlock_ranges(topology, &[range], opts, run_opts) }
}

/// The failure of one chunk, as the work function reports it to the runner.
#[derive(Debug, thiserror::Error)]
#[error("system call failed")]
struct ChunkError(#[source] io::Error);

fn page_bytes(page_size: PageSize) -> usize {
    // Page sizes are at most 1 GiB, which fits every usize we build for.
    usize::try_from(page_size.bytes()).unwrap_or(usize::MAX)
}

/// Checks the ranges; returns the chunk size rounded up to the largest page.
fn plan(ranges: &[LockRange], opts: &LockOptions) -> Result<usize> {
    let mut largest = BASE_PAGE;
    for r in ranges {
        let page = page_bytes(r.page_size);
        let bad = || LockError::BadRange {
            start: r.start,
            len: r.len,
            page_size: r.page_size,
        };
        if r.len == 0
            || r.start % page != 0
            || r.len % page != 0
            || r.start.checked_add(r.len).is_none()
        {
            return Err(bad());
        }
        largest = largest.max(page);
    }
    let chunk = opts.chunk.unwrap_or(if largest > BASE_PAGE {
        DEFAULT_HUGE_LOCK_CHUNK
    } else {
        DEFAULT_LOCK_CHUNK
    });
    Ok(chunk.div_ceil(largest).saturating_mul(largest))
}

/// # Safety
/// As for [`lock_ranges`].
unsafe fn run(
    topology: &Topology,
    ranges: &[LockRange],
    opts: &LockOptions,
    run_opts: &RunOptions<'_>,
    op: LockOp,
) -> Result<LockReport> {
    let chunk = plan(ranges, opts)?;
    let jobs: Vec<Job> = ranges
        .iter()
        .map(|r| Job {
            start: r.start,
            len: r.len,
            align: page_bytes(r.page_size),
            min_chunk: chunk,
            max_threads: opts.threads_per_node,
            node: r.node,
        })
        .collect();
    let total: u64 = ranges.iter().map(|r| r.len as u64).sum();
    // Every call covers at most one chunk: this cap is the batching.
    let batched = RunOptions {
        cancel: run_opts.cancel,
        progress: run_opts.progress,
        max_chunk: chunk,
    };
    let done = AtomicU64::new(0);
    let calls = AtomicU64::new(0);
    let started = Instant::now();
    let result = clearing::run_jobs(topology, &jobs, &batched, |c: &Chunk| {
        let addr = std::ptr::with_exposed_provenance::<u8>(c.start);
        // In all three arms: the runner hands out chunks inside the job
        // ranges, which the caller of `lock_ranges`/`unlock_ranges` guarantees
        // are its own live mappings for the duration of this run.
        let res = match op {
            // SAFETY: see above; the chunk is the caller's live mapping.
            LockOp::Lock => unsafe { sys::mlock(addr, c.len) },
            // SAFETY: see above; the chunk is the caller's live mapping.
            LockOp::LockOnFault => unsafe { sys::mlock_onfault(addr, c.len) },
            // SAFETY: see above; the chunk is the caller's live mapping.
            LockOp::Unlock => unsafe { sys::munlock(addr, c.len) },
        };
        calls.fetch_add(1, Ordering::Relaxed);
        res.map_err(ChunkError)?;
        done.fetch_add(c.len as u64, Ordering::Relaxed);
        Ok(())
    });
    let seconds = started.elapsed().as_secs_f64();
    let done_bytes = done.load(Ordering::Relaxed);
    match result {
        Ok(report) => Ok(LockReport {
            op,
            bytes: report.bytes,
            seconds,
            chunks: calls.load(Ordering::Relaxed),
            chunk_bytes: chunk,
            nodes: report.nodes,
        }),
        Err(RunError::Cancelled { .. }) => Err(LockError::Cancelled {
            op,
            done_bytes,
            total_bytes: total,
        }),
        Err(RunError::Work {
            chunk: c,
            source: ChunkError(source),
        }) => Err(classify(op, c.start, c.len, done_bytes, source)),
        Err(other) => Err(LockError::Runner {
            message: other.to_string(),
            done_bytes,
        }),
    }
}

/// Maps a failed call's errno to the variant that explains it.
fn classify(op: LockOp, start: usize, len: usize, done_bytes: u64, source: io::Error) -> LockError {
    match (op, source.raw_os_error()) {
        (LockOp::Lock | LockOp::LockOnFault, Some(libc::ENOMEM | libc::EPERM)) => {
            LockError::Limit {
                op,
                start,
                len,
                done_bytes,
                source,
            }
        }
        (LockOp::Lock | LockOp::LockOnFault, Some(libc::EAGAIN)) => LockError::NoMemory {
            op,
            start,
            len,
            done_bytes,
            source,
        },
        _ => LockError::Syscall {
            op,
            start,
            len,
            done_bytes,
            source,
        },
    }
}

#[cfg(test)]
mod tests;
