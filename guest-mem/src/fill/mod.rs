//! Filling a region from files: parking a VM whose memory is a VMM's own
//! memfd, restoring one from files on disk.
//!
//! Every byte of the region ends up either read from a source or zero.
//! Bytes a source supplies are read straight into the region's mapping with
//! `pread`, never zeroed first; holes in a source (`SEEK_DATA`/`SEEK_HOLE`:
//! shmem and memfds, ext4, xfs) and bytes no source covers are zeroed with
//! the [`clearing`] kernels, or skipped when the region is known to be zero
//! ([`FillOptions::dest_is_zero`], or an `Unpopulated` unit, which the kernel
//! zeroes as it populates it).
//!
//! # Design
//!
//! **`pread`, never `mmap`, of the peer's file.** The files come from an
//! untrusted peer, which can truncate its memfd at any moment: a mapping of
//! it would then SIGBUS the daemon, where a read just comes back short. A
//! short read is an error naming the source and offset, and the rest of the
//! unit is zeroed so nothing stale remains. A file that grows meanwhile is
//! fine: only the claimed range is read.
//!
//! **One state unit at a time, claimed.** [`fill_unit`] claims a unit the
//! way the lazy clearing claims a page (`Unpopulated`/`Dirty → Clearing`,
//! one `compare_exchange`), fills it and marks it `Clean`: a page fault that
//! asks for one unit and background workers filling the rest in address
//! order fill each unit exactly once. `Clean` after a fill means "holds its
//! final contents" (not zero, as it means in the pool: a filled region goes
//! back to a pool only through
//! [`Region::mark_all_dirty`](crate::Region::mark_all_dirty)); so a region
//! whose pages are clean (zero) is first marked with [`mark_for_fill`],
//! which also says whether its bytes are all zero.
//!
//! **Parallel and NUMA-local.** [`fill_region`] runs [`fill_unit`] over the
//! region on the [`clearing`] job runner: chunks of whole units, workers
//! pinned to the region's node (so the copy's writes and the page cache's
//! reads stay local), pulled in address order from one counter, each chunk
//! written by its worker only. Progress is reported by bytes, not by time.
//!
//! **Direct reads from disk.** A source whose file takes `O_DIRECT` and
//! whose range is mostly not in the page cache is read with `O_DIRECT`
//! ([`FillPlan::with_direct_io`], the default of [`fill_region`]): the
//! device writes straight into the region's huge pages, with no page-cache
//! pages to allocate, fill, copy out of and reclaim. The file is opened a
//! second time for it, through `/proc/self/fd`, only when the caller's fd
//! is open for reading. Unaligned heads and tails, and files that refuse,
//! are read through the page cache.
//!
//! **Checksums.** A source can come with the CRC-32C of each piece of its
//! file ([`FillPlan::with_checksums`]: a saved VM's manifest). Each piece is
//! checked in the region once the unit that holds it is filled, by whoever
//! filled it (a background worker or a fault), and a unit with a piece that
//! does not match goes back to `Dirty` with an error that names the source,
//! the file offset and both checksums: a damaged file never becomes a VM's
//! memory, even when it is read one unit at a time as a guest runs.
//!
//! **Read-ahead.** For sources read through the page cache, each chunk's
//! file ranges are handed to the kernel with `POSIX_FADV_WILLNEED` before
//! they are read ([`Readahead`]), which keeps the device's queue full while
//! the workers copy; docs/benchmarks.md (`bench fill`) has the
//! measurements.

mod error;
mod options;
mod plan;
mod region;
mod unit;

pub use error::FillError;
pub use options::{
    FillCounts, FillOptions, FillProgress, FillReport, Readahead, UnitFill, DEFAULT_FILL_CHUNK,
    DEFAULT_PROGRESS_EVERY,
};
pub use plan::{Checksums, FillPlan, FillSource};
pub use region::{fill_region, fill_region_planned, mark_for_fill};
pub use unit::fill_unit;
