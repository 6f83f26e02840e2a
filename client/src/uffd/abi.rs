//! userfaultfd kernel ABI: numbers and `#[repr(C)]` structs from
//! `include/uapi/linux/userfaultfd.h`, nothing else.
//!
//! The ioctl numbers are recomputed from the `_IOC` formula of
//! `include/uapi/asm-generic/ioctl.h` in `const fn`s, so a struct whose size
//! drifts from the kernel's changes the number and fails the unit test that
//! pins the values the C headers give. Every struct's size is also asserted at
//! compile time.
//!
//! The safe functions that use these live in the parent module; this file has
//! no `unsafe`.

#![allow(missing_docs)] // Names mirror the kernel header; each group is documented.

use std::mem::size_of;

// ---------------------------------------------------------------------------
// ioctl number formula (asm-generic/ioctl.h; x86_64, aarch64 and riscv use it).

const IOC_NRBITS: u32 = 8;
const IOC_TYPEBITS: u32 = 8;
const IOC_SIZEBITS: u32 = 14;
const IOC_NRSHIFT: u32 = 0;
const IOC_TYPESHIFT: u32 = IOC_NRSHIFT + IOC_NRBITS;
const IOC_SIZESHIFT: u32 = IOC_TYPESHIFT + IOC_TYPEBITS;
const IOC_DIRSHIFT: u32 = IOC_SIZESHIFT + IOC_SIZEBITS;

const IOC_NONE: u32 = 0;
const IOC_WRITE: u32 = 1;
const IOC_READ: u32 = 2;

/// `_IOC(dir, type, nr, size)`. Fails to compile (const panic) if `size` does
/// not fit the 14-bit size field.
pub const fn ioc(dir: u32, ty: u32, nr: u32, size: usize) -> u32 {
    assert!(
        size < (1 << IOC_SIZEBITS),
        "ioctl argument too large for _IOC"
    );
    assert!(ty < (1 << IOC_TYPEBITS) && nr < (1 << IOC_NRBITS));
    // `size` < 2^14 was checked just above, so the narrowing cannot lose bits.
    #[allow(clippy::cast_possible_truncation)]
    let size = size as u32;
    (dir << IOC_DIRSHIFT) | (ty << IOC_TYPESHIFT) | (nr << IOC_NRSHIFT) | (size << IOC_SIZESHIFT)
}

/// `_IO(type, nr)`: no argument.
pub const fn io(ty: u32, nr: u32) -> u32 {
    ioc(IOC_NONE, ty, nr, 0)
}

/// `_IOR(type, nr, T)`: the kernel writes `T` ("userland is reading").
pub const fn ior<T>(ty: u32, nr: u32) -> u32 {
    ioc(IOC_READ, ty, nr, size_of::<T>())
}

/// `_IOWR(type, nr, T)`: the kernel reads and writes `T`.
pub const fn iowr<T>(ty: u32, nr: u32) -> u32 {
    ioc(IOC_READ | IOC_WRITE, ty, nr, size_of::<T>())
}

// ---------------------------------------------------------------------------
// Magic numbers.

/// ioctl type byte of both the uffd and `/dev/userfaultfd` ioctls.
pub const UFFDIO: u32 = 0xAA;
/// `UFFD_API`: the only API version there is.
pub const UFFD_API: u64 = 0xAA;

/// `USERFAULTFD_IOC_NEW` on `/dev/userfaultfd`: argument = the `userfaultfd(2)`
/// flags, returns a new uffd (Linux 6.1+).
pub const USERFAULTFD_IOC_NEW: u32 = io(UFFDIO, 0x00);

/// `userfaultfd(2)` flag: only faults from user mode are handled. Faults the
/// kernel takes on the process's behalf (KVM's guest accesses through
/// `get_user_pages`, `copy_from_user` in syscalls) then fail instead of
/// waiting; under KVM they turn into silent MMIO exits. Never the default here.
pub const UFFD_USER_MODE_ONLY: i32 = 1;

// ---------------------------------------------------------------------------
// ioctl command numbers (`_UFFDIO_*`): also the bit positions in the `ioctls`
// masks that UFFDIO_API and UFFDIO_REGISTER return.

pub const NR_REGISTER: u32 = 0x00;
pub const NR_UNREGISTER: u32 = 0x01;
pub const NR_WAKE: u32 = 0x02;
pub const NR_COPY: u32 = 0x03;
pub const NR_ZEROPAGE: u32 = 0x04;
/// `_UFFDIO_MOVE` (6.8+); no wrapper here.
pub const NR_MOVE: u32 = 0x05;
pub const NR_WRITEPROTECT: u32 = 0x06;
pub const NR_CONTINUE: u32 = 0x07;
/// `_UFFDIO_POISON` (6.6+); no wrapper here.
pub const NR_POISON: u32 = 0x08;
pub const NR_API: u32 = 0x3F;

pub const UFFDIO_API: u32 = iowr::<UffdioApi>(UFFDIO, NR_API);
pub const UFFDIO_REGISTER: u32 = iowr::<UffdioRegister>(UFFDIO, NR_REGISTER);
/// `_IOR`, not `_IOW`: a historical mistake the kernel header keeps.
pub const UFFDIO_UNREGISTER: u32 = ior::<UffdioRange>(UFFDIO, NR_UNREGISTER);
/// `_IOR` like UNREGISTER.
pub const UFFDIO_WAKE: u32 = ior::<UffdioRange>(UFFDIO, NR_WAKE);
pub const UFFDIO_COPY: u32 = iowr::<UffdioCopy>(UFFDIO, NR_COPY);
pub const UFFDIO_ZEROPAGE: u32 = iowr::<UffdioZeropage>(UFFDIO, NR_ZEROPAGE);
pub const UFFDIO_WRITEPROTECT: u32 = iowr::<UffdioWriteprotect>(UFFDIO, NR_WRITEPROTECT);
pub const UFFDIO_CONTINUE: u32 = iowr::<UffdioContinue>(UFFDIO, NR_CONTINUE);

// ---------------------------------------------------------------------------
// UFFDIO_API feature bits (`uffdio_api.features`).

pub const UFFD_FEATURE_PAGEFAULT_FLAG_WP: u64 = 1 << 0;
pub const UFFD_FEATURE_EVENT_FORK: u64 = 1 << 1;
pub const UFFD_FEATURE_EVENT_REMAP: u64 = 1 << 2;
pub const UFFD_FEATURE_EVENT_REMOVE: u64 = 1 << 3;
pub const UFFD_FEATURE_MISSING_HUGETLBFS: u64 = 1 << 4;
pub const UFFD_FEATURE_MISSING_SHMEM: u64 = 1 << 5;
pub const UFFD_FEATURE_EVENT_UNMAP: u64 = 1 << 6;
pub const UFFD_FEATURE_SIGBUS: u64 = 1 << 7;
pub const UFFD_FEATURE_THREAD_ID: u64 = 1 << 8;
pub const UFFD_FEATURE_MINOR_HUGETLBFS: u64 = 1 << 9;
pub const UFFD_FEATURE_MINOR_SHMEM: u64 = 1 << 10;
pub const UFFD_FEATURE_EXACT_ADDRESS: u64 = 1 << 11;
pub const UFFD_FEATURE_WP_HUGETLBFS_SHMEM: u64 = 1 << 12;
pub const UFFD_FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
pub const UFFD_FEATURE_POISON: u64 = 1 << 14;
pub const UFFD_FEATURE_WP_ASYNC: u64 = 1 << 15;
pub const UFFD_FEATURE_MOVE: u64 = 1 << 16;

/// Feature bits with their header names, lowest bit first (for messages).
pub const FEATURE_NAMES: [(u64, &str); 17] = [
    (UFFD_FEATURE_PAGEFAULT_FLAG_WP, "PAGEFAULT_FLAG_WP"),
    (UFFD_FEATURE_EVENT_FORK, "EVENT_FORK"),
    (UFFD_FEATURE_EVENT_REMAP, "EVENT_REMAP"),
    (UFFD_FEATURE_EVENT_REMOVE, "EVENT_REMOVE"),
    (UFFD_FEATURE_MISSING_HUGETLBFS, "MISSING_HUGETLBFS"),
    (UFFD_FEATURE_MISSING_SHMEM, "MISSING_SHMEM"),
    (UFFD_FEATURE_EVENT_UNMAP, "EVENT_UNMAP"),
    (UFFD_FEATURE_SIGBUS, "SIGBUS"),
    (UFFD_FEATURE_THREAD_ID, "THREAD_ID"),
    (UFFD_FEATURE_MINOR_HUGETLBFS, "MINOR_HUGETLBFS"),
    (UFFD_FEATURE_MINOR_SHMEM, "MINOR_SHMEM"),
    (UFFD_FEATURE_EXACT_ADDRESS, "EXACT_ADDRESS"),
    (UFFD_FEATURE_WP_HUGETLBFS_SHMEM, "WP_HUGETLBFS_SHMEM"),
    (UFFD_FEATURE_WP_UNPOPULATED, "WP_UNPOPULATED"),
    (UFFD_FEATURE_POISON, "POISON"),
    (UFFD_FEATURE_WP_ASYNC, "WP_ASYNC"),
    (UFFD_FEATURE_MOVE, "MOVE"),
];

// ---------------------------------------------------------------------------
// UFFDIO_REGISTER modes and per-ioctl mode bits.

pub const UFFDIO_REGISTER_MODE_MISSING: u64 = 1 << 0;
pub const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;
pub const UFFDIO_REGISTER_MODE_MINOR: u64 = 1 << 2;

pub const UFFDIO_COPY_MODE_DONTWAKE: u64 = 1 << 0;
pub const UFFDIO_COPY_MODE_WP: u64 = 1 << 1;
pub const UFFDIO_ZEROPAGE_MODE_DONTWAKE: u64 = 1 << 0;
pub const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;
pub const UFFDIO_WRITEPROTECT_MODE_DONTWAKE: u64 = 1 << 1;
pub const UFFDIO_CONTINUE_MODE_DONTWAKE: u64 = 1 << 0;
/// Map the continued page write-protected (6.4+).
pub const UFFDIO_CONTINUE_MODE_WP: u64 = 1 << 1;

// ---------------------------------------------------------------------------
// Events read from the fd (`uffd_msg.event`) and page-fault flags.

pub const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
pub const UFFD_EVENT_FORK: u8 = 0x13;
pub const UFFD_EVENT_REMAP: u8 = 0x14;
pub const UFFD_EVENT_REMOVE: u8 = 0x15;
pub const UFFD_EVENT_UNMAP: u8 = 0x16;

/// The faulting access was a write.
pub const UFFD_PAGEFAULT_FLAG_WRITE: u64 = 1 << 0;
/// The fault hit a write-protected page (register mode WP).
pub const UFFD_PAGEFAULT_FLAG_WP: u64 = 1 << 1;
/// Minor fault: the page is in the page cache but not mapped (mode MINOR).
/// Neither WP nor MINOR set means a MISSING fault.
pub const UFFD_PAGEFAULT_FLAG_MINOR: u64 = 1 << 2;

// ---------------------------------------------------------------------------
// Structs.

/// `struct uffdio_api`: `api` and `features` in, `features` and `ioctls` out.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct UffdioApi {
    pub api: u64,
    pub features: u64,
    pub ioctls: u64,
}

/// `struct uffdio_range`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct UffdioRange {
    pub start: u64,
    pub len: u64,
}

/// `struct uffdio_register`: `ioctls` is written by the kernel.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct UffdioRegister {
    pub range: UffdioRange,
    pub mode: u64,
    pub ioctls: u64,
}

/// `struct uffdio_copy`: `copy` is written by the kernel (bytes copied or
/// `-errno`).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct UffdioCopy {
    pub dst: u64,
    pub src: u64,
    pub len: u64,
    pub mode: u64,
    pub copy: i64,
}

/// `struct uffdio_zeropage`: `zeropage` is written by the kernel.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct UffdioZeropage {
    pub range: UffdioRange,
    pub mode: u64,
    pub zeropage: i64,
}

/// `struct uffdio_writeprotect`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct UffdioWriteprotect {
    pub range: UffdioRange,
    pub mode: u64,
}

/// `struct uffdio_continue`: `mapped` is written by the kernel.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct UffdioContinue {
    pub range: UffdioRange,
    pub mode: u64,
    pub mapped: i64,
}

/// `struct uffd_msg` (packed, 32 bytes), with its union kept as the raw 24
/// bytes and read through accessors. Byte arrays give it the kernel's
/// alignment of 1 and make every read safe: no union, no unaligned reference.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct UffdMsg {
    pub event: u8,
    pub reserved1: u8,
    pub reserved2: [u8; 2],
    pub reserved3: [u8; 4],
    /// The `arg` union.
    pub arg: [u8; 24],
}

impl UffdMsg {
    fn u64_at(&self, offset: usize) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.arg[offset..offset + 8]);
        u64::from_ne_bytes(b)
    }

    fn u32_at(&self, offset: usize) -> u32 {
        let mut b = [0u8; 4];
        b.copy_from_slice(&self.arg[offset..offset + 4]);
        u32::from_ne_bytes(b)
    }

    fn put_u64(&mut self, offset: usize, value: u64) {
        self.arg[offset..offset + 8].copy_from_slice(&value.to_ne_bytes());
    }

    fn put_u32(&mut self, offset: usize, value: u32) {
        self.arg[offset..offset + 4].copy_from_slice(&value.to_ne_bytes());
    }

    /// `arg.pagefault.flags`.
    pub fn pagefault_flags(&self) -> u64 {
        self.u64_at(0)
    }
    /// `arg.pagefault.address` (page-aligned unless EXACT_ADDRESS).
    pub fn pagefault_address(&self) -> u64 {
        self.u64_at(8)
    }
    /// `arg.pagefault.feat.ptid` (0 unless THREAD_ID).
    pub fn pagefault_ptid(&self) -> u32 {
        self.u32_at(16)
    }
    /// `arg.fork.ufd`: an fd the kernel installed in the reader's table.
    pub fn fork_ufd(&self) -> u32 {
        self.u32_at(0)
    }
    /// `arg.remap.from`.
    pub fn remap_from(&self) -> u64 {
        self.u64_at(0)
    }
    /// `arg.remap.to`.
    pub fn remap_to(&self) -> u64 {
        self.u64_at(8)
    }
    /// `arg.remap.len`.
    pub fn remap_len(&self) -> u64 {
        self.u64_at(16)
    }
    /// `arg.remove.start` (also used by UNMAP).
    pub fn remove_start(&self) -> u64 {
        self.u64_at(0)
    }
    /// `arg.remove.end` (exclusive; also used by UNMAP).
    pub fn remove_end(&self) -> u64 {
        self.u64_at(8)
    }

    /// A page-fault message, as the kernel would write it (tests, fuzzing).
    pub fn pagefault(flags: u64, address: u64, ptid: u32) -> Self {
        let mut m = Self {
            event: UFFD_EVENT_PAGEFAULT,
            ..Self::default()
        };
        m.put_u64(0, flags);
        m.put_u64(8, address);
        m.put_u32(16, ptid);
        m
    }

    /// A REMOVE or UNMAP message.
    pub fn range_event(event: u8, start: u64, end: u64) -> Self {
        let mut m = Self {
            event,
            ..Self::default()
        };
        m.put_u64(0, start);
        m.put_u64(8, end);
        m
    }

    /// A REMAP message.
    pub fn remap(from: u64, to: u64, len: u64) -> Self {
        let mut m = Self {
            event: UFFD_EVENT_REMAP,
            ..Self::default()
        };
        m.put_u64(0, from);
        m.put_u64(8, to);
        m.put_u64(16, len);
        m
    }

    /// A FORK message carrying fd number `ufd`.
    pub fn fork(ufd: u32) -> Self {
        let mut m = Self {
            event: UFFD_EVENT_FORK,
            ..Self::default()
        };
        m.put_u32(0, ufd);
        m
    }
}

// Compile-time layout checks against the kernel's sizes.
const _: () = assert!(size_of::<UffdioApi>() == 24);
const _: () = assert!(size_of::<UffdioRange>() == 16);
const _: () = assert!(size_of::<UffdioRegister>() == 32);
const _: () = assert!(size_of::<UffdioCopy>() == 40);
const _: () = assert!(size_of::<UffdioZeropage>() == 32);
const _: () = assert!(size_of::<UffdioWriteprotect>() == 24);
const _: () = assert!(size_of::<UffdioContinue>() == 32);
const _: () = assert!(size_of::<UffdMsg>() == 32);
const _: () = assert!(std::mem::align_of::<UffdMsg>() == 1);

#[cfg(test)]
mod tests {
    use super::*;

    /// The values `<linux/userfaultfd.h>` gives (printed by a C program on
    /// x86_64 against the installed uapi headers).
    #[test]
    fn uffd_ioctl_numbers_match_kernel_headers() {
        assert_eq!(UFFDIO_API, 0xc018_aa3f);
        assert_eq!(UFFDIO_REGISTER, 0xc020_aa00);
        assert_eq!(UFFDIO_UNREGISTER, 0x8010_aa01);
        assert_eq!(UFFDIO_WAKE, 0x8010_aa02);
        assert_eq!(UFFDIO_COPY, 0xc028_aa03);
        assert_eq!(UFFDIO_ZEROPAGE, 0xc020_aa04);
        assert_eq!(UFFDIO_WRITEPROTECT, 0xc018_aa06);
        assert_eq!(UFFDIO_CONTINUE, 0xc020_aa07);
        assert_eq!(USERFAULTFD_IOC_NEW, 0xaa00);
    }

    #[test]
    fn uffd_ioc_formula_fields() {
        // _IOWR('V', 1, u32): a well-known shape, checked bit by bit.
        let n = iowr::<u32>(0x56, 1);
        assert_eq!(n >> 30, 3);
        assert_eq!((n >> 16) & 0x3fff, 4);
        assert_eq!((n >> 8) & 0xff, 0x56);
        assert_eq!(n & 0xff, 1);
    }

    #[test]
    fn uffd_msg_accessors_round_trip() {
        let m = UffdMsg::pagefault(
            UFFD_PAGEFAULT_FLAG_MINOR | UFFD_PAGEFAULT_FLAG_WRITE,
            0x7f00_0020_1000,
            4242,
        );
        assert_eq!(m.event, UFFD_EVENT_PAGEFAULT);
        assert_eq!(m.pagefault_flags(), 5);
        assert_eq!(m.pagefault_address(), 0x7f00_0020_1000);
        assert_eq!(m.pagefault_ptid(), 4242);

        let r = UffdMsg::remap(1, 2, 3);
        assert_eq!((r.remap_from(), r.remap_to(), r.remap_len()), (1, 2, 3));
        let u = UffdMsg::range_event(UFFD_EVENT_UNMAP, 0x1000, 0x3000);
        assert_eq!((u.remove_start(), u.remove_end()), (0x1000, 0x3000));
        assert_eq!(UffdMsg::fork(7).fork_ufd(), 7);
    }

    /// The kernel's layout, byte offsets from the start of `uffd_msg`:
    /// event 0, arg 8, pagefault.address 16, pagefault.feat.ptid 24.
    #[test]
    fn uffd_msg_offsets_match_kernel() {
        let m = UffdMsg::pagefault(0x0102_0304_0506_0708, 0x1112_1314_1516_1718, 0x2122_2324);
        let bytes: Vec<u8> = [
            &[m.event, m.reserved1][..],
            &m.reserved2[..],
            &m.reserved3[..],
            &m.arg[..],
        ]
        .concat();
        assert_eq!(bytes.len(), 32);
        assert_eq!(bytes[0], 0x12);
        assert_eq!(&bytes[8..16], &0x0102_0304_0506_0708u64.to_ne_bytes());
        assert_eq!(&bytes[16..24], &0x1112_1314_1516_1718u64.to_ne_bytes());
        assert_eq!(&bytes[24..28], &0x2122_2324u32.to_ne_bytes());
    }

    #[test]
    fn uffd_feature_names_cover_every_bit_once() {
        let mut all = 0u64;
        for (i, (bit, _)) in FEATURE_NAMES.iter().enumerate() {
            assert_eq!(*bit, 1u64 << i);
            all |= bit;
        }
        assert_eq!(all, (1 << 17) - 1);
    }
}
