//! Checking the sources against the region and each other, once, before
//! anything is written; and finding the sources that cover a unit.

use std::os::fd::BorrowedFd;

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

/// One source, as the plan keeps it: the caller's index (errors name it).
#[derive(Debug, Clone, Copy)]
pub(super) struct Planned<'a> {
    pub(super) index: usize,
    pub(super) source: FillSource<'a>,
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
