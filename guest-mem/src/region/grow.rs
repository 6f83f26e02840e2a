//! Growing a region in place.

use std::os::fd::{AsFd, AsRawFd};

use numa::{MbindFlags, MemPolicyMode, NodeId, NodeMask, Topology};
use tracing::{info, warn};

use crate::pools::{self, PoolSnapshot};
use crate::state::PageState;
use crate::sys;

use super::*;

impl Region {
    /// Grows the region to `new_len` bytes in place: same fd (same inode),
    /// same node and page size; the pages it had keep their contents and
    /// states, the new ones start `Unpopulated` (`Dirty` where the file was
    /// already longer than the region, see the module docs), so a following
    /// [`Region::prepare_eager`] populates only them, node-locally.
    ///
    /// Steps: check that the node (and the host) has the extra pages, as
    /// [`Region::create`] does; map the file again at `new_len`, `MAP_SHARED`
    /// without `MAP_NORESERVE` (for hugetlb this reserves the new pages: a
    /// short pool fails here with `ENOMEM`, not later with SIGBUS); bind the
    /// whole new mapping with `mbind(MPOL_BIND)` before any new page exists
    /// (the hugetlb policy belongs to the VMA, so the new VMA needs it; pages
    /// that already exist are not moved); size the file; only then unmap the
    /// old mapping and switch to the new one.
    ///
    /// Needs `&mut self`: nothing else may use the region (no scrubber,
    /// guest, prepare or borrowed slice) while it moves.
    ///
    /// # Errors
    ///
    /// [`RegionError::BadGrow`] (not larger, not a multiple of the page size,
    /// a partial last granule, too large for the address space),
    /// [`RegionError::GrowUnavailable`] (naming the free pages),
    /// [`RegionError::Pools`], [`RegionError::Map`], [`RegionError::Bind`],
    /// [`RegionError::Size`]. On every error the region is left exactly as it
    /// was: same mapping, length, states and pages. The one trace an error
    /// after the new mapping was made can leave is a hugetlb file whose size
    /// already reached `new_len` (hugetlbfs extends the file when it maps it):
    /// nothing maps or reads beyond [`Region::len`], no page exists there, a
    /// later `grow` simply covers it, and it goes back to the kernel with the
    /// region.
    pub fn grow(&mut self, topology: &Topology, new_len: u64) -> Result<(), RegionError> {
        let (unit, new_len_usize) = self.check_grow(new_len)?;
        let extra = new_len - self.len;
        let node = self.node();
        let node_ids = self.check_grow_pools(topology, extra, node)?;
        // Bytes of the file beyond our region that someone (a VMM) already
        // added: they may hold data, so they are cleared, not populated.
        let file_len = sys::file_size(self.fd.as_fd()).map_err(|source| RegionError::Size {
            name: self.name.clone(),
            source,
        })?;
        let addr = self.map_grown(new_len, new_len_usize, node, file_len, &node_ids)?;
        self.switch_to_grown(addr, (new_len, new_len_usize), unit, file_len, node);
        Ok(())
    }

    /// Checks `new_len` against the region: larger, whole pages, a whole
    /// last granule, within the address space. Returns the state unit and
    /// `new_len` as a `usize`.
    fn check_grow(&self, new_len: u64) -> Result<(u64, usize), RegionError> {
        let bad = |why| RegionError::BadGrow {
            name: self.name.clone(),
            len: self.len,
            new_len,
            why,
        };
        if new_len <= self.len {
            return Err(bad("a region only grows"));
        }
        if !new_len.is_multiple_of(self.page_size.bytes()) {
            return Err(bad("the new length is not a multiple of the page size"));
        }
        let unit = state_unit(self.page_size);
        if !self.len.is_multiple_of(unit) {
            return Err(bad("the region's last state granule is partial"));
        }
        let Ok(new_len_usize) = usize::try_from(new_len) else {
            return Err(bad("the new length does not fit the address space"));
        };
        Ok((unit, new_len_usize))
    }

    /// Checks that the pools have `extra` bytes of the region's pages (on
    /// its node, if bound), as [`Region::create`] does. Returns the host's
    /// nodes.
    fn check_grow_pools(
        &self,
        topology: &Topology,
        extra: u64,
        node: Option<NodeId>,
    ) -> Result<Vec<NodeId>, RegionError> {
        let node_ids: Vec<NodeId> = topology.nodes().iter().map(|n| n.id).collect();
        let snapshot = PoolSnapshot::read(&node_ids).map_err(RegionError::Pools)?;
        let availability =
            snapshot.availability(self.page_size, extra / self.page_size.bytes(), node);
        if availability != pools::Availability::Yes {
            return Err(RegionError::GrowUnavailable {
                name: self.name.clone(),
                extra,
                page_size: self.page_size,
                node,
                reason: pools::Skipped::Unavailable(availability).to_string(),
                snapshot: Box::new(snapshot),
            });
        }
        Ok(node_ids)
    }

    /// Maps the file again at `new_len`, binds the new mapping to `node`
    /// and makes the file `new_len` long; on error the new mapping is gone
    /// again and the region untouched. Returns the new mapping's address.
    fn map_grown(
        &self,
        new_len: u64,
        new_len_usize: usize,
        node: Option<NodeId>,
        file_len: u64,
        node_ids: &[NodeId],
    ) -> Result<*mut u8, RegionError> {
        // Never MAP_NORESERVE (see `create`). The old mapping stays until the
        // new one is complete, so any error below leaves the region as it was.
        let addr = sys::mmap(
            new_len_usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            self.fd.as_raw_fd(),
            0,
        )
        .map_err(|source| RegionError::Map {
            size: new_len,
            page_size: self.page_size,
            snapshot: PoolSnapshot::read(node_ids)
                .map_or_else(|e| e.to_string(), |s| s.to_string()),
            source,
        })?;
        let unmap_new = |addr: *mut u8| {
            // SAFETY: `addr..addr+new_len` is the mapping made just above,
            // which nothing but this function knows about or uses.
            if let Err(e) = unsafe { sys::munmap(addr, new_len_usize) } {
                tracing::error!(error = %e, region = %self.name, "munmap of a failed grow's mapping failed");
            }
        };
        if let Some(node) = node {
            // The whole new VMA: its policy is its own (hugetlb has no shared
            // policy), and new pages must be allocated under it. Existing
            // pages are not moved (no MPOL_MF_MOVE).
            if let Err(source) = numa::mbind(
                addr as usize,
                new_len_usize,
                MemPolicyMode::Bind,
                &NodeMask::single(node),
                MbindFlags::default(),
            ) {
                unmap_new(addr);
                return Err(RegionError::Bind {
                    name: self.name.clone(),
                    node,
                    source,
                });
            }
        }
        // Hugetlbfs already extended the file when mapping it; shmem needs
        // this before a page beyond the old end may be touched.
        if file_len < new_len {
            if let Err(source) = sys::ftruncate(self.fd.as_fd(), new_len) {
                unmap_new(addr);
                return Err(RegionError::Size {
                    name: self.name.clone(),
                    source,
                });
            }
        }
        Ok(addr)
    }

    /// Replaces the old mapping by the grown one at `addr` and adds the new
    /// pages' states: `Dirty` below the file's old end (`file_len`),
    /// `Unpopulated` beyond it.
    fn switch_to_grown(
        &mut self,
        addr: *mut u8,
        (new_len, new_len_usize): (u64, usize),
        unit: u64,
        file_len: u64,
        node: Option<NodeId>,
    ) {
        // The old length was checked to fit usize at creation.
        // SAFETY: the old mapping is owned by self, and `&mut self` means no
        // borrow of it (slices borrow self) and no other user exists.
        if let Err(e) = unsafe { sys::munmap(self.addr, self.len as usize) } {
            tracing::error!(error = %e, region = %self.name, "munmap of a region's old mapping failed");
        }
        // As at creation: no forked child inherits the new mapping.
        // SAFETY: `addr..addr+new_len` is the mapping made above.
        if let Err(e) = unsafe { sys::dont_fork(addr, new_len_usize) } {
            tracing::warn!(error = %e, region = %self.name, "MADV_DONTFORK failed; a forked child would inherit the mapping");
        }
        let old_len = self.len;
        let old_pages = self.states.len();
        let new_pages = usize::try_from(new_len.div_ceil(unit)).unwrap_or(usize::MAX);
        // Pages of the new range that lie below the file's old end.
        let dirty = usize::try_from(file_len.min(new_len).saturating_sub(old_len).div_ceil(unit))
            .unwrap_or(usize::MAX)
            .min(new_pages - old_pages);
        self.addr = addr;
        self.len = new_len;
        self.states.grow(dirty, PageState::Dirty);
        self.states
            .grow(new_pages - old_pages - dirty, PageState::Unpopulated);
        if dirty > 0 {
            warn!(region = %self.name, pages = dirty, "the file had grown beyond the region; those pages will be cleared");
        }
        info!(
            region = %self.name,
            from = old_len,
            to = new_len,
            page_size = %self.page_size,
            node = ?node,
            "region grown"
        );
    }
}
