//! A pending fill's part of the state document (a takeover, systemd's fd
//! store): a VM parked on demand keeps its files and their sources across
//! both, so it is restored afterwards as before (`fills.rs`).
//!
//! Its files are the tenant's (opened with its rights by `hugemem park
//! --from-dir`); they travel as fds, as the regions do, and the record
//! says which source reads which. A record saved while a restore was
//! filling the VM (`reload_all`) makes the successor mark every unit of
//! its memory to be filled again: units filled for the receiver may hold
//! what its guest wrote since, and only the files hold the parked VM.

use std::os::fd::AsFd;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::daemon::ids::AllocId;
use crate::daemon::persist::{Persist, RestoreContext, SaveContext, SaveError};
use crate::daemon::pool::Pool;
use crate::daemon::requests::parked::loads::{
    PendingLoad, PendingLoads, SourceChecksums, SourceSpec,
};

/// One pending fill in the state document.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadRecord {
    /// The parked allocation it fills.
    pub alloc: u64,
    /// Its files: indices in the document's fd list.
    pub files: Vec<usize>,
    /// What each source reads (`file` is an index in `files`).
    pub sources: Vec<SourceSpec>,
    /// The region read zero where no file has bytes.
    pub dest_is_zero: bool,
    /// A restore was filling it: fill every unit again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reload_all: bool,
    /// What the files must hold (a saved VM's manifest, PARK with VERIFY):
    /// checked as they are read after the takeover too.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub checksums: Vec<SourceChecksums>,
}

/// A pending fill as the document saves it.
#[derive(Debug)]
pub struct LoadSnapshot {
    /// The allocation.
    pub alloc: AllocId,
    /// The fill.
    pub fill: Arc<PendingLoad>,
    /// A restore is filling it.
    pub restoring: bool,
}

impl LoadSnapshot {
    /// Every pending fill of `fills`.
    pub fn all(fills: &PendingLoads) -> Vec<Self> {
        fills
            .all()
            .into_iter()
            .map(|(alloc, fill, restoring)| Self {
                alloc,
                fill,
                restoring,
            })
            .collect()
    }
}

/// A fill restored from its record.
#[derive(Debug)]
pub struct RestoredLoad {
    /// The allocation.
    pub alloc: AllocId,
    /// The fill, its files taken from the document.
    pub fill: PendingLoad,
    /// Fill every unit again.
    pub reload_all: bool,
}

/// Why a fill's record does not restore (the VM then stays parked
/// without its files: a RESTORE refuses it, UNPARK drops it).
#[derive(Debug, thiserror::Error)]
pub enum LoadRestoreError {
    /// A file the record names did not come with the document.
    #[error("file {0} of the fill did not come with the document")]
    MissingFile(usize),
    /// A source names a file the record does not have.
    #[error("a source reads file {file}, the fill has {files}")]
    NoSuchFile {
        /// The source's file.
        file: usize,
        /// Files in the record.
        files: usize,
    },
    /// Checksums for a source the record does not have.
    #[error("checksums for source {index}, the fill has {sources}")]
    NoSuchSource {
        /// The checksums' source.
        index: usize,
        /// Sources in the record.
        sources: usize,
    },
}

impl Persist for LoadSnapshot {
    type State = LoadRecord;
    type Restored = RestoredLoad;
    type RestoreError = LoadRestoreError;

    /// Its record, its files numbered in the document.
    fn save(&self, ctx: &mut SaveContext<'_>) -> Result<LoadRecord, SaveError> {
        let files = self
            .fill
            .files
            .iter()
            .map(|f| ctx.fds.add(f.as_fd()))
            .collect::<Result<_, _>>()?;
        Ok(LoadRecord {
            alloc: self.alloc,
            files,
            sources: self.fill.sources.clone(),
            dest_is_zero: self.fill.dest_is_zero && !self.restoring,
            reload_all: self.restoring,
            checksums: self.fill.checksums.clone(),
        })
    }

    /// The fill, its files taken from the document's.
    fn restore(
        state: LoadRecord,
        ctx: &mut RestoreContext<'_>,
    ) -> Result<RestoredLoad, LoadRestoreError> {
        let files = state
            .files
            .iter()
            .map(|i| ctx.fds.take(*i).ok_or(LoadRestoreError::MissingFile(*i)))
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(s) = state.sources.iter().find(|s| s.file >= files.len()) {
            return Err(LoadRestoreError::NoSuchFile {
                file: s.file,
                files: files.len(),
            });
        }
        if let Some(c) = state
            .checksums
            .iter()
            .find(|c| c.source >= state.sources.len())
        {
            return Err(LoadRestoreError::NoSuchSource {
                index: c.source,
                sources: state.sources.len(),
            });
        }
        Ok(RestoredLoad {
            alloc: state.alloc,
            fill: PendingLoad {
                files,
                sources: state.sources,
                dest_is_zero: state.dest_is_zero && !state.reload_all,
                checksums: state.checksums,
            },
            reload_all: state.reload_all,
        })
    }
}

/// The fills of `records` that belong to a VM parked in `pool` (imported
/// already), into `fills`; one saved during a restore has its VM's units
/// marked to be filled again. Returns how many were kept.
pub fn restore_into(
    records: Vec<LoadRecord>,
    ctx: &mut RestoreContext<'_>,
    pool: &Pool,
    fills: &PendingLoads,
) -> usize {
    let parked = pool.parking().parked_list();
    let mut kept = 0;
    for r in records {
        let alloc = r.alloc;
        let Some(vm) = parked.iter().find(|p| p.alloc == alloc) else {
            // Not parked (restored since, or not kept): its files close
            // with the document's.
            continue;
        };
        let restored = match LoadSnapshot::restore(r, ctx) {
            Ok(f) => f,
            Err(e) => {
                warn!(alloc, name = %vm.name, error = %e, "a VM parked on demand lost its files; it can only be unparked");
                continue;
            }
        };
        let holds = pool
            .parking()
            .find_parked(vm.uid, &vm.name)
            .map_or(0, |found| found.regions.len());
        if restored.fill.regions() > holds {
            warn!(alloc, name = %vm.name, files = restored.fill.regions(), holds, "a VM parked on demand has files for regions it does not hold; it can only be unparked");
            continue;
        }
        if restored.reload_all {
            if let Some(found) = pool.parking().find_parked(vm.uid, &vm.name) {
                for (_, region) in &found.regions {
                    region.mark_all_dirty();
                }
            }
            info!(alloc, name = %vm.name, "a VM parked on demand was being restored: all of its memory is read again from its files at the next restore");
        }
        fills.insert(alloc, restored.fill);
        kept += 1;
    }
    kept
}
