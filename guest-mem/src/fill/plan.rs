//! Checking the sources against the region and each other, once, before
//! anything is written; and finding the sources that cover a unit.

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::error::FillError;
use crate::region::Region;
use crate::sys;

/// One range of a file to copy into the region.
#[derive(Debug, Clone, Copy)]
pub struct FillSource<'a> {
    /// The file (a memfd, a hugetlbfs file, a file on disk). Only regular
    /// files are accepted; it is only ever read with `pread`, never mapped.
    pub file: BorrowedFd<'a>,
    /// Where the range starts in the file.
    pub file_offset: u64,
    /// Where it goes in the region.
    pub dest_offset: u64,
    /// Bytes.
    pub len: u64,
}

impl FillSource<'_> {
    fn dest_end(&self) -> u64 {
        // Checked not to overflow by `FillPlan::new`.
        self.dest_offset + self.len
    }
}

/// What a source's file must hold, piece by piece: the CRC-32C of each
/// `piece`-byte piece of the file from offset 0, the last one ending at
/// `file_len` (a saved VM's manifest lists them). A fill checks each piece
/// of the source once the unit that holds it is filled
/// ([`FillPlan::with_checksums`]).
#[derive(Debug, Clone, Copy)]
pub struct Checksums<'a> {
    /// Bytes per piece: a power of two of at least 4 KiB.
    pub piece: u64,
    /// The file's length when the checksums were taken.
    pub file_len: u64,
    /// One CRC-32C per piece, `file_len.div_ceil(piece)` of them.
    pub crc32c: &'a [u32],
}

impl Checksums<'_> {
    /// The file range of piece `k`.
    pub(super) fn piece_range(&self, k: u64) -> (u64, u64) {
        let start = k * self.piece;
        (start, (start + self.piece).min(self.file_len))
    }
}

/// One source, as the plan keeps it: the caller's index (errors name it).
#[derive(Debug, Clone)]
pub(super) struct Planned<'a> {
    pub(super) index: usize,
    pub(super) source: FillSource<'a>,
    /// Where its file is read with `O_DIRECT` ([`FillPlan::with_direct_io`]).
    pub(super) direct: Option<Arc<DirectReads>>,
    /// What its bytes must be ([`FillPlan::with_checksums`]).
    pub(super) expected: Option<Checksums<'a>>,
}

/// A second open of a source's file for `O_DIRECT` reads (see
/// [`FillPlan::with_direct_io`]), and what those reads need aligned.
#[derive(Debug)]
pub(super) struct DirectReads {
    pub(super) fd: OwnedFd,
    /// Alignment of the destination address, bytes.
    pub(super) mem_align: u64,
    /// Alignment of the file offset and the length, bytes.
    pub(super) offset_align: u64,
    /// Cleared when the file refuses a direct read (`EINVAL`): the rest is
    /// read through the page cache.
    usable: AtomicBool,
}

impl DirectReads {
    fn open(file: BorrowedFd<'_>) -> Option<Self> {
        let (mem_align, offset_align) = sys::direct_io_alignment(file).ok().flatten()?;
        match sys::reopen_for_direct_reads(file) {
            Ok(fd) => Some(Self {
                fd,
                mem_align,
                offset_align,
                usable: AtomicBool::new(true),
            }),
            Err(e) => {
                tracing::debug!(error = %e, "no O_DIRECT reads of a fill source");
                None
            }
        }
    }

    /// True until a direct read was refused.
    pub(super) fn usable(&self) -> bool {
        self.usable.load(Ordering::Relaxed)
    }

    /// A direct read was refused: read the rest through the page cache.
    pub(super) fn refused(&self) {
        self.usable.store(false, Ordering::Relaxed);
    }
}

/// Pages of a source's range the page cache holds at most for a direct
/// read to pay: below half, reading the device beats copying the rest.
fn mostly_uncached(file: BorrowedFd<'_>, offset: u64, len: u64) -> bool {
    match sys::cached_pages(file, offset, len) {
        Ok(pages) => pages.saturating_mul(4096) < len / 2,
        // Before Linux 6.5: no way to ask without mapping the peer's file.
        Err(_) => true,
    }
}

/// Sources checked against a region and each other: regular files, long
/// enough for what they claim, inside the region, not overlapping. Made once
/// by [`FillPlan::new`]; [`fill_unit`](super::fill_unit) then costs no
/// `fstat` and no sort per unit.
#[derive(Debug, Clone)]
pub struct FillPlan<'a> {
    /// Non-empty sources, by destination offset.
    sorted: Vec<Planned<'a>>,
    region_len: u64,
}

impl<'a> FillPlan<'a> {
    /// Checks `sources` for `region`.
    ///
    /// # Errors
    ///
    /// [`FillError::Stat`], [`FillError::NotRegular`], [`FillError::TooShort`]
    /// (the file is shorter now than `file_offset + len`),
    /// [`FillError::OutOfRegion`], [`FillError::FileRange`],
    /// [`FillError::Overlap`]. Sources of length 0 are accepted and ignored.
    pub fn new(region: &Region, sources: &[FillSource<'a>]) -> Result<Self, FillError> {
        let region_len = region.len();
        let mut sorted = Vec::with_capacity(sources.len());
        for (index, source) in sources.iter().enumerate() {
            let (kind, size) = sys::file_type_and_size(source.file)
                .map_err(|error| FillError::Stat { index, error })?;
            if kind != libc::S_IFREG {
                return Err(FillError::NotRegular {
                    index,
                    kind: file_kind(kind),
                });
            }
            let dest_in_region = source
                .dest_offset
                .checked_add(source.len)
                .is_some_and(|end| end <= region_len);
            if !dest_in_region {
                return Err(FillError::OutOfRegion {
                    index,
                    dest_offset: source.dest_offset,
                    len: source.len,
                    region_len,
                });
            }
            let claimed_end = source
                .file_offset
                .checked_add(source.len)
                .filter(|&end| i64::try_from(end).is_ok())
                .ok_or(FillError::FileRange {
                    index,
                    file_offset: source.file_offset,
                    len: source.len,
                })?;
            if size < claimed_end {
                return Err(FillError::TooShort {
                    index,
                    size,
                    claimed_end,
                });
            }
            if source.len > 0 {
                sorted.push(Planned {
                    index,
                    source: *source,
                    direct: None,
                    expected: None,
                });
            }
        }
        sorted.sort_unstable_by_key(|p| p.source.dest_offset);
        for pair in sorted.windows(2) {
            if pair[1].source.dest_offset < pair[0].source.dest_end() {
                return Err(FillError::Overlap {
                    first: pair[0].index,
                    second: pair[1].index,
                    at: pair[1].source.dest_offset,
                });
            }
        }
        Ok(Self { sorted, region_len })
    }

    /// Reads the sources on disk with `O_DIRECT` where that pays: straight
    /// from the device into the region, without filling the page cache and
    /// copying out of it (docs/benchmarks.md, `bench fill`: on this kind of
    /// host a direct fill ran at twice the buffered one, and steadily).
    ///
    /// A source gets direct reads when its file says it takes them
    /// (`statx` `STATX_DIOALIGN`: files on disk, not hugetlbfs or most
    /// memfds) and less than half of its range is in the page cache
    /// (`cachestat`; a file just written or read stays buffered, a copy
    /// from memory). The file is opened a second time through
    /// `/proc/self/fd`, only when the caller's fd is open for reading (a
    /// peer's `O_PATH` or write-only fd gains no read access this way).
    /// Reads that are not aligned as the file needs (a range's head and
    /// tail) and a file that refuses a direct read go through the page
    /// cache as before; holes are found on the caller's fd.
    #[must_use]
    pub fn with_direct_io(mut self) -> Self {
        let mut opened: Vec<(RawFd, Option<Arc<DirectReads>>)> = Vec::new();
        for p in &mut self.sorted {
            let s = &p.source;
            if !mostly_uncached(s.file, s.file_offset, s.len) {
                continue;
            }
            let raw = s.file.as_raw_fd();
            let direct = match opened.iter().find(|(fd, _)| *fd == raw) {
                Some((_, d)) => d.clone(),
                None => {
                    let d = DirectReads::open(s.file).map(Arc::new);
                    opened.push((raw, d.clone()));
                    d
                }
            };
            p.direct = direct;
        }
        self
    }

    /// Checks source `index`'s bytes against `expected` as they are filled:
    /// each piece of its file is checked once the unit that holds it is
    /// filled, and a piece whose CRC-32C differs fails that unit
    /// ([`FillError::Checksum`]), which goes back to `Dirty`. For a fault
    /// and a background filler alike: nothing of a damaged file is taken
    /// for the VM's memory.
    ///
    /// The source must read the file from a piece's start and to the end
    /// of the file the checksums were taken of, its pieces must land on
    /// piece boundaries of the region, and a piece must fit a state unit
    /// (pieces of 2 MiB fit every page size), so that each piece is inside
    /// one unit.
    ///
    /// # Errors
    ///
    /// [`FillError::Checksums`] when the source and the checksums do not
    /// fit each other so; nothing changes then.
    pub fn with_checksums(
        mut self,
        index: usize,
        expected: Checksums<'a>,
        state_unit: u64,
    ) -> Result<Self, FillError> {
        let refuse = |why: &'static str| FillError::Checksums { index, why };
        if !expected.piece.is_power_of_two() || expected.piece < 4096 {
            return Err(refuse(
                "the piece size is not a power of two of at least 4 KiB",
            ));
        }
        if !state_unit.is_multiple_of(expected.piece) {
            return Err(refuse("a piece does not fit a fill unit"));
        }
        if expected.crc32c.len() as u64 != expected.file_len.div_ceil(expected.piece) {
            return Err(refuse("the checksums do not cover the file"));
        }
        let Some(p) = self.sorted.iter_mut().find(|p| p.index == index) else {
            // A source of length 0: nothing to read, nothing to check.
            return if expected.file_len == 0 {
                Ok(self)
            } else {
                Err(refuse("the source reads nothing of a file that has bytes"))
            };
        };
        let s = &p.source;
        if !s.file_offset.is_multiple_of(expected.piece)
            || !s.dest_offset.is_multiple_of(expected.piece)
        {
            return Err(refuse("the source does not start on a piece boundary"));
        }
        if s.file_offset + s.len != expected.file_len {
            return Err(refuse("the source does not read to the end of the file"));
        }
        p.expected = Some(expected);
        Ok(self)
    }

    /// True when some source is read with `O_DIRECT`.
    pub fn reads_direct(&self) -> bool {
        self.sorted
            .iter()
            .any(|p| p.direct.as_ref().is_some_and(|d| d.usable()))
    }

    /// The length of the region the plan was made for.
    pub fn region_len(&self) -> u64 {
        self.region_len
    }

    /// Bytes the sources supply, holes included.
    pub fn source_bytes(&self) -> u64 {
        self.sorted.iter().map(|p| p.source.len).sum()
    }

    /// The sources that cover part of `start..end`, in destination order.
    pub(super) fn covering(&self, start: u64, end: u64) -> &[Planned<'a>] {
        let first = self
            .sorted
            .partition_point(|p| p.source.dest_end() <= start);
        let last = self.sorted.partition_point(|p| p.source.dest_offset < end);
        &self.sorted[first..last.max(first)]
    }

    /// Every source's file, each once, with the file range the sources take
    /// from it (lowest to highest offset): for read-ahead hints.
    pub(super) fn sources(&self) -> &[Planned<'a>] {
        &self.sorted
    }
}

fn file_kind(kind: libc::mode_t) -> &'static str {
    match kind {
        libc::S_IFIFO => "a pipe",
        libc::S_IFSOCK => "a socket",
        libc::S_IFCHR => "a character device",
        libc::S_IFBLK => "a block device",
        libc::S_IFDIR => "a directory",
        libc::S_IFLNK => "a symbolic link",
        _ => "not a file",
    }
}
