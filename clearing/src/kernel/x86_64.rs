//! x86-64 clearing kernels: `rep stosb` (ERMS/FSRM) and AVX-512 / AVX2
//! non-temporal streaming stores.
//!
//! # Design
//! `rep stosb` is issued with inline assembly rather than through
//! `ptr::write_bytes`, because the compiler is free to turn `write_bytes` into a
//! call to `memset`, whose strategy (vector loops, size thresholds, NT stores
//! above some cache-size guess) is the C library's choice and not ours. With
//! the instruction spelled out, "multi-page" really is one instruction over the
//! whole run, and "per 4 KiB" really is one instruction per page, which is what
//! the measurements in [`ClearKernel::default_kernel`](super::ClearKernel::default_kernel)
//! compare.
//!
//! The streaming kernels pick AVX-512 when the CPU has it and AVX2 otherwise
//! (`is_x86_feature_detected!`, which std caches after the first call). The
//! unaligned head and tail of a run are cleared with `rep stosb`; the aligned
//! body goes out as full-cache-line (or half-line) NT stores, followed by one
//! `sfence`.

use core::arch::asm;
use core::arch::x86_64::{
    __m256i, __m512i, _mm256_setzero_si256, _mm256_stream_si256, _mm512_setzero_si512,
    _mm512_stream_si512, _mm_sfence,
};

use super::page::PAGE_4K;

/// Runs shorter than this are cleared with `rep stosb` even by the
/// non-temporal kernel: a few cache lines are not worth the head/tail split
/// and the `sfence`, and for them the cache pollution is negligible.
const NT_MIN_LEN: usize = 512;

/// True when the CPU can run the non-temporal kernel (AVX-512F or AVX2).
pub(super) fn non_temporal_available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f") || std::arch::is_x86_feature_detected!("avx2")
}

/// Zeroes `len` bytes at `ptr` with one `rep stosb`.
///
/// # Safety
/// `ptr..ptr + len` must be valid for writes and not accessed by anyone else
/// while this runs. `len == 0` is allowed with any pointer.
#[inline(always)]
unsafe fn rep_stosb(ptr: *mut u8, len: usize) {
    // SAFETY: the caller guarantees `ptr..ptr + len` is writable and exclusively
    // ours. `rep stosb` writes exactly `rcx` bytes of `al` upwards from `rdi`
    // (the Rust ABI guarantees DF = 0 on entry to asm), clobbers only rcx and
    // rdi (declared), touches no stack and leaves the flags alone.
    unsafe {
        asm!(
            "rep stosb",
            inout("rcx") len => _,
            inout("rdi") ptr => _,
            in("al") 0u8,
            options(nostack, preserves_flags)
        );
    }
}

/// Multi-page kernel: one `rep stosb` over the whole run.
///
/// # Safety
/// As for [`rep_stosb`].
pub(super) unsafe fn multi_page(ptr: *mut u8, len: usize) {
    // SAFETY: forwarded caller contract: `ptr..ptr + len` is writable and ours.
    unsafe { rep_stosb(ptr, len) }
}

/// Baseline kernel: one `rep stosb` per 4 KiB page, the way a per-subpage
/// `clear_page()` loop clears a huge page. Pieces follow absolute 4 KiB page
/// boundaries, so an unaligned start gives a short first piece.
///
/// # Safety
/// As for [`rep_stosb`].
pub(super) unsafe fn per_page_4k(ptr: *mut u8, len: usize) {
    let mut off = 0;
    while off < len {
        let p = ptr.wrapping_add(off);
        let to_boundary = PAGE_4K - (p as usize & (PAGE_4K - 1));
        let n = to_boundary.min(len - off);
        // SAFETY: `off + n <= len`, so `p..p + n` lies inside the caller's
        // writable, exclusively owned range.
        unsafe { rep_stosb(p, n) };
        off += n;
    }
}

/// Non-temporal kernel: AVX-512 streaming stores if available, else AVX2,
/// else (no vector unit that can stream) `rep stosb`.
///
/// # Safety
/// As for [`rep_stosb`].
pub(super) unsafe fn non_temporal(ptr: *mut u8, len: usize) {
    if len < NT_MIN_LEN {
        // SAFETY: forwarded caller contract.
        unsafe { rep_stosb(ptr, len) };
    } else if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU supports AVX-512F (checked just above); the range
        // contract is forwarded from the caller.
        unsafe { nt_avx512(ptr, len) };
    } else if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above); the range
        // contract is forwarded from the caller.
        unsafe { nt_avx2(ptr, len) };
    } else {
        // SAFETY: forwarded caller contract.
        unsafe { rep_stosb(ptr, len) };
    }
}

/// Bytes from `ptr` up to the next multiple of `align` (a power of two),
/// at most `len`.
fn head_len(ptr: *mut u8, align: usize, len: usize) -> usize {
    (align.wrapping_sub(ptr as usize) & (align - 1)).min(len)
}

/// AVX-512 streaming clear: `rep stosb` head up to a 64-byte boundary, 64-byte
/// `vmovntdq` stores (unrolled by four) for the body, `rep stosb` tail, then
/// `sfence` so the NT stores are globally visible before any later store
/// (such as telling the guest the page is ready).
///
/// # Safety
/// The CPU must support AVX-512F, and the range contract of [`rep_stosb`] holds.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn nt_avx512(ptr: *mut u8, len: usize) {
    const V: usize = 64;
    let head = head_len(ptr, V, len);
    // SAFETY: `head <= len`: inside the caller's range.
    unsafe { rep_stosb(ptr, head) };
    let mut p = ptr.wrapping_add(head);
    let body = (len - head) & !(V - 1);
    let end = p.wrapping_add(body);
    let zero = _mm512_setzero_si512();
    while (end as usize) - (p as usize) >= 4 * V {
        // SAFETY: `p` is 64-byte aligned and `p + 256 <= end`, which
        // is inside the caller's range; AVX-512F is enabled for this function.
        unsafe { _mm512_stream_si512(p.cast::<__m512i>(), zero) };
        // SAFETY: as above, second line of the four.
        unsafe { _mm512_stream_si512(p.wrapping_add(V).cast::<__m512i>(), zero) };
        // SAFETY: as above, third line.
        unsafe { _mm512_stream_si512(p.wrapping_add(2 * V).cast::<__m512i>(), zero) };
        // SAFETY: as above, fourth line.
        unsafe { _mm512_stream_si512(p.wrapping_add(3 * V).cast::<__m512i>(), zero) };
        p = p.wrapping_add(4 * V);
    }
    while p < end {
        // SAFETY: `p` is 64-byte aligned and `p + 64 <= end` (body is a multiple
        // of 64), inside the caller's range.
        unsafe { _mm512_stream_si512(p.cast::<__m512i>(), zero) };
        p = p.wrapping_add(V);
    }
    // SAFETY: `end..ptr + len` is the tail of the caller's range.
    unsafe { rep_stosb(end, len - head - body) };
    _mm_sfence();
}

/// AVX2 streaming clear; the same shape as [`nt_avx512`] with 32-byte stores.
///
/// # Safety
/// The CPU must support AVX2, and the range contract of [`rep_stosb`] holds.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn nt_avx2(ptr: *mut u8, len: usize) {
    const V: usize = 32;
    let head = head_len(ptr, V, len);
    // SAFETY: `head <= len`: inside the caller's range.
    unsafe { rep_stosb(ptr, head) };
    let mut p = ptr.wrapping_add(head);
    let body = (len - head) & !(V - 1);
    let end = p.wrapping_add(body);
    let zero = _mm256_setzero_si256();
    while (end as usize) - (p as usize) >= 4 * V {
        // SAFETY: `p` is 32-byte aligned and `p + 128 <= end`, which
        // is inside the caller's range; AVX2 is enabled for this function.
        unsafe { _mm256_stream_si256(p.cast::<__m256i>(), zero) };
        // SAFETY: as above, second store of the four.
        unsafe { _mm256_stream_si256(p.wrapping_add(V).cast::<__m256i>(), zero) };
        // SAFETY: as above, third store.
        unsafe { _mm256_stream_si256(p.wrapping_add(2 * V).cast::<__m256i>(), zero) };
        // SAFETY: as above, fourth store.
        unsafe { _mm256_stream_si256(p.wrapping_add(3 * V).cast::<__m256i>(), zero) };
        p = p.wrapping_add(4 * V);
    }
    while p < end {
        // SAFETY: `p` is 32-byte aligned and `p + 32 <= end`, inside the range.
        unsafe { _mm256_stream_si256(p.cast::<__m256i>(), zero) };
        p = p.wrapping_add(V);
    }
    // SAFETY: `end..ptr + len` is the tail of the caller's range.
    unsafe { rep_stosb(end, len - head - body) };
    _mm_sfence();
}

#[cfg(test)]
mod tests {
    #![allow(clippy::undocumented_unsafe_blocks)]

    use super::*;
    use crate::kernel::tests::check_kernel_raw;

    #[test]
    fn head_len_cases() {
        let p = 0x1000 as *mut u8;
        assert_eq!(head_len(p, 64, 100), 0);
        assert_eq!(head_len(p.wrapping_add(1), 64, 100), 63);
        assert_eq!(head_len(p.wrapping_add(1), 64, 10), 10);
        assert_eq!(head_len(p.wrapping_add(63), 64, 100), 1);
    }

    #[test]
    fn avx512_streaming_zeroes_exactly_the_range() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            eprintln!("skipped: no AVX-512F");
            return;
        }
        check_kernel_raw(|p, n| unsafe { nt_avx512(p, n) });
    }

    #[test]
    fn avx2_streaming_zeroes_exactly_the_range() {
        if !std::arch::is_x86_feature_detected!("avx2") {
            eprintln!("skipped: no AVX2");
            return;
        }
        check_kernel_raw(|p, n| unsafe { nt_avx2(p, n) });
    }

    #[test]
    fn rep_stosb_kernels_zero_exactly_the_range() {
        check_kernel_raw(|p, n| unsafe { multi_page(p, n) });
        check_kernel_raw(|p, n| unsafe { per_page_4k(p, n) });
    }
}
