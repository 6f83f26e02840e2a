//! Memory the daemon still has to fill from a tenant's files: a VM parked
//! on demand (`hugemem park --from-dir --on-demand`) keeps its directory's
//! files here, by allocation, until a RESTORE fills its memory (as the
//! receiver asks for pages, and in the background: `park/ondemand.rs`) or
//! UNPARK drops it. In memory only: a takeover does not carry the files,
//! so a successor finds the allocation's unfilled units dirty and refuses
//! to restore it (it can be dropped).

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex};

use guest_mem::{Checksums, FillError, FillPlan, FillSource, Region};

use super::ids::AllocId;

/// One source of a pending fill: `len` bytes of file `file` (an index in
/// [`PendingFill::files`]) from `file_offset`, to the region at `dest_offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourceSpec {
    /// Index of the file.
    pub file: usize,
    /// Offset in the file.
    pub file_offset: u64,
    /// Offset in the region.
    pub dest_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// What a saved VM's manifest says the file of source `source` holds:
/// the CRC-32C of each `piece` of it (PARK with VERIFY).
#[derive(Debug, Clone)]
pub struct SourceChecksums {
    /// Index of the source (in the fill's sources).
    pub source: usize,
    /// The file's name in the saved directory, for errors.
    pub name: String,
    /// Bytes per piece.
    pub piece: u64,
    /// The file's length when it was saved.
    pub file_len: u64,
    /// One checksum per piece.
    pub crc32c: Arc<[u32]>,
}

/// The fill plan of `sources` for `region`, each source with checksums
/// checked against them as it is filled.
///
/// # Errors
///
/// As [`FillPlan::new`] and [`FillPlan::with_checksums`].
pub fn plan<'a>(
    region: &Region,
    sources: &[FillSource<'a>],
    checksums: &'a [SourceChecksums],
) -> Result<FillPlan<'a>, FillError> {
    let mut plan = FillPlan::new(region, sources)?;
    for c in checksums {
        let expected = Checksums {
            piece: c.piece,
            file_len: c.file_len,
            crc32c: &c.crc32c,
        };
        plan = plan.with_checksums(c.source, expected, region.state_unit())?;
    }
    Ok(plan.with_direct_io())
}

/// A fill's error as a tenant reads it: the source named by its file in
/// the saved directory where there is one (`memory-0: …`).
pub fn describe(e: &FillError, checksums: &[SourceChecksums]) -> String {
    let index = match e {
        FillError::Checksum { index, .. }
        | FillError::Checksums { index, .. }
        | FillError::Read { index, .. }
        | FillError::ShortRead { index, .. }
        | FillError::Seek { index, .. } => Some(*index),
        _ => None,
    };
    let name = index.and_then(|i| checksums.iter().find(|c| c.source == i));
    match (e, name) {
        (FillError::Checksum { .. }, Some(c)) => {
            format!("{} does not match its manifest: {e}", c.name)
        }
        (_, Some(c)) => format!("{}: {e}", c.name),
        _ => crate::diag::chain(e),
    }
}

/// What an allocation parked on demand is to be filled from.
#[derive(Debug)]
pub struct PendingFill {
    /// The files (the tenant's, opened with its rights).
    pub files: Vec<OwnedFd>,
    /// Where their bytes go.
    pub sources: Vec<SourceSpec>,
    /// The region's bytes were all zero before the fill (holes need no
    /// zeroing).
    pub dest_is_zero: bool,
    /// What the files must hold, where a manifest said (PARK with VERIFY).
    pub checksums: Vec<SourceChecksums>,
}

/// The fill engine's sources for `specs`, file `i` being `file(i)`.
pub fn fill_sources<'a>(
    specs: &[SourceSpec],
    file: impl Fn(usize) -> BorrowedFd<'a>,
) -> Vec<FillSource<'a>> {
    specs
        .iter()
        .map(|s| FillSource {
            file: file(s.file),
            file_offset: s.file_offset,
            dest_offset: s.dest_offset,
            len: s.len,
        })
        .collect()
}

impl PendingFill {
    /// The fill engine's sources for what is left to fill.
    pub fn fill_sources(&self) -> Vec<FillSource<'_>> {
        fill_sources(&self.sources, |i| self.files[i].as_fd())
    }

    /// The fill plan for `region`, checksums included.
    ///
    /// # Errors
    ///
    /// As [`plan`], described by [`describe`].
    pub fn plan(&self, region: &Region) -> Result<FillPlan<'_>, String> {
        plan(region, &self.fill_sources(), &self.checksums)
            .map_err(|e| describe(&e, &self.checksums))
    }
}

/// Every pending fill, by allocation.
#[derive(Debug, Default)]
pub struct PendingFills {
    map: Mutex<HashMap<AllocId, Arc<PendingFill>>>,
}

impl PendingFills {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<AllocId, Arc<PendingFill>>> {
        self.map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records `fill` for `alloc`.
    pub fn insert(&self, alloc: AllocId, fill: PendingFill) {
        self.lock().insert(alloc, Arc::new(fill));
    }

    /// The pending fill of `alloc`.
    pub fn get(&self, alloc: AllocId) -> Option<Arc<PendingFill>> {
        self.lock().get(&alloc).cloned()
    }

    /// Forgets `alloc`'s fill (done, or dropped); its files close when the
    /// last user lets go.
    pub fn remove(&self, alloc: AllocId) {
        self.lock().remove(&alloc);
    }
}
