//! `/proc/self/pagemap`: is a virtual page of this process mapped right now?
//!
//! Both sides of lazy mode ask it. The daemon checks, before serving a
//! region, that every dirty page is in its own page table (so in the file's
//! page cache: a MINOR fault will come for it, and the kernel will not hand
//! the VMM a fresh page the scrubber would later clear under the guest). The
//! VMM's fallback checks that a faulting page is not already mapped in its
//! guest mapping before it clears it (a stale event for a page the daemon
//! served just before dying).
//!
//! Each 4 KiB virtual page has one little-endian `u64` at offset
//! `addr / 4096 * 8`; bit 63 is "present". Reading one's own pagemap needs no
//! privilege (only the PFN bits are hidden without `CAP_SYS_ADMIN`). For a
//! hugetlb mapping every 4 KiB entry of a mapped huge page reads present.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

use clearing::PAGE_4K;

/// Bit 63 of a pagemap entry: the page is present in RAM and mapped.
const PM_PRESENT: u64 = 1 << 63;

/// An open `/proc/self/pagemap`.
#[derive(Debug)]
pub struct Pagemap(File);

impl Pagemap {
    /// Opens this process's pagemap.
    ///
    /// # Errors
    ///
    /// The `open` error (no procfs).
    pub fn open_self() -> io::Result<Self> {
        File::open("/proc/self/pagemap").map(Self)
    }

    /// True when the page holding `addr` is mapped in this process.
    ///
    /// # Errors
    ///
    /// The `pread` error.
    pub fn present(&self, addr: u64) -> io::Result<bool> {
        let mut entry = [0u8; 8];
        let offset = (addr / PAGE_4K as u64)
            .checked_mul(8)
            .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        self.0.read_exact_at(&mut entry, offset)?;
        Ok(u64::from_le_bytes(entry) & PM_PRESENT != 0)
    }
}

/// Bytes of mapping one [`resident_pages`] call looks at (its status vector
/// is 1/4096 of that: 256 KiB).
const MINCORE_CHUNK: usize = 1 << 30;

/// Which pages of `unit` bytes in this process's mapping `[addr, addr + len)`
/// are mapped right now, judged by their first 4 KiB (all of a huge page's
/// entries agree) (one `mincore(2)` per GiB instead of one pagemap
/// read per page: the dirty-page check of an 8 GiB region of 2 MiB pages
/// is 8 syscalls, not 4096). For hugetlb mappings `mincore` reports whether
/// this process has the huge page mapped, which is what [`Pagemap::present`]
/// says too.
///
/// # Safety
///
/// `addr .. addr + len` must be a mapping of this process (it is only
/// inspected, never read or written); `addr` must be 4 KiB aligned and `unit`
/// a multiple of 4 KiB.
///
/// # Errors
///
/// The `mincore` error (`ENOMEM`: part of the range is not mapped).
pub unsafe fn resident_pages(addr: *const u8, len: usize, unit: usize) -> io::Result<Vec<bool>> {
    let pages = len.div_ceil(unit.max(1));
    let mut out = Vec::with_capacity(pages);
    let mut vec = vec![0u8; MINCORE_CHUNK / PAGE_4K];
    let mut at = 0;
    while at < len {
        let n = (len - at).min(MINCORE_CHUNK);
        // SAFETY: `at < len`, so the pointer stays inside the caller's mapping.
        let start = unsafe { addr.add(at) };
        // SAFETY: `start .. start + n` lies in a mapping of this process (the
        // caller's promise) and is 4 KiB aligned (`addr` is, `at` is a multiple
        // of the chunk); `vec` has MINCORE_CHUNK / 4096 ≥ n / 4096 (rounded up)
        // bytes for the kernel to write; nothing is read or written at `start`.
        let rc = unsafe { libc::mincore(start.cast_mut().cast(), n, vec.as_mut_ptr()) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        let mut off = 0;
        while off < n && out.len() < pages {
            out.push(vec[off / PAGE_4K] & 1 != 0);
            off += unit;
        }
        at += n;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mincore_agrees_with_pagemap() {
        let mut m =
            guest_mem::AnonMapping::new(8 * PAGE_4K, guest_mem::PageSize::Base4K).expect("map");
        m.as_mut_slice()[2 * PAGE_4K] = 1;
        m.as_mut_slice()[6 * PAGE_4K] = 1;
        // Not the first 4 KiB of its unit: does not count.
        m.as_mut_slice()[5 * PAGE_4K] = 1;
        // SAFETY: the range is `m`'s own mapping, 4 KiB aligned.
        let r = unsafe { resident_pages(m.addr(), 8 * PAGE_4K, 2 * PAGE_4K) }.expect("mincore");
        assert_eq!(r, vec![false, true, false, true]);
    }

    #[test]
    fn touched_pages_are_present_and_untouched_are_not() {
        let mut m =
            guest_mem::AnonMapping::new(4 * PAGE_4K, guest_mem::PageSize::Base4K).expect("map");
        let base = m.addr() as u64;
        m.as_mut_slice()[PAGE_4K] = 1;
        let pm = Pagemap::open_self().expect("pagemap");
        assert!(pm.present(base + PAGE_4K as u64 + 7).expect("read"));
        assert!(!pm.present(base + 3 * PAGE_4K as u64).expect("read"));
    }
}
