//! Why a fill was refused or failed.

use std::io;

use clearing::RunError;

use crate::state::PageState;

/// Why a fill was refused (before anything was written) or failed.
///
/// `index` is always the source's position in the slice the caller gave.
#[derive(Debug, thiserror::Error)]
pub enum FillError {
    /// `fstat` of a source's fd failed.
    #[error("source {index}: cannot fstat its fd")]
    Stat {
        /// The source.
        index: usize,
        /// The `fstat` error.
        #[source]
        error: io::Error,
    },
    /// A source's fd is not a regular file (a pipe, socket, device,
    /// directory): only regular files (memfds and hugetlbfs files are) can be
    /// read at offsets and probed for holes.
    #[error("source {index}: its fd is not a regular file ({kind})")]
    NotRegular {
        /// The source.
        index: usize,
        /// What it is instead.
        kind: &'static str,
    },
    /// A source's destination range does not lie inside the region.
    #[error("source {index}: destination {dest_offset:#x}+{len:#x} goes past the region's {region_len:#x} bytes")]
    OutOfRegion {
        /// The source.
        index: usize,
        /// Its destination offset.
        dest_offset: u64,
        /// Its length.
        len: u64,
        /// The region's length.
        region_len: u64,
    },
    /// A source's file range overflows a file offset.
    #[error("source {index}: file range {file_offset:#x}+{len:#x} overflows")]
    FileRange {
        /// The source.
        index: usize,
        /// Its file offset.
        file_offset: u64,
        /// Its length.
        len: u64,
    },
    /// Two sources write the same destination bytes.
    #[error("sources {first} and {second} overlap in the destination at {at:#x}")]
    Overlap {
        /// The source that starts first in the destination.
        first: usize,
        /// The one that starts inside it.
        second: usize,
        /// Where the second starts.
        at: u64,
    },
    /// A source's file is shorter than the range it claims (checked before
    /// anything is read).
    #[error("source {index}: the file has {size} bytes, the source claims up to {claimed_end}")]
    TooShort {
        /// The source.
        index: usize,
        /// The file's size.
        size: u64,
        /// `file_offset + len`.
        claimed_end: u64,
    },
    /// A source's file ended before the claimed range did, while it was read
    /// (truncated meanwhile): the rest of the unit was zeroed.
    #[error("source {index}: the file ends at {file_offset:#x}, inside the claimed range (destination {dest_offset:#x}); truncated while it was read?")]
    ShortRead {
        /// The source.
        index: usize,
        /// File offset where the data stopped.
        file_offset: u64,
        /// The destination offset that offset maps to.
        dest_offset: u64,
    },
    /// `pread` failed.
    #[error("source {index}: read at file offset {file_offset:#x} failed")]
    Read {
        /// The source.
        index: usize,
        /// File offset of the failed read.
        file_offset: u64,
        /// The error.
        #[source]
        error: io::Error,
    },
    /// A piece of a source's file does not hold what its checksum says
    /// ([`FillPlan::with_checksums`](super::FillPlan::with_checksums)): the
    /// unit that holds it was not filled.
    #[error("source {index}: the {len} bytes at file offset {file_offset:#x} have CRC-32C {found:#010x}, its checksum says {expected:#010x}")]
    Checksum {
        /// The source.
        index: usize,
        /// Where the piece starts in the file.
        file_offset: u64,
        /// Its length.
        len: u64,
        /// The checksum it should have.
        expected: u32,
        /// The checksum of what was read.
        found: u32,
    },
    /// Checksums that cannot be checked on this source (see
    /// [`FillPlan::with_checksums`](super::FillPlan::with_checksums)).
    #[error("source {index}: its checksums cannot be checked: {why}")]
    Checksums {
        /// The source.
        index: usize,
        /// Why.
        why: &'static str,
    },
    /// `lseek(SEEK_DATA/SEEK_HOLE)` failed.
    #[error("source {index}: looking for data or holes at file offset {file_offset:#x} failed")]
    Seek {
        /// The source.
        index: usize,
        /// File offset.
        file_offset: u64,
        /// The error.
        #[source]
        error: io::Error,
    },
    /// An unpopulated unit could not be populated (`MADV_POPULATE_WRITE`:
    /// the node's pool is short).
    #[error("unit {unit}: cannot populate it")]
    Populate {
        /// The unit.
        unit: usize,
        /// The error.
        #[source]
        error: io::Error,
    },
    /// The plan was made for a region of another length.
    #[error("the fill plan is for a region of {planned} bytes, this one has {actual}")]
    WrongRegion {
        /// The length the plan was made for.
        planned: u64,
        /// This region's length.
        actual: u64,
    },
    /// No such state unit.
    #[error("unit {unit} is out of range ({units} units)")]
    NoSuchUnit {
        /// The unit asked for.
        unit: usize,
        /// Units in the region.
        units: usize,
    },
    /// The unit left `Clearing` under its filler (a bug elsewhere).
    #[error("unit {unit} was {actual} when its filler finished")]
    LostUnit {
        /// The unit.
        unit: usize,
        /// Its state then.
        actual: PageState,
    },
    /// The parallel runner failed (could not pin or spawn a worker, a
    /// worker panicked, the run was cancelled); units not filled stay
    /// `Dirty` or `Unpopulated`.
    #[error("the fill's workers failed")]
    Run(#[source] Box<RunError<FillError>>),
}
