//! Guest RAM regions: one fd of one page size, bound to one NUMA node, mapped
//! once by hugemem itself, prepared (populated or cleared) before a VMM sees it.
//!
//! # Design
//!
//! **One region = one node (or unbound) = one fd.** A VM with 4 GiB on node 0
//! and 4 GiB on node 1 is two regions. Keeping the node per fd means the fd
//! can be handed to any VMM (cloud-hypervisor `memory-zone file=`, QEMU
//! `memory-backend-file`/`memfd`, a rust-vmm VMM through [`crate::vmm`]) and
//! each of them maps whole files; none of them has to know about hugemem's
//! placement. The alternative, one fd per VM with per-range `mbind`, would
//! need every consumer to keep our ranges intact when it splits guest RAM
//! (cloud-hypervisor splits at the 3 GiB hole) and makes verification and
//! recycling per range instead of per file.
//!
//! **Page size policy.** [`PagePolicy::Strict`] takes one size or fails;
//! [`PagePolicy::Best`] tries 1 GiB, then 2 MiB, then 4 KiB (shmem). The choice
//! is made from pool counts read at that moment ([`crate::pools`]), *before*
//! anything is allocated; a fallback is logged with `tracing::warn!` and shows
//! in [`Region::page_size`] and [`Region::fallback`]. A strict request that
//! cannot be met fails with [`RegionError::Unavailable`], which names the free
//! pages per node and size.
//!
//! **Reservations and SIGBUS.** The region's own mapping is `MAP_SHARED`
//! without `MAP_NORESERVE`, so the kernel reserves every huge page at `mmap`
//! time and a short host pool fails there with `ENOMEM`. Reservations are
//! host-wide though (see [`crate::pools`]); what makes a node-bound region safe
//! is the per-node check before allocating plus populating at allocation time
//! ([`Region::allocate`] = create + [`Region::prepare_eager`]): a page the node
//! cannot provide then fails `MADV_POPULATE_WRITE` with `EFAULT`/`ENOMEM` in
//! our process, the region is dropped (unmapped, fd closed, file unlinked) and
//! the caller gets an error, instead of a guest getting SIGBUS later.
//!
//! **Placement.** The mapping is bound with `mbind(MPOL_BIND, {node})` right
//! after `mmap`, before any page exists, and then populated by the
//! [`clearing`] job runner, whose workers are pinned to the node's CPUs.
//! [`Region::verify_placement`] asks `move_pages` (no targets: query only)
//! where each huge page is and reports the ones that landed elsewhere.
//! For hugetlb the policy belongs to our VMA; for shmem (4 KiB) it is stored
//! on the file and applies to every mapping. Either way, pages exist before a
//! VMM maps the fd, so its own mapping (default policy) finds them placed.
//!
//! **Fresh vs reused.** Each page has a [`PageState`]. A new region's pages
//! are `Unpopulated`: preparing them means populating (the kernel zeroes a new
//! hugetlb page itself; clearing it again would write it twice). Pages a
//! hugemem pool keeps across VMs are marked `Dirty` and preparing them means
//! clearing them with the [`clearing`] kernels; `Clean` pages are skipped.
//!
//! **State granularity.** One state per huge page. For 4 KiB (shmem) regions
//! one state covers a 2 MiB granule (the last one may be shorter): a state per
//! 4 KiB page would be 512 times the atomics for nothing, since populating and
//! clearing work on megabytes at a time anyway.
//!
//! **Sealing.** Memfds are created with `MFD_ALLOW_SEALING` and sealed with
//! `F_SEAL_SHRINK | F_SEAL_SEAL` once sized. `F_SEAL_SHRINK`: a VMM that
//! receives the fd cannot truncate it under hugemem's own mapping, which
//! would turn the scrubber's next write into SIGBUS in the daemon.
//! `F_SEAL_SEAL`: it cannot add seals (`F_SEAL_WRITE`, `F_SEAL_GROW`) that
//! would stop hugemem from writing or growing the file. Growing is allowed
//! on purpose, because hugemem grows pooled regions itself
//! ([`Region::grow`]). A VMM that grows the file only adds pages *beyond*
//! the region's length: hugemem's own mapping is exactly [`Region::len`]
//! bytes (created, and remapped by `grow`, at that length), its page states,
//! prepare, scrub and placement checks cover only that range, and the daemon
//! hands the region out with its own length, so those extra pages are never
//! handed to anyone by hugemem nor read by it. They are the VMM's own
//! (charged to the same hugetlb pool) and go back to the kernel when the last
//! fd and mapping of the memfd are gone (for the daemon: when the region
//! drops). Should hugemem later grow the region over them, [`Region::grow`]
//! sees that the file is already longer than the region and marks the pages
//! in that range `Dirty`, so they are cleared, not merely populated, before
//! anyone is handed them.
//!
//! # Example
//!
//! ```
//! use guest_mem::{PageState, Region, RegionSpec};
//!
//! let topology = numa::Topology::detect()?;
//! let node = topology.nodes().first().map(|n| n.id);
//! // 4 MiB bound to the first node: 2 MiB pages if that pool has two free,
//! // else 4 KiB (1 GiB does not divide 4 MiB); the fallback is logged.
//! let spec = RegionSpec::new("example", 4 << 20, node);
//! let (region, report) = Region::allocate(&topology, &spec, &clearing::RunOptions::default())?;
//! assert_eq!(report.populated, region.states().len());
//! assert_eq!(region.states().counts().get(PageState::Clean), region.states().len());
//! assert!(region.verify_placement()?.misplaced.is_empty());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
mod adopt;
mod create;
mod error;
mod grow;
mod prepare;
mod spec;

pub use error::*;
pub use spec::{AdoptSpec, Backing, PagePolicy, RegionSpec};

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use clearing::RunOptions;
use numa::{MbindFlags, MemPolicyMode, NodeId, NodeMask, Topology};
use tracing::warn;

use crate::mapping::PageSize;
use crate::state::{PageState, PageStates, StateError};
use crate::sys;

/// State granule of 4 KiB regions (see the module docs).
const BASE_GRANULE: u64 = 2 << 20;

/// Pages per `move_pages` query call (the kernel batches internally too; this
/// bounds our status buffer).
const QUERY_BATCH: usize = 1 << 16;
/// `Region::node` value meaning "not bound to a node".
const UNBOUND: u32 = u32::MAX;

/// One region of guest RAM (see the module docs).
#[derive(Debug)]
pub struct Region {
    addr: *mut u8,
    len: u64,
    page_size: PageSize,
    /// Bound node, `UNBOUND` for none. Atomic because migration rebinds a
    /// region that the daemon shares between threads.
    node: AtomicU32,
    name: String,
    fallback: Option<String>,
    states: PageStates,
    /// Path of a hugetlbfs file, unlinked on drop.
    path: Option<PathBuf>,
    /// The file went to a successor daemon: not unlinked on drop.
    keep_path: std::sync::atomic::AtomicBool,
    fd: OwnedFd,
}

// SAFETY: `addr` is the start of a shared mapping owned by this value for its
// whole life; the pointer is only an address. Writes through it happen only
// in `prepare_eager`, to pages the writing thread owns through a `Clearing`
// state, or through `unsafe` accessors whose callers promise exclusivity.
unsafe impl Send for Region {}
// SAFETY: as for `Send`; `&Region` hands out the address, the fd and the
// atomic page states, all of which are safe to share.
unsafe impl Sync for Region {}

impl Region {
    /// [`Region::create`] then [`Region::prepare_eager`]: every page is
    /// populated now, by workers pinned to the node. A page the node cannot
    /// provide is an error here (the region is dropped, nothing is kept),
    /// never a SIGBUS later.
    ///
    /// # Errors
    ///
    /// As [`Region::create`], plus [`RegionError::Prepare`].
    pub fn allocate(
        topology: &Topology,
        spec: &RegionSpec,
        opts: &RunOptions<'_>,
    ) -> Result<(Self, PrepareReport), RegionError> {
        let region = Self::create(topology, spec)?;
        match region.prepare_eager(topology, opts) {
            Ok(report) => Ok((region, report)),
            Err(source) => Err(RegionError::Prepare {
                name: spec.name.clone(),
                source,
            }),
        }
    }

    /// Binds this process's mapping of the region to `node`
    /// (`mbind(MPOL_BIND)`, no move): pages allocated through it from now on
    /// come from that node.
    fn bind_to(&self, node: NodeId) -> Result<(), numa::PolicyError> {
        // The length was checked to fit usize when the region was made.
        numa::mbind(
            self.addr as usize,
            self.len as usize,
            MemPolicyMode::Bind,
            &NodeMask::single(node),
            MbindFlags::default(),
        )
    }

    /// Marks every page that is not being cleared `Dirty` (a pool taking the
    /// region back from a VM); returns (pages changed, pages busy in `Clearing`).
    pub fn mark_all_dirty(&self) -> (usize, usize) {
        self.states.mark_all_dirty()
    }

    /// Marks every `Unpopulated` page `Mapped` (through `Clearing` and
    /// `Clean`, the only path the transition table allows): the region's
    /// owner has mapped it and may have written those pages itself (a lazy
    /// allocation on fresh memory, which the kernel zeroed at the guest's
    /// first touch), so they hold its bytes and must never be taken for zero
    /// or for pages still to fill. Other pages are left as they are; returns
    /// how many changed.
    ///
    /// # Errors
    ///
    /// [`StateError::Conflict`] when another thread claimed such a page
    /// meanwhile (nothing should: the owner's own pages are nobody's work).
    pub fn mark_owner_written(&self) -> Result<usize, StateError> {
        let mut changed = 0;
        for page in 0..self.states.len() {
            if self.states.get(page)? != PageState::Unpopulated {
                continue;
            }
            self.states
                .try_transition(page, PageState::Unpopulated, PageState::Clearing)?;
            self.states
                .try_transition(page, PageState::Clearing, PageState::Clean)?;
            self.states
                .try_transition(page, PageState::Clean, PageState::Mapped)?;
            changed += 1;
        }
        Ok(changed)
    }

    /// Moves every page `Clean → Mapped` before the region is handed to a
    /// guest; returns how many pages changed. Pages already `Mapped` are left.
    ///
    /// # Errors
    ///
    /// [`StateError::Conflict`] for the first page that is neither clean nor
    /// mapped; pages before it stay `Mapped` (call [`Region::mark_all_dirty`]
    /// to take the region back).
    pub fn mark_mapped(&self) -> Result<usize, StateError> {
        let mut changed = 0;
        for page in 0..self.states.len() {
            match self
                .states
                .try_transition(page, PageState::Clean, PageState::Mapped)
            {
                Ok(()) => changed += 1,
                Err(StateError::Conflict {
                    actual: PageState::Mapped,
                    ..
                }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(changed)
    }

    /// The backing fd (memfd or hugetlbfs file), for mapping or sending.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// A duplicate of the fd (`F_DUPFD_CLOEXEC`) to hand to a VMM.
    ///
    /// # Errors
    ///
    /// `EMFILE` and the like.
    pub fn try_clone_fd(&self) -> io::Result<OwnedFd> {
        self.fd.try_clone()
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false: empty regions cannot be created.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The page size actually used (after any fallback).
    pub fn page_size(&self) -> PageSize {
        self.page_size
    }

    /// Why larger page sizes were passed over, when they were.
    pub fn fallback(&self) -> Option<&str> {
        self.fallback.as_deref()
    }

    /// The node the region is bound to.
    pub fn node(&self) -> Option<NodeId> {
        match self.node.load(Ordering::Acquire) {
            UNBOUND => None,
            n => Some(n),
        }
    }

    /// Records that the region is now bound to `node`, after `migrate` has
    /// rebound and moved it; later placement checks and preparation use it.
    pub fn set_node(&self, node: Option<NodeId>) {
        self.node.store(node.unwrap_or(UNBOUND), Ordering::Release);
    }

    /// The region's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The hugetlbfs file path, for a [`Backing::HugetlbfsDir`] region.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Per-page states (one per huge page; per 2 MiB granule for 4 KiB regions).
    pub fn states(&self) -> &PageStates {
        &self.states
    }

    /// Bytes covered by one page state: the page size, or 2 MiB for 4 KiB regions.
    pub fn state_unit(&self) -> u64 {
        state_unit(self.page_size)
    }

    /// Offset and length of state page `page` (the last granule of a 4 KiB
    /// region may be short).
    pub fn page_range(&self, page: usize) -> (u64, u64) {
        let unit = state_unit(self.page_size);
        let offset = (page as u64).saturating_mul(unit).min(self.len);
        (offset, unit.min(self.len - offset))
    }

    /// Start of hugemem's own mapping of the region. Reading or writing
    /// through it is `unsafe` territory: see [`Region::as_slice`].
    pub fn as_ptr(&self) -> *mut u8 {
        self.addr
    }

    /// The whole region as bytes, through hugemem's own mapping.
    ///
    /// # Safety
    ///
    /// While the slice lives nothing may write the region: no guest may have
    /// it mapped writable, no `prepare_eager` or scrubber may run on it, and no
    /// [`Region::as_mut_slice`] may exist.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: addr..addr+len is our live mapping (len fits usize, checked
        // at creation); the caller promises no writer for the slice's life.
        unsafe { std::slice::from_raw_parts(self.addr, self.len as usize) }
    }

    /// The whole region as mutable bytes, through hugemem's own mapping.
    ///
    /// # Safety
    ///
    /// While the slice lives nothing else may read or write the region (no
    /// guest, no `prepare_eager`, no scrubber, no other slice).
    #[allow(clippy::mut_from_ref)] // the mapping is shared memory, not owned by `self`'s fields
    pub unsafe fn as_mut_slice(&self) -> &mut [u8] {
        // SAFETY: as for `as_slice`; the caller promises exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.addr, self.len as usize) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // The size was checked to fit usize at creation.
        // SAFETY: the mapping is owned by self; no borrow (the unsafe slices
        // borrow self) outlives it.
        if let Err(e) = unsafe { sys::munmap(self.addr, self.len as usize) } {
            tracing::error!(error = %e, region = %self.name, "munmap of a region failed");
        }
        if let Some(path) = self
            .path
            .as_ref()
            .filter(|_| !self.keep_path.load(Ordering::Acquire))
        {
            if let Err(e) = std::fs::remove_file(path) {
                warn!(error = %e, path = %path.display(), "cannot unlink a region's hugetlbfs file");
            }
        }
        // `fd` closes when the field drops; with the mapping gone and the
        // file unlinked, the kernel frees the pages once no VMM holds them.
    }
}

fn state_unit(page_size: PageSize) -> u64 {
    page_size.bytes().max(BASE_GRANULE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_parses() {
        assert_eq!(PagePolicy::parse("best"), Some(PagePolicy::Best));
        assert_eq!(
            PagePolicy::parse("1G"),
            Some(PagePolicy::Strict(PageSize::Huge1G))
        );
        assert_eq!(
            PagePolicy::parse("4k"),
            Some(PagePolicy::Strict(PageSize::Base4K))
        );
        assert_eq!(PagePolicy::parse("3M"), None);
        assert_eq!(PagePolicy::Best.to_string(), "best");
    }

    #[test]
    fn state_units() {
        assert_eq!(state_unit(PageSize::Base4K), 2 << 20);
        assert_eq!(state_unit(PageSize::Huge2M), 2 << 20);
        assert_eq!(state_unit(PageSize::Huge1G), 1 << 30);
    }
}
