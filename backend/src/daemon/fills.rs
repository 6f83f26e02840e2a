//! Memory the daemon still has to fill from a tenant's files: a VM parked
//! on demand (`hugemem park --from-dir --on-demand`) keeps its directory's
//! files here, by allocation, until a RESTORE fills its memory (as the
//! receiver asks for pages, and in the background: `park/ondemand.rs`) or
//! UNPARK drops it. The files and their sources travel in the state
//! document (a takeover, systemd's fd store: `fill_record.rs`), so a VM
//! parked on demand survives both.
//!
//! The region's page states say which units are filled. While a restore
//! runs, a unit filled for the receiver may be written by its guest: the
//! fill is then [`restoring`](PendingFills::restoring), and a document
//! saved meanwhile (the fd store's, before a crash) says so, so the
//! successor fills every unit again from the files. A restore that fails
//! does the same ([`PendingFills::refill_all`]).

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex};

use guest_mem::FillSource;
use serde::{Deserialize, Serialize};

use super::ids::AllocId;

/// One source of a pending fill: `len` bytes of file `file` (an index in
/// [`PendingFill::files`]) from `file_offset`, to the region at `dest_offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
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

/// Every pending fill, by allocation, and those a restore is filling.
#[derive(Debug, Default)]
pub struct PendingFills {
    map: Mutex<Fills>,
}

#[derive(Debug, Default)]
struct Fills {
    pending: HashMap<AllocId, Arc<PendingFill>>,
    restoring: HashSet<AllocId>,
}

/// Marks a fill as being restored while it lives (see
/// [`PendingFills::restoring`]).
#[derive(Debug)]
pub struct Restoring<'a> {
    fills: &'a PendingFills,
    alloc: AllocId,
}

impl Drop for Restoring<'_> {
    fn drop(&mut self) {
        self.fills.lock().restoring.remove(&self.alloc);
    }
}

impl PendingFills {
    fn lock(&self) -> std::sync::MutexGuard<'_, Fills> {
        self.map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records `fill` for `alloc`.
    pub fn insert(&self, alloc: AllocId, fill: PendingFill) {
        self.lock().pending.insert(alloc, Arc::new(fill));
    }

    /// The pending fill of `alloc`.
    pub fn get(&self, alloc: AllocId) -> Option<Arc<PendingFill>> {
        self.lock().pending.get(&alloc).cloned()
    }

    /// Forgets `alloc`'s fill (done, or dropped); its files close when the
    /// last user lets go.
    pub fn remove(&self, alloc: AllocId) {
        self.lock().pending.remove(&alloc);
    }

    /// `alloc`'s fill is being restored until the guard drops: units
    /// filled meanwhile may hold what the receiver's guest wrote since.
    pub fn restoring(&self, alloc: AllocId) -> Restoring<'_> {
        self.lock().restoring.insert(alloc);
        Restoring { fills: self, alloc }
    }

    /// Every pending fill, and whether a restore is filling it.
    pub fn all(&self) -> Vec<(AllocId, Arc<PendingFill>, bool)> {
        let g = self.lock();
        g.pending
            .iter()
            .map(|(a, f)| (*a, Arc::clone(f), g.restoring.contains(a)))
            .collect()
    }

    /// After a restore that did not hand the VM out: its units are to be
    /// filled again, all of them (the caller marked them dirty), and the
    /// region no longer reads zero where the files have holes.
    ///
    /// # Errors
    ///
    /// Another user still holds the fill and its files cannot be
    /// duplicated: the fill is dropped (the VM can no longer be restored,
    /// only unparked).
    pub fn refill_all(&self, alloc: AllocId) -> std::io::Result<()> {
        let mut g = self.lock();
        let Some(old) = g.pending.remove(&alloc) else {
            return Ok(());
        };
        let fill = match Arc::try_unwrap(old) {
            Ok(mut fill) => {
                fill.dest_is_zero = false;
                fill
            }
            // Someone still reads it: a copy with its own fds.
            Err(shared) => PendingFill {
                files: shared
                    .files
                    .iter()
                    .map(OwnedFd::try_clone)
                    .collect::<std::io::Result<_>>()?,
                sources: shared.sources.clone(),
                dest_is_zero: false,
            },
        };
        g.pending.insert(alloc, Arc::new(fill));
        Ok(())
    }
}
