//! The vCPU: its CPUID and registers at boot (long mode or PVH), the loop
//! that runs it on the calling thread and timestamps the guest's port
//! writes, and the watchdog that kicks it out of `KVM_RUN` at the deadline
//! (see the [`runner`](super) module docs).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvm_bindings::{kvm_segment, CpuId};
use kvm_ioctls::{VcpuExit, VcpuFd, VmFd};

use super::error::Error;
use crate::image;
use crate::sys;

/// Runs the vCPU on this thread with a watchdog that kicks it out of
/// `KVM_RUN` once `timeout` has passed.
pub(super) fn drive_with_watchdog(
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

/// 1 GiB page support and physical address width of the vCPU model.
pub(super) fn cpu_properties(cpuid: &CpuId) -> (bool, u8) {
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
pub(super) struct Outcome {
    pub(super) first: Option<Duration>,
    pub(super) touched: Option<Duration>,
    /// The vCPU thread's CPU time at the all-touched write.
    pub(super) touched_cpu: Option<Duration>,
    pub(super) total: Duration,
    pub(super) results: Vec<u32>,
    pub(super) serial: Vec<u8>,
    pub(super) exits: u64,
    pub(super) exit_value: u8,
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
pub(super) enum Boot {
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
