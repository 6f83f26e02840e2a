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

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvm_bindings::{kvm_segment, kvm_userspace_memory_region, CpuId, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};

use crate::image;
use crate::layout::{self, get_u64, put_u64, ConfigError, GuestRam, DEFAULT_CONTROL_GPA};
use crate::pvh;
use crate::sys;

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

/// What a run measured and what the guest reported.
///
/// All durations are host `Instant`s taken when `KVM_RUN` returned with the
/// corresponding exit, measured from the run start: just before the vCPU is
/// created (VM creation and memory-slot registration are in
/// [`RunReport::setup`], not in the run).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunReport {
    /// VM creation, CPUID query, control-slot fill and slot registration.
    pub setup: Duration,
    /// Run start to the guest's first port write (its first instructions).
    pub first_instruction: Duration,
    /// Run start to the guest's "all pages touched" port write.
    pub all_touched: Duration,
    /// CPU time the vCPU thread used over [`RunReport::all_touched`] (its
    /// own page faults, the kernel's zeroing in them, and any spinning on a
    /// page another thread is faulting in), beside the wall time.
    pub all_touched_vcpu_cpu: Duration,
    /// Run start to the guest's exit port write.
    pub total: Duration,
    /// Pages the guest touched (equal to what the host expected, or [`run`]
    /// fails).
    pub pages_touched: u64,
    /// Whether any of the first-8-byte reads returned non-zero.
    pub saw_nonzero: bool,
    /// OR of every value the guest read.
    pub or_accumulator: u64,
    /// Returns from `KVM_RUN`, every exit counted.
    pub exits: u64,
    /// Whether the identity map used 1 GiB pages (else 2 MiB).
    pub huge_1g_mappings: bool,
    /// The guest's text report on COM1, e.g. `HUGEMEM-GUEST pages=32 nonzero=0 status=0\n`.
    pub serial: String,
}

/// A run that failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration or the RAM slots were refused before any KVM call.
    #[error("invalid run configuration")]
    Config(#[from] ConfigError),
    /// Opening `/dev/kvm` failed.
    #[error("cannot open /dev/kvm")]
    OpenKvm(#[source] kvm_ioctls::Error),
    /// `KVM_CREATE_VM` failed.
    #[error("cannot create a VM")]
    CreateVm(#[source] kvm_ioctls::Error),
    /// `KVM_GET_SUPPORTED_CPUID` failed.
    #[error("cannot read the supported CPUID")]
    SupportedCpuid(#[source] kvm_ioctls::Error),
    /// Mapping the control slot failed.
    #[error("cannot map the control slot")]
    ControlSlot(#[source] std::io::Error),
    /// `KVM_SET_USER_MEMORY_REGION` failed.
    #[error(
        "cannot register memory slot {slot} at guest-physical {guest_phys:#x} ({len:#x} bytes)"
    )]
    MemorySlot {
        /// KVM slot number (the control slot comes last).
        slot: u32,
        /// Guest-physical address.
        guest_phys: u64,
        /// Length.
        len: u64,
        /// The ioctl error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// `KVM_CREATE_VCPU` failed.
    #[error("cannot create the vCPU")]
    CreateVcpu(#[source] kvm_ioctls::Error),
    /// Setting the vCPU's CPUID or registers failed.
    #[error("cannot set the vCPU's {what}")]
    VcpuSetup {
        /// Which state.
        what: &'static str,
        /// The ioctl error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// Installing the signal that interrupts `KVM_RUN` failed.
    #[error("cannot install the vCPU kick signal")]
    Signal(#[source] std::io::Error),
    /// `KVM_RUN` failed.
    #[error("KVM_RUN failed")]
    Run(#[source] kvm_ioctls::Error),
    /// The guest did not finish within [`RunConfig::timeout`].
    #[error("the guest did not finish within {timeout:?} (stuck {stage})")]
    Timeout {
        /// The configured timeout.
        timeout: Duration,
        /// How far the guest got.
        stage: &'static str,
    },
    /// The vCPU stopped in a way the guest never asks for.
    #[error("the guest stopped unexpectedly ({exit}) at rip {rip:#x}")]
    GuestFault {
        /// The exit, as KVM reported it.
        exit: String,
        /// The guest's instruction pointer afterwards (0 if unreadable).
        rip: u64,
    },
    /// [`run_pvh`] was given something that is not a loadable PVH kernel.
    #[error("not a loadable PVH ELF kernel: {0}")]
    Elf(String),
    /// The guest's reports disagree with each other or with the host.
    #[error("inconsistent guest report: {0}")]
    Protocol(String),
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

/// Runs the vCPU on this thread with a watchdog that kicks it out of
/// `KVM_RUN` once `timeout` has passed.
fn drive_with_watchdog(
    vm: &VmFd,
    cpuid: &CpuId,
    boot: &Boot,
    timeout: Duration,
) -> Result<Outcome, Error> {
    let sig = sys::kick_signal().map_err(Error::Signal)?;
    let timed_out = AtomicBool::new(false);
    std::thread::scope(|s| {
        let (stop_tx, stop_rx) = mpsc::channel::<()>();
        let vcpu_thread = sys::current_thread();
        // `None`: a timeout too large to represent, i.e. no deadline.
        let deadline = Instant::now().checked_add(timeout);
        let timed_out = &timed_out;
        s.spawn(move || watchdog(&stop_rx, deadline, vcpu_thread, sig, timed_out));
        let outcome = drive(vm, cpuid, boot, timeout, timed_out);
        drop(stop_tx);
        outcome
    })
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

/// 1 GiB page support and physical address width of the vCPU model.
fn cpu_properties(cpuid: &CpuId) -> (bool, u8) {
    let entries = cpuid.as_slice();
    let huge_1g = entries
        .iter()
        .find(|e| e.function == 0x8000_0001)
        .is_some_and(|e| e.edx & (1 << 26) != 0);
    let phys_bits = entries
        .iter()
        .find(|e| e.function == 0x8000_0008)
        .map_or(36, |e| (e.eax & 0xff) as u8);
    (huge_1g, phys_bits)
}

/// Sends the kick signal once the deadline passes, and again every 10 ms,
/// until the vCPU loop drops its end of the channel.
fn watchdog(
    stop: &mpsc::Receiver<()>,
    deadline: Option<Instant>,
    vcpu_thread: libc::pthread_t,
    sig: libc::c_int,
    timed_out: &AtomicBool,
) {
    let Some(deadline) = deadline else {
        // Returns when the vCPU loop drops the sender.
        let _ = stop.recv();
        return;
    };
    let mut wait = deadline.saturating_duration_since(Instant::now());
    loop {
        match stop.recv_timeout(wait) {
            Err(mpsc::RecvTimeoutError::Timeout) => {
                timed_out.store(true, Ordering::SeqCst);
                // The vCPU thread is alive: it owns the channel's sender and
                // the scope joins this thread before that thread moves on.
                if let Err(e) = sys::kick(vcpu_thread, sig) {
                    tracing::warn!(error = %e, "cannot kick the vCPU thread");
                }
                wait = Duration::from_millis(10);
            }
            Ok(()) | Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// What the vCPU loop observed.
#[derive(Debug, Default)]
struct Outcome {
    first: Option<Duration>,
    touched: Option<Duration>,
    /// The vCPU thread's CPU time at the all-touched write.
    touched_cpu: Option<Duration>,
    total: Duration,
    results: Vec<u32>,
    serial: Vec<u8>,
    exits: u64,
    exit_value: u8,
}

/// What one exit means for the loop.
enum Step {
    Continue,
    Exit,
    Fault(String),
}

/// Creates the vCPU, starts it at the long-mode entry point and services
/// exits until the guest writes the exit port.
fn drive(
    vm: &VmFd,
    cpuid: &CpuId,
    boot: &Boot,
    timeout: Duration,
    timed_out: &AtomicBool,
) -> Result<Outcome, Error> {
    let t0 = Instant::now();
    let cpu0 = sys::thread_cpu_time();
    let mut vcpu = vm.create_vcpu(0).map_err(Error::CreateVcpu)?;
    setup_vcpu(&vcpu, cpuid, boot)?;
    let mut out = Outcome::default();
    loop {
        let step = match vcpu.run() {
            Ok(exit) => {
                out.exits += 1;
                let now = t0.elapsed();
                let step = on_exit(exit, now, &mut out);
                if out.touched.is_some() && out.touched_cpu.is_none() {
                    out.touched_cpu = Some(sys::thread_cpu_time().saturating_sub(cpu0));
                }
                step
            }
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                if timed_out.load(Ordering::SeqCst) {
                    let stage = match (out.first, out.touched) {
                        (None, _) => "before the first instruction",
                        (Some(_), None) => "touching pages",
                        (Some(_), Some(_)) => "reporting",
                    };
                    return Err(Error::Timeout { timeout, stage });
                }
                Step::Continue
            }
            Err(e) => return Err(Error::Run(e)),
        };
        match step {
            Step::Continue => {}
            Step::Exit => {
                out.total = t0.elapsed();
                return Ok(out);
            }
            Step::Fault(exit) => {
                let rip = vcpu.get_regs().map_or(0, |r| r.rip);
                return Err(Error::GuestFault { exit, rip });
            }
        }
    }
}

fn on_exit(exit: VcpuExit<'_>, now: Duration, out: &mut Outcome) -> Step {
    match exit {
        VcpuExit::IoOut(image::PORT_PROGRESS, [image::FIRST_MAGIC]) => {
            out.first.get_or_insert(now);
            Step::Continue
        }
        VcpuExit::IoOut(image::PORT_PROGRESS, [image::DONE_MAGIC]) => {
            out.touched.get_or_insert(now);
            Step::Continue
        }
        VcpuExit::IoOut(image::PORT_RESULT, &[a, b, c, d]) => {
            out.results.push(u32::from_le_bytes([a, b, c, d]));
            Step::Continue
        }
        VcpuExit::IoOut(image::PORT_SERIAL, data) => {
            out.serial.extend_from_slice(data);
            Step::Continue
        }
        VcpuExit::IoOut(image::PORT_DEBUG_EXIT, [value]) => {
            out.exit_value = *value;
            Step::Exit
        }
        VcpuExit::IoOut(image::PORT_DEBUG, _) => Step::Continue,
        VcpuExit::IoOut(port, data) => {
            Step::Fault(format!("write of {data:02x?} to port {port:#x}"))
        }
        VcpuExit::IoIn(_, data) => {
            data.fill(0xff);
            Step::Continue
        }
        VcpuExit::MmioRead(addr, _) => {
            Step::Fault(format!("read of unbacked guest-physical address {addr:#x}"))
        }
        VcpuExit::MmioWrite(addr, _) => Step::Fault(format!(
            "write to unbacked guest-physical address {addr:#x}"
        )),
        VcpuExit::Hlt => Step::Fault("hlt before the exit port".into()),
        other => Step::Fault(format!("{other:?}")),
    }
}

/// How the vCPU starts.
#[derive(Debug)]
enum Boot {
    /// Long mode at `direct64` with host-built page tables.
    Long {
        /// Guest-physical address of the control slot (image at offset 0).
        control_gpa: u64,
        /// Guest-physical address of the PML4.
        pml4: u64,
    },
    /// PVH: 32-bit protected mode, paging off, `ebx` = start info.
    Pvh {
        /// The entry point from the ELF note.
        entry: u32,
        /// Guest-physical address of `hvm_start_info`.
        start_info: u64,
    },
}

/// Sets CPUID (everything KVM supports, so the guest sees LM and, if
/// present, 1 GiB pages) and the registers for `boot`.
///
/// Long mode: flat 64-bit code segment (GDT selector 0x08) and data
/// segments (0x10) matching the image's GDT, CR0.PG|PE, CR4.PAE,
/// EFER.LME|LMA, `rsi` = parameter block, `rsp` = top of the image's stack.
/// PVH: flat 32-bit segments, CR0.PE only, as the PVH ABI specifies.
/// CR0.CD/NW from the reset state are cleared in both cases.
fn setup_vcpu(vcpu: &VcpuFd, cpuid: &CpuId, boot: &Boot) -> Result<(), Error> {
    let setup = |what| move |source| Error::VcpuSetup { what, source };
    vcpu.set_cpuid2(cpuid).map_err(setup("CPUID"))?;
    let mut sregs = vcpu.get_sregs().map_err(setup("special registers"))?;
    let long = matches!(boot, Boot::Long { .. });
    let code = kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector: 0x08,
        type_: 0xb, // execute/read, accessed
        present: 1,
        dpl: 0,
        db: u8::from(!long),
        s: 1,
        l: u8::from(long),
        g: 1,
        avl: 0,
        unusable: 0,
        padding: 0,
    };
    let data = kvm_segment {
        selector: 0x10,
        type_: 0x3, // read/write, accessed
        db: 1,
        l: 0,
        ..code
    };
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    const CR0_PE: u64 = 1;
    const CR0_ET: u64 = 1 << 4;
    const CR0_NE: u64 = 1 << 5;
    const CR0_PG: u64 = 1 << 31;
    let regs = match *boot {
        Boot::Long { control_gpa, pml4 } => {
            sregs.gdt.base = control_gpa + image::GDT as u64;
            sregs.gdt.limit = 3 * 8 - 1;
            sregs.cr3 = pml4;
            sregs.cr4 = 1 << 5; // PAE
            sregs.cr0 = CR0_PG | CR0_NE | CR0_ET | CR0_PE;
            sregs.efer = (1 << 8) | (1 << 10); // LME | LMA
            kvm_bindings::kvm_regs {
                rip: control_gpa + image::DIRECT64 as u64,
                rsi: control_gpa + image::PARAMS as u64,
                rsp: control_gpa + image::STACK_TOP as u64,
                rflags: 0x2,
                ..Default::default()
            }
        }
        Boot::Pvh { entry, start_info } => {
            sregs.cr0 = CR0_NE | CR0_ET | CR0_PE;
            sregs.cr4 = 0;
            sregs.efer = 0;
            kvm_bindings::kvm_regs {
                rip: u64::from(entry),
                rbx: start_info,
                rflags: 0x2,
                ..Default::default()
            }
        }
    };
    vcpu.set_sregs(&sregs).map_err(setup("special registers"))?;
    vcpu.set_regs(&regs).map_err(setup("registers"))
}

/// What the host expects the guest to report.
#[derive(Debug)]
struct Expect {
    pages: u64,
    status: u64,
    huge_1g: bool,
}

/// Cross-checks the port reports, the parameter block and the host's
/// expectation, and builds the report.
fn check(
    expect: &Expect,
    out: &Outcome,
    params: &[u8],
    setup: Duration,
) -> Result<RunReport, Error> {
    let proto = |m: String| Err(Error::Protocol(m));
    let (Some(first), Some(touched)) = (out.first, out.touched) else {
        return proto(format!(
            "progress signals missing (first: {:?}, done: {:?})",
            out.first, out.touched
        ));
    };
    let &[p_lo, p_hi, o_lo, o_hi] = out.results.as_slice() else {
        return proto(format!("expected 4 result words, got {:?}", out.results));
    };
    let pages = u64::from(p_lo) | u64::from(p_hi) << 32;
    let or = u64::from(o_lo) | u64::from(o_hi) << 32;
    let mem_pages = get_u64(params, image::P_PAGES);
    let mem_or = get_u64(params, image::P_ORACC);
    let status = get_u64(params, image::P_STATUS);
    if (pages, or) != (mem_pages, mem_or) {
        return proto(format!(
            "ports say pages={pages} or={or:#x}, memory says pages={mem_pages} or={mem_or:#x}"
        ));
    }
    if (pages, status) != (expect.pages, expect.status) {
        return proto(format!(
            "guest touched {pages} pages with status {status}, host expected {} with status {}",
            expect.pages, expect.status
        ));
    }
    let nonzero = or != 0;
    if out.exit_value != u8::from(nonzero) {
        return proto(format!("exit value {} but OR is {or:#x}", out.exit_value));
    }
    let serial = String::from_utf8_lossy(&out.serial).into_owned();
    let expected = format!(
        "HUGEMEM-GUEST pages={pages} nonzero={} status={status}\n",
        u8::from(nonzero)
    );
    if serial != expected {
        return proto(format!("serial says {serial:?}, expected {expected:?}"));
    }
    Ok(RunReport {
        setup,
        first_instruction: first,
        all_touched: touched,
        all_touched_vcpu_cpu: out.touched_cpu.unwrap_or_default(),
        total: out.total,
        pages_touched: pages,
        saw_nonzero: nonzero,
        or_accumulator: or,
        exits: out.exits,
        huge_1g_mappings: expect.huge_1g,
        serial,
    })
}
