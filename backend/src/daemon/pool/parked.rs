//! Parked VMs: an allocation that holds a cloud-hypervisor VM's memory
//! under a name, with the VM's configuration and state, while no process
//! runs the VM (`crate::daemon::requests::park`). A parked allocation belongs to no
//! connection (as an orphan) but never times out; it is its tenant's
//! until RESTORE hands it to a connection or UNPARK releases it.
//!
//! Each move is one step under the pool's lock, as HANDOFF's: the
//! allocation belongs to its launcher's connection until it is parked,
//! and to the parked record until a restoring connection owns it. Each
//! move gives the allocation a new token, so no earlier holder of the old
//! one can REATTACH or HANDOFF it away from the record.

use std::sync::Arc;

use guest_mem::Region;

use super::allocation::ChangeGate;
use super::files::{set_access_all, Access};
use super::parked_vm::ParkedVm;
use super::table::EntryState;
use super::token::new_token;
use crate::daemon::ids::{AllocId, RegionId, SessionId};

/// Who holds the file a peer sent, by its identity (device and inode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileOwner {
    /// Region `region` (index in the allocation) of allocation `alloc`,
    /// tenant `tenant`, owned by connection `session` (`None`: orphaned or
    /// parked).
    Allocation {
        /// The allocation.
        alloc: AllocId,
        /// The region's index in it.
        region: usize,
        /// Its tenant.
        tenant: u32,
        /// The connection that owns it.
        session: Option<SessionId>,
    },
    /// A region of the pool that no allocation holds (released, pooled):
    /// a peer that still has its fd kept it past its release.
    NotInUse,
}

/// Why a park or restore move was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParkError {
    /// The tenant already has a VM parked under this name.
    #[error("a VM named {0:?} is parked already (UNPARK it, or choose another name)")]
    NameInUse(String),
    /// No VM of this tenant is parked under this name.
    #[error("no VM named {0:?} is parked")]
    NoSuchVm(String),
    /// The allocation changed hands (released, handed off, parked) since
    /// the park began.
    #[error("allocation {0} changed hands while it was being parked")]
    Moved(AllocId),
    /// Pages a lazy allocation has not cleared yet.
    #[error(
        "allocation {alloc} still has {pages} page(s) to clear; park it when STATS shows none left"
    )]
    NotCleared {
        /// The allocation.
        alloc: AllocId,
        /// Pages dirty or being cleared.
        pages: usize,
    },
    /// No new token could be made, or the receiver's view could not be opened.
    #[error("{0}")]
    Internal(String),
}

/// A parked VM as STATS and /metrics list it.
pub use hugemem_client::stats::ParkedVmStats as ParkedSummary;

/// A parked VM found for RESTORE: its allocation, record and regions.
#[derive(Debug, Clone)]
pub struct FoundParked {
    /// The allocation.
    pub alloc: AllocId,
    /// The record.
    pub vm: Arc<ParkedVm>,
    /// Its regions, in order.
    pub regions: Vec<(RegionId, Arc<Region>)>,
    /// Locked.
    pub locked: bool,
    /// Its change gate.
    pub gate: ChangeGate,
}

/// The parked VMs' side of the pool (`Pool::parking`): finding a parked VM,
/// parking and restoring one (the owner's moves `Owner::park` and
/// `Owner::restore`), and listing them. Like [`Owners`](super::owners::Owners),
/// a borrow of the pool whose methods each take the lock for one step.
#[derive(Debug, Clone, Copy)]
pub struct Parking<'a> {
    pool: &'a super::table::Pool,
}

impl super::table::Pool {
    /// The parked VMs' part of the pool.
    pub fn parking(&self) -> Parking<'_> {
        Parking { pool: self }
    }
}

impl Parking<'_> {
    /// Who holds the file whose identity is `(dev, ino)`, if it is one of
    /// the pool's regions.
    pub fn owner_of_file(&self, dev: u64, ino: u64) -> Option<FileOwner> {
        let g = self.pool.lock();
        let (id, state) = g.find_region(|r| file_identity(r.fd()).ok() == Some((dev, ino)))?;
        let EntryState::InUse(alloc) = state else {
            return Some(FileOwner::NotInUse);
        };
        let a = g.allocs.get(alloc)?;
        let region = a.regions.iter().position(|r| *r == id)?;
        Some(FileOwner::Allocation {
            alloc,
            region,
            tenant: a.tenant,
            session: a.owner().session(),
        })
    }

    /// Moves allocation `alloc` of tenant `uid`, owned by `session`, into a
    /// parked record `vm`, in one step: from then on it is no connection's
    /// and has a new token. Returns its regions' bytes. Pages not cleared
    /// are refused, unless `unfilled_ok` (a park on demand: the daemon
    /// fills them from the tenant's files before any process maps them).
    /// A moved allocation's `Unpopulated` pages are marked as holding the
    /// VM (`Region::mark_owner_written`).
    ///
    /// # Errors
    ///
    /// [`ParkError`]; nothing changed.
    pub fn park(
        &self,
        alloc: AllocId,
        uid: u32,
        session: Option<SessionId>,
        vm: ParkedVm,
        unfilled_ok: bool,
    ) -> Result<u64, ParkError> {
        let fresh = new_token().map_err(|e| ParkError::Internal(e.to_string()))?;
        let mut g = self.pool.lock();
        if g.allocs.parked(uid, &vm.name).is_some() {
            return Err(ParkError::NameInUse(vm.name));
        }
        let a = g.allocs.get(alloc).ok_or(ParkError::Moved(alloc))?;
        if a.tenant != uid {
            return Err(ParkError::Moved(alloc));
        }
        // Still held by the owner the PARK saw, and not parked already.
        let next = a
            .owner()
            .park(session, vm)
            .map_err(|_| ParkError::Moved(alloc))?;
        let (bytes, pages) = g.bytes_and_uncleared(a);
        if pages > 0 && !unfilled_ok {
            return Err(ParkError::NotCleared { alloc, pages });
        }
        if !unfilled_ok {
            // Moved: its pages are the VM's, whatever the daemon saw of
            // them. A lazy allocation on fresh memory has pages the guest
            // faulted in and wrote itself, still `Unpopulated` here: so
            // marked, a restore would take the VM for one parked on demand
            // whose files are gone, and a save for memory to fill.
            for (_, region) in g.regions_of(a) {
                region
                    .mark_owner_written()
                    .map_err(|e| ParkError::Internal(format!("page states: {e}")))?;
            }
        }
        // A template: no process but root may open its files for writing
        // from now on, whatever fd of them it holds (a clone's read-only
        // ones included); a refusal leaves them the tenant's.
        let regions = g.regions_of(a);
        let tenant = Access::Tenant {
            uid,
            gid: tenant_gid(&regions),
        };
        set_access_all(regions.iter().map(|(_, r)| &**r), Access::Template, tenant).map_err(
            |(i, e)| ParkError::Internal(format!("cannot make region {i} read-only to all: {e}")),
        )?;
        let a = g.allocs.get_mut(alloc).ok_or(ParkError::Moved(alloc))?;
        a.enter(next);
        a.token = fresh;
        Ok(bytes)
    }

    /// The change gate of allocation `alloc`.
    pub fn gate_of(&self, alloc: AllocId) -> Option<ChangeGate> {
        self.pool
            .lock()
            .allocs
            .get(alloc)
            .map(|a| Arc::clone(&a.gate))
    }

    /// The VM `uid` parked under `name`.
    pub fn find_parked(&self, uid: u32, name: &str) -> Option<FoundParked> {
        let g = self.pool.lock();
        let (alloc, a, vm) = g.allocs.parked(uid, name)?;
        Some(FoundParked {
            alloc,
            vm: Arc::clone(vm),
            regions: g.regions_of(a),
            locked: a.locked,
            gate: Arc::clone(&a.gate),
        })
    }

    /// Gives the VM `uid` parked under `name` as allocation `alloc` to
    /// `session`, in one step, with a new token (returned). The caller
    /// holds the allocation's change gate.
    ///
    /// # Errors
    ///
    /// [`ParkError::NoSuchVm`] when it is no longer parked (an UNPARK or
    /// another RESTORE won).
    pub fn unpark_to(
        &self,
        alloc: AllocId,
        uid: u32,
        name: &str,
        session: SessionId,
    ) -> Result<super::token::AllocToken, ParkError> {
        let fresh = new_token().map_err(|e| ParkError::Internal(e.to_string()))?;
        let mut g = self.pool.lock();
        let no_such_vm = || ParkError::NoSuchVm(name.to_string());
        let a = g
            .allocs
            .get_mut(alloc)
            .filter(|a| a.tenant == uid)
            .ok_or_else(no_such_vm)?;
        let next = a.owner().restore(name, session).map_err(|_| no_such_vm())?;
        a.enter(next);
        a.token = fresh;
        Ok(fresh)
    }

    /// The name under which allocation `alloc` of tenant `uid` is parked.
    pub fn parked_name(&self, alloc: AllocId, uid: u32) -> Option<String> {
        let g = self.pool.lock();
        let a = g.allocs.get(alloc).filter(|a| a.tenant == uid)?;
        a.owner().parked().map(|p| p.name.clone())
    }

    /// Every parked VM.
    pub fn parked_list(&self) -> Vec<ParkedSummary> {
        let g = self.pool.lock();
        let mut out: Vec<ParkedSummary> = g
            .allocs
            .parked_all()
            .map(|(id, a, p)| {
                let (bytes, page_size) = g.regions_of(a).iter().fold((0, 0), |(b, ps), (_, r)| {
                    (b + r.len(), ps.max(r.page_size().bytes()))
                });
                ParkedSummary {
                    uid: a.tenant,
                    name: p.name.clone(),
                    alloc: id,
                    bytes,
                    copied_bytes: p.copied_bytes,
                    slots: p.slots.len(),
                    page_size,
                    parked_at: p.parked_at,
                    vmm: Some(p.vmm().as_str().to_owned()),
                    // The park room counts clones, not the pool: STATS fills it.
                    shared_clones: 0,
                    shared_clone_written_bytes: 0,
                    copy_clones_filling: 0,
                }
            })
            .collect();
        out.sort_by(|a, b| (a.uid, &a.name).cmp(&(b.uid, &b.name)));
        out
    }
}

impl super::table::Pool {
    /// UNPARK: releases the VM `uid` parked under `name` into quarantine
    /// (its memory returns to the pool once no process holds it). The
    /// caller holds the allocation's change gate.
    ///
    /// # Errors
    ///
    /// [`ParkError::NoSuchVm`].
    pub fn release_parked(
        &self,
        uid: u32,
        name: &str,
    ) -> Result<super::release::Released, ParkError> {
        let mut g = self.lock();
        let (id, a) = g
            .allocs
            .remove_parked(uid, name)
            .ok_or_else(|| ParkError::NoSuchVm(name.to_string()))?;
        let released = self.release_locked(&mut g, id, a);
        drop(g);
        self.changed.notify_all();
        Ok(released)
    }
}

/// The group of the first of `regions`' files (the tenant's while it used
/// them), for a park refused after they were made read-only.
fn tenant_gid(regions: &[(RegionId, Arc<Region>)]) -> u32 {
    regions
        .first()
        .and_then(|(_, r)| nix::sys::stat::fstat(r.fd()).ok())
        .map_or(0, |st| st.st_gid)
}

/// A file's identity: its device and inode (`fstat`).
///
/// # Errors
///
/// The `fstat` error.
fn file_identity(fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<(u64, u64)> {
    let st = nix::sys::stat::fstat(fd).map_err(std::io::Error::from)?;
    Ok((st.st_dev, st.st_ino))
}
