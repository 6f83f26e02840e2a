//! Guest-physical layout: the caller's RAM slots, the runner's control slot,
//! and the identity-mapping page tables inside it.
//!
//! Everything here is pure arithmetic on addresses so it can be unit-tested
//! without KVM. The runner ([`crate::run`]) turns the computed plan into memory
//! slots.
//!
//! # Control slot
//!
//! The runner needs a few pages the caller did not give it: the guest image
//! (code, GDT, parameter block, stack) and the page tables. It allocates them
//! itself (an anonymous mapping) and registers them as one extra memory slot at
//! [`RunConfig::control_gpa`](crate::RunConfig::control_gpa), by default
//! [`DEFAULT_CONTROL_GPA`] = 4 GiB − 1 MiB. That address is in the 32-bit MMIO
//! hole where PC firmware lives; hugemem (like cloud-hypervisor) splits guest
//! RAM at 3 GiB and restarts at 4 GiB, so no hugemem layout puts RAM there. A
//! caller whose RAM does cover it gets [`ConfigError::ControlOverlap`] and can
//! pick another address. The image is position independent in long mode, so
//! any 4 KiB-aligned address below the identity map's limit works.
//!
//! Control slot contents, offsets from its start:
//!
//! | offset | what |
//! |---|---|
//! | `0` .. `image::FILE_END` | the guest image; the parameter block at `image::PARAMS` |
//! | .. `image::STACK_TOP` (32 KiB) | zeroed: the PVH path's page tables (unused here) and the stack |
//! | `32 KiB` | PML4 |
//! | `+4 KiB` … | one PDPT per 512 GiB, then (without 1 GiB pages) one PD per GiB |
//!
//! # Pages the guest touches
//!
//! Within each RAM range `[start, end)` (a slot, clipped to
//! [`RunConfig::start_gpa`](crate::RunConfig::start_gpa)), the guest touches
//! the addresses `align_up(start, stride)`, `+ stride`, … while the first 8
//! bytes fit below `end` ([`stride_pages`]), and writes [`pattern`] there.

use std::marker::PhantomData;

use crate::image;

/// Default guest-physical address of the runner's control slot: 4 GiB − 1 MiB,
/// inside the 32-bit MMIO hole that hugemem RAM layouts leave free.
pub const DEFAULT_CONTROL_GPA: u64 = 0xfff0_0000;

/// KVM's granule for slot addresses and sizes.
const PAGE_4K: u64 = 4096;
const GIB: u64 = 1 << 30;
/// Guest-physical memory one PDPT maps (512 × 1 GiB).
const PDPT_SPAN: u64 = 512 * GIB;
/// Page-table entry bits: present | writable.
const PTE_TABLE: u64 = 0x3;
/// Page-table entry bits: present | writable | page size (a 2 MiB or 1 GiB page).
const PTE_LEAF: u64 = 0x83;
/// Where the host's page tables start in the control slot.
const PML4_OFFSET: usize = image::IMAGE_END;

/// What the guest writes into the first 8 bytes of the page at `gpa`.
///
/// The page's own guest-physical address XORed with the run's marker: unique
/// per page, independent of the stride and of the order pages are visited, and
/// different between runs that use different markers.
pub const fn pattern(marker: u64, gpa: u64) -> u64 {
    marker ^ gpa
}

/// The guest-physical addresses the guest touches in `[start, end)`.
///
/// `start` rounded up to `stride`, then every `stride` bytes, as long as the
/// 8 bytes read and written fit below `end`. `stride` must be a power of two
/// (as [`crate::run`] checks); with `stride == 0` nothing is yielded.
pub fn stride_pages(start: u64, end: u64, stride: u64) -> impl Iterator<Item = u64> {
    let first = if stride == 0 {
        None
    } else {
        start.checked_next_multiple_of(stride)
    };
    std::iter::successors(first, move |&a| a.checked_add(stride))
        .take_while(move |&a| a.checked_add(8).is_some_and(|e| e <= end))
}

/// One slot of caller-provided guest RAM: host memory and the guest-physical
/// address it appears at.
///
/// The lifetime ties the slot to the memory it borrows, so the memory cannot
/// be unmapped or reused while a run is in progress. KVM needs `host_addr`,
/// `len` and `guest_phys` to be multiples of 4 KiB.
#[derive(Debug)]
pub struct GuestRam<'a> {
    host_addr: *mut u8,
    len: usize,
    guest_phys: u64,
    _mem: PhantomData<&'a mut [u8]>,
}

impl<'a> GuestRam<'a> {
    /// Guest RAM backed by `mem`, seen by the guest at `guest_phys`.
    pub fn new(mem: &'a mut [u8], guest_phys: u64) -> Self {
        GuestRam {
            host_addr: mem.as_mut_ptr(),
            len: mem.len(),
            guest_phys,
            _mem: PhantomData,
        }
    }

    /// Guest RAM backed by `len` bytes at `host_addr` (for example an `mmap`
    /// of a hugetlb memfd), seen by the guest at `guest_phys`.
    ///
    /// # Safety
    ///
    /// For the lifetime `'a`, `host_addr .. host_addr + len` must be a mapping
    /// that is readable and writable by this process, that stays mapped, and
    /// that no Rust reference aliases: the guest reads and writes it behind the
    /// compiler's back.
    pub unsafe fn from_raw_parts(host_addr: *mut u8, len: usize, guest_phys: u64) -> Self {
        GuestRam {
            host_addr,
            len,
            guest_phys,
            _mem: PhantomData,
        }
    }

    /// Start of the host mapping.
    pub fn host_addr(&self) -> *mut u8 {
        self.host_addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the slot is empty (which [`crate::run`] rejects).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Guest-physical address of the first byte.
    pub fn guest_phys(&self) -> u64 {
        self.guest_phys
    }

    /// Copies `data` to `offset` and zeroes the following `zeros` bytes.
    /// Returns `None` (writing nothing) when that does not fit in the slot.
    ///
    /// # Safety
    ///
    /// No vCPU may be running on this memory.
    pub(crate) unsafe fn write_at(&self, offset: usize, data: &[u8], zeros: usize) -> Option<()> {
        let end = offset.checked_add(data.len())?.checked_add(zeros)?;
        if end > self.len {
            return None;
        }
        // SAFETY: `offset..end` is inside the slot, which is mapped read/write
        // for 'a (the type's invariant); `data` is a Rust slice, so it cannot
        // overlap guest RAM that the type treats as exclusively borrowed; the
        // caller guarantees no vCPU writes concurrently.
        let dst = unsafe { self.host_addr.add(offset) };
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        // SAFETY: `offset + data.len() <= end <= len`: still inside the slot.
        let tail = unsafe { dst.add(data.len()) };
        // SAFETY: `tail .. tail + zeros` ends at `end`, inside the slot.
        unsafe { std::ptr::write_bytes(tail, 0, zeros) };
        Some(())
    }

    /// Copies `out.len()` bytes from `offset` into `out`; `None` when out of
    /// bounds.
    ///
    /// # Safety
    ///
    /// No vCPU may be running on this memory.
    pub(crate) unsafe fn read_at(&self, offset: usize, out: &mut [u8]) -> Option<()> {
        if offset.checked_add(out.len())? > self.len {
            return None;
        }
        // SAFETY: `offset < offset + out.len() <= len`: inside the slot.
        let src = unsafe { self.host_addr.add(offset) };
        // SAFETY: in bounds of the slot, which is mapped for 'a; `out` is a
        // separate Rust buffer; no vCPU runs (caller's guarantee).
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
        Some(())
    }
}

/// A configuration the runner refuses before touching KVM.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// No RAM slot was given.
    #[error("no guest RAM given")]
    NoRam,
    /// More RAM slots than the guest's range table holds.
    #[error("{count} RAM slots given, at most {max} are supported")]
    TooManySlots {
        /// Slots given.
        count: usize,
        /// Capacity of the guest's range table.
        max: usize,
    },
    /// The stride is not a power of two of at least 8 bytes.
    #[error("stride {0:#x} is not a power of two of at least 8 bytes")]
    Stride(u64),
    /// A RAM slot has no bytes.
    #[error("RAM slot {index} is empty")]
    EmptySlot {
        /// Index of the slot in the caller's list.
        index: usize,
    },
    /// A slot address or length that KVM needs 4 KiB aligned is not.
    #[error("RAM slot {index}: {what} {value:#x} is not a multiple of 4 KiB")]
    Misaligned {
        /// Index of the slot in the caller's list (`usize::MAX`: the control slot).
        index: usize,
        /// Which field.
        what: &'static str,
        /// Its value.
        value: u64,
    },
    /// Two RAM slots overlap in guest-physical space.
    #[error("RAM slots {first} and {second} overlap in guest-physical space")]
    Overlap {
        /// Index of one slot.
        first: usize,
        /// Index of the other.
        second: usize,
    },
    /// A RAM slot covers the runner's control slot.
    #[error(
        "RAM slot {index} overlaps the control slot at {control_start:#x}..{control_end:#x}; \
         set RunConfig::control_gpa to a free address"
    )]
    ControlOverlap {
        /// Index of the slot.
        index: usize,
        /// Start of the control slot.
        control_start: u64,
        /// End of the control slot.
        control_end: u64,
    },
    /// Memory ends beyond what the vCPU can address.
    #[error("guest-physical address {end:#x} is beyond the vCPU's {phys_bits}-bit physical address space")]
    AddressTooHigh {
        /// End of the highest slot.
        end: u64,
        /// The vCPU's physical address width.
        phys_bits: u8,
    },
}

/// Where everything goes for one run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Guest-physical address of the control slot.
    pub control_gpa: u64,
    /// Length of the control slot (a multiple of 4 KiB).
    pub control_len: usize,
    /// Identity map covers `[0, map_limit)`.
    pub map_limit: u64,
    /// 1 GiB pages in the PDPTs, else 2 MiB pages in PDs.
    pub huge_1g: bool,
    /// RAM ranges the guest walks, clipped to `start_gpa`, sorted.
    pub ranges: Vec<(u64, u64)>,
    /// Pages the guest must touch.
    pub expected_pages: u64,
}

impl Plan {
    /// Offset of the PML4 in the control slot.
    pub fn pml4_offset(&self) -> usize {
        PML4_OFFSET
    }
}

/// Checks the slots and computes the layout.
///
/// `slots` are `(guest_phys, len, host_addr)` in the caller's order.
pub(crate) fn plan(
    slots: &[(u64, u64, u64)],
    stride: u64,
    start_gpa: u64,
    control_gpa: u64,
    huge_1g: bool,
    phys_bits: u8,
) -> Result<Plan, ConfigError> {
    if slots.is_empty() {
        return Err(ConfigError::NoRam);
    }
    if slots.len() > image::MAX_RANGES {
        return Err(ConfigError::TooManySlots {
            count: slots.len(),
            max: image::MAX_RANGES,
        });
    }
    if stride < 8 || !stride.is_power_of_two() {
        return Err(ConfigError::Stride(stride));
    }
    let addr_limit = 1u64.checked_shl(u32::from(phys_bits)).unwrap_or(u64::MAX);
    for (index, &(gpa, len, host)) in slots.iter().enumerate() {
        if len == 0 {
            return Err(ConfigError::EmptySlot { index });
        }
        for (what, value) in [
            ("guest-physical address", gpa),
            ("length", len),
            ("host address", host),
        ] {
            if value % PAGE_4K != 0 {
                return Err(ConfigError::Misaligned { index, what, value });
            }
        }
        match gpa.checked_add(len) {
            Some(end) if end <= addr_limit => {}
            _ => {
                return Err(ConfigError::AddressTooHigh {
                    end: gpa.saturating_add(len),
                    phys_bits,
                })
            }
        }
    }
    let mut order: Vec<usize> = (0..slots.len()).collect();
    order.sort_by_key(|&i| slots[i].0);
    for pair in order.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        if slots[a].0 + slots[a].1 > slots[b].0 {
            return Err(ConfigError::Overlap {
                first: a.min(b),
                second: a.max(b),
            });
        }
    }
    if !control_gpa.is_multiple_of(PAGE_4K) {
        return Err(ConfigError::Misaligned {
            index: usize::MAX,
            what: "control slot address",
            value: control_gpa,
        });
    }

    let ram_end = order
        .iter()
        .map(|&i| slots[i].0 + slots[i].1)
        .max()
        .unwrap_or(0);
    // The page tables' size depends on the map limit, which depends on where
    // the control slot ends: size it for the larger of the two candidates.
    let tables_for = |limit: u64| -> u64 {
        let gib = limit.div_ceil(GIB);
        let pdpts = limit.div_ceil(PDPT_SPAN);
        (1 + pdpts + if huge_1g { 0 } else { gib }) * PAGE_4K
    };
    let provisional_limit = ram_end.max(control_gpa + GIB).next_multiple_of(GIB);
    let control_len = PML4_OFFSET as u64 + tables_for(provisional_limit);
    let control_end = control_gpa
        .checked_add(control_len)
        .filter(|&e| e <= addr_limit)
        .ok_or(ConfigError::AddressTooHigh {
            end: control_gpa.saturating_add(control_len),
            phys_bits,
        })?;
    let map_limit = ram_end.max(control_end).next_multiple_of(GIB);
    debug_assert!(tables_for(map_limit) <= tables_for(provisional_limit));
    for (index, &(gpa, len, _)) in slots.iter().enumerate() {
        if gpa < control_end && control_gpa < gpa + len {
            return Err(ConfigError::ControlOverlap {
                index,
                control_start: control_gpa,
                control_end,
            });
        }
    }

    let mut ranges = Vec::with_capacity(slots.len());
    let mut expected_pages = 0;
    for &i in &order {
        let (gpa, len, _) = slots[i];
        let (start, end) = (gpa.max(start_gpa), gpa + len);
        if start < end {
            ranges.push((start, end));
            expected_pages += stride_pages(start, end, stride).count() as u64;
        }
    }
    Ok(Plan {
        control_gpa,
        control_len: usize::try_from(control_len).map_err(|_| ConfigError::AddressTooHigh {
            end: control_end,
            phys_bits,
        })?,
        map_limit,
        huge_1g,
        ranges,
        expected_pages,
    })
}

/// What the PVH path of the guest touches for `ranges` (the loader's memory
/// map): each range clipped to `[min_gpa, map_limit)`, pages overlapping
/// `skip` (the guest's own image) left out. Returns the page count and
/// whether clipping at `map_limit` happened (the guest's `status` bit 0).
pub(crate) fn pvh_expected(
    ranges: &[(u64, u64)],
    stride: u64,
    min_gpa: u64,
    map_limit: u64,
    skip: (u64, u64),
) -> (u64, bool) {
    let mut pages = 0;
    let mut clipped = false;
    for &(start, end) in ranges.iter().take(image::MAX_RANGES) {
        let start = start.max(min_gpa);
        let end = if end > map_limit {
            clipped = true;
            map_limit
        } else {
            end
        };
        if start < end {
            pages += stride_pages(start, end, stride)
                .filter(|&a| !(a < skip.1 && a + 8 > skip.0))
                .count() as u64;
        }
    }
    (pages, clipped)
}

pub(crate) fn put_u64(buf: &mut [u8], offset: usize, value: u64) {
    buf[offset..offset + 8].copy_from_slice(&value.to_le_bytes());
}

/// Reads a little-endian u64 at `offset`.
pub(crate) fn get_u64(buf: &[u8], offset: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&buf[offset..offset + 8]);
    u64::from_le_bytes(b)
}

/// Fills the control slot: image, parameter block, page tables.
///
/// # Panics
///
/// If `buf` is shorter than `plan.control_len` (a bug in the caller).
pub(crate) fn fill_control(plan: &Plan, stride: u64, marker: u64, buf: &mut [u8]) {
    assert!(buf.len() >= plan.control_len, "control slot too small");
    buf[..plan.control_len].fill(0);
    buf[..image::FILE_END].copy_from_slice(&image::IMAGE);
    let p = image::PARAMS;
    put_u64(buf, p + image::P_STRIDE, stride);
    put_u64(buf, p + image::P_MARKER, marker);
    // The control slot is not caller RAM: nothing to skip.
    put_u64(buf, p + image::P_SKIPLO, 0);
    put_u64(buf, p + image::P_SKIPHI, 0);
    put_u64(buf, p + image::P_NRANGES, plan.ranges.len() as u64);
    for (i, &(start, end)) in plan.ranges.iter().enumerate() {
        put_u64(buf, p + image::P_RANGES + 16 * i, start);
        put_u64(buf, p + image::P_RANGES + 16 * i + 8, end);
    }
    build_page_tables(plan, &mut buf[..plan.control_len]);
}

/// Identity map of `[0, plan.map_limit)`, written at `plan.pml4_offset()`.
fn build_page_tables(plan: &Plan, buf: &mut [u8]) {
    let page = PAGE_4K as usize;
    let gib = plan.map_limit / GIB;
    let pdpts = plan.map_limit.div_ceil(PDPT_SPAN);
    let pml4 = plan.pml4_offset();
    let pdpt_at = |i: u64| pml4 + page * (1 + i as usize);
    let pd_at = |g: u64| pml4 + page * (1 + pdpts as usize + g as usize);
    for i in 0..pdpts {
        put_u64(
            buf,
            pml4 + 8 * i as usize,
            (plan.control_gpa + pdpt_at(i) as u64) | PTE_TABLE,
        );
    }
    for g in 0..gib {
        let entry = pdpt_at(g / 512) + 8 * (g % 512) as usize;
        if plan.huge_1g {
            put_u64(buf, entry, (g * GIB) | PTE_LEAF);
        } else {
            put_u64(buf, entry, (plan.control_gpa + pd_at(g) as u64) | PTE_TABLE);
            for k in 0..512u64 {
                put_u64(
                    buf,
                    pd_at(g) + 8 * k as usize,
                    (g * GIB + (k << 21)) | PTE_LEAF,
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Software page walk through the host-built tables.
    fn translate(plan: &Plan, buf: &[u8], va: u64) -> Option<u64> {
        let read = |gpa: u64| -> u64 {
            let off = (gpa - plan.control_gpa) as usize;
            get_u64(buf, off)
        };
        let pml4e = read(plan.control_gpa + plan.pml4_offset() as u64 + 8 * ((va >> 39) & 511));
        if pml4e & 1 == 0 {
            return None;
        }
        let pdpte = read((pml4e & !0xfff) + 8 * ((va >> 30) & 511));
        if pdpte & 1 == 0 {
            return None;
        }
        if pdpte & 0x80 != 0 {
            return Some((pdpte & !0xfff & !(GIB - 1)) | (va & (GIB - 1)));
        }
        let pde = read((pdpte & !0xfff) + 8 * ((va >> 21) & 511));
        if pde & 0x81 != 0x81 {
            return None;
        }
        Some((pde & !0xfff & !((1 << 21) - 1)) | (va & ((1 << 21) - 1)))
    }

    fn slot(gpa: u64, len: u64) -> (u64, u64, u64) {
        (gpa, len, 0x7f00_0000_0000)
    }

    #[test]
    fn pattern_is_marker_xor_gpa() {
        assert_eq!(pattern(0xff00, 0x0f0f), 0xf00f);
    }

    #[test]
    fn stride_pages_align_up_and_fit_below_end() {
        let v: Vec<u64> = stride_pages(0x1000, 0x60_0000, 0x20_0000).collect();
        assert_eq!(v, [0x20_0000, 0x40_0000]);
        let v: Vec<u64> = stride_pages(0, 0x40_0008, 0x20_0000).collect();
        assert_eq!(v, [0, 0x20_0000, 0x40_0000]);
        let v: Vec<u64> = stride_pages(0, 0x40_0007, 0x20_0000).collect();
        assert_eq!(v, [0, 0x20_0000]);
        assert_eq!(stride_pages(0, 100, 0).count(), 0);
        assert_eq!(stride_pages(u64::MAX - 4, u64::MAX, 8).count(), 0);
    }

    #[test]
    fn plan_rejects_bad_input() {
        let c = DEFAULT_CONTROL_GPA;
        assert_eq!(plan(&[], 8, 0, c, true, 46), Err(ConfigError::NoRam));
        let one = [slot(0, 1 << 20)];
        assert_eq!(plan(&one, 12, 0, c, true, 46), Err(ConfigError::Stride(12)));
        assert_eq!(plan(&one, 4, 0, c, true, 46), Err(ConfigError::Stride(4)));
        assert_eq!(plan(&one, 0, 0, c, true, 46), Err(ConfigError::Stride(0)));
        assert_eq!(
            plan(&[slot(0, 0)], 8, 0, c, true, 46),
            Err(ConfigError::EmptySlot { index: 0 })
        );
        assert!(matches!(
            plan(&[slot(0x800, 4096)], 8, 0, c, true, 46),
            Err(ConfigError::Misaligned { index: 0, .. })
        ));
        assert!(matches!(
            plan(&[(0, 4096, 0x10)], 8, 0, c, true, 46),
            Err(ConfigError::Misaligned {
                what: "host address",
                ..
            })
        ));
        assert_eq!(
            plan(
                &[slot(1 << 30, 1 << 30), slot(0, (1 << 30) + 4096)],
                8,
                0,
                c,
                true,
                46
            ),
            Err(ConfigError::Overlap {
                first: 0,
                second: 1
            })
        );
        assert!(matches!(
            plan(&[slot(0, 8 << 30)], 8, 0, c, true, 46),
            Err(ConfigError::ControlOverlap { index: 0, .. })
        ));
        assert!(matches!(
            plan(&[slot(1 << 40, 4096)], 8, 0, c, true, 39),
            Err(ConfigError::AddressTooHigh { .. })
        ));
        let many: Vec<_> = (0..33).map(|i| slot(i << 20, 4096)).collect();
        assert!(matches!(
            plan(&many, 8, 0, c, true, 46),
            Err(ConfigError::TooManySlots { count: 33, .. })
        ));
    }

    #[test]
    fn plan_split_layout_counts_pages() {
        // hugemem's layout for 8 GiB: [0, 3 GiB) + [4 GiB, 9 GiB).
        let slots = [slot(4 << 30, 5 << 30), slot(0, 3 << 30)];
        let p = plan(&slots, 1 << 30, 0, DEFAULT_CONTROL_GPA, true, 46).expect("plan");
        assert_eq!(p.ranges, [(0, 3 << 30), (4 << 30, 9 << 30)]);
        assert_eq!(p.expected_pages, 8);
        assert_eq!(p.map_limit, 9 << 30);
        let p = plan(&slots, 1 << 30, 5 << 30, DEFAULT_CONTROL_GPA, true, 46).expect("plan");
        assert_eq!(p.ranges, [(5 << 30, 9 << 30)]);
        assert_eq!(p.expected_pages, 4);
    }

    #[test]
    fn page_tables_identity_map_everything() {
        for huge_1g in [true, false] {
            let slots = [slot(0, 3 << 30), slot(4 << 30, 5 << 30)];
            let p = plan(&slots, 2 << 20, 0, DEFAULT_CONTROL_GPA, huge_1g, 46).expect("plan");
            let mut buf = vec![0u8; p.control_len];
            fill_control(&p, 2 << 20, 7, &mut buf);
            for va in [
                0,
                0x1234_5678,
                3 << 30,
                DEFAULT_CONTROL_GPA + 0x1a2,
                (9 << 30) - 8,
            ] {
                assert_eq!(translate(&p, &buf, va), Some(va), "va {va:#x} 1g={huge_1g}");
            }
            assert_eq!(translate(&p, &buf, 9 << 30), None);
            assert_eq!(get_u64(&buf, image::PARAMS + image::P_NRANGES), 2);
            assert_eq!(get_u64(&buf, image::PARAMS + image::P_RANGES + 16), 4 << 30);
            assert_eq!(get_u64(&buf, image::PARAMS + image::P_MARKER), 7);
        }
    }

    #[test]
    fn pvh_expected_clips_and_skips() {
        let ranges = [(0, 0x9_fc00), (0x10_0000, 3 << 30), (4 << 30, 6 << 30)];
        let skip = (0x10_0000, 0x10_8000);
        // 2 MiB stride below 4 GiB: page 0, then 2 MiB .. 3 GiB; 1 MiB is skipped
        // anyway because 0x100000 rounds up to 2 MiB.
        let (pages, clipped) = pvh_expected(&ranges, 2 << 20, 0, 4 << 30, skip);
        assert_eq!((pages, clipped), (1 + 1535, true));
        let (pages, clipped) = pvh_expected(&ranges, 2 << 20, 0, 512 << 30, skip);
        assert_eq!((pages, clipped), (1 + 1535 + 1024, false));
        // 4 KiB stride: the image's 8 pages at 1 MiB are left out.
        let (pages, _) = pvh_expected(&[(0x10_0000, 0x20_0000)], 4096, 0, 4 << 30, skip);
        assert_eq!(pages, 256 - 8);
        let (pages, _) = pvh_expected(&ranges, 1 << 30, 1 << 30, 512 << 30, skip);
        assert_eq!(pages, 2 + 2);
    }

    #[test]
    fn page_tables_beyond_512_gib() {
        let slots = [slot(1 << 40, 1 << 30)];
        let p = plan(&slots, 1 << 30, 0, DEFAULT_CONTROL_GPA, true, 46).expect("plan");
        let mut buf = vec![0u8; p.control_len];
        fill_control(&p, 1 << 30, 0, &mut buf);
        let va = (1u64 << 40) + 0x42;
        assert_eq!(translate(&p, &buf, va), Some(va));
        assert_eq!(
            translate(&p, &buf, DEFAULT_CONTROL_GPA),
            Some(DEFAULT_CONTROL_GPA)
        );
    }
}
