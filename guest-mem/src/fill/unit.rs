//! One state unit: claimed through its page state, filled from the sources
//! that cover it (their holes and the gaps between them zeroed where the
//! unit may hold stale bytes), then marked clean.

use std::os::fd::AsFd;

use clearing::ClearKernel;

use super::error::FillError;
use super::options::{FillCounts, FillOptions, UnitFill};
use super::plan::{FillPlan, Planned};
use crate::region::Region;
use crate::state::PageState;
use crate::sys;

/// Fills state unit `unit` of `region` from `plan`, exactly once however
/// many threads ask: the unit is claimed the way the lazy clearing claims a
/// page (`Unpopulated`/`Dirty → Clearing`), filled, and left `Clean`.
///
/// * A `Dirty` unit: bytes the sources supply are read over the old ones;
///   their holes and the bytes no source covers are zeroed, unless
///   [`FillOptions::dest_is_zero`] says the region's bytes are zero already.
/// * An `Unpopulated` unit is populated first (`MADV_POPULATE_WRITE`: the
///   kernel zeroes fresh pages, and a pool that is short fails here, not as
///   a SIGBUS later); then only the sources' data is read.
/// * A unit another thread holds in `Clearing` is [`UnitFill::Busy`] (that
///   thread fills it; a fault handler waits for it to turn `Clean`); a
///   `Clean` or `Mapped` unit is [`UnitFill::Done`]: to fill a region whose
///   pages are clean (zero) call [`mark_for_fill`](super::mark_for_fill) first.
///
/// # Errors
///
/// [`FillError::WrongRegion`], [`FillError::NoSuchUnit`] before anything is
/// claimed; [`FillError::Populate`]; [`FillError::ShortRead`],
/// [`FillError::Read`], [`FillError::Seek`] while reading;
/// [`FillError::Checksum`] when a piece of a checked source does not
/// match once read (see [`FillPlan::with_checksums`]). On an error after
/// the claim, the rest of the unit from the failure on is zeroed (unless it
/// is known to be zero already), so no byte of an earlier user remains, and
/// the unit goes back to `Dirty`: it holds neither the file's bytes nor only
/// zeros.
pub fn fill_unit(
    region: &Region,
    plan: &FillPlan<'_>,
    unit: usize,
    opts: &FillOptions<'_>,
) -> Result<UnitFill, FillError> {
    if plan.region_len() != region.len() {
        return Err(FillError::WrongRegion {
            planned: plan.region_len(),
            actual: region.len(),
        });
    }
    let states = region.states();
    let Some(was) = states.claim_for_prepare(unit) else {
        return match states.get(unit) {
            Ok(PageState::Clearing) => Ok(UnitFill::Busy),
            Ok(state) => Ok(UnitFill::Done(state)),
            Err(_) => Err(FillError::NoSuchUnit {
                unit,
                units: states.len(),
            }),
        };
    };
    // This thread owns the unit now (`Clearing`): nobody else writes it, no
    // guest has it mapped.
    let (offset, len) = region.page_range(unit);
    let mut counts = FillCounts::default();
    let filled = if was == PageState::Unpopulated {
        populate(region, unit, offset, len).and_then(|()| {
            let writer = UnitWriter::new(region, false);
            writer.fill(plan, offset, offset + len, &mut counts)
        })
    } else {
        let writer = UnitWriter::new(region, !opts.dest_is_zero);
        writer.fill(plan, offset, offset + len, &mut counts)
    };
    let to = if filled.is_ok() {
        PageState::Clean
    } else {
        PageState::Dirty
    };
    if let Err(e) = states.try_transition(unit, PageState::Clearing, to) {
        tracing::error!(error = %e, unit, "a unit left Clearing under its filler");
        if let crate::state::StateError::Conflict { actual, .. } = e {
            return Err(FillError::LostUnit { unit, actual });
        }
    }
    filled.map(|()| UnitFill::Filled(counts))
}

fn populate(region: &Region, unit: usize, offset: u64, len: u64) -> Result<(), FillError> {
    // SAFETY: offset..offset+len is a unit inside the region's live mapping
    // (page_range clips to the region's length, which fits usize);
    // POPULATE_WRITE only faults pages in, it never changes contents.
    unsafe {
        sys::madvise(
            region.as_ptr().wrapping_add(offset as usize),
            len as usize,
            sys::MADV_POPULATE_WRITE,
        )
    }
    .map_err(|error| FillError::Populate { unit, error })
}

/// Writes into one claimed unit of a region.
struct UnitWriter<'r> {
    region: &'r Region,
    /// The unit may hold an earlier user's bytes: zero what no source supplies.
    zero_needed: bool,
    kernel: ClearKernel,
}

impl<'r> UnitWriter<'r> {
    fn new(region: &'r Region, zero_needed: bool) -> Self {
        Self {
            region,
            zero_needed,
            kernel: ClearKernel::default_kernel(),
        }
    }

    /// Fills `start..end` (one unit) from the sources that cover it; on an
    /// error, zeroes from where it stopped to `end` first.
    fn fill(
        &self,
        plan: &FillPlan<'_>,
        start: u64,
        end: u64,
        counts: &mut FillCounts,
    ) -> Result<(), FillError> {
        let mut pos = start;
        for planned in plan.covering(start, end) {
            let source = &planned.source;
            let from = source.dest_offset.max(start);
            let to = (source.dest_offset + source.len).min(end);
            self.zero(pos, from, counts);
            if let Err((stopped_at, error)) = self.copy(planned, from, to, counts) {
                self.zero(stopped_at, end, counts);
                return Err(error);
            }
            pos = to;
        }
        self.zero(pos, end, counts);
        for planned in plan.covering(start, end) {
            self.verify(planned, start, end, counts)?;
        }
        Ok(())
    }

    /// Checks the pieces of `planned`'s file that the unit `start..end`
    /// holds against their checksums, if it has any. A piece lies inside
    /// one unit ([`FillPlan::with_checksums`] checked the alignment).
    fn verify(
        &self,
        planned: &Planned<'_>,
        start: u64,
        end: u64,
        counts: &mut FillCounts,
    ) -> Result<(), FillError> {
        let Some(expected) = planned.expected else {
            return Ok(());
        };
        let source = &planned.source;
        let from = source.dest_offset.max(start);
        let to = (source.dest_offset + source.len).min(end);
        let file_of = |dest: u64| source.file_offset + (dest - source.dest_offset);
        let mut piece = file_of(from) / expected.piece;
        loop {
            let (file_start, file_end) = expected.piece_range(piece);
            let dest = source.dest_offset + (file_start - source.file_offset);
            if file_start >= file_end || dest >= to {
                return Ok(());
            }
            let len = file_end - file_start;
            // SAFETY: dest..dest+len lies in the unit this thread owns
            // through its `Clearing` state (see `fill_unit`; a piece never
            // crosses a unit), inside the region's live mapping, filled
            // just now; nothing else reads or writes it meanwhile.
            let bytes = unsafe {
                std::slice::from_raw_parts(
                    self.region
                        .as_ptr()
                        .wrapping_add(dest as usize)
                        .cast_const(),
                    len as usize,
                )
            };
            let found = crc32c::crc32c(bytes);
            let want = expected
                .crc32c
                .get(piece as usize)
                .copied()
                .unwrap_or(!found);
            if found != want {
                return Err(FillError::Checksum {
                    index: planned.index,
                    file_offset: file_start,
                    len,
                    expected: want,
                    found,
                });
            }
            counts.bytes_verified += len;
            piece += 1;
        }
    }

    /// Zeroes destination bytes `from..to`, when the unit needs it.
    fn zero(&self, from: u64, to: u64, counts: &mut FillCounts) {
        if !self.zero_needed || to <= from {
            return;
        }
        // SAFETY: from..to lies in a unit this thread owns through its
        // `Clearing` state (see `fill_unit`), inside the region's live,
        // writable, backed mapping (a `Dirty` unit was populated before);
        // no Rust reference covers it (only the region's unsafe accessors
        // hand those out, under the same rule).
        unsafe {
            clearing::clear_raw(
                self.kernel,
                self.region.as_ptr().wrapping_add(from as usize),
                (to - from) as usize,
            );
        }
        counts.bytes_zeroed += to - from;
    }

    /// Copies destination `from..to` from `planned`'s file: data with
    /// `pread`, holes (`SEEK_DATA`/`SEEK_HOLE`) zeroed or skipped. On an
    /// error, the destination offset it stopped at.
    fn copy(
        &self,
        planned: &Planned<'_>,
        from: u64,
        to: u64,
        counts: &mut FillCounts,
    ) -> Result<(), (u64, FillError)> {
        let source = &planned.source;
        let index = planned.index;
        let dest_of = |file: u64| source.dest_offset + (file - source.file_offset);
        let file_end = source.file_offset + (to - source.dest_offset);
        let mut file = source.file_offset + (from - source.dest_offset);
        while file < file_end {
            let seek_error = |error| {
                let e = FillError::Seek {
                    index,
                    file_offset: file,
                    error,
                };
                (dest_of(file), e)
            };
            let data = match sys::seek(source.file, file, true).map_err(seek_error)? {
                Some(data) => data.min(file_end),
                // No data from here on: a hole to the end of the file, or
                // the file is shorter now than it was when checked.
                None => self.check_length(planned, file, file_end)?,
            };
            if data > file {
                counts.hole_bytes += data - file;
                self.zero(dest_of(file), dest_of(data), counts);
                file = data;
                continue;
            }
            let hole = match sys::seek(source.file, file, false).map_err(seek_error)? {
                // A hole punched between the two seeks can make them
                // disagree; reading then is still right (holes read as
                // zeros) and cannot be kept spinning by a peer.
                Some(hole) if hole > file => hole.min(file_end),
                Some(_) => file_end,
                None => self.check_length(planned, file, file_end)?,
            };
            self.read(planned, file, hole, counts)?;
            file = hole;
        }
        Ok(())
    }

    /// `file_end` when the file still reaches it; else the short read.
    fn check_length(
        &self,
        planned: &Planned<'_>,
        file: u64,
        file_end: u64,
    ) -> Result<u64, (u64, FillError)> {
        let source = &planned.source;
        let size = sys::file_type_and_size(source.file).map_or(0, |(_, size)| size);
        if size >= file_end {
            return Ok(file_end);
        }
        let stopped = size.max(file);
        let dest_offset = source.dest_offset + (stopped - source.file_offset);
        Err((
            source.dest_offset + (file - source.file_offset),
            FillError::ShortRead {
                index: planned.index,
                file_offset: stopped,
                dest_offset,
            },
        ))
    }

    /// `pread`s file bytes `file..end` to their place in the unit: with
    /// `O_DIRECT` where the plan opened the file so and the read is
    /// aligned as the file needs, else through the page cache.
    fn read(
        &self,
        planned: &Planned<'_>,
        mut file: u64,
        end: u64,
        counts: &mut FillCounts,
    ) -> Result<(), (u64, FillError)> {
        let source = &planned.source;
        while file < end {
            let dest = source.dest_offset + (file - source.file_offset);
            let at = self.region.as_ptr().wrapping_add(dest as usize);
            let direct = planned
                .direct
                .as_deref()
                .filter(|d| d.usable())
                .and_then(|d| {
                    let aligned = file.is_multiple_of(d.offset_align)
                        && (at as u64).is_multiple_of(d.mem_align);
                    let len = (end - file) / d.offset_align * d.offset_align;
                    (aligned && len > 0).then_some((d, len))
                });
            let (fd, len) = match direct {
                Some((d, len)) => (d.fd.as_fd(), len),
                None => (source.file, end - file),
            };
            // SAFETY: dest..dest+len lies in a unit this thread owns
            // through its `Clearing` state (see `fill_unit`), inside the
            // region's live, writable mapping; no Rust reference covers it.
            let read = unsafe { sys::pread(fd, at, len as usize, file) };
            match read {
                Err(e) if direct.is_some() && e.raw_os_error() == Some(libc::EINVAL) => {
                    // The file takes no direct read after all (its
                    // filesystem says otherwise than statx did).
                    tracing::debug!(index = planned.index, error = %e, "O_DIRECT read refused; reading through the page cache");
                    if let Some((d, _)) = direct {
                        d.refused();
                    }
                }
                Ok(0) => {
                    let error = FillError::ShortRead {
                        index: planned.index,
                        file_offset: file,
                        dest_offset: dest,
                    };
                    return Err((dest, error));
                }
                Ok(n) => {
                    file += n as u64;
                    counts.bytes_read += n as u64;
                    if direct.is_some() {
                        counts.bytes_read_direct += n as u64;
                    }
                }
                Err(error) => {
                    let error = FillError::Read {
                        index: planned.index,
                        file_offset: file,
                        error,
                    };
                    return Err((dest, error));
                }
            }
        }
        Ok(())
    }
}
