//! Why a fault service could not start.

use hugemem_client::table;

/// Errors starting a fault service.
#[derive(Debug, thiserror::Error)]
pub enum FaultError {
    /// No mapping was given.
    #[error("a fault service needs at least one mapping")]
    NoMappings,
    /// Lazy mode serves huge pages only (hugetlbfs MINOR faults).
    #[error("mapping {mapping} is backed by 4 KiB pages; lazy mode needs huge pages")]
    NotHuge {
        /// Index in the mapping list.
        mapping: usize,
    },
    /// A mapping is empty, misaligned, or runs past its region.
    #[error("mapping {mapping} ({len:#x} bytes at {vmm_start:#x}, region offset {region_offset:#x}) does not fit a region of {region_len:#x} bytes in {page_size:#x}-byte pages")]
    BadMapping {
        /// Index in the mapping list.
        mapping: usize,
        /// VMM start.
        vmm_start: u64,
        /// Bytes.
        len: u64,
        /// Offset in the region.
        region_offset: u64,
        /// Region length.
        region_len: u64,
        /// Page size.
        page_size: u64,
    },
    /// Mappings overlap in the VMM's address space.
    #[error("the VMM mappings overlap")]
    Table(#[source] table::TableError),
    /// A dirty page is not resident, so it would not raise a MINOR fault.
    #[error(
        "page {page} of region {region} is dirty but not resident; hand the region out eagerly"
    )]
    NotResident {
        /// Region name.
        region: String,
        /// Page index.
        page: usize,
    },
    /// epoll, eventfd, fcntl or pagemap setup failed.
    #[error("cannot set up the fault service")]
    Setup(#[source] std::io::Error),
    /// A service thread could not be started.
    #[error("cannot start a fault service thread")]
    Threads(#[source] std::io::Error),
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, FaultError>;
