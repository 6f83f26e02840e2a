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

use guest_mem::FillSource;

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
