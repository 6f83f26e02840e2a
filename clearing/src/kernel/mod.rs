//! Clearing kernels: the instruction sequences that zero memory, behind one
//! portable API.
//!
//! Three kernels are offered so that callers (and the benches) can compare
//! them on the machine at hand:
//!
//! * [`ClearKernel::MultiPage`]: one `rep stosb` over the whole run. Modern
//!   x86 cores (ERMS/FSRM) execute long string stores with full-cache-line
//!   writes that skip the read-for-ownership; one long instruction lets the
//!   microcode do that for the whole run instead of restarting every 4 KiB.
//! * [`ClearKernel::NonTemporal`]: AVX-512 (or AVX2) streaming stores, which
//!   bypass the caches. Clearing a 1 GiB page through the cache evicts
//!   everything else; streaming does not, at the price of the page itself
//!   never being cache-hot.
//! * [`ClearKernel::PerPage4K`]: one `rep stosb` per 4 KiB page, the shape of
//!   the classic per-subpage `clear_page()` loop; kept as the baseline.
//!
//! None of the kernels checks for cancellation: a call clears everything it
//! was given. Responsiveness comes from the caller handing out bounded runs;
//! the parallel runner caps each run at [`MAX_RUN`] by default
//! (see [`RunOptions::max_chunk`](crate::RunOptions::max_chunk)).
//!
//! [`clear_huge_page`] clears one huge page around a fault so that the part the
//! guest is about to touch is the part that was written last (see there).
//!
//! Platform code lives in private sibling modules picked by `cfg`: `x86_64`
//! (inline `rep stosb`, AVX-512/AVX2 intrinsics) and `generic`
//! (`ptr::write_bytes`, used on every other target).

use std::ops::Range;

#[cfg(target_arch = "x86_64")]
mod x86_64;
#[cfg(target_arch = "x86_64")]
use self::x86_64 as arch;

// Compiled on every target so its tests run on x86-64 CI too; it is the
// implementation only where no hand-written module exists.
#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
mod generic;
#[cfg(not(target_arch = "x86_64"))]
use self::generic as arch;

mod page;
pub use page::PAGE_4K;

/// The longest run the parallel runner hands to one kernel call by default:
/// 64 MiB.
///
/// A kernel call is not interruptible by hugemem (one `rep stosb` is one
/// instruction), so this bounds how long a worker goes without looking at the
/// cancel token and reporting progress: at the 8-22 GB/s measured here
/// (see [`ClearKernel::default_kernel`]), 64 MiB takes 3-8 ms. It is far above
/// the size where a longer run stops being faster, so it costs no throughput.
pub const MAX_RUN: usize = 64 << 20;

/// How many 4 KiB pages on each side of the faulting page
/// [`clear_huge_page`] clears last, together with the faulting page itself.
///
/// 8 + 1 + 8 pages = 68 KiB: well inside a core's L2 (2 MiB here) so it is
/// all still cached when the guest resumes, and enough to cover the
/// neighbouring cache lines a guest typically touches right after the fault
/// (a stack or a struct straddling a page boundary, a short sequential scan).
pub const NEIGHBOURHOOD_PAGES: usize = 8;

/// Which instruction sequence zeroes memory. See the [module docs](self).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ClearKernel {
    /// One `rep stosb` over the whole run (`ptr::write_bytes` off x86-64).
    MultiPage,
    /// AVX-512 or AVX2 non-temporal streaming stores, then `sfence`.
    /// Falls back to [`ClearKernel::MultiPage`] where unavailable.
    NonTemporal,
    /// One `rep stosb` per 4 KiB page: the baseline.
    PerPage4K,
}

impl ClearKernel {
    /// Every kernel, in a stable order (for benches and CLIs).
    pub const ALL: [ClearKernel; 3] = [
        ClearKernel::MultiPage,
        ClearKernel::NonTemporal,
        ClearKernel::PerPage4K,
    ];

    /// The short name: `"multipage"`, `"nt"` or `"per4k"`.
    pub fn name(self) -> &'static str {
        match self {
            ClearKernel::MultiPage => "multipage",
            ClearKernel::NonTemporal => "nt",
            ClearKernel::PerPage4K => "per4k",
        }
    }

    /// The kernel whose [`name`](Self::name) is `s`, if any.
    pub fn from_name(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == s)
    }

    /// True when this kernel runs as itself on this CPU. Only
    /// [`ClearKernel::NonTemporal`] can be unavailable: it needs x86-64 with
    /// AVX-512F or AVX2. An unavailable kernel still clears correctly, through
    /// [`ClearKernel::MultiPage`].
    pub fn is_available(self) -> bool {
        match self {
            ClearKernel::MultiPage | ClearKernel::PerPage4K => true,
            ClearKernel::NonTemporal => arch::non_temporal_available(),
        }
    }

    /// True when the kernel writes through the cache, leaving what it cleared
    /// cache-hot.
    pub fn is_temporal(self) -> bool {
        !matches!(self, ClearKernel::NonTemporal)
    }

    /// The kernel hugemem uses unless told otherwise:
    /// [`ClearKernel::NonTemporal`] where [available](Self::is_available),
    /// else [`ClearKernel::MultiPage`].
    ///
    /// Chosen by measurement on the development machine (2 vCPU Xeon with
    /// AVX-512F and ERMS/FSRM, 105 MiB L3, kernel 6.18, under a hypervisor
    /// that backs memory lazily): one 1 GiB hugetlb page, mapped, written and
    /// freed once so the host had backed it, then mapped and written again;
    /// each kernel then cleared the whole dirty page (refilled with `0xff`
    /// before every run), kernels interleaved, 11 runs each, host otherwise
    /// idle. Two such sessions:
    ///
    /// | kernel (1 GiB, 1 thread) | best GB/s | median GB/s |
    /// |---|---|---|
    /// | `nt` (AVX-512 `vmovntdq`) | 21.7, 22.1 | 19.0, 21.0 |
    /// | `multipage` (one `rep stosb`) | 10.4, 10.8 | 9.3, 10.4 |
    /// | `per4k` (`rep stosb` per 4 KiB) | 7.9, 8.0 | 7.3, 6.6 |
    /// | [`clear_huge_page`], `nt` bulk | 21.2, 21.8 | 19.4, 21.1 |
    /// | [`clear_huge_page`], `multipage` | 10.7, 10.9 | 9.5, 10.1 |
    ///
    /// The ordering held in every run, including runs on 2 MiB hugetlb and
    /// 4 KiB anonymous memory (1 GiB: `nt` 19.7-20.6, `multipage` 11.7-13.3,
    /// `per4k` 10.0-10.6 best GB/s) and under load from other processes;
    /// criterion (`benches/kernels.rs`, 1 GiB hugetlb, busy host) gave
    /// 14.4 / 5.7 / 3.8 GiB/s. With two threads (`clear_parallel`) medians
    /// barely moved (`nt` 20.7-25.8, `multipage` 10.2-11.5): the limit is the
    /// memory path, not the core.
    ///
    /// So streaming stores clear DRAM-sized runs about twice as fast as
    /// `rep stosb` here, and they leave the host's caches alone. `rep stosb`
    /// wins only on runs that fit in the LLC (64 MiB: `multipage` 16.8 vs `nt`
    /// 14.9 best GB/s), which guest RAM never is; the one part of a page worth
    /// having in cache is the fault neighbourhood, and [`clear_huge_page`]
    /// clears that with `rep stosb` whatever the bulk kernel. The multi-page
    /// `rep stosb` is still 1.3-1.4x the per-4 KiB loop, and is the fallback
    /// without AVX2/AVX-512.
    ///
    /// An earlier measurement on this kind of machine recorded 6.5 GB/s for
    /// both; host conditions differ between sessions, so re-measure before
    /// changing this, with
    /// `HUGEMEM_BENCH_PAGE=1g HUGEMEM_BENCH_BYTES=1073741824 cargo bench -p clearing`.
    pub fn default_kernel() -> Self {
        if ClearKernel::NonTemporal.is_available() {
            ClearKernel::NonTemporal
        } else {
            ClearKernel::MultiPage
        }
    }
}

/// Zeroes `buf` with `kernel`.
pub fn clear(kernel: ClearKernel, buf: &mut [u8]) {
    // SAFETY: `buf` is a live, exclusively borrowed slice: writable for
    // `buf.len()` bytes and accessed by nobody else during the call.
    unsafe { clear_raw(kernel, buf.as_mut_ptr(), buf.len()) }
}

/// Zeroes `len` bytes at `ptr` with `kernel`.
///
/// # Safety
/// * `ptr..ptr + len` must be mapped writable (for guest RAM: mapped with
///   `PROT_WRITE`, and for a file mapping, backed, or the write raises
///   SIGBUS) and valid for writes as Rust understands it.
/// * No other thread may read or write the range during the call, and no Rust
///   reference to it may be live: the kernels write through a raw pointer.
///
/// `len == 0` does nothing, whatever `ptr` is.
pub unsafe fn clear_raw(kernel: ClearKernel, ptr: *mut u8, len: usize) {
    if len == 0 {
        return;
    }
    match kernel {
        // SAFETY: forwarded caller contract (writable, exclusive range).
        ClearKernel::MultiPage => unsafe { arch::multi_page(ptr, len) },
        // SAFETY: forwarded caller contract; the NT kernel checks CPU features
        // itself before using vector instructions.
        ClearKernel::NonTemporal => unsafe { arch::non_temporal(ptr, len) },
        // SAFETY: forwarded caller contract.
        ClearKernel::PerPage4K => unsafe { arch::per_page_4k(ptr, len) },
    }
}

/// The order in which [`clear_huge_page`] clears a page of `len` bytes that
/// faulted at `fault_offset`: `[left, right, neighbourhood]`, offsets from the
/// start of the page.
///
/// The neighbourhood is the 4 KiB page holding the fault plus up to
/// [`NEIGHBOURHOOD_PAGES`] pages on each side (4 KiB pages counted from the
/// start of the huge page), clipped to the page; `left` and
/// `right` are what remains before and after it (either may be empty). The
/// three ranges are disjoint and together cover `0..len`. A `fault_offset`
/// at or past `len` is treated as a fault in the last byte (clamped: every
/// byte of the page is cleared either way, so only the cache-hot part
/// changes). `len == 0` gives three empty ranges.
pub fn clear_order(len: usize, fault_offset: usize) -> [Range<usize>; 3] {
    if len == 0 {
        return [0..0, 0..0, 0..0];
    }
    let fault_page = fault_offset.min(len - 1) / PAGE_4K;
    let start = fault_page.saturating_sub(NEIGHBOURHOOD_PAGES) * PAGE_4K;
    let end = fault_page
        .saturating_add(NEIGHBOURHOOD_PAGES + 1)
        .saturating_mul(PAGE_4K)
        .min(len);
    [0..start, end..len, start..end]
}

/// Zeroes one huge page in the order that leaves the faulting part cache-hot.
///
/// The bulk (left and right of the fault's neighbourhood) is cleared first
/// with `kernel`; the neighbourhood (see [`clear_order`]) is cleared last, so
/// that the lines the guest touches as soon as it resumes are the most
/// recently written ones and still sit in this core's L1/L2.
///
/// The neighbourhood is always cleared with a temporal kernel: if `kernel` is
/// [`ClearKernel::NonTemporal`], the neighbourhood uses
/// [`ClearKernel::MultiPage`]. Streaming stores write around the cache and
/// evict any cached copy of the lines they write, so clearing the
/// neighbourhood with them would make the guest's first accesses miss to DRAM,
/// which defeats the point of clearing it last.
///
/// `fault_offset` is the offset of the faulting address within `page`; one at
/// or past the end is clamped to the last byte.
pub fn clear_huge_page(kernel: ClearKernel, page: &mut [u8], fault_offset: usize) {
    // SAFETY: `page` is a live, exclusively borrowed slice: writable for its
    // whole length and accessed by nobody else during the call.
    unsafe { clear_huge_page_raw(kernel, page.as_mut_ptr(), page.len(), fault_offset) }
}

/// [`clear_huge_page`] on a raw range.
///
/// # Safety
/// As for [`clear_raw`]: `page..page + len` must be mapped writable and not
/// accessed by anyone else during the call.
pub unsafe fn clear_huge_page_raw(
    kernel: ClearKernel,
    page: *mut u8,
    len: usize,
    fault_offset: usize,
) {
    for_each_huge_page_step(kernel, len, fault_offset, |k, range| {
        // SAFETY: `range` is one of `clear_order(len, ..)`, all inside `0..len`,
        // so `page + range.start .. page + range.end` is inside the caller's
        // writable, exclusively owned range.
        unsafe { clear_raw(k, page.wrapping_add(range.start), range.len()) }
    });
}

/// Calls `step(kernel, range)` for each part of a huge-page clear, in order.
/// Split out from [`clear_huge_page_raw`] so the ordering is testable.
fn for_each_huge_page_step(
    kernel: ClearKernel,
    len: usize,
    fault_offset: usize,
    mut step: impl FnMut(ClearKernel, Range<usize>),
) {
    let [left, right, hot] = clear_order(len, fault_offset);
    let hot_kernel = if kernel.is_temporal() {
        kernel
    } else {
        ClearKernel::MultiPage
    };
    for (k, r) in [(kernel, left), (kernel, right), (hot_kernel, hot)] {
        if !r.is_empty() {
            step(k, r);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(clippy::undocumented_unsafe_blocks)]

    use proptest::prelude::*;

    use super::*;

    const GUARD: usize = 128;
    const FILL: u8 = 0xA5;

    /// Lengths that hit every edge case of the kernels.
    pub(crate) const LENS: [usize; 12] = [
        0,
        1,
        31,
        63,
        64,
        511,
        513,
        4095,
        4096,
        4097,
        3 * 4096 + 100,
        (1 << 20) + 13,
    ];
    /// Start misalignments relative to a 4 KiB boundary.
    pub(crate) const OFFSETS: [usize; 6] = [0, 1, 7, 32, 63, 4095];

    /// A 4 KiB-aligned buffer filled with `FILL`, big enough for `len` bytes at
    /// `offset` plus guard zones on both sides.
    struct Guarded {
        storage: Vec<u8>,
        base: usize,
    }

    impl Guarded {
        fn new(offset: usize, len: usize) -> Self {
            let storage = vec![FILL; GUARD + offset + len + GUARD + 2 * PAGE_4K];
            // `b0 + GUARD` is the first 4 KiB boundary at or after GUARD bytes in.
            let b0 = (PAGE_4K - (storage.as_ptr() as usize + GUARD) % PAGE_4K) % PAGE_4K;
            Self {
                storage,
                base: b0 + offset,
            }
        }
        fn target(&mut self) -> *mut u8 {
            self.storage.as_mut_ptr().wrapping_add(self.base + GUARD)
        }
        fn check(&self, len: usize, what: &str) {
            let s = &self.storage;
            let lo = self.base + GUARD;
            assert!(
                s[..lo].iter().all(|&b| b == FILL),
                "{what}: byte before the range was written"
            );
            if let Some(i) = s[lo..lo + len].iter().position(|&b| b != 0) {
                panic!("{what}: byte {i} of {len} not zeroed");
            }
            assert!(
                s[lo + len..].iter().all(|&b| b == FILL),
                "{what}: byte after the range was written"
            );
        }
    }

    /// Runs `f(ptr, len)` over every length/offset pair and checks that exactly
    /// the range was zeroed.
    pub(crate) fn check_kernel_raw(f: impl Fn(*mut u8, usize)) {
        for &len in &LENS {
            for &off in &OFFSETS {
                let mut g = Guarded::new(off, len);
                f(g.target(), len);
                g.check(len, &format!("len {len} offset {off}"));
            }
        }
    }

    #[test]
    fn names_round_trip() {
        for k in ClearKernel::ALL {
            assert_eq!(ClearKernel::from_name(k.name()), Some(k));
        }
        assert_eq!(ClearKernel::from_name("memset"), None);
        assert_eq!(ClearKernel::MultiPage.name(), "multipage");
        assert_eq!(ClearKernel::NonTemporal.name(), "nt");
        assert_eq!(ClearKernel::PerPage4K.name(), "per4k");
    }

    #[test]
    fn availability() {
        assert!(ClearKernel::MultiPage.is_available());
        assert!(ClearKernel::PerPage4K.is_available());
        assert!(ClearKernel::default_kernel().is_available());
        #[cfg(target_arch = "x86_64")]
        assert_eq!(
            ClearKernel::NonTemporal.is_available(),
            std::arch::is_x86_feature_detected!("avx2")
                || std::arch::is_x86_feature_detected!("avx512f")
        );
    }

    #[test]
    fn clear_raw_every_kernel() {
        for k in ClearKernel::ALL {
            check_kernel_raw(|p, n| unsafe { clear_raw(k, p, n) });
        }
    }

    #[test]
    fn clear_slice_every_kernel() {
        for k in ClearKernel::ALL {
            for &len in &LENS {
                for &off in &OFFSETS {
                    let mut g = Guarded::new(off, len);
                    let lo = g.base + GUARD;
                    clear(k, &mut g.storage[lo..lo + len]);
                    g.check(len, &format!("{} len {len} offset {off}", k.name()));
                }
            }
        }
    }

    #[test]
    fn clear_raw_zero_len_ignores_pointer() {
        for k in ClearKernel::ALL {
            unsafe { clear_raw(k, std::ptr::null_mut(), 0) };
        }
    }

    #[test]
    fn order_fault_in_middle() {
        let len = 2 << 20;
        let fault = 100 * PAGE_4K + 17;
        let [l, r, h] = clear_order(len, fault);
        assert_eq!(
            h,
            (100 - NEIGHBOURHOOD_PAGES) * PAGE_4K..(101 + NEIGHBOURHOOD_PAGES) * PAGE_4K
        );
        assert_eq!(l, 0..h.start);
        assert_eq!(r, h.end..len);
    }

    #[test]
    fn order_fault_at_edges_and_beyond() {
        let len = 2 << 20;
        let n = NEIGHBOURHOOD_PAGES;
        assert_eq!(
            clear_order(len, 0),
            [0..0, (n + 1) * PAGE_4K..len, 0..(n + 1) * PAGE_4K]
        );
        let tail = len - (n + 1) * PAGE_4K;
        assert_eq!(clear_order(len, len - 1), [0..tail, len..len, tail..len]);
        assert_eq!(clear_order(len, len), clear_order(len, len - 1));
        assert_eq!(clear_order(len, usize::MAX), clear_order(len, len - 1));
        assert_eq!(clear_order(0, 5), [0..0, 0..0, 0..0]);
        // A page smaller than the neighbourhood is all neighbourhood.
        assert_eq!(
            clear_order(3 * PAGE_4K + 5, 4096),
            [0..0, 3 * PAGE_4K + 5..3 * PAGE_4K + 5, 0..3 * PAGE_4K + 5]
        );
    }

    #[test]
    fn neighbourhood_is_cleared_last_and_temporally() {
        for kernel in ClearKernel::ALL {
            let mut steps = Vec::new();
            for_each_huge_page_step(kernel, 2 << 20, 1 << 20, |k, r| steps.push((k, r)));
            assert_eq!(steps.len(), 3);
            let hot = clear_order(2 << 20, 1 << 20)[2].clone();
            let (last_k, last_r) = steps[2].clone();
            assert_eq!(last_r, hot, "{}: neighbourhood not last", kernel.name());
            assert!(last_k.is_temporal());
            assert_eq!(steps[0].0, kernel);
            assert_eq!(steps[1].0, kernel);
        }
        // Empty parts are skipped, the neighbourhood still comes last.
        let mut steps = Vec::new();
        for_each_huge_page_step(ClearKernel::NonTemporal, 2 << 20, 0, |k, r| {
            steps.push((k, r))
        });
        assert_eq!(steps.len(), 2);
        assert_eq!(
            steps[1],
            (
                ClearKernel::MultiPage,
                0..(NEIGHBOURHOOD_PAGES + 1) * PAGE_4K
            )
        );
    }

    #[test]
    fn clear_huge_page_zeroes_all() {
        let len = 2 << 20;
        for kernel in ClearKernel::ALL {
            for fault in [0, 1, len / 2 + 3, len - PAGE_4K, len - 1, len, len + 12345] {
                let mut g = Guarded::new(0, len);
                let lo = g.base + GUARD;
                clear_huge_page(kernel, &mut g.storage[lo..lo + len], fault);
                g.check(len, &format!("{} fault {fault}", kernel.name()));
                let mut g = Guarded::new(0, len);
                unsafe { clear_huge_page_raw(kernel, g.target(), len, fault) };
                g.check(len, &format!("{} raw fault {fault}", kernel.name()));
            }
        }
    }

    #[test]
    fn clear_huge_page_odd_sizes() {
        for kernel in ClearKernel::ALL {
            for &len in &LENS {
                for fault in [0, len / 2, len] {
                    let mut g = Guarded::new(3, len);
                    unsafe { clear_huge_page_raw(kernel, g.target(), len, fault) };
                    g.check(len, &format!("{} len {len} fault {fault}", kernel.name()));
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn order_partitions_the_page(len in 0usize..(4 << 20), fault in any::<usize>(), small in any::<bool>()) {
            let fault = if small { fault % (len + 1).max(1) } else { fault };
            let [l, r, h] = clear_order(len, fault);
            // Disjoint, in address order left | hot | right, covering 0..len.
            prop_assert_eq!(l.start, 0);
            prop_assert_eq!(l.end, h.start);
            prop_assert_eq!(h.end, r.start);
            prop_assert_eq!(r.end, len);
            if len > 0 {
                let f = fault.min(len - 1);
                prop_assert!(h.contains(&f));
                prop_assert!(h.len() <= (2 * NEIGHBOURHOOD_PAGES + 1) * PAGE_4K);
                prop_assert_eq!(h.start % PAGE_4K, 0);
                prop_assert!(h.end % PAGE_4K == 0 || h.end == len);
            }
        }

        #[test]
        fn kernels_zero_random_ranges(len in 0usize..20_000, off in 0usize..4096, k in 0usize..3) {
            let kernel = ClearKernel::ALL[k];
            let mut g = Guarded::new(off, len);
            unsafe { clear_raw(kernel, g.target(), len) };
            g.check(len, kernel.name());
        }
    }
}
