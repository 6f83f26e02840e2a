//! `hugemem bench churn`: N VM launches back to back (K at once) against one
//! daemon, each guest probing the memory the previous guests wrote, and the
//! same churn on the VMM's own preallocated memory as the baseline.
//!
//! # What runs
//!
//! Every launch boots the project's micro-guest on `size` bytes of RAM. The
//! guest reads the first 8 bytes of every 2 MiB of RAM from 1 MiB up and then
//! writes `marker ^ gpa` there ([`microguest::pattern`]). Every guest of a
//! churn has the same RAM layout, so each one *probes exactly the addresses
//! every earlier guest wrote*, before writing them itself. A non-zero read
//! there (the guest's `nonzero=1`) is an earlier guest's marker seen by a
//! later one: a **stale read**. Nothing else writes those addresses (the
//! guest starts at 1 MiB because QEMU's firmware writes the real-mode vector
//! table at GPA 0).
//!
//! The VMM, `--vmm` or else the first that is there:
//!
//! * `cloud-hypervisor` (the binary `CLOUD_HYPERVISOR` names) and `qemu`
//!   (`qemu-system-x86_64 -M microvm`): each launch is a real
//!   `hugemem launch --size S -- VMM …` process (ALLOC, VMM run, FREE, as an
//!   operator runs it); the page sizes come from its summary line. The
//!   baseline runs the same VMM on its own memory: QEMU
//!   `memory-backend-memfd,hugetlb=on,prealloc=on,prealloc-threads=<CPUs>`,
//!   cloud-hypervisor `--memory size=S,hugepages=on,prefault=on`.
//! * `micro`: hugemem's own KVM runner ([`microguest::run`]) in this process,
//!   on daemon memory the way a rust-vmm VMM takes it (connect, ALLOC, map
//!   the fds, run, unmap, FREE); the baseline maps anonymous hugetlb memory
//!   and populates it (`MADV_POPULATE_WRITE`: the kernel allocates and zeroes
//!   every page before the vCPU starts, the same work as `MAP_POPULATE`).
//!
//! # What is measured
//!
//! Three spans per launch, each from the launch's start: `ready_ms`, to the
//! guest's first instruction; `touched_ms`, to the guest having read and
//! written every 2 MiB of its RAM; `ms`, to the launch's end (below). The
//! guest marks the first two on port 0x3f0 (123, then 124); the VMM's debug
//! console on that port (QEMU `isa-debugcon`, cloud-hypervisor
//! `--debug-console`) writes them to its stdout, where they are timed as
//! they arrive; `micro` takes them from its runner. Each is reported as
//! p50/p99 against the baseline's (`ready`, `touched`), and the report says
//! how many VMs of this size the host's pages held at the start
//! (`host_vm_fits`: 1 is an exact fit, 2 or more leaves pages to spare).
//!
//! A launch's time runs from the start of the `hugemem launch` process (for
//! `micro`: the connect) to its end after the guest powered off and the
//! memory was freed; a baseline launch's from the VMM's start to its exit.
//! Both sides end at the same point, and hugemem's side also carries the
//! FREE and its own process start. Per side: p50, p99 (nearest rank) and max
//! of the N launches; one untimed warm-up launch comes first on each side
//! (`warmup_ms`: the outer host backs never-touched memory lazily, and the
//! daemon's first ALLOC takes fresh pages). The baseline runs first, before
//! a private daemon exists, so it finds the huge pages free. The private
//! daemon (no `--socket`) is `hugemem serve` in a process of its own, as a
//! host runs it: in the bench's process its scrubbers' page faults would
//! hold the `mmap_lock` the micro runner's mappings need.
//!
//! `downgrades`: the daemon's `downgrades` counter over the timed launches
//! when its STATS has one (`downgrades_source: "daemon"`); else the launches
//! whose reply had a page smaller than `expected_page_size`, the largest
//! page the policy allowed (for `best`: that divides the size) of which the
//! host had enough for K launches at the start, free in the kernel or idle
//! in the daemon's pool (`downgrades_source: "replies"`).

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

use guest_mem::vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
use guest_mem::{AnonMapping, PageSize, PoolCounts};
use hugemem_client::stats::Stats;
use serde::Serialize;

use crate::private_dir::PrivateDir;
use crate::serve_child::{ServeChild, ServeChildError, ServeOptions};
use backend::client::{Client, ClientError};
use backend::daemon::{ByteSize, Config, DaemonError};
use backend::proto::{AllocRequest, ClearMode, PagePolicy};
use guest_mem::size::format_size;

mod process;
mod report;
use process::{chain, parse_launch_summary, run_process, GuestLine};
use report::page_key;
pub use report::{ChurnReport, LaunchSample, SpanReport, Spread};

/// Distance between the guest's probes: every 2 MiB page of either size.
const STRIDE: u64 = 2 << 20;
/// First probed address (QEMU's firmware writes GPA 0).
const START_GPA: u64 = 1 << 20;
/// Mixed into what the guest writes.
const MARKER: u64 = 0x4855_4743_4855_524e; // "HUGCHURN"
/// Where RAM above 3 GiB continues (hugemem's and the VMMs' PCI hole).
const HOLE_START: u64 = 3 << 30;
const HOLE_END: u64 = 4 << 30;

/// Which VMM runs the guests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ChurnVmm {
    /// cloud-hypervisor through `hugemem launch`.
    CloudHypervisor,
    /// QEMU microvm through `hugemem launch`.
    Qemu,
    /// hugemem's own KVM runner, in process.
    Micro,
}

impl ChurnVmm {
    /// Parses `cloud-hypervisor`/`ch`, `qemu` or `micro`.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "cloud-hypervisor" | "ch" => Some(Self::CloudHypervisor),
            "qemu" => Some(Self::Qemu),
            "micro" => Some(Self::Micro),
            _ => None,
        }
    }

    /// The name used in `--vmm` and file names.
    pub fn name(self) -> &'static str {
        match self {
            Self::CloudHypervisor => "cloud-hypervisor",
            Self::Qemu => "qemu",
            Self::Micro => "micro",
        }
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct ChurnConfig {
    /// Timed launches per side.
    pub vms: usize,
    /// Guest RAM per launch, a multiple of 2 MiB.
    pub size: u64,
    /// Launches at once.
    pub parallel: usize,
    /// The VMM; `None`: cloud-hypervisor when `cloud_hypervisor` is set, else
    /// QEMU when `qemu` runs, else `micro`.
    pub vmm: Option<ChurnVmm>,
    /// Page policy of the ALLOCs.
    pub page_policy: PagePolicy,
    /// A live daemon's socket; `None`: a private daemon for the run.
    pub socket: Option<PathBuf>,
    /// The `hugemem` binary whose `launch` subcommand runs the VMMs.
    pub launcher: PathBuf,
    /// The cloud-hypervisor binary (the CLI passes `CLOUD_HYPERVISOR`).
    pub cloud_hypervisor: Option<OsString>,
    /// The QEMU binary.
    pub qemu: OsString,
    /// Longest one launch may take.
    pub timeout: Duration,
}

/// Errors of the churn benchmark.
#[derive(Debug, thiserror::Error)]
pub enum ChurnError {
    /// Bad options.
    #[error("{0}")]
    Options(String),
    /// Something the run needs is missing.
    #[error("cannot run: {0}")]
    Missing(String),
    /// The private daemon did not start.
    #[error("cannot start a private daemon")]
    Daemon(#[from] DaemonError),
    /// The private daemon's process did not start or answer.
    #[error("cannot run a private daemon")]
    Serve(#[from] ServeChildError),
    /// Talking to the daemon failed.
    #[error("daemon request failed")]
    Client(#[from] ClientError),
    /// Files, processes, pipes.
    #[error("{what}")]
    Io {
        /// What was being done.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A launch did not run its guest to a normal end.
    #[error("{side} launch {index}: {why}")]
    Launch {
        /// `hugemem` or `baseline`.
        side: &'static str,
        /// Which launch (`warm-up` = the untimed one).
        index: String,
        /// What went wrong.
        why: String,
    },
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ChurnError {
    let what = what.into();
    move |source| ChurnError::Io { what, source }
}

/// Which side a launch is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Hugemem,
    Baseline,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Self::Hugemem => "hugemem",
            Self::Baseline => "baseline",
        }
    }
}

/// Everything a launch needs, shared by the workers.
struct Plan {
    vmm: ChurnVmm,
    size: u64,
    policy: PagePolicy,
    baseline_page: PageSize,
    socket: PathBuf,
    launcher: PathBuf,
    program: OsString,
    elf: PathBuf,
    cpus: usize,
    timeout: Duration,
}

impl Plan {
    /// The VMM's own arguments for the guest (no memory options).
    fn guest_args(&self) -> Vec<OsString> {
        let elf = self.elf.clone().into_os_string();
        let list: Vec<&str> = match self.vmm {
            ChurnVmm::Qemu => vec![
                "-accel",
                "kvm",
                "-cpu",
                hugemem::launch::qemu::KVM_CPU,
                "-nodefaults",
                "-no-user-config",
                "-nographic",
                "-no-reboot",
                "-serial",
                "stdio",
                "-device",
                "isa-debug-exit",
                // The guest's marks on port 0x3f0 (first instruction, all
                // RAM touched) come on stdout, timed as they arrive.
                "-chardev",
                "file,id=hmmarks,path=/dev/stdout",
                "-device",
                "isa-debugcon,iobase=0x3f0,chardev=hmmarks",
            ],
            ChurnVmm::CloudHypervisor => vec![
                "--cpus",
                "boot=1",
                "--serial",
                "tty",
                "--console",
                "off",
                "--debug-console",
                "file=/dev/stdout,iobase=0x3f0",
            ],
            ChurnVmm::Micro => vec![],
        };
        let mut v: Vec<OsString> = list.into_iter().map(OsString::from).collect();
        v.push(
            if self.vmm == ChurnVmm::Qemu {
                "-kernel"
            } else {
                "--kernel"
            }
            .into(),
        );
        v.push(elf);
        v
    }

    /// The full command line of one launch.
    fn argv(&self, side: Side) -> Vec<OsString> {
        let size = format_size(self.size);
        let page = self.baseline_page.to_string();
        let mut a: Vec<OsString> = Vec::new();
        if side == Side::Hugemem {
            a.push(self.launcher.clone().into_os_string());
            a.extend(["launch".into(), "--socket".into()]);
            a.push(self.socket.clone().into_os_string());
            a.extend(["--size".into(), size.clone().into(), "--page-size".into()]);
            a.push(policy_text(self.policy).into());
            a.push("--".into());
        }
        a.push(self.program.clone());
        match (self.vmm, side) {
            (ChurnVmm::Qemu, Side::Hugemem) => a.extend(["-M".into(), "microvm".into()]),
            (ChurnVmm::Qemu, Side::Baseline) => a.extend([
                "-object".into(),
                format!(
                    "memory-backend-memfd,id=ram0,size={size},hugetlb=on,hugetlbsize={page},prealloc=on,prealloc-threads={}",
                    self.cpus
                )
                .into(),
                "-m".into(),
                size.clone().into(),
                "-M".into(),
                "microvm,memory-backend=ram0".into(),
            ]),
            (ChurnVmm::CloudHypervisor, Side::Baseline) => a.extend([
                "--memory".into(),
                format!("size={size},hugepages=on,hugepage_size={page},prefault=on").into(),
            ]),
            _ => {}
        }
        a.extend(self.guest_args());
        a
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
    fn launch(&self, side: Side) -> Result<LaunchSample, String> {
        match self.vmm {
            ChurnVmm::Micro => self.launch_micro(side),
            _ => self.launch_process(side),
        }
    }

    fn launch_process(&self, side: Side) -> Result<LaunchSample, String> {
        let argv = self.argv(side);
        let run = run_process(&argv, self.timeout)?;
        let line = run
            .stdout
            .lines()
            .find_map(|l| l.find("HUGEMEM-GUEST ").map(|i| l[i..].trim().to_string()))
            .ok_or_else(|| format!("no guest report; {}", run.describe()))?;
        let guest = GuestLine::parse(&line).ok_or_else(|| format!("bad guest report {line:?}"))?;
        // QEMU's isa-debug-exit: (nonzero << 1) | 1; cloud-hypervisor: 0 after
        // the ACPI power-off. `hugemem launch` exits with the VMM's status.
        let expected = match self.vmm {
            ChurnVmm::Qemu => Some(if guest.nonzero { 3 } else { 1 }),
            _ => Some(0),
        };
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

    fn launch_micro(&self, side: Side) -> Result<LaunchSample, String> {
        let cfg = microguest::RunConfig {
            stride: STRIDE,
            marker: MARKER,
            start_gpa: START_GPA,
            timeout: self.timeout,
            ..Default::default()
        };
        let len = usize::try_from(self.size).map_err(|_| "size too large".to_string())?;
        let t0 = Instant::now();
        let (report, started, alloc_ms, page_sizes) = if side == Side::Baseline {
            let mut map = AnonMapping::new(len, self.baseline_page).map_err(|e| chain(&e))?;
            map.populate_write(0, len).map_err(|e| chain(&e))?;
            let low = len.min(HOLE_START as usize);
            let (lo, hi) = map.as_mut_slice().split_at_mut(low);
            let mut ram = vec![microguest::GuestRam::new(lo, 0)];
            if !hi.is_empty() {
                ram.push(microguest::GuestRam::new(hi, HOLE_END));
            }
            let started = t0.elapsed();
            let r = microguest::run(&ram, &cfg).map_err(|e| chain(&e))?;
            (r, started, None, Vec::new())
        } else {
            let mut client = Client::connect(&self.socket).map_err(|e| chain(&e))?;
            let alloc = client.alloc(self.request()).map_err(|e| chain(&e))?;
            let alloc_ms = t0.elapsed().as_secs_f64() * 1e3;
            let page_sizes = alloc.regions.iter().map(|r| r.page_size).collect();
            let mem = alloc.guest_memory().map_err(|e| chain(&e))?;
            let mut ram = Vec::with_capacity(mem.num_regions());
            for r in mem.iter() {
                let n = usize::try_from(r.len()).map_err(|_| "region too large".to_string())?;
                // SAFETY: `r.as_ptr() .. + n` is the live read-write shared
                // mapping vm-memory made for this region; `mem` outlives
                // `ram` (dropped first below), and no Rust reference to the
                // memory exists while the guest runs.
                ram.push(unsafe {
                    microguest::GuestRam::from_raw_parts(r.as_ptr(), n, r.start_addr().0)
                });
            }
            let started = t0.elapsed();
            let r = microguest::run(&ram, &cfg);
            drop(ram);
            drop(mem);
            let id = alloc.id;
            // Our fds go before FREE, so the daemon sees no other holder.
            drop(alloc);
            client
                .free(id)
                .map_err(|e| format!("FREE: {}", chain(&e)))?;
            (
                r.map_err(|e| chain(&e))?,
                started,
                Some(alloc_ms),
                page_sizes,
            )
        };
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let run_start = started + report.setup;
        Ok(LaunchSample {
            ms: ms(t0.elapsed()),
            ready_ms: Some(ms(run_start + report.first_instruction)),
            touched_ms: Some(ms(run_start + report.all_touched)),
            alloc_ms,
            page_sizes,
            guest_pages: report.pages_touched,
            stale: report.saw_nonzero,
            exit: "guest exit port".into(),
        })
    }
}

/// Starts the run's private daemon on `socket` (default configuration;
/// pool target and limit at least `parallel` x `size`) and waits until it
/// answers.
fn start_daemon(
    launcher: &std::path::Path,
    socket: &std::path::Path,
    size: u64,
    parallel: usize,
) -> Result<ServeChild, ChurnError> {
    let defaults = Config::default();
    let hold = ByteSize(size.saturating_mul(parallel as u64));
    let opts = ServeOptions {
        socket: socket.to_path_buf(),
        pool: Some((
            defaults.pool.target.max(hold).0,
            defaults.pool.limit.max(hold).0,
        )),
        ..ServeOptions::default()
    };
    Ok(ServeChild::start(launcher, &opts)?)
}

fn policy_text(p: PagePolicy) -> &'static str {
    match p {
        PagePolicy::Best => "best",
        PagePolicy::Huge1G => "1G",
        PagePolicy::Huge2M => "2M",
        PagePolicy::Base4K => "4K",
    }
}

fn launch_error(side: Side, index: String) -> impl FnOnce(String) -> ChurnError {
    move |why| ChurnError::Launch {
        side: side.name(),
        index,
        why,
    }
}

/// The untimed first launch of a side.
fn warm_up(
    plan: &Plan,
    side: Side,
    progress: &mut dyn FnMut(&str),
) -> Result<LaunchSample, ChurnError> {
    let warm = plan
        .launch(side)
        .map_err(launch_error(side, "warm-up".into()))?;
    progress(&format!(
        "{} warm-up launch: {:.1} ms{}",
        side.name(),
        warm.ms,
        pages_text(&warm.page_sizes)
    ));
    Ok(warm)
}

/// `vms` timed launches, `parallel` at once, in start order. Every guest
/// must end normally.
fn churn(
    plan: &Plan,
    side: Side,
    vms: usize,
    parallel: usize,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<LaunchSample>, ChurnError> {
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let results: Mutex<Vec<Option<Result<LaunchSample, String>>>> =
        Mutex::new((0..vms).map(|_| None).collect());
    let (tx, rx) = mpsc::channel::<String>();
    std::thread::scope(|s| {
        for _ in 0..parallel.min(vms) {
            let tx = tx.clone();
            let (next, stop, results) = (&next, &stop, &results);
            s.spawn(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= vms || stop.load(Ordering::Relaxed) {
                    return;
                }
                let r = plan.launch(side);
                let line = match &r {
                    Ok(x) => format!(
                        "{} launch {}/{vms}: {:.1} ms{}{}",
                        side.name(),
                        i + 1,
                        x.ms,
                        pages_text(&x.page_sizes),
                        if x.stale { ", STALE READ" } else { "" }
                    ),
                    Err(e) => {
                        stop.store(true, Ordering::Relaxed);
                        format!("{} launch {}/{vms} failed: {e}", side.name(), i + 1)
                    }
                };
                let _ = tx.send(line);
                if let Ok(mut g) = results.lock() {
                    g[i] = Some(r);
                }
            });
        }
        drop(tx);
        for line in rx {
            progress(&line);
        }
    });
    let results = results
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut out = Vec::with_capacity(vms);
    for (i, r) in results.into_iter().enumerate() {
        match r {
            Some(Ok(x)) => out.push(x),
            Some(Err(why)) => return Err(launch_error(side, (i + 1).to_string())(why)),
            None => {}
        }
    }
    if out.len() != vms {
        return Err(launch_error(side, "?".into())(
            "stopped after another launch failed".into(),
        ));
    }
    Ok(out)
}

fn pages_text(sizes: &[u64]) -> String {
    if sizes.is_empty() {
        String::new()
    } else {
        format!(" on {} pages", page_key(sizes))
    }
}

/// Pages of `page` the host has for new allocations: free in the kernel,
/// plus idle (not in use) in the daemon's pools per `stats`.
fn pages_on_hand(page: PageSize, stats: Option<&Stats>) -> u64 {
    let free = PoolCounts::read(page, None)
        .ok()
        .flatten()
        .map_or(0, |c| c.available());
    let idle: u64 = stats.map_or(0, |s| {
        s.pools
            .iter()
            .filter(|p| p.page_size == page.to_string())
            .map(|p| p.clean_bytes + p.dirty_bytes + p.quarantined_bytes)
            .sum()
    });
    free + idle / page.bytes()
}

/// The largest page the policy allows (and that divides the size) of which
/// the host has enough for `parallel` launches; 4K when none.
fn expected_page(cfg: &ChurnConfig, stats: Option<&Stats>) -> PageSize {
    let candidates: Vec<PageSize> = match cfg.page_policy {
        PagePolicy::Best => vec![PageSize::Huge1G, PageSize::Huge2M],
        PagePolicy::Huge1G => return PageSize::Huge1G,
        PagePolicy::Huge2M => return PageSize::Huge2M,
        PagePolicy::Base4K => return PageSize::Base4K,
    };
    let want = |p: PageSize| cfg.size / p.bytes() * cfg.parallel as u64;
    candidates
        .into_iter()
        .filter(|p| cfg.size.is_multiple_of(p.bytes()))
        .find(|&p| pages_on_hand(p, stats) >= want(p))
        .unwrap_or(PageSize::Base4K)
}

/// The daemon's `downgrades` counter; `None` from a daemon whose STATS has
/// none (read by key: the typed `Counters` would say 0).
fn downgrade_counter(stats: &serde_json::Value) -> Option<u64> {
    stats.get("counters")?.get("downgrades")?.as_u64()
}

fn choose_vmm(cfg: &ChurnConfig) -> Result<(ChurnVmm, OsString), ChurnError> {
    let qemu_runs = || {
        Command::new(&cfg.qemu)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    let vmm = match cfg.vmm {
        Some(v) => v,
        None if cfg.cloud_hypervisor.is_some() => ChurnVmm::CloudHypervisor,
        None if qemu_runs() => ChurnVmm::Qemu,
        None => ChurnVmm::Micro,
    };
    let program = match vmm {
        ChurnVmm::CloudHypervisor => cfg.cloud_hypervisor.clone().ok_or_else(|| {
            ChurnError::Missing(
                "--vmm cloud-hypervisor needs CLOUD_HYPERVISOR to name the binary".into(),
            )
        })?,
        ChurnVmm::Qemu if !qemu_runs() => {
            return Err(ChurnError::Missing(format!(
                "{} --version does not run",
                cfg.qemu.to_string_lossy()
            )))
        }
        ChurnVmm::Qemu => cfg.qemu.clone(),
        ChurnVmm::Micro => OsString::new(),
    };
    Ok((vmm, program))
}

/// Runs the benchmark; `progress` gets one line per launch.
///
/// # Errors
///
/// See [`ChurnError`]; a launch whose guest does not run to a normal end
/// fails the run (a stale read does not: it is counted).
pub fn run(cfg: &ChurnConfig, progress: &mut dyn FnMut(&str)) -> Result<ChurnReport, ChurnError> {
    if cfg.vms == 0 || cfg.parallel == 0 || cfg.size == 0 || !cfg.size.is_multiple_of(STRIDE) {
        return Err(ChurnError::Options(
            "--vms and --parallel must be non-zero and --size a non-zero multiple of 2M".into(),
        ));
    }
    microguest::kvm_available().map_err(ChurnError::Missing)?;
    let (vmm, program) = choose_vmm(cfg)?;
    let dir =
        PrivateDir::create("hugemem-churn").map_err(io_err("cannot create a private directory"))?;
    let elf = dir.path().join("guest.elf");
    let image = microguest::pvh_elf(&microguest::PvhConfig {
        stride: STRIDE,
        marker: MARKER,
        start_gpa: START_GPA,
        ..Default::default()
    })
    .map_err(|e| ChurnError::Options(e.to_string()))?;
    std::fs::write(&elf, image).map_err(io_err(format!("cannot write {}", elf.display())))?;

    let live_stats = match &cfg.socket {
        Some(s) => Some(Client::connect(s)?.stats()?),
        None => None,
    };
    let expected = expected_page(cfg, live_stats.as_ref());
    // How many of these VMs the host's pages hold at the start: 1 is an
    // exact fit, 2 or more leaves pages to spare.
    let host_vm_fits = if expected.is_huge() {
        pages_on_hand(expected, live_stats.as_ref()) / (cfg.size / expected.bytes()).max(1)
    } else {
        0
    };
    let baseline_page = match (expected, cfg.page_policy) {
        (PageSize::Base4K, _) | (_, PagePolicy::Base4K) => {
            return Err(ChurnError::Missing(format!(
                "the baseline preallocates huge pages, and the host has neither {} x 1G nor {} x 2M free for {} launch(es) at once",
                cfg.size >> 30,
                cfg.size >> 21,
                cfg.parallel
            )))
        }
        (p, _) => p,
    };
    progress(&format!(
        "churn: {} x {} on {}, {} at once; expected page size {expected}; baseline first",
        cfg.vms,
        format_size(cfg.size),
        vmm.name(),
        cfg.parallel
    ));
    let mut plan = Plan {
        vmm,
        size: cfg.size,
        policy: cfg.page_policy,
        baseline_page,
        socket: cfg.socket.clone().unwrap_or_default(),
        launcher: cfg.launcher.clone(),
        program,
        elf,
        cpus: std::thread::available_parallelism().map_or(1, usize::from),
        timeout: cfg.timeout,
    };
    let base_warm = warm_up(&plan, Side::Baseline, progress)?;
    let baseline = churn(&plan, Side::Baseline, cfg.vms, cfg.parallel, progress)?;

    let private: Option<ServeChild> = match &cfg.socket {
        Some(_) => None,
        None => {
            let socket = dir.path().join("hugemem.sock");
            let d = start_daemon(&cfg.launcher, &socket, cfg.size, cfg.parallel)?;
            plan.socket = socket;
            Some(d)
        }
    };
    let mut hugemem_side = || -> Result<_, ChurnError> {
        let warm = warm_up(&plan, Side::Hugemem, progress)?;
        let before = Client::connect(&plan.socket)?.stats_json()?;
        let launches = churn(&plan, Side::Hugemem, cfg.vms, cfg.parallel, progress)?;
        let after = Client::connect(&plan.socket)?.stats_json()?;
        Ok((warm, before, after, launches))
    };
    let result = hugemem_side();
    if let Some(d) = private {
        d.stop();
    }
    let (warm, before, after, launches) = result?;

    let (downgrades, source) = match (downgrade_counter(&before), downgrade_counter(&after)) {
        (Some(b), Some(a)) => (a.saturating_sub(b), "daemon"),
        _ => (
            launches
                .iter()
                .filter(|l| l.page_sizes.iter().any(|&p| p < expected.bytes()))
                .count() as u64,
            "replies",
        ),
    };
    let mut page_sizes = BTreeMap::new();
    for l in &launches {
        *page_sizes.entry(page_key(&l.page_sizes)).or_insert(0) += 1;
    }
    let (h, b) = (Spread::of(&launches), Spread::of(&baseline));
    let ready = SpanReport::of(&launches, &baseline, |l| l.ready_ms);
    let touched = SpanReport::of(&launches, &baseline, |l| l.touched_ms);
    let allocs: Vec<f64> = launches.iter().filter_map(|l| l.alloc_ms).collect();
    Ok(ChurnReport {
        vmm,
        vms: cfg.vms,
        parallel: cfg.parallel,
        size_bytes: cfg.size,
        page_policy: policy_text(cfg.page_policy).into(),
        daemon: cfg
            .socket
            .as_ref()
            .map_or_else(|| "private".into(), |s| s.display().to_string()),
        expected_page_size: expected.to_string(),
        page_sizes,
        downgrades,
        downgrades_source: source,
        stale_reads: launches.iter().filter(|l| l.stale).count(),
        baseline_stale_reads: baseline.iter().filter(|l| l.stale).count(),
        p50_ms: h.p50,
        p99_ms: h.p99,
        max_ms: h.max,
        alloc_p50_ms: crate::stats::median(&allocs),
        baseline_p50_ms: b.p50,
        baseline_p99_ms: b.p99,
        baseline_max_ms: b.max,
        baseline_page_size: baseline_page.to_string(),
        speedup_p50: crate::stats::ratio(b.p50, h.p50),
        speedup_p99: crate::stats::ratio(b.p99, h.p99),
        p99_over_p50: crate::stats::ratio(h.p99, h.p50),
        host_vm_fits,
        ready,
        touched,
        warmup_ms: warm.ms,
        warmup_page_sizes: warm.page_sizes,
        baseline_warmup_ms: base_warm.ms,
        launches,
        baseline,
    })
}
