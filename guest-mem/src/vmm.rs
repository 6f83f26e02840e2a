//! `vm-memory` adapter: hugemem regions as a rust-vmm `GuestMemoryMmap`.
//!
//! A rust-vmm VMM (Firecracker, a custom VMM, the tests' micro-guest) describes
//! guest RAM as a [`GuestMemoryMmap`]: regions at guest physical addresses,
//! each a mapping in the VMM process. [`guest_memory`] builds one from
//! prepared hugemem [`Region`]s, mapping each region's fd again (a `dup` of
//! it, owned by the vm-memory `FileOffset`), so the VMM's mapping and
//! hugemem's own mapping share the same pages.
//!
//! # Why the builder, and which flags
//!
//! vm-memory's convenience constructors are wrong for this memory
//! (docs/platform.md#vm-memory): `GuestRegionMmap::from_range`/`from_ranges_with_files` map
//! with `MAP_NORESERVE`, which turns an exhausted pool into SIGBUS in the
//! guest, and `MmapRegionBuilder` defaults to `prot = 0` and
//! `MAP_ANONYMOUS | MAP_PRIVATE` (a private mapping would give the guest a
//! copy-on-write view that hugemem's scrubber cannot see). So each region is
//! built with `MmapRegionBuilder` and exactly `PROT_READ | PROT_WRITE`,
//! `MAP_SHARED`, the fd at offset 0, and `hugetlbfs` set from the page size.
//!
//! # Preconditions checked
//!
//! * Every page is `Clean` or `Mapped`. An `Unpopulated` page would be
//!   allocated by the VMM's first touch under the VMM mapping's (default)
//!   policy, not the region's node; a `Dirty` page holds an earlier guest's
//!   data. Both are refused; call [`Region::prepare_eager`] first.
//! * Each region's guest address is aligned to its page size, so KVM can map
//!   1 GiB pages with 1 GiB stage-2 entries.
//! * Regions do not overlap (sorted here; vm-memory then checks).
//!
//! The adapter does not change page states: the daemon decides when a region
//! is handed out ([`Region::mark_mapped`]) and taken back.
//!
//! The alternative, `MmapRegionBuilder::with_raw_mmap_pointer` over hugemem's
//! own mapping, would avoid a second mapping but tie the vm-memory object's
//! life to the `Region` through a raw pointer the type system cannot follow.
//!
//! [`GuestMemoryMmap`]: vm_memory::GuestMemoryMmap

use std::fs::File;
use std::io;

use vm_memory::mmap::{MmapRegion, MmapRegionBuilder, MmapRegionError};
use vm_memory::{
    FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionCollectionError, GuestRegionMmap,
};

use crate::mapping::PageSize;
use crate::region::Region;
use crate::state::PageState;

/// Errors building guest memory from regions.
#[derive(Debug, thiserror::Error)]
pub enum AdapterError {
    /// A region has pages that are not ready for a guest.
    #[error("region {name} is not prepared: {unpopulated} unpopulated, {dirty} dirty, {clearing} clearing pages")]
    NotPrepared {
        /// Region name.
        name: String,
        /// Pages never populated.
        unpopulated: usize,
        /// Pages waiting to be cleared.
        dirty: usize,
        /// Pages being cleared.
        clearing: usize,
    },
    /// A guest address is not aligned to the region's page size.
    #[error("region {name} at guest address {guest_addr:#x} is not aligned to its {page_size}-byte pages")]
    Misaligned {
        /// Region name.
        name: String,
        /// Guest physical address.
        guest_addr: u64,
        /// Page size in bytes.
        page_size: u64,
    },
    /// The region does not fit above its guest address.
    #[error("region {name} at guest address {guest_addr:#x} overflows the guest address space")]
    Overflow {
        /// Region name.
        name: String,
        /// Guest physical address.
        guest_addr: u64,
    },
    /// Duplicating the region's fd failed.
    #[error("cannot duplicate the fd of region {name}")]
    Dup {
        /// Region name.
        name: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Mapping the region into the VMM's address space failed.
    #[error("cannot map region {name}")]
    Map {
        /// Region name.
        name: String,
        /// The cause.
        #[source]
        source: MmapRegionError,
    },
    /// vm-memory refused the set of regions (none, or overlapping).
    #[error("the regions do not form a valid guest memory")]
    Collection(#[source] GuestRegionCollectionError),
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, AdapterError>;

/// Maps `len` bytes of `file` from `offset` the way guest RAM must be mapped:
/// `PROT_READ|PROT_WRITE`, `MAP_SHARED` (the daemon and the VMM see the same
/// pages), no `MAP_NORESERVE` (a short pool fails here, not as a SIGBUS in
/// the guest), and vm-memory told whether it is hugetlbfs. vm-memory's builder
/// defaults (prot 0, `MAP_PRIVATE|MAP_ANONYMOUS`) are wrong for all of these.
/// The daemon side ([`guest_region`]) and the VMM side (`backend::guest_memory`)
/// both map through here.
///
/// # Errors
///
/// `mmap` failed.
pub fn shared_file_mapping(
    file: File,
    offset: u64,
    len: usize,
    page_size: PageSize,
) -> std::result::Result<MmapRegion, MmapRegionError> {
    MmapRegionBuilder::new(len)
        .with_file_offset(FileOffset::new(file, offset))
        .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
        .with_mmap_flags(libc::MAP_SHARED)
        .with_hugetlbfs(page_size.is_huge())
        .build()
}

/// Maps one prepared region at `guest_addr` as a vm-memory region
/// (`MAP_SHARED`, read-write, no `MAP_NORESERVE`).
///
/// # Errors
///
/// [`AdapterError::NotPrepared`], [`AdapterError::Misaligned`],
/// [`AdapterError::Overflow`], [`AdapterError::Dup`], [`AdapterError::Map`].
pub fn guest_region(region: &Region, guest_addr: GuestAddress) -> Result<GuestRegionMmap> {
    let name = region.name().to_string();
    let counts = region.states().counts();
    if counts.get(PageState::Clean) + counts.get(PageState::Mapped) != counts.total() {
        return Err(AdapterError::NotPrepared {
            name,
            unpopulated: counts.unpopulated,
            dirty: counts.dirty,
            clearing: counts.clearing,
        });
    }
    let page_size = region.page_size().bytes();
    if !guest_addr.0.is_multiple_of(page_size) {
        return Err(AdapterError::Misaligned {
            name,
            guest_addr: guest_addr.0,
            page_size,
        });
    }
    if guest_addr.0.checked_add(region.len()).is_none() {
        return Err(AdapterError::Overflow {
            name,
            guest_addr: guest_addr.0,
        });
    }
    let fd = region.try_clone_fd().map_err(|source| AdapterError::Dup {
        name: name.clone(),
        source,
    })?;
    // A region's length fits usize: it was checked when the region was created.
    let len = region.len() as usize;
    let mapping =
        shared_file_mapping(File::from(fd), 0, len, region.page_size()).map_err(|source| {
            AdapterError::Map {
                name: name.clone(),
                source,
            }
        })?;
    GuestRegionMmap::new(mapping, guest_addr).ok_or(AdapterError::Overflow {
        name,
        guest_addr: guest_addr.0,
    })
}

/// Builds a [`GuestMemoryMmap`] from prepared regions at guest physical
/// addresses (any order; they are sorted here).
///
/// # Errors
///
/// As [`guest_region`] for each region, and [`AdapterError::Collection`] for
/// an empty list or overlapping regions.
pub fn guest_memory(regions: &[(GuestAddress, &Region)]) -> Result<GuestMemoryMmap> {
    let mut sorted: Vec<&(GuestAddress, &Region)> = regions.iter().collect();
    sorted.sort_by_key(|(addr, _)| *addr);
    let mapped = sorted
        .into_iter()
        .map(|(addr, r)| guest_region(r, *addr))
        .collect::<Result<Vec<_>>>()?;
    GuestMemoryMmap::from_regions(mapped).map_err(AdapterError::Collection)
}

/// `GuestMemoryMmap::from_hugemem(...)`: the adapter as an extension trait on
/// the vm-memory type, for VMM code that builds its guest memory in one place.
pub trait GuestMemoryHugememExt: Sized {
    /// See [`guest_memory`].
    ///
    /// # Errors
    ///
    /// As [`guest_memory`].
    fn from_hugemem(regions: &[(GuestAddress, &Region)]) -> Result<Self>;
}

impl GuestMemoryHugememExt for GuestMemoryMmap {
    fn from_hugemem(regions: &[(GuestAddress, &Region)]) -> Result<Self> {
        guest_memory(regions)
    }
}
