//! Huge-page mappings: page sizes, an owned anonymous (private) mapping and an
//! owned memfd-backed shared mapping ([`SharedMapping`]).
//!
//! The mapping never uses `MAP_NORESERVE`: the kernel reserves every huge page
//! at `mmap` time, so a pool that is too small fails here with `ENOMEM` rather
//! than as a SIGBUS when the memory is first touched.

use std::fmt;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use crate::sys;

/// Page sizes that guest RAM can be backed by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PageSize {
    /// 4 KiB base pages (shmem / anonymous).
    Base4K,
    /// 2 MiB hugetlb pages.
    Huge2M,
    /// 1 GiB hugetlb pages.
    Huge1G,
}

impl PageSize {
    /// Largest first: the `best` fallback order.
    pub const FALLBACK_ORDER: [PageSize; 3] =
        [PageSize::Huge1G, PageSize::Huge2M, PageSize::Base4K];

    /// Size in bytes.
    pub const fn bytes(self) -> u64 {
        match self {
            PageSize::Base4K => 4 << 10,
            PageSize::Huge2M => 2 << 20,
            PageSize::Huge1G => 1 << 30,
        }
    }

    /// The page size of `bytes`, if it is one of ours.
    pub fn from_bytes(bytes: u64) -> Option<Self> {
        Self::FALLBACK_ORDER
            .into_iter()
            .find(|p| p.bytes() == bytes)
    }

    /// Parses `1G`, `2M`, `4K` (case-insensitive).
    pub fn parse(text: &str) -> Option<Self> {
        match text.to_ascii_uppercase().as_str() {
            "1G" | "1GIB" => Some(PageSize::Huge1G),
            "2M" | "2MIB" => Some(PageSize::Huge2M),
            "4K" | "4KIB" => Some(PageSize::Base4K),
            _ => None,
        }
    }

    /// True for the hugetlb sizes.
    pub const fn is_huge(self) -> bool {
        !matches!(self, PageSize::Base4K)
    }

    /// `MAP_HUGETLB | MAP_HUGE_<size>` for hugetlb sizes, 0 for base pages.
    pub(crate) const fn mmap_flags(self) -> libc::c_int {
        match self {
            PageSize::Base4K => 0,
            PageSize::Huge2M => libc::MAP_HUGETLB | libc::MAP_HUGE_2MB,
            PageSize::Huge1G => libc::MAP_HUGETLB | libc::MAP_HUGE_1GB,
        }
    }

    /// `MFD_HUGETLB | MFD_HUGE_<size>` for hugetlb sizes, 0 (shmem) for
    /// base pages.
    pub(crate) const fn memfd_flags(self) -> libc::c_uint {
        match self {
            PageSize::Base4K => 0,
            PageSize::Huge2M => libc::MFD_HUGETLB | libc::MFD_HUGE_2MB,
            PageSize::Huge1G => libc::MFD_HUGETLB | libc::MFD_HUGE_1GB,
        }
    }
}

impl fmt::Display for PageSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PageSize::Base4K => "4K",
            PageSize::Huge2M => "2M",
            PageSize::Huge1G => "1G",
        })
    }
}

/// Errors creating or populating a mapping.
#[derive(Debug, thiserror::Error)]
pub enum MappingError {
    /// The length is zero or not a multiple of the page size.
    #[error("length {len} is not a non-zero multiple of the {page_size} page size")]
    BadLength {
        /// Requested length.
        len: usize,
        /// Page size.
        page_size: PageSize,
    },
    /// `mmap` failed; for hugetlb, `ENOMEM` means the pool has too few free pages.
    #[error("cannot map {len} bytes of {page_size} pages")]
    Map {
        /// Requested length.
        len: usize,
        /// Page size.
        page_size: PageSize,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// `memfd_create` or `ftruncate` of the backing memfd failed.
    #[error("cannot create a {len}-byte memfd of {page_size} pages")]
    Memfd {
        /// Requested length.
        len: usize,
        /// Page size.
        page_size: PageSize,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// `madvise(MADV_POPULATE_WRITE)` failed.
    #[error("cannot populate {len} bytes at offset {offset}")]
    Populate {
        /// Offset into the mapping.
        offset: usize,
        /// Length of the range.
        len: usize,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// `madvise(MADV_DONTNEED)` failed.
    #[error("cannot discard {len} bytes at offset {offset}")]
    Discard {
        /// Offset into the mapping.
        offset: usize,
        /// Length of the range.
        len: usize,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A range outside the mapping.
    #[error("range {offset}+{len} is outside the {mapping_len}-byte mapping")]
    OutOfRange {
        /// Offset asked for.
        offset: usize,
        /// Length asked for.
        len: usize,
        /// Length of the mapping.
        mapping_len: usize,
    },
}

/// An owned, private, anonymous mapping of one page size, unmapped on drop.
#[derive(Debug)]
pub struct AnonMapping {
    addr: *mut u8,
    len: usize,
    page_size: PageSize,
}

// SAFETY: the mapping is plain memory owned by this value; the raw pointer is
// only an address, and access goes through `&self`/`&mut self` borrows.
unsafe impl Send for AnonMapping {}
// SAFETY: shared references only hand out the address and read-only views.
unsafe impl Sync for AnonMapping {}

impl AnonMapping {
    /// Maps `len` bytes of `page_size` pages, read-write, reserving huge pages
    /// now (no `MAP_NORESERVE`). Nothing is populated yet.
    pub fn new(len: usize, page_size: PageSize) -> Result<Self, MappingError> {
        let page = usize::try_from(page_size.bytes()).unwrap_or(usize::MAX);
        if len == 0 || !len.is_multiple_of(page) {
            return Err(MappingError::BadLength { len, page_size });
        }
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | page_size.mmap_flags();
        let addr =
            sys::mmap(len, libc::PROT_READ | libc::PROT_WRITE, flags, -1, 0).map_err(|source| {
                MappingError::Map {
                    len,
                    page_size,
                    source,
                }
            })?;
        Ok(Self {
            addr,
            len,
            page_size,
        })
    }

    /// Faults in `offset..offset+len` for writing (`MADV_POPULATE_WRITE`): the
    /// kernel allocates and zeroes every page, as VMMs pre-fault guest RAM today.
    pub fn populate_write(&self, offset: usize, len: usize) -> Result<(), MappingError> {
        self.check_range(offset, len)?;
        let start = self.addr.wrapping_add(offset);
        // SAFETY: the range was checked to lie inside this live mapping, which
        // this value owns; populating only faults pages in.
        unsafe { sys::madvise(start, len, sys::MADV_POPULATE_WRITE) }.map_err(|source| {
            MappingError::Populate {
                offset,
                len,
                source,
            }
        })
    }

    /// Gives the pages of `offset..offset+len` back (`MADV_DONTNEED`; hugetlb
    /// since Linux 5.18): the mapping stays, and the next touch or
    /// [`populate_write`](Self::populate_write) faults in fresh pages the
    /// kernel zeroes. `offset` and `len` must be page aligned.
    pub fn discard(&mut self, offset: usize, len: usize) -> Result<(), MappingError> {
        self.check_range(offset, len)?;
        let start = self.addr.wrapping_add(offset);
        // SAFETY: the range was checked to lie inside this live mapping, which
        // this value owns, and the unique borrow means no reference into its
        // bytes is live; dropping the pages only makes them read as zero.
        unsafe { sys::madvise(start, len, libc::MADV_DONTNEED) }.map_err(|source| {
            MappingError::Discard {
                offset,
                len,
                source,
            }
        })
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<(), MappingError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(MappingError::OutOfRange {
                offset,
                len,
                mapping_len: self.len,
            }),
        }
    }

    /// Start address.
    pub fn addr(&self) -> *mut u8 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: empty mappings cannot be created.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Page size.
    pub fn page_size(&self) -> PageSize {
        self.page_size
    }

    /// The whole mapping as bytes (faults pages in on access).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: addr..addr+len is a live read-write mapping owned by self;
        // the shared borrow of self prevents mutation through this value.
        unsafe { std::slice::from_raw_parts(self.addr, self.len) }
    }

    /// The whole mapping as mutable bytes.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and the unique borrow of self makes this the
        // only reference to the memory.
        unsafe { std::slice::from_raw_parts_mut(self.addr, self.len) }
    }
}

impl Drop for AnonMapping {
    fn drop(&mut self) {
        // SAFETY: the mapping is owned by self and no borrow outlives self.
        if let Err(e) = unsafe { sys::munmap(self.addr, self.len) } {
            tracing::error!(error = %e, len = self.len, "munmap of a guest-mem mapping failed");
        }
    }
}

/// An owned memfd mapped `MAP_SHARED`, read-write: the shape a VMM maps guest
/// RAM in when another process (a vhost-user backend, hugemem) must see it.
/// With [`PageSize::Base4K`] it is plain shmem; with a huge size the memfd is
/// `MFD_HUGETLB` of that size. Unmapped, then the memfd closed, on drop.
///
/// As with [`AnonMapping`], no `MAP_NORESERVE`: hugetlb pages are reserved at
/// `mmap`, so a short pool fails here with `ENOMEM`, not later with SIGBUS.
#[derive(Debug)]
pub struct SharedMapping {
    addr: *mut u8,
    len: usize,
    page_size: PageSize,
    fd: OwnedFd,
}

// SAFETY: the mapping is plain shared memory owned by this value; the raw
// pointer is only an address, and access from Rust goes through borrows of self.
unsafe impl Send for SharedMapping {}
// SAFETY: shared references only hand out the address, the fd and read-only views.
unsafe impl Sync for SharedMapping {}

impl SharedMapping {
    /// Creates a memfd of `len` bytes of `page_size` pages and maps all of it
    /// `MAP_SHARED`, read-write. Nothing is populated yet.
    pub fn memfd(len: usize, page_size: PageSize) -> Result<Self, MappingError> {
        let page = usize::try_from(page_size.bytes()).unwrap_or(usize::MAX);
        if len == 0 || !len.is_multiple_of(page) {
            return Err(MappingError::BadLength { len, page_size });
        }
        let memfd_err = |source| MappingError::Memfd {
            len,
            page_size,
            source,
        };
        let fd =
            sys::memfd_create(c"hugemem-shared", page_size.memfd_flags()).map_err(memfd_err)?;
        sys::ftruncate(fd.as_fd(), len as u64).map_err(memfd_err)?;
        let addr = sys::mmap(
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
        .map_err(|source| MappingError::Map {
            len,
            page_size,
            source,
        })?;
        Ok(Self {
            addr,
            len,
            page_size,
            fd,
        })
    }

    /// Faults in `offset..offset+len` for writing (`MADV_POPULATE_WRITE`).
    pub fn populate_write(&self, offset: usize, len: usize) -> Result<(), MappingError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => {}
            _ => {
                return Err(MappingError::OutOfRange {
                    offset,
                    len,
                    mapping_len: self.len,
                })
            }
        }
        let start = self.addr.wrapping_add(offset);
        // SAFETY: the range was checked to lie inside this live mapping, which
        // this value owns; populating only faults pages in.
        unsafe { sys::madvise(start, len, sys::MADV_POPULATE_WRITE) }.map_err(|source| {
            MappingError::Populate {
                offset,
                len,
                source,
            }
        })
    }

    /// Start address.
    pub fn addr(&self) -> *mut u8 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: empty mappings cannot be created.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Page size.
    pub fn page_size(&self) -> PageSize {
        self.page_size
    }

    /// The backing memfd.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The whole mapping as bytes (faults pages in on access).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: addr..addr+len is a live read-write mapping owned by self;
        // the shared borrow of self prevents mutation through this value.
        unsafe { std::slice::from_raw_parts(self.addr, self.len) }
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        // SAFETY: the mapping is owned by self and no borrow outlives self.
        if let Err(e) = unsafe { sys::munmap(self.addr, self.len) } {
            tracing::error!(error = %e, len = self.len, "munmap of a guest-mem shared mapping failed");
        }
        // `fd` closes when the field drops, after the unmap.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_size_round_trips() {
        for p in PageSize::FALLBACK_ORDER {
            assert_eq!(PageSize::from_bytes(p.bytes()), Some(p));
            assert_eq!(PageSize::parse(&p.to_string()), Some(p));
        }
        assert_eq!(PageSize::parse("3M"), None);
        assert_eq!(PageSize::from_bytes(12345), None);
    }

    #[test]
    fn base_page_mapping_populates_zeroed_memory() {
        let mut m = AnonMapping::new(1 << 20, PageSize::Base4K).expect("map 1 MiB");
        m.populate_write(0, m.len()).expect("populate");
        assert!(m.as_slice().iter().all(|&b| b == 0));
        m.as_mut_slice()[4096] = 7;
        assert_eq!(m.as_slice()[4096], 7);
    }

    #[test]
    fn discarded_pages_read_zero_again() {
        let mut m = AnonMapping::new(1 << 20, PageSize::Base4K).expect("map 1 MiB");
        m.as_mut_slice().fill(0xAB);
        m.discard(0, 8192).expect("discard two pages");
        m.populate_write(0, 8192).expect("repopulate");
        assert!(m.as_slice()[..8192].iter().all(|&b| b == 0));
        assert!(m.as_slice()[8192..].iter().all(|&b| b == 0xAB));
        assert!(matches!(
            m.discard(1 << 20, 4096),
            Err(MappingError::OutOfRange { .. })
        ));
    }

    #[test]
    fn bad_lengths_and_ranges_are_refused() {
        assert!(matches!(
            AnonMapping::new(0, PageSize::Base4K),
            Err(MappingError::BadLength { .. })
        ));
        assert!(matches!(
            AnonMapping::new(4096 + 1, PageSize::Base4K),
            Err(MappingError::BadLength { .. })
        ));
        let m = AnonMapping::new(8192, PageSize::Base4K).expect("map");
        assert!(matches!(
            m.populate_write(4096, 8192),
            Err(MappingError::OutOfRange { .. })
        ));
        assert!(matches!(
            m.populate_write(usize::MAX, 2),
            Err(MappingError::OutOfRange { .. })
        ));
    }

    #[test]
    fn shared_4k_mapping_is_zeroed_and_sized() {
        let m = SharedMapping::memfd(1 << 20, PageSize::Base4K).expect("memfd 1 MiB");
        m.populate_write(0, m.len()).expect("populate");
        assert!(m.as_slice().iter().all(|&b| b == 0));
        let file = std::fs::File::from(m.fd().try_clone_to_owned().expect("dup memfd"));
        assert_eq!(file.metadata().expect("fstat").len(), 1 << 20);
        assert!(matches!(
            SharedMapping::memfd(4095, PageSize::Base4K),
            Err(MappingError::BadLength { .. })
        ));
        assert!(matches!(
            m.populate_write(1 << 20, 1),
            Err(MappingError::OutOfRange { .. })
        ));
    }
}
