//! The runner's vocabulary: a job and its chunks, the options and cancel
//! token of a run, its progress and its report, and how it fails. Its own
//! file: the planner and the workers use it, and the runner uses them.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use numa::{NodeId, PinError};

use crate::kernel::MAX_RUN;

/// How many chunks per worker the splitter aims at (padata's
/// `load_balance_factor`).
pub(super) const LOAD_BALANCE_FACTOR: usize = 4;

/// The progress callback is called at most this often (plus once at the end).
pub(super) const PROGRESS_INTERVAL: Duration = Duration::from_millis(10);

/// Chunk alignment used by [`clear_parallel`](crate::clear_parallel): 2 MiB, so that a transparent
/// or hugetlb 2 MiB page is never split between two workers.
pub const CLEAR_ALIGN: usize = 2 << 20;

/// Minimum chunk used by [`clear_parallel`](crate::clear_parallel): 4 MiB, 0.2-0.5 ms of clearing at
/// the measured single-thread rates, well above the cost of starting and
/// pinning a thread (tens of µs); buffers below twice this are cleared by one
/// worker.
pub const CLEAR_MIN_CHUNK: usize = 4 << 20;

/// One range of work and how it may be split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Job {
    /// First address (or index) of the range.
    pub start: usize,
    /// Length of the range; 0 makes the job a no-op.
    pub len: usize,
    /// Chunk boundaries inside the range fall on multiples of this (a power of
    /// two; 1 for no constraint).
    pub align: usize,
    /// Smallest chunk worth a hand-off; every chunk of the job but the last is
    /// at least this long. Also bounds the worker count (`len / min_chunk`).
    /// 0 is treated as 1.
    pub min_chunk: usize,
    /// Most workers for this job (at least 1).
    pub max_threads: usize,
    /// The NUMA node whose CPUs run the workers, or `None` for unpinned.
    pub node: Option<NodeId>,
}

/// One piece of a job, handed to the work function.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Chunk {
    /// Index of the job in the slice given to [`run_jobs`](crate::run_jobs).
    pub job: usize,
    /// First address (or index) of the piece.
    pub start: usize,
    /// Length of the piece (never 0).
    pub len: usize,
}

/// Asks a running [`run_jobs`](crate::run_jobs) to stop; cheap to clone and share.
///
/// Workers look at it between chunks, so a run stops within one chunk
/// ([`RunOptions::max_chunk`]) per worker.
#[derive(Debug, Clone, Default)]
pub struct CancelToken(Arc<AtomicBool>);

impl CancelToken {
    /// A token that is not cancelled.
    pub fn new() -> Self {
        Self::default()
    }
    /// Requests cancellation; every clone sees it.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }
    /// True once [`cancel`](Self::cancel) has been called on any clone.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// Progress of a run, summed over all its jobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Bytes in finished chunks so far.
    pub bytes_done: u64,
    /// Bytes in all jobs of the run.
    pub bytes_total: u64,
}

/// How a run behaves, beyond the jobs themselves.
#[derive(Clone, Copy)]
pub struct RunOptions<'a> {
    /// Stops the run between chunks when cancelled.
    pub cancel: Option<&'a CancelToken>,
    /// Called from worker threads with cumulative progress: after the first
    /// chunk, then at most every 10 ms, and after the last chunk. Calls are
    /// serialized and `bytes_done` never decreases from one call to the next.
    /// Keep it cheap: workers wait for it.
    pub progress: Option<&'a (dyn Fn(&Progress) + Sync)>,
    /// The responsiveness cap: no chunk is longer than this, so a worker looks
    /// at the cancel token and reports progress at least every `max_chunk`
    /// bytes. Default [`MAX_RUN`] (64 MiB); 0 means no cap. Where a job's
    /// `min_chunk` rounded up to its `align` is larger, the job's constraints
    /// win, since a chunk cannot be smaller than the job allows.
    pub max_chunk: usize,
}

impl Default for RunOptions<'_> {
    fn default() -> Self {
        Self {
            cancel: None,
            progress: None,
            max_chunk: MAX_RUN,
        }
    }
}

impl std::fmt::Debug for RunOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunOptions")
            .field("cancel", &self.cancel)
            .field("progress", &self.progress.map(|_| "Fn(&Progress)"))
            .field("max_chunk", &self.max_chunk)
            .finish()
    }
}

/// What the workers of one node (or the unpinned workers) did.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeStats {
    /// The node the jobs asked for, `None` for unpinned jobs.
    pub node: Option<NodeId>,
    /// Bytes in chunks they finished.
    pub bytes: u64,
    /// Wall time from the first of them starting to the last finishing.
    pub seconds: f64,
    /// How many workers.
    pub threads: usize,
    /// How many chunks they finished.
    pub chunks: usize,
}

impl NodeStats {
    /// Throughput in GiB/s (0 when no time was measured).
    pub fn gib_per_s(&self) -> f64 {
        gib_per_s(self.bytes, self.seconds)
    }
}

/// The outcome of a successful run.
#[derive(Debug, Clone, PartialEq)]
pub struct RunReport {
    /// Per node, in the order the nodes first appear in the jobs.
    pub nodes: Vec<NodeStats>,
    /// Bytes done over all jobs.
    pub bytes: u64,
    /// Wall time from the first worker starting to the last finishing.
    pub seconds: f64,
}

impl RunReport {
    /// Overall throughput in GiB/s (0 when no time was measured).
    pub fn gib_per_s(&self) -> f64 {
        gib_per_s(self.bytes, self.seconds)
    }
}

fn gib_per_s(bytes: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        // Precision loss above 2^53 bytes is irrelevant for a rate.
        #[allow(clippy::cast_precision_loss)]
        let b = bytes as f64;
        b / f64::from(1u32 << 30) / seconds
    } else {
        0.0
    }
}

/// Why a run failed.
#[derive(Debug, thiserror::Error)]
pub enum RunError<E> {
    /// A job failed validation; nothing ran.
    #[error("job {job} is invalid: {reason}")]
    InvalidJob {
        /// Index of the job.
        job: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// The cancel token fired before all chunks were done.
    #[error("cancelled after {bytes_done} bytes")]
    Cancelled {
        /// Bytes in chunks finished before the workers stopped.
        bytes_done: u64,
    },
    /// The work function failed on a chunk; the other workers were stopped.
    #[error("work failed on job {} at {:#x} ({} bytes)", chunk.job, chunk.start, chunk.len)]
    Work {
        /// The chunk that failed.
        chunk: Chunk,
        /// The work function's error.
        #[source]
        source: E,
    },
    /// A worker could not be pinned to its node.
    #[error("cannot pin a worker to its NUMA node")]
    Pin(#[source] PinError),
    /// A worker (or the work or progress function it ran) panicked.
    #[error("a worker of job {job} panicked: {message}")]
    WorkerPanicked {
        /// Index of the job the worker ran.
        job: usize,
        /// The panic payload, if it was a string.
        message: String,
    },
    /// A worker thread could not be created.
    #[error("cannot spawn a worker thread")]
    Spawn(#[source] io::Error),
}
