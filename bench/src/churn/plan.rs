//! One launch of a churn, on any side: the guest's layout, the VMM's
//! command line (through `hugemem launch`, the VMM's own memory for the
//! baseline, or the floor's memfd handed over as `hugemem launch` hands a
//! daemon's fds), or hugemem's own KVM runner (`micro`).

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use backend::client::Client;
use backend::proto::{AllocRequest, ClearMode, PagePolicy};
use guest_mem::size::format_size;
use guest_mem::vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use guest_mem::{AnonMapping, PageSize};

use super::options::ChurnVmm;
use super::process::{chain, parse_launch_summary, run_process, GuestLine};
use super::report::LaunchSample;
use crate::floor::{vmm_argv, FloorMemory, FloorPool};
use crate::harness::vmm::VmmRun;
use crate::vmm_side;

/// Distance between the guest's probes: every 2 MiB page of either size.
pub(super) const STRIDE: u64 = 2 << 20;
/// First probed address (QEMU's firmware writes GPA 0).
pub(super) const START_GPA: u64 = 1 << 20;
/// Mixed into what the guest writes.
pub(super) const MARKER: u64 = 0x4855_4743_4855_524e; // "HUGCHURN"
/// Where RAM above 3 GiB continues (hugemem's and the VMMs' PCI hole).
const HOLE_START: u64 = 3 << 30;
const HOLE_END: u64 = 4 << 30;

/// Which side a launch is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Side {
    Hugemem,
    Baseline,
    /// The VMM's floor: the same VMM and guest on a resident memfd, no daemon.
    Floor,
}

impl Side {
    pub(super) fn name(self) -> &'static str {
        match self {
            Self::Hugemem => "hugemem",
            Self::Baseline => "baseline",
            Self::Floor => "floor",
        }
    }
}

/// Everything a launch needs, shared by the workers.
pub(super) struct Plan {
    pub(super) vmm: ChurnVmm,
    pub(super) size: u64,
    pub(super) policy: PagePolicy,
    pub(super) baseline_page: PageSize,
    pub(super) socket: PathBuf,
    pub(super) launcher: PathBuf,
    pub(super) program: OsString,
    pub(super) elf: PathBuf,
    pub(super) cpus: usize,
    pub(super) timeout: Duration,
    /// The floor side's memfds while it runs.
    pub(super) floor: Option<FloorPool>,
}

impl Plan {
    /// What `hugemem launch` is given after `--` besides the program: the
    /// VMM's own arguments with no memory options.
    fn launch_user_args(&self) -> Vec<OsString> {
        let Some(vmm) = self.vmm.kind() else {
            return Vec::new();
        };
        let side = vmm_side::of(vmm);
        let mut a = side.machine_args();
        a.extend(side.guest_args(&self.elf));
        a
    }

    /// The full command line of one launch on the hugemem or baseline side.
    fn argv(&self, side: Side) -> Vec<OsString> {
        let size = format_size(self.size);
        let mut a: Vec<OsString> = Vec::new();
        if side == Side::Hugemem {
            a.push(self.launcher.clone().into_os_string());
            a.extend(["launch".into(), "--socket".into()]);
            a.push(self.socket.clone().into_os_string());
            a.extend(["--size".into(), size.into(), "--page-size".into()]);
            a.push(policy_text(self.policy).into());
            a.push("--".into());
            a.push(self.program.clone());
            a.extend(self.launch_user_args());
            return a;
        }
        a.push(self.program.clone());
        if let Some(vmm) = self.vmm.kind() {
            let vmm = vmm_side::of(vmm);
            let page = self.baseline_page.to_string();
            a.extend(vmm.own_memory_args(&size, &page, Some(self.cpus)));
            a.extend(vmm.guest_args(&self.elf));
        }
        a
    }

    /// The floor's command line: `hugemem launch`'s for `memory`, with no
    /// daemon and no `hugemem launch` process.
    fn floor_argv(&self, memory: &FloorMemory) -> Result<Vec<OsString>, String> {
        let vmm = self
            .vmm
            .kind()
            .ok_or("the micro-guest runs on no VMM command line")?;
        vmm_argv(
            vmm,
            self.program.clone(),
            &self.launch_user_args(),
            &[memory.region()],
            &[memory.fd()],
        )
        .map_err(|e| chain(&e))
    }

    fn request(&self) -> AllocRequest {
        AllocRequest {
            total_size: self.size,
            page_policy: self.policy,
            clear_mode: ClearMode::Eager,
            lock: false,
            parts: Vec::new(),
            want_paths: false,
        }
    }

    /// One launch on `side`.
    pub(super) fn launch(&self, side: Side) -> Result<LaunchSample, String> {
        if side == Side::Floor {
            let pool = self
                .floor
                .as_ref()
                .ok_or("the floor's memory is not ready")?;
            return pool
                .lend(|memory| match self.vmm {
                    ChurnVmm::Micro => self.micro_floor(memory),
                    _ => {
                        let argv = self.floor_argv(memory)?;
                        let run = run_process(&argv, &[memory.fd()], self.timeout)?;
                        self.process_sample(side, &run)
                    }
                })
                .map_err(|e| format!("the floor's memfd: {}", chain(&e)))?;
        }
        match self.vmm {
            ChurnVmm::Micro => self.launch_micro(side),
            _ => {
                let run = run_process(&self.argv(side), &[], self.timeout)?;
                self.process_sample(side, &run)
            }
        }
    }

    /// Checks a VMM process's end and the guest's report, and turns them
    /// into a sample.
    fn process_sample(&self, side: Side, run: &VmmRun) -> Result<LaunchSample, String> {
        let line = run
            .guest_line()
            .ok_or_else(|| format!("no guest report; {}", run.describe()))?;
        let guest = GuestLine::parse(line).ok_or_else(|| format!("bad guest report {line:?}"))?;
        // The guest's exit code is `nonzero`; the VMM's adapter says what
        // its process then exits with (QEMU's isa-debug-exit: (code << 1) |
        // 1; cloud-hypervisor: 0 after the ACPI power-off). `hugemem launch`
        // exits with the VMM's status.
        let expected = Some(self.vmm.kind().map_or(0, |k| {
            k.adapter().exit_status_of_guest(u8::from(guest.nonzero))
        }));
        if run.status.code() != expected || guest.status != 0 || guest.pages == 0 {
            return Err(format!("abnormal end: {}", run.describe()));
        }
        let (alloc_ms, page_sizes) = if side == Side::Hugemem {
            let (a, p) = parse_launch_summary(&run.stderr)
                .ok_or_else(|| format!("no `hugemem launch:` summary; {}", run.describe()))?;
            (Some(a), p)
        } else {
            (None, Vec::new())
        };
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        Ok(LaunchSample {
            ms: ms(run.elapsed),
            ready_ms: run.ready.map(ms),
            touched_ms: run.touched.map(ms),
            alloc_ms,
            page_sizes,
            guest_pages: guest.pages,
            stale: guest.nonzero,
            exit: run.status.to_string(),
        })
    }

    fn run_config(&self) -> microguest::RunConfig {
        microguest::RunConfig {
            stride: STRIDE,
            marker: MARKER,
            start_gpa: START_GPA,
            timeout: self.timeout,
            ..Default::default()
        }
    }

    /// `micro` on the hugemem or baseline side.
    fn launch_micro(&self, side: Side) -> Result<LaunchSample, String> {
        let len = usize::try_from(self.size).map_err(|_| "size too large".to_string())?;
        let t0 = Instant::now();
        if side != Side::Baseline {
            return self.micro_hugemem(t0);
        }
        let mut map = AnonMapping::new(len, self.baseline_page).map_err(|e| chain(&e))?;
        map.populate_write(0, len).map_err(|e| chain(&e))?;
        let low = len.min(HOLE_START as usize);
        let (lo, hi) = map.as_mut_slice().split_at_mut(low);
        let mut ram = vec![microguest::GuestRam::new(lo, 0)];
        if !hi.is_empty() {
            ram.push(microguest::GuestRam::new(hi, HOLE_END));
        }
        let started = t0.elapsed();
        let r = microguest::run(&ram, &self.run_config()).map_err(|e| chain(&e))?;
        Ok(micro_sample(&r, t0, started, None, Vec::new()))
    }

    /// `micro` on daemon memory the way a rust-vmm VMM takes it: connect,
    /// ALLOC, map the fds, run, unmap, FREE.
    fn micro_hugemem(&self, t0: Instant) -> Result<LaunchSample, String> {
        let mut client = Client::connect(&self.socket).map_err(|e| chain(&e))?;
        let alloc = client.alloc(self.request()).map_err(|e| chain(&e))?;
        let alloc_ms = t0.elapsed().as_secs_f64() * 1e3;
        let page_sizes = alloc.regions.iter().map(|r| r.page_size).collect();
        let mem = alloc.guest_memory().map_err(|e| chain(&e))?;
        let started = t0.elapsed();
        let r = self.run_mapped(&mem);
        drop(mem);
        let id = alloc.id;
        // Our fds go before FREE, so the daemon sees no other holder.
        drop(alloc);
        client
            .free(id)
            .map_err(|e| format!("FREE: {}", chain(&e)))?;
        Ok(micro_sample(&r?, t0, started, Some(alloc_ms), page_sizes))
    }

    /// `micro` on the floor's memfd, mapped the same way as the daemon's
    /// fds (the mapping on the clock, as on the hugemem side).
    fn micro_floor(&self, memory: &FloorMemory) -> Result<LaunchSample, String> {
        let t0 = Instant::now();
        let mem = backend::guest_memory::guest_memory_from_fds(&[memory.region()], &[memory.fd()])
            .map_err(|e| chain(&e))?;
        let started = t0.elapsed();
        let r = self.run_mapped(&mem);
        drop(mem);
        Ok(micro_sample(&r?, t0, started, None, Vec::new()))
    }

    /// The micro-guest on every region of `mem`.
    fn run_mapped(&self, mem: &GuestMemoryMmap) -> Result<microguest::RunReport, String> {
        let mut ram = Vec::with_capacity(mem.num_regions());
        for r in mem.iter() {
            let n = usize::try_from(r.len()).map_err(|_| "region too large".to_string())?;
            // SAFETY: `r.as_ptr() .. + n` is the live read-write shared
            // mapping vm-memory made for this region; `mem` outlives `ram`
            // (borrowed for this call), and no Rust reference to the memory
            // exists while the guest runs.
            ram.push(unsafe {
                microguest::GuestRam::from_raw_parts(r.as_ptr(), n, r.start_addr().0)
            });
        }
        microguest::run(&ram, &self.run_config()).map_err(|e| chain(&e))
    }
}

/// A `micro` launch's sample: `t0` its start, `started` when the guest
/// memory was ready for the runner.
fn micro_sample(
    report: &microguest::RunReport,
    t0: Instant,
    started: Duration,
    alloc_ms: Option<f64>,
    page_sizes: Vec<u64>,
) -> LaunchSample {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let run_start = started + report.setup;
    LaunchSample {
        ms: ms(t0.elapsed()),
        ready_ms: Some(ms(run_start + report.first_instruction)),
        touched_ms: Some(ms(run_start + report.all_touched)),
        alloc_ms,
        page_sizes,
        guest_pages: report.pages_touched,
        stale: report.saw_nonzero,
        exit: "guest exit port".into(),
    }
}

/// A page-size policy as `hugemem launch --page-size` takes it.
pub(super) fn policy_text(p: PagePolicy) -> &'static str {
    match p {
        PagePolicy::Best => "best",
        PagePolicy::Huge1G => "1G",
        PagePolicy::Huge2M => "2M",
        PagePolicy::Base4K => "4K",
    }
}
