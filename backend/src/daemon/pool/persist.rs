//! The pool's persistence: a snapshot of every region and allocation,
//! their records in the state document a takeover or systemd's fd store
//! keeps (`crate::daemon::restart::takeover`), and the successor's adoption and
//! import of what it verified.

use std::collections::HashSet;
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use guest_mem::{AdoptSpec, PageSize, Region};
use numa::Topology;
use serde::{Deserialize, Serialize};
use tracing::warn;

use super::allocation::{AllocSnapshot, Owner};
use super::table::Entry;
use super::table::EntryState;
use super::table::Pool;
use crate::daemon::counters::metrics::Metrics;
use crate::daemon::ids::AllocId;
use crate::daemon::ids::PoolKey;
use crate::daemon::ids::RegionId;
use crate::daemon::peers::holders::Owned;
use crate::daemon::persist::encoding::{decode_pages, encode_pages, hex, unhex};
use crate::daemon::persist::{DecodeError, Persist, RestoreContext, SaveContext, SaveError};

/// Where an exported region is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Life {
    /// Clean, pooled.
    Clean,
    /// Pooled, pages to scrub.
    Dirty,
    /// Released, not yet proved free of holders.
    Quarantined,
    /// Handed to a client as part of this allocation.
    InUse(AllocId),
}

/// One region of a snapshot.
#[derive(Debug, Clone)]
pub struct RegionSnapshot {
    /// Its id.
    pub id: RegionId,
    /// The region (its fd and page states travel).
    pub region: Arc<Region>,
    /// Its pool key.
    pub key: PoolKey,
    /// Its state.
    pub life: Life,
    /// Uid of the tenant that last held it.
    pub tenant: Option<u32>,
    /// Pages may be on several nodes.
    pub split: bool,
    /// Holes still to be faulted in ahead of the guest.
    pub fill: bool,
}

/// Everything the pool owns, for the state document.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// Regions.
    pub regions: Vec<RegionSnapshot>,
    /// Allocations.
    pub allocs: Vec<AllocSnapshot>,
    /// The next region id.
    pub next_region: RegionId,
    /// The next allocation id.
    pub next_alloc: AllocId,
}

/// A region the successor adopted, with what it found when verifying it.
#[derive(Debug)]
pub struct Adopted {
    /// Its id (kept across the takeover).
    pub id: RegionId,
    /// The region.
    pub region: Region,
    /// Its pool key.
    pub key: PoolKey,
    /// The state it enters (a pooled region that failed a check enters
    /// `Quarantined`: the quarantine's proofs then decide).
    pub life: Life,
    /// Uid of the tenant that last held it.
    pub tenant: Option<u32>,
    /// Pages may be on several nodes.
    pub split: bool,
    /// Holes to fault in ahead of the guest.
    pub fill: bool,
}

/// Why the pool's table cannot be snapshot for a takeover now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotError {
    /// An ALLOC (or a refill) still owns the region: the takeover must wait
    /// or be given up.
    #[error("region {0} is reserved by an ALLOC in progress")]
    Reserved(RegionId),
}

/// Why a region record is not adopted (the region then goes back to the
/// kernel).
#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    /// The document names no fd for it (or named its fd twice).
    #[error("no fd came with it")]
    NoFd,
    /// In use, by no allocation.
    #[error("in use by no allocation")]
    NoAllocation,
    /// A page size this host does not have.
    #[error("page size {0}")]
    PageSize(u64),
    /// Its page states do not decode.
    #[error(transparent)]
    Pages(#[from] DecodeError),
    /// Bound to a node this host does not have.
    #[error("node {0} is not on this host")]
    Node(u32),
    /// The file is not what the record says.
    #[error(transparent)]
    Region(#[from] guest_mem::AdoptError),
}

impl Pool {
    /// The table as it is; a `Reserved` region is an error, or skipped.
    fn take_snapshot(&self, skip_reserved: bool) -> Result<Snapshot, SnapshotError> {
        let g = self.lock();
        let mut out = Snapshot {
            next_region: self.next_region.load(Ordering::Relaxed),
            next_alloc: self.next_alloc.load(Ordering::Relaxed),
            ..Snapshot::default()
        };
        for (id, e) in &g.entries {
            let life = match e.state {
                EntryState::Reserved if skip_reserved => continue,
                EntryState::Reserved => return Err(SnapshotError::Reserved(*id)),
                EntryState::InUse(a) => Life::InUse(a),
                EntryState::Quarantined => Life::Quarantined,
                EntryState::Dirty => Life::Dirty,
                EntryState::Clean => Life::Clean,
            };
            out.regions.push(RegionSnapshot {
                id: *id,
                region: Arc::clone(&e.region),
                key: e.key,
                life,
                tenant: e.tenant,
                split: e.split,
                fill: e.fill.is_some(),
            });
        }
        out.allocs = g.allocs.snapshot();
        Ok(out)
    }
}

/// The pool's part of the state document: its snapshot for a takeover or
/// the fd store, the import of a predecessor's, the orphans a restart left.
/// Borrowed from [`Pool::records`]; each method takes the pool's one lock
/// for its step.
#[derive(Debug, Clone, Copy)]
pub struct Records<'a> {
    pub(super) pool: &'a Pool,
}

impl Pool {
    /// The pool's part of the state document (takeover, fd store, restart).
    pub fn records(&self) -> Records<'_> {
        Records { pool: self }
    }
}

impl Records<'_> {
    /// A snapshot of every region and allocation. For a takeover the
    /// caller has stopped everything that changes the table (handlers
    /// parked, scrubbers joined, background loops paused) and keeps it so
    /// until the successor answers. `keep` marks every region's file as
    /// kept, so that this process's exit does not unlink the hugetlbfs
    /// files it passes on ([`Records::unkeep`] undoes it when the takeover
    /// fails).
    ///
    /// # Errors
    ///
    /// A region is `Reserved` (an ALLOC or refill still runs): the
    /// takeover must wait or be given up.
    pub fn snapshot(&self, keep: bool) -> Result<Snapshot, SnapshotError> {
        let out = self.pool.take_snapshot(false)?;
        if keep {
            for r in &out.regions {
                r.region.keep_file();
            }
        }
        Ok(out)
    }

    /// [`Records::snapshot`] while the daemon serves (systemd's fd store):
    /// regions an ALLOC holds in the middle of its work are left out (the
    /// next snapshot has them), nothing is marked kept.
    pub fn snapshot_partial(&self) -> Snapshot {
        // Never an error when reserved regions are skipped.
        self.pool.take_snapshot(true).unwrap_or_default()
    }

    /// Allocations waiting for their VMM to re-attach.
    pub fn orphans(&self) -> usize {
        self.pool.lock().allocs.orphans().count()
    }

    /// Releases every orphaned allocation into quarantine.
    pub fn release_orphans(&self) -> Vec<super::release::Released> {
        let mut g = self.pool.lock();
        let orphans = g.allocs.remove_orphans();
        let out = orphans
            .into_iter()
            .map(|(id, a)| self.pool.release_locked(&mut g, id, a))
            .collect();
        drop(g);
        self.pool.changed.notify_all();
        out
    }

    /// Lets the scrubbers and waiters run again after [`Pool::stop`] (a
    /// takeover that did not happen).
    pub fn resume(&self) {
        self.pool.lock().stopping = false;
        self.pool.changed.notify_all();
    }

    /// Counts `bytes` of a predecessor's regions that failed their checks
    /// and went back to the kernel as released.
    pub fn released_unadopted(&self, bytes: u64) {
        Metrics::add(&self.pool.metrics.bytes_released, bytes);
    }

    /// Enters the regions and allocations a predecessor passed on (the
    /// regions adopted and verified by the caller). An allocation whose
    /// regions are not all here (one failed its checks) is not kept: it
    /// counts as released, and its surviving regions go back to the kernel
    /// once its VMM lets go, the same as a region the daemon no longer
    /// tracks (`given_back` says why). Returns how many allocations were
    /// kept.
    pub fn import(
        &self,
        regions: Vec<Adopted>,
        allocs: Vec<AllocSnapshot>,
        next_region: RegionId,
        next_alloc: AllocId,
    ) -> usize {
        let present: HashSet<RegionId> = regions.iter().map(|r| r.id).collect();
        let mut kept_allocs = Vec::new();
        for a in allocs {
            if a.regions.iter().all(|r| present.contains(r)) {
                kept_allocs.push(a);
            } else {
                warn!(
                    alloc = a.id,
                    "an inherited allocation lost a region that failed its checks; no longer tracked"
                );
                Metrics::add(&self.pool.metrics.allocs_released, 1);
            }
        }
        let kept_ids: HashSet<AllocId> = kept_allocs.iter().map(|a| a.id).collect();
        let mut g = self.pool.lock();
        let mut max_region = 0;
        for r in regions {
            max_region = max_region.max(r.id);
            let state = match r.life {
                Life::InUse(a) if kept_ids.contains(&a) => EntryState::InUse(a),
                Life::InUse(_) => {
                    Metrics::add(&self.pool.metrics.bytes_released, r.region.len());
                    continue;
                }
                Life::Clean => EntryState::Clean,
                Life::Dirty => EntryState::Dirty,
                Life::Quarantined => EntryState::Quarantined,
            };
            let owned = match Owned::region(
                r.region.fd(),
                r.region.as_ptr() as usize,
                usize::try_from(r.region.len()).unwrap_or(usize::MAX),
            ) {
                Ok(o) => o,
                Err(e) => {
                    warn!(region = r.id, error = %e, "cannot track an inherited region; back to the kernel");
                    Metrics::add(&self.pool.metrics.bytes_released, r.region.len());
                    continue;
                }
            };
            g.entries.insert(
                r.id,
                Entry {
                    region: Arc::new(r.region),
                    key: r.key,
                    owned,
                    state,
                    since: Instant::now(),
                    holder: None,
                    withheld: None,
                    tenant: r.tenant,
                    warned: false,
                    split: r.split,
                    fill: r.fill.then(super::refault::Refault::new),
                },
            );
        }
        let max_alloc = g.allocs.import(kept_allocs);
        // A parked VM is read-only to all but root here too (inodes keep
        // their mode across a takeover; a predecessor of an older version
        // may have left it writable).
        for (id, a, _) in g.allocs.parked_all() {
            for (region, r) in g.regions_of(a) {
                if let Err(e) = super::files::set_access(&r, super::files::Access::Template) {
                    warn!(alloc = id, region, error = %e, "an inherited parked VM's region stays writable to its owner until its next CLONE or RESTORE");
                }
            }
        }
        let n = g.allocs.len();
        drop(g);
        self.pool
            .next_region
            .fetch_max(next_region.max(max_region + 1), Ordering::Relaxed);
        self.pool
            .next_alloc
            .fetch_max(next_alloc.max(max_alloc + 1), Ordering::Relaxed);
        self.pool.changed.notify_all();
        n
    }

    /// Undoes [`Records::snapshot`]'s marks: the takeover did not happen, this
    /// process owns its files again.
    pub fn unkeep(&self) {
        // Region::keep_file has no inverse on purpose elsewhere; here the
        // snapshot's regions are simply all regions.
        for e in self.pool.lock().entries.values() {
            e.region.keep_file_undo();
        }
    }
}

/// A region's life as the state document says it (version 1's strings:
/// `"clean"`, `"dirty"`, `"quarantined"`, `"in_use"`; an in-use region's
/// allocation is [`RegionRecord::alloc`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SavedLife {
    /// Clean, pooled.
    Clean,
    /// Pooled, pages to scrub.
    Dirty,
    /// Released, not yet proved free of holders.
    Quarantined,
    /// Handed to a client.
    InUse,
}

/// One region in the state document.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RegionRecord {
    /// Region id.
    pub id: u64,
    /// Index of its fd in the fd list.
    pub fd: usize,
    /// Its name.
    pub name: String,
    /// Bytes.
    pub len: u64,
    /// Page size in bytes.
    pub page_size: u64,
    /// Node it is pooled by.
    pub node: u32,
    /// Bound to its node (else unbound).
    pub bound: bool,
    /// Its hugetlbfs path, for a path-backed region.
    pub path: Option<String>,
    /// Where it is in its life.
    pub life: SavedLife,
    /// The allocation, when in use.
    pub alloc: Option<u64>,
    /// Uid of the tenant that last held it.
    pub tenant: Option<u32>,
    /// Pages may be on several nodes.
    pub split: bool,
    /// Holes still to be faulted in ahead of the guest.
    pub fill: bool,
    /// One digit per page state ([`guest_mem::PageState`] discriminants).
    pub pages: String,
}

/// One allocation in the state document.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AllocRecord {
    /// Allocation id.
    pub id: u64,
    /// The session that owns it; `None`: orphaned (waiting for its VMM to
    /// re-attach).
    pub session: Option<u64>,
    /// Its regions, in reply order.
    pub regions: Vec<u64>,
    /// Locked.
    pub locked: bool,
    /// The uid it was handed to.
    pub tenant: u32,
    /// Its re-attach token, as hex (the state memfd is the daemon uid's
    /// and sealed; it never reaches a tenant).
    pub token: String,
    /// Handed out lazily.
    pub lazy: bool,
    /// Its lazy regions are served by the VMM's fallback.
    pub lazy_fallback: bool,
    /// The VM parked in it (absent in a predecessor's document that knew
    /// no parking).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parked: Option<super::parked_vm::ParkedVm>,
}

impl Persist for RegionSnapshot {
    type State = RegionRecord;
    type Restored = Adopted;
    type RestoreError = AdoptError;

    /// Its record, its fd numbered in the document.
    fn save(&self, ctx: &mut SaveContext<'_>) -> Result<RegionRecord, SaveError> {
        let fd = ctx.fds.add(self.region.fd())?;
        Ok(self.record(fd))
    }

    /// The region adopted from its fd ([`RegionRecord::adopt`]).
    fn restore(state: RegionRecord, ctx: &mut RestoreContext<'_>) -> Result<Adopted, AdoptError> {
        let fd = ctx.fds.take(state.fd).ok_or(AdoptError::NoFd)?;
        state.adopt(fd, ctx.topology)
    }
}

impl RegionSnapshot {
    /// Its record in the state document; its fd is `fd` in the fd list.
    fn record(&self, fd: usize) -> RegionRecord {
        let (life, alloc) = match self.life {
            Life::Clean => (SavedLife::Clean, None),
            Life::Dirty => (SavedLife::Dirty, None),
            Life::Quarantined => (SavedLife::Quarantined, None),
            Life::InUse(a) => (SavedLife::InUse, Some(a)),
        };
        RegionRecord {
            id: self.id,
            fd,
            name: self.region.name().to_string(),
            len: self.region.len(),
            page_size: self.region.page_size().bytes(),
            node: self.key.node,
            bound: self.region.node().is_some(),
            path: self.region.path().map(|p| p.display().to_string()),
            life,
            alloc,
            tenant: self.tenant,
            split: self.split,
            fill: self.fill,
            pages: encode_pages(&self.region.states().snapshot()),
        }
    }
}

impl RegionRecord {
    /// Adopts the region this record describes from its fd
    /// (`guest_mem::Region::adopt`: size, page size, seals, page states),
    /// on a node of `topology`.
    ///
    /// # Errors
    ///
    /// A malformed record or a region that fails its checks (it then goes
    /// back to the kernel).
    pub fn adopt(&self, fd: OwnedFd, topology: &Topology) -> Result<Adopted, AdoptError> {
        let life = match (self.life, self.alloc) {
            (SavedLife::Clean, _) => Life::Clean,
            (SavedLife::Dirty, _) => Life::Dirty,
            (SavedLife::Quarantined, _) => Life::Quarantined,
            (SavedLife::InUse, Some(a)) => Life::InUse(a),
            (SavedLife::InUse, None) => return Err(AdoptError::NoAllocation),
        };
        let page_size =
            PageSize::from_bytes(self.page_size).ok_or(AdoptError::PageSize(self.page_size))?;
        let states = decode_pages(&self.pages)?;
        if topology.nodes().iter().all(|n| n.id != self.node) {
            return Err(AdoptError::Node(self.node));
        }
        let spec = AdoptSpec {
            name: self.name.clone(),
            len: self.len,
            page_size,
            node: self.bound.then_some(self.node),
            path: self.path.as_ref().map(std::path::PathBuf::from),
            states,
        };
        let file = std::fs::File::from(fd);
        let identity = file.metadata().ok().map(|m| (m.dev(), m.ino()));
        let region = Region::adopt(OwnedFd::from(file), spec).inspect_err(|_| {
            if let (Some(path), Some(identity)) = (&self.path, identity) {
                remove_refused_file(std::path::Path::new(path), identity);
            }
        })?;
        Ok(Adopted {
            id: self.id,
            region,
            key: PoolKey {
                node: self.node,
                page_size,
                paths: self.path.is_some(),
            },
            life,
            tenant: self.tenant,
            split: self.split,
            fill: self.fill,
        })
    }
}

/// Unlinks the hugetlbfs file of a region that failed its checks, if
/// `path` still names that very file (`identity`: device and inode): its
/// pages go back to the kernel once the fd is closed. Left on the mount,
/// they would stay taken until a later start found the file of a dead
/// process (a tenant that grows its path-mode file before each takeover
/// would take pages away each time).
fn remove_refused_file(path: &std::path::Path, identity: (u64, u64)) {
    let same = std::fs::symlink_metadata(path).is_ok_and(|m| (m.dev(), m.ino()) == identity);
    if same {
        if let Err(e) = std::fs::remove_file(path) {
            warn!(path = %path.display(), error = %e, "the file of a refused inherited region stays");
        }
    }
}

/// Why an allocation's record does not restore (it is then not tracked).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("allocation {0}'s token is malformed")]
pub struct MalformedToken(pub AllocId);

impl Persist for AllocSnapshot {
    type State = AllocRecord;
    type Restored = AllocSnapshot;
    type RestoreError = MalformedToken;

    /// Its record. For systemd's fd store no connection survives, so the
    /// allocation waits for its VMM to re-attach (orphaned), and a lazy
    /// one's faults go to its VMM's fallback meanwhile.
    fn save(&self, ctx: &mut SaveContext<'_>) -> Result<AllocRecord, SaveError> {
        let orphaned;
        let a = if ctx.to_store {
            orphaned = self.orphaned();
            &orphaned
        } else {
            self
        };
        let (session, parked) = a.owner.record();
        Ok(AllocRecord {
            id: a.id,
            session,
            regions: a.regions.clone(),
            locked: a.locked,
            tenant: a.tenant,
            token: hex(&a.token),
            lazy: a.lazy,
            lazy_fallback: a.lazy_fallback,
            parked,
        })
    }

    /// The allocation the record describes.
    fn restore(
        state: AllocRecord,
        _ctx: &mut RestoreContext<'_>,
    ) -> Result<AllocSnapshot, MalformedToken> {
        let token = unhex(&state.token)
            .ok()
            .and_then(|t| <[u8; 16]>::try_from(t).ok())
            .ok_or(MalformedToken(state.id))?;
        Ok(AllocSnapshot {
            id: state.id,
            owner: Owner::from_record(state.session, state.parked),
            regions: state.regions,
            locked: state.locked,
            tenant: state.tenant,
            token,
            lazy: state.lazy,
            lazy_fallback: state.lazy_fallback,
        })
    }
}
