//! Portable clearing kernels for targets without a hand-written one.
//!
//! Everything is `ptr::write_bytes`, which the compiler lowers to the
//! platform's `memset`. There is no portable way to ask for non-temporal
//! stores, so [`non_temporal_available`] is false and the non-temporal kernel
//! is the multi-page one.

use core::ptr;

use super::page::PAGE_4K;

/// No portable streaming stores.
pub(super) fn non_temporal_available() -> bool {
    false
}

/// One `write_bytes` over the whole run.
///
/// # Safety
/// `ptr..ptr + len` must be valid for writes and not accessed by anyone else
/// while this runs. `len == 0` is allowed with any non-null pointer.
pub(super) unsafe fn multi_page(ptr: *mut u8, len: usize) {
    // SAFETY: the caller guarantees the range is writable and exclusively ours;
    // `u8` has no alignment requirement and every byte value is valid.
    unsafe { ptr::write_bytes(ptr, 0, len) }
}

/// One `write_bytes` per 4 KiB page (absolute page boundaries).
///
/// # Safety
/// As for [`multi_page`].
pub(super) unsafe fn per_page_4k(ptr: *mut u8, len: usize) {
    let mut off = 0;
    while off < len {
        let p = ptr.wrapping_add(off);
        let n = (PAGE_4K - (p as usize & (PAGE_4K - 1))).min(len - off);
        // SAFETY: `off + n <= len`: inside the caller's writable range.
        unsafe { ptr::write_bytes(p, 0, n) };
        off += n;
    }
}

/// No streaming stores here: the multi-page kernel.
///
/// # Safety
/// As for [`multi_page`].
pub(super) unsafe fn non_temporal(ptr: *mut u8, len: usize) {
    // SAFETY: forwarded caller contract.
    unsafe { multi_page(ptr, len) }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::undocumented_unsafe_blocks)]

    use super::*;
    use crate::kernel::tests::check_kernel_raw;

    #[test]
    fn generic_kernels_zero_exactly_the_range() {
        check_kernel_raw(|p, n| unsafe { multi_page(p, n) });
        check_kernel_raw(|p, n| unsafe { per_page_4k(p, n) });
        check_kernel_raw(|p, n| unsafe { non_temporal(p, n) });
    }
}
