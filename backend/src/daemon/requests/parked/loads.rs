//! Memory the daemon still has to fill from a tenant's files: a VM parked
//! on demand (`hugemem park --from-dir --on-demand`) keeps its directory's
//! files here, by allocation, until a RESTORE fills its memory (as the
//! receiver asks for pages, and in the background: `requests/park/ondemand.rs`) or
//! UNPARK drops it. The files and their sources travel in the state
//! document (a takeover, systemd's fd store: `loads_record.rs`), so a VM
//! parked on demand survives both.
//!
//! The region's page states say which units are filled. While a restore
//! runs, a unit filled for the receiver may be written by its guest: the
//! fill is then [`restoring`](PendingLoads::restoring), and a document
//! saved meanwhile (the fd store's, before a crash) says so, so the
//! successor fills every unit again from the files. A restore that fails
//! does the same ([`PendingLoads::reload_all`]).

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex};

use guest_mem::{Checksums, FillError, FillPlan, FillSource, Region};
use serde::{Deserialize, Serialize};

use crate::daemon::ids::AllocId;

/// One source of a pending fill: `len` bytes of file `file` (an index in
/// [`PendingLoad::files`]) from `file_offset`, to region `region` of the
/// allocation at `dest_offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceSpec {
    /// Index of the file.
    pub file: usize,
    /// Index of the region it fills, in the allocation's order: 0 for a
    /// load into one region (every cloud-hypervisor VM's), the slot's own
    /// region for a QEMU VM (QEMU maps each region's file from its start).
    #[serde(default, skip_serializing_if = "is_first")]
    pub region: usize,
    /// Offset in the file.
    pub file_offset: u64,
    /// Offset in the region.
    pub dest_offset: u64,
    /// Bytes.
    pub len: u64,
}

fn is_first(region: &usize) -> bool {
    *region == 0
}

/// What a saved VM's manifest says the file of source `source` holds:
/// the CRC-32C of each `piece` of it (PARK with VERIFY). It travels in
/// the state document with its fill (`loads_record.rs`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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
    pub crc32c: Vec<u32>,
}

/// The indices (in `specs`) of the sources that fill region `index`.
pub fn sources_of(specs: &[SourceSpec], index: usize) -> Vec<usize> {
    (0..specs.len())
        .filter(|i| specs[*i].region == index)
        .collect()
}

/// The fill plan of region `index` of an allocation (`region`): the
/// sources of `specs` that fill it (`of_region`: their indices, from
/// [`sources_of`]), file `i` being `file(i)`, each with its checksums
/// checked as it is filled. A fill error's source index is then an index
/// in `of_region` ([`describe`] maps it back).
///
/// # Errors
///
/// As [`FillPlan::new`] and [`FillPlan::with_checksums`].
pub fn plan<'a>(
    region: &Region,
    (specs, of_region): (&[SourceSpec], &[usize]),
    file: impl Fn(usize) -> BorrowedFd<'a>,
    checksums: &'a [SourceChecksums],
) -> Result<FillPlan<'a>, FillError> {
    let chosen: Vec<SourceSpec> = of_region.iter().map(|i| specs[*i]).collect();
    let mut plan = FillPlan::new(region, &load_sources(&chosen, file))?;
    for (local, global) in of_region.iter().enumerate() {
        for c in checksums.iter().filter(|c| c.source == *global) {
            let expected = Checksums {
                piece: c.piece,
                file_len: c.file_len,
                crc32c: &c.crc32c,
            };
            plan = plan.with_checksums(local, expected, region.state_unit())?;
        }
    }
    Ok(plan.with_direct_io())
}

/// The source a fill error names, if any.
fn source_index(e: &FillError) -> Option<usize> {
    match e {
        FillError::Stat { index, .. }
        | FillError::NotRegular { index, .. }
        | FillError::OutOfRegion { index, .. }
        | FillError::FileRange { index, .. }
        | FillError::TooShort { index, .. }
        | FillError::ShortRead { index, .. }
        | FillError::Read { index, .. }
        | FillError::Seek { index, .. }
        | FillError::Checksum { index, .. }
        | FillError::Checksums { index, .. } => Some(*index),
        _ => None,
    }
}

/// The innermost fill error in `e`'s chain (the runner wraps a worker's).
fn innermost(e: &FillError) -> &FillError {
    let mut found = e;
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cur {
        if let Some(f) = c.downcast_ref::<FillError>() {
            found = f;
        }
        cur = c.source();
    }
    found
}

/// A fill's error as a tenant reads it (a disk error, a file truncated
/// meanwhile, a piece that does not match its manifest): the error with its
/// causes, and the file its source reads: by its name in the saved
/// directory where a manifest named it (`memory-0 does not match its
/// manifest: …`), else by its path (`file_of(source)`, as this process's
/// `/proc/self/fd` names it). The error's source index is one in
/// `of_region` (the plan's sources, see [`plan`]); `file_of` and the
/// checksums take the index it maps to.
pub fn describe<'a>(
    e: &FillError,
    (checksums, of_region): (&[SourceChecksums], &[usize]),
    file_of: impl Fn(usize) -> Option<BorrowedFd<'a>>,
) -> String {
    let inner = innermost(e);
    let index = source_index(inner).and_then(|i| of_region.get(i).copied());
    let named = index.and_then(|i| checksums.iter().find(|c| c.source == i));
    if let (
        FillError::Checksum {
            file_offset,
            len,
            expected,
            found,
            ..
        },
        Some(c),
    ) = (inner, named)
    {
        return format!(
            "{} does not match its manifest: the {len} bytes at offset {file_offset:#x} have CRC-32C {found:#010x}, the manifest says {expected:#010x}",
            c.name
        );
    }
    let mut text = crate::diag::chain(e);
    if let Some(c) = named {
        text.push_str(&format!(" (source {} is {})", c.source, c.name));
    } else if let Some((index, fd)) = index.and_then(|i| Some((i, file_of(i)?))) {
        let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()));
        if let Ok(path) = link {
            text.push_str(&format!(" (source {index} is {})", path.display()));
        }
    }
    text
}

/// What an allocation parked on demand is to be filled from.
#[derive(Debug)]
pub struct PendingLoad {
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
pub fn load_sources<'a>(
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

impl PendingLoad {
    /// How many regions its sources fill (at least one).
    pub fn regions(&self) -> usize {
        self.sources.iter().map(|s| s.region + 1).max().unwrap_or(1)
    }

    /// The fill plan for region `index` of the allocation (`region`),
    /// checksums included.
    ///
    /// # Errors
    ///
    /// As [`plan`], described by [`describe`].
    pub fn plan(&self, index: usize, region: &Region) -> Result<FillPlan<'_>, LoadFailed> {
        let of_region = sources_of(&self.sources, index);
        plan(
            region,
            (&self.sources, &of_region),
            |i| self.files[i].as_fd(),
            &self.checksums,
        )
        .map_err(|e| self.describe(index, &e))
    }

    /// [`describe`] for a fill of region `index` from this load's sources.
    pub fn describe(&self, index: usize, e: &FillError) -> LoadFailed {
        let sources = &self.sources;
        let of_region = sources_of(sources, index);
        LoadFailed(describe(e, (&self.checksums, &of_region), |i| {
            let s = sources.get(i)?;
            self.files.get(s.file).map(AsFd::as_fd)
        }))
    }
}

/// A load from a tenant's files that failed, described with the file, the
/// offset and both checksums where a piece did not match (see [`describe`]).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct LoadFailed(pub String);

/// Every pending fill, by allocation, and those a restore is filling.
#[derive(Debug, Default)]
pub struct PendingLoads {
    map: Mutex<Fills>,
}

#[derive(Debug, Default)]
struct Fills {
    pending: HashMap<AllocId, Arc<PendingLoad>>,
    restoring: HashSet<AllocId>,
}

/// Marks a fill as being restored while it lives (see
/// [`PendingLoads::restoring`]).
#[derive(Debug)]
pub struct Restoring<'a> {
    fills: &'a PendingLoads,
    alloc: AllocId,
}

impl Drop for Restoring<'_> {
    fn drop(&mut self) {
        self.fills.lock().restoring.remove(&self.alloc);
    }
}

impl PendingLoads {
    fn lock(&self) -> std::sync::MutexGuard<'_, Fills> {
        self.map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records `fill` for `alloc`.
    pub fn insert(&self, alloc: AllocId, fill: PendingLoad) {
        self.lock().pending.insert(alloc, Arc::new(fill));
    }

    /// The pending fill of `alloc`.
    pub fn get(&self, alloc: AllocId) -> Option<Arc<PendingLoad>> {
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
    pub fn all(&self) -> Vec<(AllocId, Arc<PendingLoad>, bool)> {
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
    pub fn reload_all(&self, alloc: AllocId) -> std::io::Result<()> {
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
            Err(shared) => PendingLoad {
                files: shared
                    .files
                    .iter()
                    .map(OwnedFd::try_clone)
                    .collect::<std::io::Result<_>>()?,
                sources: shared.sources.clone(),
                dest_is_zero: false,
                checksums: shared.checksums.clone(),
            },
        };
        g.pending.insert(alloc, Arc::new(fill));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_source_names_its_region_and_records_before_it_read_as_the_first() {
        // A record of a daemon before regions were named: region 0.
        let old: SourceSpec =
            serde_json::from_str(r#"{"file":0,"file_offset":0,"dest_offset":4096,"len":8192}"#)
                .expect("an older record");
        assert_eq!(old.region, 0);
        // Region 0 is written as before; another region is named.
        let text = serde_json::to_string(&old).expect("json");
        assert!(!text.contains("region"), "{text}");
        let second = SourceSpec { region: 1, ..old };
        let text = serde_json::to_string(&second).expect("json");
        assert_eq!(
            serde_json::from_str::<SourceSpec>(&text).expect("back"),
            second
        );
        let specs = [old, second, SourceSpec { file: 1, ..second }];
        assert_eq!(sources_of(&specs, 0), [0]);
        assert_eq!(sources_of(&specs, 1), [1, 2]);
        assert!(sources_of(&specs, 2).is_empty());
        let load = PendingLoad {
            files: Vec::new(),
            sources: specs.to_vec(),
            dest_is_zero: true,
            checksums: Vec::new(),
        };
        assert_eq!(load.regions(), 2);
    }
}
