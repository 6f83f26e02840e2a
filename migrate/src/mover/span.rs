//! What to move: [`MoveSpan`], an address range of this process made of
//! whole pages of one size, checked when it is made, and the address of
//! each of its pages.

use std::marker::PhantomData;

use guest_mem::{PageSize, Region, SharedMapping};

use crate::plan::PlanError;

/// An address range of this process made of whole pages of one size: what
/// [`move_range`](super::move_range) works on. Borrowing the mapping it was made from keeps the
/// addresses valid for as long as the span lives.
#[derive(Debug, Clone, Copy)]
pub struct MoveSpan<'a> {
    pub(super) addr: usize,
    pub(super) len: u64,
    pub(super) page_size: PageSize,
    _mapping: PhantomData<&'a ()>,
}

impl<'a> MoveSpan<'a> {
    /// The whole of hugemem's mapping of `region`.
    pub fn of_region(region: &'a Region) -> Self {
        Self {
            addr: region.as_ptr() as usize,
            len: region.len(),
            page_size: region.page_size(),
            _mapping: PhantomData,
        }
    }

    /// The whole of a [`SharedMapping`].
    pub fn of_mapping(mapping: &'a SharedMapping) -> Self {
        Self {
            addr: mapping.addr() as usize,
            // usize -> u64 is lossless on 64-bit hosts.
            len: mapping.len() as u64,
            page_size: mapping.page_size(),
            _mapping: PhantomData,
        }
    }
}

impl MoveSpan<'static> {
    /// A span from raw parts. The calls made on it (`mbind`, `move_pages`)
    /// change where memory is, never what it holds, and the kernel checks
    /// the addresses, so this is safe; but the range should be a mapping of
    /// `page_size` pages that this process owns for the duration.
    ///
    /// # Errors
    ///
    /// [`PlanError::BadSpan`] when `addr` or `len` is not page aligned, `len`
    /// is zero, or the range wraps the address space.
    pub fn from_raw(
        addr: usize,
        len: u64,
        page_size: PageSize,
    ) -> std::result::Result<Self, PlanError> {
        let ps = page_size.bytes();
        let fits = usize::try_from(len)
            .ok()
            .and_then(|l| addr.checked_add(l))
            .is_some();
        if len == 0 || !len.is_multiple_of(ps) || !(addr as u64).is_multiple_of(ps) || !fits {
            return Err(PlanError::BadSpan {
                addr,
                len,
                page_size,
            });
        }
        Ok(Self {
            addr,
            len,
            page_size,
            _mapping: PhantomData,
        })
    }
}

impl MoveSpan<'_> {
    /// Start address.
    pub fn addr(&self) -> usize {
        self.addr
    }
    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Always false: spans are not empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Page size.
    pub fn page_size(&self) -> PageSize {
        self.page_size
    }
    /// Address of page `page`. `page` is below `len / page_size`, so the
    /// result lies in the span (checked to fit the address space).
    pub(super) fn page_addr(&self, page: usize) -> usize {
        // The page size is at most 1 GiB and fits usize.
        self.addr + page * self.page_size.bytes() as usize
    }
}
