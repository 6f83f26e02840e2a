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

#[cfg(test)]
mod tests {
    use super::*;

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
