//! Client side of the `vm-memory` adapter: an allocation's fds as a rust-vmm
//! [`GuestMemoryMmap`], for VMMs that got their memory from the daemon.
//!
//! ```no_run
//! use hugemem_client::client::Client;
//! use hugemem_client::proto::{AllocRequest, ClearMode, PagePolicy};
//! use guest_mem::vm_memory::{Bytes, GuestAddress};
//!
//! let mut client = Client::connect("/run/hugemem/hugemem.sock".as_ref())?;
//! // Let the daemon wait up to 2 s for pages still quarantined after the
//! // previous VM (default: its `pool.alloc_wait_ms`).
//! client.set_alloc_wait(Some(std::time::Duration::from_secs(2)));
//! let alloc = client.alloc(AllocRequest {
//!     total_size: 2 << 30,
//!     page_policy: PagePolicy::Best,
//!     clear_mode: ClearMode::Eager,
//!     lock: false,
//!     parts: vec![],
//!     want_paths: false,
//! })?;
//! if !alloc.note.is_empty() {
//!     // e.g. "2G on 2M pages: 2 x 1G pages missing on node 0 (0 free, 0 in the pool)"
//!     eprintln!("{}", alloc.note);
//! }
//! let mem = alloc.guest_memory()?;
//! mem.write_obj(0xdead_beef_u64, GuestAddress(0x1000))?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Relation to `guest_mem::vmm`
//!
//! `guest_mem::vmm::guest_region` maps a daemon-side [`guest_mem::Region`]
//! and checks its page states; a VMM has only an fd and the region table.
//! [`region_from_fd`] maps an fd through the same
//! [`guest_mem::shared_file_mapping`] (`PROT_READ|PROT_WRITE`, `MAP_SHARED`,
//! no `MAP_NORESERVE`, `hugetlbfs` set from the page size), and adds the
//! checks a VMM needs on a region table it received and the MMIO-hole layout.
//!
//! # Guest-physical layout
//!
//! The daemon suggests addresses back to back from 0 (`RegionInfo::guest_phys`).
//! x86 guests need `[3 GiB, 4 GiB)` free for MMIO (the local APIC at
//! `0xfee00000`, the IOAPIC, PCI holes): KVM does not send accesses there to
//! memory, so a guest whose RAM covers it stops there. [`guest_layout`] moves
//! everything at or above 3 GiB up by 1 GiB and splits a region that crosses
//! 3 GiB into two vm-memory regions over the same fd at two file offsets, as
//! cloud-hypervisor and QEMU lay out RAM around the hole.
//!
//! Checks before mapping: the page size is one hugemem uses, the guest address
//! is aligned to it (so KVM can use huge stage-2 mappings), the length fits
//! this process, and the file is at least as long as the region: mapping past
//! EOF would turn the first guest access there into SIGBUS (Firecracker's
//! `snapshot_file` check). Lazy regions are refused: they need a userfaultfd
//! the VMM creates, which this helper does not do.
//!
//! [`GuestMemoryMmap`]: guest_mem::vm_memory::GuestMemoryMmap
//! [`region_from_fd`]: crate::guest_memory::region_from_fd
//! [`guest_layout`]: crate::guest_memory::guest_layout

use std::fs::File;
use std::io;
use std::os::fd::BorrowedFd;

use guest_mem::vm_memory::mmap::MmapRegionError;
use guest_mem::vm_memory::{
    GuestAddress, GuestMemoryMmap, GuestMemoryRegion, GuestRegionCollectionError, GuestRegionMmap,
};
use guest_mem::PageSize;

use crate::proto::RegionInfo;

/// Errors mapping an allocation.
#[derive(Debug, thiserror::Error)]
pub enum GuestMemoryError {
    /// The region table and the fds disagree.
    #[error("{regions} regions but {fds} fds")]
    Count {
        /// Regions in the table.
        regions: usize,
        /// Fds received.
        fds: usize,
    },
    /// A page size hugemem does not use.
    #[error("region {region_id} has page size {page_size}, not 4K, 2M or 1G")]
    PageSize {
        /// Region id.
        region_id: u64,
        /// Page size in bytes.
        page_size: u64,
    },
    /// The guest address is not aligned to the page size.
    #[error("region {region_id} at guest address {guest_phys:#x} is not aligned to its {page_size}-byte pages")]
    Misaligned {
        /// Region id.
        region_id: u64,
        /// Guest physical address.
        guest_phys: u64,
        /// Page size in bytes.
        page_size: u64,
    },
    /// Zero, or more than this process can map.
    #[error("region {region_id} has size {size}, which cannot be mapped here")]
    Size {
        /// Region id.
        region_id: u64,
        /// Bytes.
        size: u64,
    },
    /// The file is shorter than the region.
    #[error("region {region_id} is {size} bytes but its file only {file_len}")]
    ShortFile {
        /// Region id.
        region_id: u64,
        /// Bytes in the table.
        size: u64,
        /// Bytes in the file.
        file_len: u64,
    },
    /// The region is cleared on demand and needs a userfaultfd.
    #[error("region {0} is lazy (cleared on demand through a userfaultfd), which this helper does not set up")]
    Lazy(u64),
    /// Duplicating or inspecting the fd failed.
    #[error("cannot use the fd of region {region_id}")]
    Fd {
        /// Region id.
        region_id: u64,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// `mmap` failed.
    #[error("cannot map region {region_id}")]
    Map {
        /// Region id.
        region_id: u64,
        /// The cause.
        #[source]
        source: MmapRegionError,
    },
    /// vm-memory refused the set (empty, overlapping, or past the end of the
    /// guest address space).
    #[error("the regions do not form a valid guest memory")]
    Collection(#[source] GuestRegionCollectionError),
}

/// Start of the 32-bit MMIO hole left free in guest-physical space.
pub const MMIO_HOLE_START: u64 = 3 << 30;
/// End of the 32-bit MMIO hole.
pub const MMIO_HOLE_END: u64 = 4 << 30;

/// Where a region of `len` bytes that the daemon suggested at `gpa` goes, as
/// `(offset in the region, length, guest-physical address)` parts, leaving
/// `[MMIO_HOLE_START, MMIO_HOLE_END)` free (see the module docs).
pub fn guest_layout(gpa: u64, len: u64) -> Vec<(u64, u64, u64)> {
    let shift = MMIO_HOLE_END - MMIO_HOLE_START;
    let end = gpa.saturating_add(len);
    if end <= MMIO_HOLE_START {
        vec![(0, len, gpa)]
    } else if gpa >= MMIO_HOLE_START {
        vec![(0, len, gpa.saturating_add(shift))]
    } else {
        let below = MMIO_HOLE_START - gpa;
        vec![(0, below, gpa), (below, len - below, MMIO_HOLE_END)]
    }
}

/// Maps one region's fd at its guest address, split around the MMIO hole
/// (see the module docs): one vm-memory region, or two over the same fd.
///
/// # Errors
///
/// Every [`GuestMemoryError`] variant but `Count` and `Collection`.
pub fn region_from_fd(
    info: &RegionInfo,
    fd: BorrowedFd<'_>,
) -> Result<Vec<GuestRegionMmap>, GuestMemoryError> {
    let region_id = info.region_id;
    let page = PageSize::from_bytes(info.page_size).ok_or(GuestMemoryError::PageSize {
        region_id,
        page_size: info.page_size,
    })?;
    if info.flags & RegionInfo::FLAG_LAZY != 0 {
        return Err(GuestMemoryError::Lazy(region_id));
    }
    if !info.guest_phys.is_multiple_of(page.bytes()) {
        return Err(GuestMemoryError::Misaligned {
            region_id,
            guest_phys: info.guest_phys,
            page_size: page.bytes(),
        });
    }
    if info.size == 0
        || !info.size.is_multiple_of(page.bytes())
        || usize::try_from(info.size).is_err()
    {
        return Err(GuestMemoryError::Size {
            region_id,
            size: info.size,
        });
    }
    let file = File::from(
        fd.try_clone_to_owned()
            .map_err(|source| GuestMemoryError::Fd { region_id, source })?,
    );
    let file_len = file
        .metadata()
        .map_err(|source| GuestMemoryError::Fd { region_id, source })?
        .len();
    if file_len < info.size {
        return Err(GuestMemoryError::ShortFile {
            region_id,
            size: info.size,
            file_len,
        });
    }
    let mut parts = Vec::new();
    for (offset, part_len, gpa) in guest_layout(info.guest_phys, info.size) {
        let size_err = || GuestMemoryError::Size {
            region_id,
            size: info.size,
        };
        let part_len = usize::try_from(part_len).map_err(|_| size_err())?;
        let file = file
            .try_clone()
            .map_err(|source| GuestMemoryError::Fd { region_id, source })?;
        let mapping = guest_mem::shared_file_mapping(file, offset, part_len, page)
            .map_err(|source| GuestMemoryError::Map { region_id, source })?;
        parts.push(GuestRegionMmap::new(mapping, GuestAddress(gpa)).ok_or_else(size_err)?);
    }
    Ok(parts)
}

/// Maps every region of an allocation (fds in table order).
///
/// # Errors
///
/// As [`region_from_fd`], [`GuestMemoryError::Count`], and
/// [`GuestMemoryError::Collection`].
pub fn guest_memory_from_fds(
    regions: &[RegionInfo],
    fds: &[BorrowedFd<'_>],
) -> Result<GuestMemoryMmap, GuestMemoryError> {
    if regions.len() != fds.len() {
        return Err(GuestMemoryError::Count {
            regions: regions.len(),
            fds: fds.len(),
        });
    }
    let mut mapped = Vec::with_capacity(regions.len() + 1);
    for (r, fd) in regions.iter().zip(fds) {
        mapped.extend(region_from_fd(r, *fd)?);
    }
    mapped.sort_by_key(GuestMemoryRegion::start_addr);
    GuestMemoryMmap::from_regions(mapped).map_err(GuestMemoryError::Collection)
}

#[cfg(test)]
mod tests {
    use super::*;
    use guest_mem::vm_memory::{Bytes, GuestMemoryBackend};
    use guest_mem::SharedMapping;

    #[test]
    fn layout_leaves_the_mmio_hole_free() {
        const G: u64 = 1 << 30;
        assert_eq!(guest_layout(0, 2 * G), [(0, 2 * G, 0)]);
        assert_eq!(guest_layout(0, 3 * G), [(0, 3 * G, 0)]);
        assert_eq!(guest_layout(0, 4 * G), [(0, 3 * G, 0), (3 * G, G, 4 * G)]);
        assert_eq!(guest_layout(4 * G, G), [(0, G, 5 * G)]);
        assert_eq!(guest_layout(3 * G, G), [(0, G, 4 * G)]);
        assert_eq!(guest_layout(2 * G, 2 * G), [(0, G, 2 * G), (G, G, 4 * G)]);
    }

    #[test]
    fn a_region_across_3g_is_mapped_at_two_offsets() {
        // 8 MiB of 4 KiB shmem suggested at 3 GiB - 4 MiB: the first 4 MiB stay
        // below the hole, the rest lands at 4 GiB over file offset 4 MiB.
        let map = SharedMapping::memfd(8 << 20, PageSize::Base4K).expect("memfd");
        let info = info((3 << 30) - (4 << 20), 8 << 20, 4096);
        let mem = guest_memory_from_fds(&[info], &[map.fd()]).expect("map");
        assert_eq!(mem.num_regions(), 2);
        mem.write_obj(0x5a5a_u16, GuestAddress(4 << 30))
            .expect("write above the hole");
        assert!(
            mem.write_obj(1u8, GuestAddress(3 << 30)).is_err(),
            "the hole must stay unmapped"
        );
        let above = map.addr().wrapping_add(4 << 20).cast::<u16>();
        // SAFETY: `above` is 4 MiB into the live 8 MiB mapping, 2-byte
        // aligned; the write above went to the same file through vm-memory's
        // MAP_SHARED mapping, and nothing else writes it.
        let seen = unsafe { std::ptr::read_volatile(above) };
        assert_eq!(seen, 0x5a5a);
    }

    fn info(guest_phys: u64, size: u64, page_size: u64) -> RegionInfo {
        RegionInfo {
            region_id: 1,
            guest_phys,
            size,
            page_size,
            node: 0,
            flags: RegionInfo::FLAG_CLEAN,
        }
    }

    #[test]
    fn maps_shared_memory_that_both_sides_see() {
        let a = SharedMapping::memfd(4 << 20, PageSize::Base4K).expect("memfd");
        let b = SharedMapping::memfd(2 << 20, PageSize::Base4K).expect("memfd");
        let table = [info(0, 4 << 20, 4096), info(4 << 20, 2 << 20, 4096)];
        let mem = guest_memory_from_fds(&table, &[a.fd(), b.fd()]).expect("map");
        assert_eq!(mem.num_regions(), 2);
        mem.write_obj(0x1122_3344_u32, GuestAddress((4 << 20) + 8))
            .expect("write");
        assert_eq!(&b.as_slice()[8..12], &0x1122_3344_u32.to_le_bytes());
        let r = mem.find_region(GuestAddress(0)).expect("region 0");
        assert_eq!(r.len(), 4 << 20);
    }

    #[test]
    fn refuses_what_would_fault_later() {
        let a = SharedMapping::memfd(2 << 20, PageSize::Base4K).expect("memfd");
        let fd = a.fd();
        // Longer than the file: SIGBUS on access, refused.
        assert!(matches!(
            region_from_fd(&info(0, 4 << 20, 4096), fd),
            Err(GuestMemoryError::ShortFile { .. })
        ));
        // Misaligned for its page size.
        assert!(matches!(
            region_from_fd(&info(4096, 2 << 20, 2 << 20), fd),
            Err(GuestMemoryError::Misaligned { .. })
        ));
        // Unknown page size, zero size, lazy.
        assert!(matches!(
            region_from_fd(&info(0, 2 << 20, 8192), fd),
            Err(GuestMemoryError::PageSize { .. })
        ));
        assert!(matches!(
            region_from_fd(&info(0, 0, 4096), fd),
            Err(GuestMemoryError::Size { .. })
        ));
        let lazy = RegionInfo {
            flags: RegionInfo::FLAG_LAZY,
            ..info(0, 2 << 20, 4096)
        };
        assert!(matches!(
            region_from_fd(&lazy, fd),
            Err(GuestMemoryError::Lazy(1))
        ));
        // Overlapping regions, and a count mismatch.
        let table = [info(0, 2 << 20, 4096), info(1 << 20, 2 << 20, 4096)];
        assert!(matches!(
            guest_memory_from_fds(&table, &[fd, fd]),
            Err(GuestMemoryError::Collection(_))
        ));
        assert!(matches!(
            guest_memory_from_fds(&table, &[fd]),
            Err(GuestMemoryError::Count { .. })
        ));
    }
}
