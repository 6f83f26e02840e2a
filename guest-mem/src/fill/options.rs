//! The fill's options, progress and reports.

use std::ops::AddAssign;
use std::time::Duration;

use clearing::CancelToken;

use crate::state::PageState;

/// Default [`FillOptions::chunk`]: 16 MiB, eight 2 MiB units; large enough
/// that each worker's reads stream, small enough that a few GiB still spread
/// over every worker of a node.
pub const DEFAULT_FILL_CHUNK: u64 = 16 << 20;

/// Default [`FillOptions::progress_every`]: 1 GiB.
pub const DEFAULT_PROGRESS_EVERY: u64 = 1 << 30;

/// Hints to the kernel about how the sources will be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readahead {
    /// No hints: the kernel's own read-ahead of each `pread`.
    None,
    /// `POSIX_FADV_SEQUENTIAL` on every source's range once (doubles the
    /// read-ahead window of the file description).
    Sequential,
    /// `POSIX_FADV_WILLNEED` on each chunk's file ranges as a worker takes it:
    /// the chunk's reads are all queued to the device at once.
    WillNeed,
}

/// How a fill runs.
#[derive(Clone, Copy)]
pub struct FillOptions<'a> {
    /// The region's bytes are all zero (taken clean from the pool, see
    /// [`mark_for_fill`](super::mark_for_fill)): holes and uncovered bytes are skipped, not zeroed.
    pub dest_is_zero: bool,
    /// Most workers of [`fill_region`](super::fill_region) (the region is on one node; the node's
    /// CPUs bound it too).
    pub max_threads_per_node: usize,
    /// Bytes per chunk a worker takes; rounded up to whole state units.
    pub chunk: u64,
    /// Read-ahead hints (for the sources read through the page cache).
    pub readahead: Readahead,
    /// Read sources on disk with `O_DIRECT` where that pays
    /// ([`FillPlan::with_direct_io`](super::FillPlan::with_direct_io));
    /// [`fill_region`](super::fill_region) only, a caller's own plan says for itself.
    pub direct_io: bool,
    /// Called with the progress every `progress_every` bytes of the region
    /// and at the end; calls are serialized. Keep it cheap: workers wait.
    pub progress: Option<&'a (dyn Fn(&FillProgress) + Sync)>,
    /// Bytes between progress reports (also logged with `tracing`); 0 for none.
    pub progress_every: u64,
    /// Called by [`fill_region`](super::fill_region)'s workers after each
    /// unit they took left their hands (filled, or failed back to `Dirty`),
    /// with its index: for a thread that waits on a unit another filler
    /// holds. Not logged; keep it cheap.
    pub unit_done: Option<&'a (dyn Fn(usize) + Sync)>,
    /// Stops [`fill_region`](super::fill_region) between chunks.
    pub cancel: Option<&'a CancelToken>,
}

impl Default for FillOptions<'_> {
    fn default() -> Self {
        Self {
            dest_is_zero: false,
            max_threads_per_node: std::thread::available_parallelism().map_or(1, usize::from),
            chunk: DEFAULT_FILL_CHUNK,
            readahead: Readahead::WillNeed,
            direct_io: true,
            progress: None,
            progress_every: DEFAULT_PROGRESS_EVERY,
            unit_done: None,
            cancel: None,
        }
    }
}

impl std::fmt::Debug for FillOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FillOptions")
            .field("dest_is_zero", &self.dest_is_zero)
            .field("max_threads_per_node", &self.max_threads_per_node)
            .field("chunk", &self.chunk)
            .field("readahead", &self.readahead)
            .field("direct_io", &self.direct_io)
            .field("progress", &self.progress.map(|_| "Fn(&FillProgress)"))
            .field("progress_every", &self.progress_every)
            .field("unit_done", &self.unit_done.map(|_| "Fn(usize)"))
            .field("cancel", &self.cancel)
            .finish()
    }
}

/// How far a [`fill_region`](super::fill_region) is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FillProgress {
    /// Bytes of the region whose units are done (filled or skipped).
    pub bytes_done: u64,
    /// The region's length.
    pub bytes_total: u64,
}

/// What was written, per unit or summed over a region.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FillCounts {
    /// Bytes read from the sources into the region.
    pub bytes_read: u64,
    /// Of those, bytes read with `O_DIRECT` (straight from the device).
    pub bytes_read_direct: u64,
    /// Bytes zeroed (holes and uncovered bytes of units that may hold stale data).
    pub bytes_zeroed: u64,
    /// Bytes of the sources' ranges that were holes, zeroed or skipped.
    pub hole_bytes: u64,
    /// Bytes checked against their checksums
    /// ([`FillPlan::with_checksums`](super::FillPlan::with_checksums)).
    pub bytes_verified: u64,
}

impl AddAssign for FillCounts {
    fn add_assign(&mut self, rhs: Self) {
        self.bytes_read += rhs.bytes_read;
        self.bytes_read_direct += rhs.bytes_read_direct;
        self.bytes_zeroed += rhs.bytes_zeroed;
        self.hole_bytes += rhs.hole_bytes;
        self.bytes_verified += rhs.bytes_verified;
    }
}

/// What [`fill_unit`](super::fill_unit) did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnitFill {
    /// This call filled the unit; it is `Clean` now.
    Filled(FillCounts),
    /// Another thread holds the unit in `Clearing` (filling it): it turns
    /// `Clean` when that thread is done.
    Busy,
    /// The unit was already `Clean` or `Mapped`: nothing done.
    Done(PageState),
}

/// What [`fill_region`](super::fill_region) did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FillReport {
    /// Bytes read, zeroed, and in holes, over all units this call filled.
    pub counts: FillCounts,
    /// Units this call filled.
    pub units_filled: usize,
    /// Units it left: already `Clean`/`Mapped`, or held by another filler.
    pub units_skipped: usize,
    /// Workers that ran.
    pub threads: usize,
    /// Wall time of the whole call.
    pub elapsed: Duration,
}

impl FillReport {
    /// Bytes read per second, in GB/s (10^9 bytes).
    pub fn read_gbps(&self) -> f64 {
        let seconds = self.elapsed.as_secs_f64();
        if seconds > 0.0 {
            // Precision loss above 2^53 bytes is irrelevant for a rate.
            #[allow(clippy::cast_precision_loss)]
            let bytes = self.counts.bytes_read as f64;
            bytes / 1e9 / seconds
        } else {
            0.0
        }
    }
}
