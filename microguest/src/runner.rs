//! The KVM runner: one VM, one vCPU started in long mode, the caller's RAM
//! slots plus the control slot, and a loop that timestamps the guest's port
//! writes.
//!
//! # Design
//!
//! The vCPU runs on the calling thread, so `first_instruction` is measured
//! without a thread hand-off. A scoped watchdog thread enforces
//! [`RunConfig::timeout`]: past the deadline it sends a real-time signal to
//! the vCPU thread (repeating every 10 ms, because a signal that lands just
//! before `KVM_RUN` is entered would otherwise be lost), `KVM_RUN` returns
//! `EINTR`, and [`run`] returns [`Error::Timeout`]. The alternative, running
//! the vCPU on a spawned thread and abandoning it on timeout, would leak a
//! thread that still uses the caller's memory.

mod error;
mod report;
mod vcpu;

use std::path::Path;
use std::time::{Duration, Instant};

use kvm_bindings::{kvm_userspace_memory_region, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Kvm, VmFd};

use crate::image;
use crate::layout::{self, get_u64, put_u64, GuestRam, DEFAULT_CONTROL_GPA};
use crate::pvh;
use crate::sys;
use report::{check, Expect};
use vcpu::{cpu_properties, drive_with_watchdog, Boot};

pub use error::Error;
pub use report::RunReport;

/// What to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunConfig {
    /// Distance between touched addresses, a power of two ≥ 8: typically the
    /// huge-page size (2 MiB or 1 GiB), so the guest touches each huge page once.
    pub stride: u64,
    /// Mixed into the value written to each page ([`crate::pattern`]).
    pub marker: u64,
    /// Guest-physical addresses below this are not touched.
    pub start_gpa: u64,
    /// Upper bound for the whole run (vCPU creation to guest exit).
    pub timeout: Duration,
    /// Guest-physical address of the runner's own control slot (4 KiB
    /// aligned, must not overlap caller RAM); see [`crate::layout`].
    pub control_gpa: u64,
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig {
            stride: 2 << 20,
            marker: 0x4855_4745_4d45_4d00, // "HUGEMEM\0"
            start_gpa: 0,
            timeout: Duration::from_secs(30),
            control_gpa: DEFAULT_CONTROL_GPA,
        }
    }
}
/// Whether KVM can be used here; `Err` carries a reason to print as
/// `SKIP: <reason>`.
///
/// Checks that `/dev/kvm` exists, opens, speaks API version 12 and creates a
/// VM. It does not run a guest.
pub fn kvm_available() -> Result<(), String> {
    if !Path::new("/dev/kvm").exists() {
        return Err("/dev/kvm does not exist".into());
    }
    let kvm = Kvm::new().map_err(|e| format!("cannot open /dev/kvm: {e}"))?;
    let version = kvm.get_api_version();
    if version != kvm_bindings::KVM_API_VERSION as i32 {
        return Err(format!("/dev/kvm speaks API version {version}, not 12"));
    }
    kvm.create_vm()
        .map_err(|e| format!("/dev/kvm cannot create a VM: {e}"))?;
    Ok(())
}

/// Runs the micro-guest over `ram` and checks what it did.
///
/// Registers each [`GuestRam`] as a KVM memory slot (slot numbers in the
/// given order), adds the control slot at [`RunConfig::control_gpa`], starts
/// one vCPU in long mode and waits until the guest exits. On return the guest
/// has written [`crate::pattern`] into the first 8 bytes of every page listed
/// by [`crate::stride_pages`] for each slot (clipped to
/// [`RunConfig::start_gpa`]), and nothing else in `ram`.
///
/// # Errors
///
/// [`Error::Config`] for slots or settings it refuses; the KVM variants when
/// an ioctl fails; [`Error::Timeout`], [`Error::GuestFault`] or
/// [`Error::Protocol`] when the guest does not behave.
pub fn run(ram: &[GuestRam<'_>], cfg: &RunConfig) -> Result<RunReport, Error> {
    let setup_start = Instant::now();
    let slots = slot_list(ram);
    // Validate what needs no KVM first, with placeholder CPU properties.
    layout::plan(&slots, cfg.stride, cfg.start_gpa, cfg.control_gpa, true, 52)?;

    let kvm = Kvm::new().map_err(Error::OpenKvm)?;
    let cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(Error::SupportedCpuid)?;
    let (huge_1g, phys_bits) = cpu_properties(&cpuid);
    let plan = layout::plan(
        &slots,
        cfg.stride,
        cfg.start_gpa,
        cfg.control_gpa,
        huge_1g,
        phys_bits,
    )?;

    // Declared before the VM so that it is unmapped only after the VM is gone.
    let mut control = sys::AnonMapping::new(plan.control_len).map_err(Error::ControlSlot)?;
    layout::fill_control(&plan, cfg.stride, cfg.marker, control.as_mut_slice());
    // SAFETY: `control` is declared before `vm`, so it is dropped after it on
    // every path, and `vm` is dropped explicitly below before `control` is read.
    let vm = unsafe { create_vm(&kvm, ram, &control, plan.control_gpa) }?;
    let setup = setup_start.elapsed();
    tracing::debug!(?plan, ?setup, "microguest VM ready");

    let boot = Boot::Long {
        control_gpa: plan.control_gpa,
        pml4: plan.control_gpa + plan.pml4_offset() as u64,
    };
    let outcome = drive_with_watchdog(&vm, &cpuid, &boot, cfg.timeout)?;
    drop(vm);
    let expect = Expect {
        pages: plan.expected_pages,
        status: 0,
        huge_1g,
    };
    check(
        &expect,
        &outcome,
        &control.as_slice()[image::PARAMS..],
        setup,
    )
}

/// Boots a PVH ELF kernel (normally one made by [`crate::pvh_elf`]) the way
/// a PVH loader such as cloud-hypervisor does, and checks its report.
///
/// This exercises the guest's own 32-bit entry, page-table setup, long-mode
/// switch and memory-map parsing under KVM, without QEMU. The `PT_LOAD`
/// segment is copied into the caller's RAM (which must cover it: 1 MiB ..
/// 1 MiB + 32 KiB for [`crate::pvh_elf`] images), its zero-filled tail is
/// cleared, and `hvm_start_info` (version 1) with a memory map listing the
/// caller's slots as RAM is placed in the control slot at
/// [`DEFAULT_CONTROL_GPA`]. The vCPU starts in 32-bit protected mode, paging
/// off, `ebx` = start info. Stride, marker and start address come from the
/// image.
///
/// # Errors
///
/// As [`run`]; [`Error::Elf`] when the file is not a PVH kernel or its
/// segment is not inside the given RAM.
pub fn run_pvh(ram: &[GuestRam<'_>], elf: &[u8], timeout: Duration) -> Result<RunReport, Error> {
    let setup_start = Instant::now();
    let img = pvh::parse(elf).map_err(Error::Elf)?;
    let params = img
        .data
        .get(image::PARAMS..image::PARAMS + image::P_RANGES)
        .ok_or_else(|| Error::Elf("segment too short for the parameter block".into()))?;
    let stride = get_u64(params, image::P_STRIDE);
    let min_gpa = get_u64(params, image::P_MINGPA);
    let skip = (
        get_u64(params, image::P_SKIPLO),
        get_u64(params, image::P_SKIPHI),
    );
    let slots = slot_list(ram);
    // Same slot checks as `run` (overlaps, alignment, control slot).
    layout::plan(&slots, stride, min_gpa, DEFAULT_CONTROL_GPA, true, 52)?;

    let kvm = Kvm::new().map_err(Error::OpenKvm)?;
    let cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(Error::SupportedCpuid)?;
    let (huge_1g, _) = cpu_properties(&cpuid);

    // Load the segment into caller RAM.
    let seg_end = img.load_addr + img.mem_size;
    let target = ram
        .iter()
        .find(|r| r.guest_phys() <= img.load_addr && seg_end <= r.guest_phys() + r.len() as u64)
        .ok_or_else(|| {
            Error::Elf(format!(
                "segment {:#x}..{seg_end:#x} is not inside one RAM slot",
                img.load_addr
            ))
        })?;
    let offset = (img.load_addr - target.guest_phys()) as usize;
    let zeros = (img.mem_size - img.data.len() as u64) as usize;
    // SAFETY: no VM exists yet, so no vCPU runs on this memory.
    unsafe { target.write_at(offset, img.data, zeros) }
        .ok_or_else(|| Error::Elf("segment does not fit in its RAM slot".into()))?;

    // hvm_start_info and its memory map, in the control slot.
    let mut ranges: Vec<(u64, u64)> = slots.iter().map(|&(g, l, _)| (g, g + l)).collect();
    ranges.sort_unstable();
    let mut control = sys::AnonMapping::new(4096).map_err(Error::ControlSlot)?;
    let buf = control.as_mut_slice();
    let memmap = DEFAULT_CONTROL_GPA + START_INFO_SIZE as u64;
    buf[0..4].copy_from_slice(&image::START_INFO_MAGIC.to_le_bytes());
    buf[4..8].copy_from_slice(&1u32.to_le_bytes()); // version
    put_u64(buf, 0x28, memmap);
    buf[0x30..0x34].copy_from_slice(&(ranges.len() as u32).to_le_bytes());
    for (i, &(start, end)) in ranges.iter().enumerate() {
        let e = START_INFO_SIZE + 24 * i;
        put_u64(buf, e, start);
        put_u64(buf, e + 8, end - start);
        buf[e + 16..e + 20].copy_from_slice(&1u32.to_le_bytes()); // E820 RAM
    }
    // SAFETY: `control` is declared before `vm`, so it outlives it.
    let vm = unsafe { create_vm(&kvm, ram, &control, DEFAULT_CONTROL_GPA) }?;
    let setup = setup_start.elapsed();

    let boot = Boot::Pvh {
        entry: img.entry,
        start_info: DEFAULT_CONTROL_GPA,
    };
    let outcome = drive_with_watchdog(&vm, &cpuid, &boot, timeout)?;
    drop(vm);
    let map_limit = if huge_1g { 512 << 30 } else { 4 << 30 };
    let (pages, clipped) = layout::pvh_expected(&ranges, stride, min_gpa, map_limit, skip);
    let expect = Expect {
        pages,
        status: u64::from(clipped),
        huge_1g,
    };
    let mut block = [0u8; image::P_RANGES];
    // SAFETY: the VM and its vCPU are gone.
    unsafe { target.read_at(offset + image::PARAMS, &mut block) }
        .ok_or_else(|| Error::Elf("parameter block outside the RAM slot".into()))?;
    check(&expect, &outcome, &block, setup)
}

/// Size of `hvm_start_info` (version 1).
const START_INFO_SIZE: usize = 0x38;

fn slot_list(ram: &[GuestRam<'_>]) -> Vec<(u64, u64, u64)> {
    ram.iter()
        .map(|r| (r.guest_phys(), r.len() as u64, r.host_addr() as u64))
        .collect()
}

/// Creates the VM and registers the caller's slots (0..n) and the control
/// slot (n).
///
/// # Safety
///
/// `control` must stay alive until the returned VM is dropped (the caller's
/// slots are kept alive by `GuestRam`'s lifetime, which outlives any local).
unsafe fn create_vm(
    kvm: &Kvm,
    ram: &[GuestRam<'_>],
    control: &sys::AnonMapping,
    control_gpa: u64,
) -> Result<VmFd, Error> {
    let vm = kvm.create_vm().map_err(Error::CreateVm)?;
    for (slot, r) in ram.iter().enumerate() {
        // SAFETY: `GuestRam` guarantees (through its borrow or the contract of
        // `from_raw_parts`) that its range stays mapped read/write for its
        // lifetime, which outlives every local of `run`/`run_pvh` and so the
        // VM; `layout::plan` checked alignment and that no two slots overlap.
        unsafe {
            register(
                &vm,
                slot as u32,
                r.guest_phys(),
                r.len() as u64,
                r.host_addr(),
            )
        }?;
    }
    // SAFETY: the caller keeps `control` alive until the VM is dropped (this
    // function's contract); `layout::plan` checked it overlaps no caller slot.
    unsafe {
        register(
            &vm,
            ram.len() as u32,
            control_gpa,
            control.len() as u64,
            control.as_ptr(),
        )
    }?;
    Ok(vm)
}

/// Registers one memory slot.
///
/// # Safety
///
/// `host..host + len` must stay mapped read/write until `vm` is dropped, and
/// must not overlap another slot of `vm` in guest-physical space.
unsafe fn register(
    vm: &VmFd,
    slot: u32,
    guest_phys: u64,
    len: u64,
    host: *mut u8,
) -> Result<(), Error> {
    let region = kvm_userspace_memory_region {
        slot,
        flags: 0,
        guest_phys_addr: guest_phys,
        memory_size: len,
        userspace_addr: host as u64,
    };
    // SAFETY: the caller guarantees the mapping outlives `vm` (this function's
    // contract); KVM only accesses it while `vm` exists.
    unsafe { vm.set_user_memory_region(region) }.map_err(|source| Error::MemorySlot {
        slot,
        guest_phys,
        len,
        source,
    })
}
