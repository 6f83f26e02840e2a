//! `hugemem bench compare`: hugemem against the VMMs' own ways of making
//! guest RAM ready, each booting the project's PVH micro-guest, in one run.
//!
//! # Variants
//!
//! * `qemu_prealloc` (**the baseline**): Debian's `qemu-system-x86_64 -accel
//!   kvm -M microvm,memory-backend=ram0` with `-object
//!   memory-backend-memfd,id=ram0,hugetlb=on,hugetlbsize=P,prealloc=on,prealloc-threads=N`
//!   (N = online CPUs): QEMU populates every page (the kernel zeroes it) before
//!   the vCPU starts.
//! * `qemu_lazy`: the same without `prealloc`: the guest's own first touches
//!   fault the pages in while it runs.
//! * `qemu_hugemem_fresh`, `qemu_hugemem_pool`: the same QEMU given hugemem
//!   memory the way `hugemem launch` does (ALLOC on a daemon, the memfd
//!   inherited as `/dev/fd/N`, `memory-backend-file,share=on`, no prealloc):
//!   from a daemon whose pool is empty (fresh pages, populated and zeroed by
//!   node-local workers), and from its clean pool (pages a guest used before,
//!   scrubbed in the background after FREE).
//! * `ch_prefault`, `ch_hugemem_pool`: cloud-hypervisor with `--memory
//!   size=S,hugepages=on,hugepage_size=P,prefault=on`, and with hugemem memory
//!   from the clean pool (`--memory size=0 --memory-zone …,file=/dev/fd/N,shared=on`).
//!   Only when the environment variable `CLOUD_HYPERVISOR` names a binary
//!   (the CLI passes it in); skipped with a note otherwise.
//! * `client_fresh`, `client_pool`: hugemem's own rust-vmm path, no VMM
//!   process: [`Client::alloc`], [`crate::client::Allocation::guest_memory`],
//!   and [`microguest::run`] on the mapped memory, KVM driven directly.
//!
//! # What is measured, per variant
//!
//! * `first_instruction_s`: launch (VMM spawn, or ALLOC for hugemem) to the
//!   guest's first instruction.
//! * `ready_s`: launch to guest RAM ready. Where the memory is populated
//!   before the vCPU starts (prealloc, prefault, hugemem) that is the first
//!   instruction; for `qemu_lazy` it is the guest's "all pages touched" mark,
//!   because only its own touches populate the RAM.
//! * `poweroff_s`: launch to the VMM's exit after the guest powered off (for
//!   the client: to [`microguest::run`] returning).
//! * `alloc_s`: the hugemem ALLOC (connect included), part of the above.
//! * `gib_per_s`: size / best `ready_s`.
//! * `ratios`: the baseline's best time over the variant's best time, for
//!   `ready_s` and `poweroff_s`: above 1 means faster than QEMU prealloc.
//!
//! # How the first instruction is seen
//!
//! The micro-guest's first instruction writes 123 (`{`) to port 0x3f0, and
//! it writes 124 (`|`) there once every page is touched. QEMU gets an
//! `isa-debugcon` device on that port whose chardev writes into the same
//! stdout pipe as the serial console; cloud-hypervisor gets `--debug-console
//! file=/dev/stdout,iobase=0x3f0`. The bench timestamps the read that brought
//! each byte. The alternative, a start marker printed on the serial console,
//! would need a change to the guest image and would come some instructions
//! later; the port write *is* the first instruction.
//!
//! # Order and state
//!
//! Each repetition runs every variant once, in two groups whose order
//! alternates (the VMM-owned memory first on even repetitions, hugemem first
//! on odd ones), and the order inside each group rotates. The hugemem group
//! starts a private daemon with an empty pool, runs one fresh variant, frees
//! (the pool scrubs it: `pool_scrub_s`), runs the pool variants one after the
//! other, each freeing and waiting for the scrub, then stops the daemon; the
//! other fresh variant runs on a second daemon. So at most `size` bytes of
//! huge pages are held at any time, which is what makes 2 GiB on 1 GiB pages
//! fit a machine with 3 of them. Before anything is timed the whole size is
//! populated and freed once (the outer host backs never-touched memory
//! lazily).
//!
//! # Page size
//!
//! 1 GiB pages when `size / 1 GiB` free pages can be reserved, else 2 MiB
//! pages, for **every** variant of the run (QEMU's `hugetlbsize`,
//! cloud-hypervisor's `hugepage_size` and hugemem's ALLOC): a fallback is
//! written into `page_size` and `note`, and the size is never changed.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use guest_mem::vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
use guest_mem::{PageSize, Reservation, SharedMapping};
use serde::Serialize;
use tracing::warn;

use super::alloc::pool_state;
use super::{best, median, ratio};
use crate::client::{Allocation, Client, ClientError};
use crate::daemon::config::PoolConfig;
use crate::daemon::{ByteSize, Config, Daemon, DaemonError, DaemonHandle};
use crate::guest_memory::GuestMemoryError;
use crate::launch::{build_args, BuildError, BuildOptions, MemoryFile, MemoryRegion, Vmm};
use crate::private_dir::PrivateDir;
use crate::proto::{AllocRequest, ClearMode, PagePolicy, ANY_NODE};
use guest_mem::size::format_size;

/// Default VM size.
pub const DEFAULT_SIZE: u64 = 4 << 30;
/// The variant every ratio is taken against.
pub const BASELINE: Variant = Variant::QemuPrealloc;
/// Distance between the guest's touches: every 2 MiB, so every page of
/// either huge-page size is touched.
const STRIDE: u64 = 2 << 20;
/// Under QEMU the first 8 bytes of GPA 0 hold the firmware's real-mode
/// interrupt vector table; the guest starts touching at 1 MiB.
const START_GPA: u64 = 1 << 20;
/// Mixed into what the guest writes.
const MARKER: u64 = 0x4845_4d43_4f4d_5052; // "HEMCOMPR"
/// The guest's first-instruction value on port 0x3f0 (`{`).
const FIRST_BYTE: u8 = 0x7b;
/// The guest's all-pages-touched value on port 0x3f0 (`|`).
const DONE_BYTE: u8 = 0x7c;
/// Longest a VMM may run before it is killed.
const VMM_DEADLINE: Duration = Duration::from_secs(120);
/// Longest wait for a FREE to come back clean.
const CLEAN_DEADLINE: Duration = Duration::from_secs(120);
/// How often the pool is looked at while waiting.
const CLEAN_POLL: Duration = Duration::from_millis(1);

/// Errors of the comparison benchmark.
#[derive(Debug, thiserror::Error)]
pub enum CompareError {
    /// Zero or unaligned size, or zero repetitions.
    #[error("size must be a non-zero multiple of 2M and repetitions non-zero")]
    Size,
    /// Neither 1 GiB nor 2 MiB pages could be reserved at the full size.
    #[error("no huge pages could be had for the run: {0}")]
    NoPages(String),
    /// The private work directory could not be made or written.
    #[error("cannot prepare the work directory {path}")]
    WorkDir {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The guest image could not be built.
    #[error("cannot build the micro-guest's PVH image")]
    Image(#[from] microguest::ConfigError),
    /// The warm-up mapping failed.
    #[error("warm-up populate failed")]
    Mapping(#[from] guest_mem::MappingError),
    /// The daemon did not start.
    #[error("cannot start the daemon")]
    Daemon(#[from] DaemonError),
    /// A daemon request failed.
    #[error("daemon request failed")]
    Client(#[from] ClientError),
    /// The pool did not show the freed memory clean in time.
    #[error("the pool did not show the freed memory clean within {0:?}")]
    CleanTimeout(Duration),
    /// The VMM command line could not carry hugemem's memory.
    #[error("cannot build the VMM command line")]
    Build(#[from] BuildError),
    /// Mapping the allocation for the client variant failed.
    #[error("cannot map the allocation")]
    Map(#[from] GuestMemoryError),
    /// The in-process micro-guest run failed.
    #[error("the micro-guest run failed")]
    Guest(#[from] microguest::Error),
    /// A VMM could not be started.
    #[error("cannot start {program:?}")]
    Spawn {
        /// The program.
        program: OsString,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Reading a VMM's output or waiting for it failed.
    #[error("cannot read from or wait for the VMM")]
    Wait(#[source] std::io::Error),
    /// A variant did not end the way the guest reports success.
    #[error("{variant}: {why}")]
    Failed {
        /// The variant's key.
        variant: &'static str,
        /// What went wrong, with the VMM's output.
        why: String,
    },
    /// The plot script failed.
    #[error("the plot script {script} failed: {why}")]
    Plot {
        /// The script.
        script: PathBuf,
        /// Why.
        why: String,
    },
}

/// One way of getting guest RAM ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Variant {
    /// QEMU, hugetlb memfd, `prealloc=on` (the baseline).
    QemuPrealloc,
    /// QEMU, hugetlb memfd, no prealloc.
    QemuLazy,
    /// QEMU on hugemem memory, fresh pages.
    QemuHugememFresh,
    /// QEMU on hugemem memory from the clean pool.
    QemuHugememPool,
    /// cloud-hypervisor, `hugepages=on,prefault=on`.
    ChPrefault,
    /// cloud-hypervisor on hugemem memory from the clean pool.
    ChHugememPool,
    /// hugemem's rust-vmm client, fresh pages.
    ClientFresh,
    /// hugemem's rust-vmm client, from the clean pool.
    ClientPool,
}

/// Who runs the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Runner {
    Qemu,
    CloudHypervisor,
    Client,
}

/// Where the memory comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Memory {
    /// The VMM's own (prealloc, prefault or lazy).
    Own,
    /// A hugemem ALLOC from an empty pool.
    Fresh,
    /// A hugemem ALLOC from the clean pool.
    Pool,
}

impl Variant {
    /// Every variant, in report order.
    pub const ALL: [Variant; 8] = [
        Variant::QemuPrealloc,
        Variant::QemuLazy,
        Variant::QemuHugememFresh,
        Variant::QemuHugememPool,
        Variant::ChPrefault,
        Variant::ChHugememPool,
        Variant::ClientFresh,
        Variant::ClientPool,
    ];

    /// The JSON key.
    pub fn key(self) -> &'static str {
        match self {
            Variant::QemuPrealloc => "qemu_prealloc",
            Variant::QemuLazy => "qemu_lazy",
            Variant::QemuHugememFresh => "qemu_hugemem_fresh",
            Variant::QemuHugememPool => "qemu_hugemem_pool",
            Variant::ChPrefault => "ch_prefault",
            Variant::ChHugememPool => "ch_hugemem_pool",
            Variant::ClientFresh => "client_fresh",
            Variant::ClientPool => "client_pool",
        }
    }

    /// A short description.
    pub fn label(self) -> &'static str {
        match self {
            Variant::QemuPrealloc => "QEMU, hugetlb memfd, prealloc=on (baseline)",
            Variant::QemuLazy => "QEMU, hugetlb memfd, no prealloc",
            Variant::QemuHugememFresh => "QEMU on hugemem memory, fresh pages",
            Variant::QemuHugememPool => "QEMU on hugemem memory, clean pool",
            Variant::ChPrefault => "cloud-hypervisor, hugepages prefault=on",
            Variant::ChHugememPool => "cloud-hypervisor on hugemem memory, clean pool",
            Variant::ClientFresh => "hugemem client (rust-vmm, KVM), fresh pages",
            Variant::ClientPool => "hugemem client (rust-vmm, KVM), clean pool",
        }
    }

    fn runner(self) -> Runner {
        match self {
            Variant::QemuPrealloc
            | Variant::QemuLazy
            | Variant::QemuHugememFresh
            | Variant::QemuHugememPool => Runner::Qemu,
            Variant::ChPrefault | Variant::ChHugememPool => Runner::CloudHypervisor,
            Variant::ClientFresh | Variant::ClientPool => Runner::Client,
        }
    }

    fn memory(self) -> Memory {
        match self {
            Variant::QemuPrealloc | Variant::QemuLazy | Variant::ChPrefault => Memory::Own,
            Variant::QemuHugememFresh | Variant::ClientFresh => Memory::Fresh,
            Variant::QemuHugememPool | Variant::ChHugememPool | Variant::ClientPool => Memory::Pool,
        }
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct CompareConfig {
    /// VM size (never changed; only the page size falls back).
    pub size: u64,
    /// Repetitions; best and median are reported.
    pub reps: usize,
    /// Page size; `None` = 1 GiB, then 2 MiB (said out loud).
    pub page_size: Option<PageSize>,
    /// The QEMU binary.
    pub qemu: OsString,
    /// The cloud-hypervisor binary (`None`: its variants are skipped).
    pub cloud_hypervisor: Option<OsString>,
    /// QEMU's `prealloc-threads` (`None`: online CPUs).
    pub prealloc_threads: Option<usize>,
}

impl Default for CompareConfig {
    fn default() -> Self {
        Self {
            size: DEFAULT_SIZE,
            reps: 3,
            page_size: None,
            qemu: "qemu-system-x86_64".into(),
            cloud_hypervisor: None,
            prealloc_threads: None,
        }
    }
}

/// Best and median of the repetitions, seconds.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Figure {
    /// The smallest.
    pub best: f64,
    /// The median.
    pub median: f64,
}

impl Figure {
    fn of(samples: &[f64]) -> Option<Self> {
        (!samples.is_empty()).then(|| Self {
            best: best(samples),
            median: median(samples),
        })
    }
}

/// Every repetition of one variant, seconds, in order.
#[derive(Debug, Clone, Default, Serialize)]
pub struct VariantSamples {
    /// Launch to guest RAM ready.
    pub ready_s: Vec<f64>,
    /// Launch to the first guest instruction.
    pub first_instruction_s: Vec<f64>,
    /// Launch to the VMM's exit after power-off.
    pub poweroff_s: Vec<f64>,
    /// The hugemem ALLOC (empty for VMM-owned memory).
    pub alloc_s: Vec<f64>,
}

/// One variant's figures.
#[derive(Debug, Clone, Serialize)]
pub struct VariantReport {
    /// JSON key, e.g. `qemu_prealloc`.
    pub key: &'static str,
    /// Description.
    pub label: &'static str,
    /// Whether it was not run.
    pub skipped: bool,
    /// Why it was skipped, or what to know about its figures.
    pub note: Option<String>,
    /// Launch to guest RAM ready.
    pub ready_s: Option<Figure>,
    /// Launch to the first guest instruction.
    pub first_instruction_s: Option<Figure>,
    /// Launch to the VMM's exit after power-off.
    pub poweroff_s: Option<Figure>,
    /// The hugemem ALLOC.
    pub alloc_s: Option<Figure>,
    /// Size / best ready time, GiB/s.
    pub gib_per_s: Option<f64>,
    /// The guest's serial report of the last repetition.
    pub guest_report: Option<String>,
    /// Every repetition.
    pub samples: VariantSamples,
}

/// A variant against the baseline.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Ratio {
    /// Baseline best `ready_s` / this variant's best `ready_s`.
    pub ready: f64,
    /// Baseline best `poweroff_s` / this variant's best `poweroff_s`.
    pub poweroff: f64,
}

/// The report; `--json` prints it as one object.
#[derive(Debug, Clone, Serialize)]
pub struct CompareReport {
    /// Guest RAM per VM.
    pub size_bytes: u64,
    /// Page size every variant used.
    pub page_size: String,
    /// Fallbacks and other things to know (`null` when none).
    pub note: Option<String>,
    /// Repetitions.
    pub reps: usize,
    /// Online CPUs.
    pub cpus: usize,
    /// QEMU's `prealloc-threads`.
    pub prealloc_threads: usize,
    /// Distance between the guest's touches, bytes.
    pub stride_bytes: u64,
    /// `qemu --version`, first line (`null`: not found).
    pub qemu_version: Option<String>,
    /// `cloud-hypervisor --version` (`null`: not given or not found).
    pub cloud_hypervisor_version: Option<String>,
    /// The baseline's key.
    pub baseline: &'static str,
    /// Every variant, skipped ones included, in a fixed order.
    pub variants: Vec<VariantReport>,
    /// Each measured variant against the baseline, by key (empty when the
    /// baseline was skipped).
    pub ratios: BTreeMap<&'static str, Ratio>,
    /// FREE to the pool showing the region clean (the background scrub that
    /// pays for the pool variants).
    pub pool_scrub_s: Option<Figure>,
}

/// One repetition of one variant.
#[derive(Debug, Clone)]
struct Sample {
    ready: f64,
    first_instruction: f64,
    poweroff: f64,
    alloc: Option<f64>,
    guest: Option<String>,
}

/// A VMM run as seen from outside: when the port 0x3f0 bytes arrived, when
/// it exited, and what it printed.
#[derive(Debug)]
struct VmmRun {
    first: Option<Duration>,
    done: Option<Duration>,
    exit: Duration,
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

impl VmmRun {
    fn guest_line(&self) -> Option<&str> {
        self.stdout
            .lines()
            .find_map(|l| l.find("HUGEMEM-GUEST ").map(|i| l[i..].trim()))
    }

    fn describe(&self) -> String {
        format!(
            "{}; stdout {:?}; stderr {:?}",
            self.status,
            self.stdout,
            tail(&self.stderr, 2000)
        )
    }
}

fn tail(s: &str, max: usize) -> &str {
    let mut start = s.len().saturating_sub(max);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

/// Picks the page size for every variant and reserves `size / page` pages.
fn reserve(
    size: u64,
    only: Option<PageSize>,
    notes: &mut Vec<String>,
) -> Result<(PageSize, Reservation), CompareError> {
    let candidates: Vec<PageSize> = match only {
        Some(p) => vec![p],
        None => vec![PageSize::Huge1G, PageSize::Huge2M],
    };
    for page in candidates {
        if !page.is_huge() {
            notes.push("4K pages are not compared: the QEMU baseline is hugetlb".into());
            continue;
        }
        if !size.is_multiple_of(page.bytes()) {
            notes.push(format!(
                "{} is not a multiple of {page} pages",
                format_size(size)
            ));
            continue;
        }
        let want = size / page.bytes();
        match Reservation::for_run(page, want) {
            Ok(r) if r.report().met => {
                if !notes.is_empty() {
                    notes.push(format!(
                        "so the QEMU baseline (hugetlbsize={page}), cloud-hypervisor and hugemem all use {page} pages"
                    ));
                }
                return Ok((page, r));
            }
            Ok(r) => notes.push(format!(
                "{} needs {want} free {page} pages, the kernel has {}",
                format_size(size),
                r.report().free
            )),
            Err(e) => notes.push(format!("cannot reserve {page} pages: {e}")),
        }
    }
    Err(CompareError::NoPages(notes.join("; ")))
}

/// First line of `program --version`, or why not.
fn version(program: &OsString) -> Result<String, String> {
    match Command::new(program)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
    {
        Ok(o) if o.status.success() => Ok(String::from_utf8_lossy(&o.stdout)
            .lines()
            .next()
            .unwrap_or("")
            .trim()
            .to_string()),
        Ok(o) => Err(format!(
            "{} --version failed ({})",
            program.to_string_lossy(),
            o.status
        )),
        Err(e) => Err(format!("{} not found: {e}", program.to_string_lossy())),
    }
}

/// Spawns `argv` with `inherit` open in the child under their current
/// numbers, stdout and stderr piped, and timestamps (from `t0`) the reads
/// that bring the guest's port 0x3f0 bytes. Kills it after [`VMM_DEADLINE`].
///
/// Not [`crate::launch::run_vmm`]: that one forwards signals and, in a
/// process with other threads (this one has the daemon's), sees the child's
/// exit only at its next 50 ms poll; here the exit is seen at once through
/// EOF on stdout and a blocking wait.
fn run_vmm_timed(
    argv: &[OsString],
    inherit: &[BorrowedFd<'_>],
    t0: Instant,
) -> Result<VmmRun, CompareError> {
    let Some((program, args)) = argv.split_first() else {
        return Err(CompareError::Spawn {
            program: OsString::new(),
            source: std::io::Error::other("empty command"),
        });
    };
    let fds: Vec<RawFd> = inherit.iter().map(AsRawFd::as_raw_fd).collect();
    let mut cmd = Command::new(program);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if !fds.is_empty() {
        let hook = move || -> std::io::Result<()> {
            for &fd in &fds {
                // SAFETY: fcntl(F_GETFD/F_SETFD) only reads and writes the
                // descriptor flags of `fd`, which the parent holds open (its
                // BorrowedFd outlives the spawn), so it is open in the child.
                let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
                if flags < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // SAFETY: as above.
                if unsafe { libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) } < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        };
        // SAFETY: the hook runs in the child between fork and exec, where only
        // async-signal-safe calls are allowed: it calls fcntl (async-signal-
        // safe) on fd numbers captured before the fork, iterates a Vec without
        // allocating, and takes no lock.
        unsafe { cmd.pre_exec(hook) };
    }
    let mut child = cmd.spawn().map_err(|source| CompareError::Spawn {
        program: program.clone(),
        source,
    })?;
    let (Some(mut stdout), Some(mut stderr)) = (child.stdout.take(), child.stderr.take()) else {
        let _ = child.kill();
        let _ = child.wait();
        return Err(CompareError::Wait(std::io::Error::other(
            "the VMM's output pipes are missing",
        )));
    };
    let pid = i32::try_from(child.id())
        .map(nix::unistd::Pid::from_raw)
        .map_err(|_| CompareError::Wait(std::io::Error::other("child pid out of range")))?;
    // The watchdog kills by pid, which is safe only while the child is not
    // reaped: it is joined before the wait below.
    let (stop, stopped) = mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(VMM_DEADLINE) {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            return true;
        }
        false
    });
    let err_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = stderr.read_to_end(&mut v);
        v
    });
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let (mut first, mut done) = (None, None);
    let read_result = loop {
        match stdout.read(&mut buf) {
            Ok(0) => break Ok(()),
            Ok(n) => {
                let at = t0.elapsed();
                let chunk = &buf[..n];
                if first.is_none() && chunk.contains(&FIRST_BYTE) {
                    first = Some(at);
                }
                if done.is_none() && chunk.contains(&DONE_BYTE) {
                    done = Some(at);
                }
                out.extend_from_slice(chunk);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => break Err(e),
        }
    };
    if read_result.is_err() {
        let _ = child.kill();
    }
    // A send error means the watchdog already fired and is gone.
    let _ = stop.send(());
    let killed = watchdog.join().unwrap_or(false);
    let status = child.wait().map_err(CompareError::Wait)?;
    let exit = t0.elapsed();
    read_result.map_err(CompareError::Wait)?;
    let stderr = err_reader.join().unwrap_or_default();
    let run = VmmRun {
        first,
        done,
        exit,
        status,
        stdout: String::from_utf8_lossy(&out).into_owned(),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
    };
    if killed {
        return Err(CompareError::Wait(std::io::Error::other(format!(
            "{} ran longer than {VMM_DEADLINE:?} and was killed: {}",
            program.to_string_lossy(),
            run.describe()
        ))));
    }
    Ok(run)
}

/// The benchmark's state during a run.
struct Bench<'a> {
    size: u64,
    page: PageSize,
    cpus: usize,
    prealloc_threads: usize,
    elf: PathBuf,
    socket: PathBuf,
    qemu: Option<OsString>,
    cloud_hypervisor: Option<OsString>,
    /// Per variant: why it is skipped.
    skipped: BTreeMap<Variant, String>,
    samples: BTreeMap<Variant, Vec<Sample>>,
    scrub: Vec<f64>,
    progress: &'a mut dyn FnMut(&str),
}

impl Bench<'_> {
    fn enabled(&self, v: Variant) -> bool {
        !self.skipped.contains_key(&v)
    }

    fn page_text(&self) -> String {
        self.page.to_string()
    }

    /// QEMU arguments shared by every QEMU variant, with `machine` as the
    /// `-M` value.
    fn qemu_common(&self, machine: &str) -> Vec<OsString> {
        let mut v: Vec<OsString> = [
            "-M",
            machine,
            "-accel",
            "kvm",
            "-cpu",
            crate::launch::qemu::KVM_CPU,
            "-nodefaults",
            "-no-user-config",
            "-nographic",
            "-no-reboot",
            "-serial",
            "stdio",
            "-chardev",
            "file,id=hmfirst,path=/dev/stdout",
            "-device",
            "isa-debugcon,iobase=0x3f0,chardev=hmfirst",
            "-device",
            "isa-debug-exit",
            "-kernel",
        ]
        .iter()
        .map(OsString::from)
        .collect();
        v.push(self.elf.clone().into_os_string());
        v
    }

    /// cloud-hypervisor arguments shared by both of its variants.
    fn ch_common(&self) -> Vec<OsString> {
        let mut v: Vec<OsString> = vec!["--kernel".into(), self.elf.clone().into_os_string()];
        v.extend(
            [
                "--cpus",
                "boot=1",
                "--serial",
                "tty",
                "--console",
                "off",
                "--debug-console",
                "file=/dev/stdout,iobase=0x3f0",
            ]
            .iter()
            .map(OsString::from),
        );
        v
    }

    /// A VMM-owned-memory variant: spawn, wait, check.
    fn run_own(&mut self, v: Variant) -> Result<Sample, CompareError> {
        let size = format_size(self.size);
        let page = self.page_text();
        let argv: Vec<OsString> = match v.runner() {
            Runner::Qemu => {
                let program = self.qemu.clone().unwrap_or_default();
                let prealloc = if v == Variant::QemuPrealloc {
                    format!(",prealloc=on,prealloc-threads={}", self.prealloc_threads)
                } else {
                    String::new()
                };
                let mut a: Vec<OsString> = vec![
                    program,
                    "-object".into(),
                    format!("memory-backend-memfd,id=ram0,size={size},hugetlb=on,hugetlbsize={page}{prealloc}").into(),
                    "-m".into(),
                    size.clone().into(),
                ];
                a.extend(self.qemu_common("microvm,memory-backend=ram0"));
                a
            }
            Runner::CloudHypervisor => {
                let mut a: Vec<OsString> = vec![
                    self.cloud_hypervisor.clone().unwrap_or_default(),
                    "--memory".into(),
                    format!("size={size},hugepages=on,hugepage_size={page},prefault=on").into(),
                ];
                a.extend(self.ch_common());
                a
            }
            Runner::Client => {
                return Err(CompareError::Failed {
                    variant: v.key(),
                    why: "the client runs on hugemem memory only".into(),
                })
            }
        };
        let t0 = Instant::now();
        let run = run_vmm_timed(&argv, &[], t0)?;
        check_vmm(v, &run, None)
    }

    fn start_daemon(&self) -> Result<DaemonHandle, CompareError> {
        let defaults = Config::default();
        // The pool must keep the freed VM, and look for other holders often.
        let config = Config {
            socket: self.socket.clone(),
            pool: PoolConfig {
                target: defaults.pool.target.max(ByteSize(self.size)),
                limit: defaults.pool.limit.max(ByteSize(self.size)),
                recheck_ms: 10,
                ..defaults.pool.clone()
            },
            ..defaults
        };
        Ok(Daemon::start(config)?)
    }

    fn request(&self) -> AllocRequest {
        AllocRequest {
            total_size: self.size,
            page_policy: match self.page {
                PageSize::Huge1G => PagePolicy::Huge1G,
                PageSize::Huge2M => PagePolicy::Huge2M,
                PageSize::Base4K => PagePolicy::Base4K,
            },
            clear_mode: ClearMode::Eager,
            lock: false,
            parts: Vec::new(),
            want_paths: false,
        }
    }

    /// FREE `id` and wait until the pool shows it clean; the time goes into
    /// `pool_scrub_s`.
    fn free_and_scrub(
        &mut self,
        daemon: &DaemonHandle,
        client: &mut Client,
        id: u64,
    ) -> Result<(), CompareError> {
        let t = Instant::now();
        client.free(id)?;
        self.wait_clean(daemon)?;
        self.scrub.push(t.elapsed().as_secs_f64());
        Ok(())
    }

    /// Waits until the pool holds the whole size clean and nothing dirty.
    fn wait_clean(&self, daemon: &DaemonHandle) -> Result<(), CompareError> {
        let deadline = Instant::now() + CLEAN_DEADLINE;
        loop {
            let (clean, pending) = pool_state(&daemon.stats());
            if clean >= self.size && pending == 0 {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(CompareError::CleanTimeout(CLEAN_DEADLINE));
            }
            std::thread::sleep(CLEAN_POLL);
        }
    }

    /// Fills the pool without timing anything (ALLOC, FREE, scrub).
    fn fill_pool(&mut self, daemon: &DaemonHandle) -> Result<(), CompareError> {
        let mut client = Client::connect(daemon.socket_path())?;
        let a = client.alloc(self.request())?;
        let id = a.id;
        drop(a);
        client.free(id)?;
        self.wait_clean(daemon)
    }

    /// A hugemem variant on `daemon`: ALLOC, run, FREE; `scrub` waits for the
    /// pool to show the region clean afterwards.
    fn run_hugemem(
        &mut self,
        daemon: &DaemonHandle,
        v: Variant,
        scrub: bool,
    ) -> Result<Sample, CompareError> {
        let t0 = Instant::now();
        let mut client = Client::connect(daemon.socket_path())?;
        let alloc = client.alloc(self.request())?;
        let alloc_s = t0.elapsed().as_secs_f64();
        let sample = match v.runner() {
            Runner::Client => run_client(v, &alloc, t0, alloc_s),
            vmm_kind => {
                let (vmm, program, user) = if vmm_kind == Runner::Qemu {
                    (
                        Vmm::Qemu,
                        self.qemu.clone().unwrap_or_default(),
                        self.qemu_common("microvm"),
                    )
                } else {
                    (
                        Vmm::CloudHypervisor,
                        self.cloud_hypervisor.clone().unwrap_or_default(),
                        self.ch_common(),
                    )
                };
                let regions: Vec<MemoryRegion> = alloc
                    .regions
                    .iter()
                    .zip(&alloc.fds)
                    .map(|(r, fd)| MemoryRegion {
                        size: r.size,
                        node: (r.node != ANY_NODE).then_some(r.node),
                        file: MemoryFile::Fd(fd.as_raw_fd()),
                    })
                    .collect();
                let mut argv = vec![program];
                argv.extend(build_args(vmm, &user, &regions, &BuildOptions::default())?);
                let inherit: Vec<BorrowedFd<'_>> = alloc.fds.iter().map(AsFd::as_fd).collect();
                run_vmm_timed(&argv, &inherit, t0).and_then(|run| check_vmm(v, &run, Some(alloc_s)))
            }
        };
        let id = alloc.id;
        // Our fds go before FREE, so the daemon sees no other holder.
        drop(alloc);
        let sample = sample?;
        if scrub {
            self.free_and_scrub(daemon, &mut client, id)?;
        } else {
            client.free(id)?;
        }
        Ok(sample)
    }

    fn record(&mut self, v: Variant, s: Sample) {
        (self.progress)(&format!(
            "  {:<20} ready {:.4} s, first instruction {:.4} s, power-off {:.4} s{}",
            v.key(),
            s.ready,
            s.first_instruction,
            s.poweroff,
            s.alloc
                .map(|a| format!(" (ALLOC {a:.4} s)"))
                .unwrap_or_default()
        ));
        self.samples.entry(v).or_default().push(s);
    }

    /// QEMU prealloc, QEMU lazy and cloud-hypervisor prefault, in `rep`'s order.
    fn own_group(&mut self, rep: usize) -> Result<(), CompareError> {
        let mut order: Vec<Variant> = Variant::ALL
            .into_iter()
            .filter(|v| v.memory() == Memory::Own)
            .collect();
        let n = order.len().max(1);
        order.rotate_left(rep % n);
        for v in order {
            if self.enabled(v) {
                let s = self.run_own(v)?;
                self.record(v, s);
            }
        }
        Ok(())
    }

    /// The hugemem variants: one fresh, the pool ones, then the other fresh
    /// one on a second daemon (each fresh variant needs an empty pool).
    fn hugemem_group(&mut self, rep: usize) -> Result<(), CompareError> {
        let of = |kind: Memory| -> Vec<Variant> {
            let mut list: Vec<Variant> = Variant::ALL
                .into_iter()
                .filter(|v| v.memory() == kind)
                .collect();
            let n = list.len().max(1);
            list.rotate_left(rep % n);
            list.retain(|v| self.enabled(*v));
            list
        };
        let (fresh, pool) = (of(Memory::Fresh), of(Memory::Pool));
        if fresh.is_empty() && pool.is_empty() {
            return Ok(());
        }
        let daemon = self.start_daemon()?;
        let result: Result<(), CompareError> = (|| {
            let mut filled = false;
            if let Some(&v) = fresh.first() {
                let s = self.run_hugemem(&daemon, v, !pool.is_empty())?;
                self.record(v, s);
                filled = true;
            }
            if !pool.is_empty() && !filled {
                self.fill_pool(&daemon)?;
            }
            for &v in &pool {
                let s = self.run_hugemem(&daemon, v, true)?;
                self.record(v, s);
            }
            Ok(())
        })();
        if let Err(e) = daemon.shutdown() {
            warn!(error = %e, "daemon shutdown failed");
        }
        result?;
        if let Some(&v) = fresh.get(1) {
            let daemon = self.start_daemon()?;
            let result = self.run_hugemem(&daemon, v, false);
            if let Err(e) = daemon.shutdown() {
                warn!(error = %e, "daemon shutdown failed");
            }
            let s = result?;
            self.record(v, s);
        }
        Ok(())
    }
}

/// Checks a VMM run (exit status, the guest's report, the port marks) and
/// turns it into a sample.
fn check_vmm(v: Variant, run: &VmmRun, alloc: Option<f64>) -> Result<Sample, CompareError> {
    let fail = |why: String| CompareError::Failed {
        variant: v.key(),
        why,
    };
    let line = run
        .guest_line()
        .ok_or_else(|| fail(format!("no guest report: {}", run.describe())))?;
    if !line.contains(" nonzero=0") {
        return Err(fail(format!("the guest read non-zero memory: {line}")));
    }
    // QEMU's isa-debug-exit: the guest writes 0, QEMU exits (0 << 1) | 1.
    let exit_ok = match v.runner() {
        Runner::Qemu => run.status.code() == Some(1),
        _ => run.status.success(),
    };
    if !exit_ok {
        return Err(fail(format!("unexpected exit: {}", run.describe())));
    }
    let first = run
        .first
        .ok_or_else(|| fail(format!("no first-instruction mark: {}", run.describe())))?;
    let ready = if v == Variant::QemuLazy {
        run.done
            .ok_or_else(|| fail(format!("no all-pages-touched mark: {}", run.describe())))?
    } else {
        first
    };
    Ok(Sample {
        ready: ready.as_secs_f64(),
        first_instruction: first.as_secs_f64(),
        poweroff: run.exit.as_secs_f64(),
        alloc,
        guest: Some(line.to_string()),
    })
}

/// The client variant: map the allocation like a rust-vmm VMM and run the
/// micro-guest on it under KVM.
fn run_client(
    v: Variant,
    alloc: &Allocation,
    t0: Instant,
    alloc_s: f64,
) -> Result<Sample, CompareError> {
    // `guest_memory()` already leaves [3 GiB, 4 GiB) free (a region crossing
    // 3 GiB becomes two vm-memory regions), so each region maps as it is.
    let mem = alloc.guest_memory()?;
    let mut ram = Vec::with_capacity(mem.num_regions());
    for r in mem.iter() {
        let len = usize::try_from(r.len()).map_err(|_| CompareError::Size)?;
        // SAFETY: `r.as_ptr() .. + len` is the live read-write shared mapping
        // vm-memory made for this region; `mem` outlives `ram` (both die at
        // the end of this function, `ram` first), and no Rust reference to
        // the memory exists while the guest runs.
        ram.push(unsafe {
            microguest::GuestRam::from_raw_parts(r.as_ptr(), len, r.start_addr().0)
        });
    }
    // RAM leaves [3 GiB, 4 GiB) free, so the runner's default control slot
    // (4 GiB - 1 MiB) does not collide with it.
    let cfg = microguest::RunConfig {
        stride: STRIDE,
        marker: MARKER,
        start_gpa: 0,
        ..Default::default()
    };
    let run_started = t0.elapsed();
    let report = microguest::run(&ram, &cfg)?;
    let poweroff = t0.elapsed();
    drop(ram);
    drop(mem);
    if report.saw_nonzero {
        return Err(CompareError::Failed {
            variant: v.key(),
            why: format!("the guest read non-zero memory: {}", report.serial.trim()),
        });
    }
    let first = run_started + report.setup + report.first_instruction;
    Ok(Sample {
        ready: first.as_secs_f64(),
        first_instruction: first.as_secs_f64(),
        poweroff: poweroff.as_secs_f64(),
        alloc: Some(alloc_s),
        guest: Some(report.serial.trim().to_string()),
    })
}

/// Why each variant cannot run here, from what is installed.
fn skip_reasons(
    kvm: &Result<(), String>,
    qemu: &Result<String, String>,
    ch: Option<&Result<String, String>>,
) -> BTreeMap<Variant, String> {
    let mut skipped = BTreeMap::new();
    for v in Variant::ALL {
        let why = if let Err(e) = kvm {
            Some(format!("no usable KVM: {e}"))
        } else {
            match v.runner() {
                Runner::Qemu => qemu.as_ref().err().cloned(),
                Runner::CloudHypervisor => match ch {
                    None => {
                        Some("CLOUD_HYPERVISOR does not name a cloud-hypervisor binary".to_string())
                    }
                    Some(r) => r.as_ref().err().cloned(),
                },
                Runner::Client => None,
            }
        };
        if let Some(why) = why {
            skipped.insert(v, why);
        }
    }
    skipped
}

/// Runs the benchmark. `progress` gets one line per step.
///
/// # Errors
///
/// See [`CompareError`]. A variant whose guest does not report clean memory
/// and a clean power-off fails the run.
pub fn run(
    cfg: &CompareConfig,
    progress: &mut dyn FnMut(&str),
) -> Result<CompareReport, CompareError> {
    if cfg.size == 0 || cfg.reps == 0 || !cfg.size.is_multiple_of(2 << 20) {
        return Err(CompareError::Size);
    }
    let len = usize::try_from(cfg.size).map_err(|_| CompareError::Size)?;
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    let prealloc_threads = cfg.prealloc_threads.unwrap_or(cpus).max(1);

    let kvm = microguest::kvm_available();
    let qemu_version = version(&cfg.qemu);
    let ch_version = cfg.cloud_hypervisor.as_ref().map(version);
    let skipped = skip_reasons(&kvm, &qemu_version, ch_version.as_ref());

    let mut notes = Vec::new();
    let (page, _reservation) = reserve(cfg.size, cfg.page_size, &mut notes)?;
    let note = (!notes.is_empty()).then(|| notes.join("; "));

    let dir = PrivateDir::create("hugemem-compare").map_err(|source| CompareError::WorkDir {
        path: std::env::temp_dir(),
        source,
    })?;
    let elf = dir.path().join("guest.elf");
    let image = microguest::pvh_elf(&microguest::PvhConfig {
        stride: STRIDE,
        marker: MARKER,
        start_gpa: START_GPA,
        ..Default::default()
    })?;
    std::fs::write(&elf, image).map_err(|source| CompareError::WorkDir {
        path: elf.clone(),
        source,
    })?;

    progress(&format!(
        "{} on {page} pages, {cpus} CPU(s), prealloc-threads={prealloc_threads}, {} repetition(s){}",
        format_size(cfg.size),
        cfg.reps,
        note.as_deref()
            .map(|n| format!(" (note: {n})"))
            .unwrap_or_default()
    ));
    for (v, why) in &skipped {
        progress(&format!("{} skipped: {why}", v.key()));
    }
    progress("warm-up: populating and freeing the pages once");
    {
        let warm = SharedMapping::memfd(len, page)?;
        warm.populate_write(0, len)?;
    }

    let mut bench = Bench {
        size: cfg.size,
        page,
        cpus,
        prealloc_threads,
        socket: dir.path().join("hugemem.sock"),
        elf,
        qemu: qemu_version.is_ok().then(|| cfg.qemu.clone()),
        cloud_hypervisor: match &ch_version {
            Some(Ok(_)) => cfg.cloud_hypervisor.clone(),
            _ => None,
        },
        skipped,
        samples: BTreeMap::new(),
        scrub: Vec::new(),
        progress,
    };
    for rep in 0..cfg.reps {
        (bench.progress)(&format!("repetition {}/{}", rep + 1, cfg.reps));
        if rep % 2 == 0 {
            bench.own_group(rep)?;
            bench.hugemem_group(rep)?;
        } else {
            bench.hugemem_group(rep)?;
            bench.own_group(rep)?;
        }
    }
    drop(dir);
    Ok(bench.report(
        cfg.reps,
        note,
        qemu_version.ok(),
        ch_version.and_then(Result::ok),
    ))
}

impl Bench<'_> {
    fn report(
        self,
        reps: usize,
        note: Option<String>,
        qemu_version: Option<String>,
        cloud_hypervisor_version: Option<String>,
    ) -> CompareReport {
        let gib = self.size as f64 / f64::from(1u32 << 30);
        let mut variants = Vec::new();
        for v in Variant::ALL {
            let list = self.samples.get(&v).map(Vec::as_slice).unwrap_or_default();
            let s = VariantSamples {
                ready_s: list.iter().map(|s| s.ready).collect(),
                first_instruction_s: list.iter().map(|s| s.first_instruction).collect(),
                poweroff_s: list.iter().map(|s| s.poweroff).collect(),
                alloc_s: list.iter().filter_map(|s| s.alloc).collect(),
            };
            let ready = Figure::of(&s.ready_s);
            let note = self.skipped.get(&v).cloned().or_else(|| match v {
                Variant::QemuLazy => Some(
                    "ready = the guest's all-pages-touched mark: its own touches populate the RAM"
                        .into(),
                ),
                Variant::QemuHugememPool | Variant::ChHugememPool | Variant::ClientPool => Some(
                    "pages a previous guest used, scrubbed in the background after FREE (pool_scrub_s)"
                        .into(),
                ),
                _ => None,
            });
            variants.push(VariantReport {
                key: v.key(),
                label: v.label(),
                skipped: self.skipped.contains_key(&v),
                note,
                gib_per_s: ready.map(|r| if r.best > 0.0 { gib / r.best } else { 0.0 }),
                ready_s: ready,
                first_instruction_s: Figure::of(&s.first_instruction_s),
                poweroff_s: Figure::of(&s.poweroff_s),
                alloc_s: Figure::of(&s.alloc_s),
                guest_report: list.last().and_then(|s| s.guest.clone()),
                samples: s,
            });
        }
        // The PVH guest reports status=1 when it could not map all RAM.
        let clipped = variants.iter().any(|r| {
            r.guest_report
                .as_deref()
                .is_some_and(|g| g.contains("status=1"))
        });
        let note = if clipped {
            let clip = "microvm puts guest RAM beyond 3G above 4G, and without 1G pages in the \
                        vCPU model (kvm_pvm) the PVH guest maps only [0, 4G): under the VMMs it \
                        touched 3G of it (status=1 in guest_report); times of memory populated \
                        before boot are unaffected, qemu_lazy faults in only what the guest touched";
            Some(note.map_or_else(|| clip.to_string(), |n| format!("{n}; {clip}")))
        } else {
            note
        };
        let baseline = variants
            .iter()
            .find(|r| r.key == BASELINE.key())
            .and_then(|r| Some((r.ready_s?, r.poweroff_s?)));
        let mut ratios = BTreeMap::new();
        if let Some((base_ready, base_off)) = baseline {
            for r in &variants {
                if let (Some(ready), Some(off)) = (r.ready_s, r.poweroff_s) {
                    ratios.insert(
                        r.key,
                        Ratio {
                            ready: ratio(base_ready.best, ready.best),
                            poweroff: ratio(base_off.best, off.best),
                        },
                    );
                }
            }
        }
        CompareReport {
            size_bytes: self.size,
            page_size: self.page.to_string(),
            note,
            reps,
            cpus: self.cpus,
            prealloc_threads: self.prealloc_threads,
            stride_bytes: STRIDE,
            qemu_version,
            cloud_hypervisor_version,
            baseline: BASELINE.key(),
            variants,
            ratios,
            pool_scrub_s: Figure::of(&self.scrub),
        }
    }
}

impl CompareReport {
    /// A human-readable table.
    pub fn to_table(&self) -> String {
        use std::fmt::Write;
        let mut t = String::new();
        let _ = writeln!(
            t,
            "hugemem bench compare: {} on {} pages, {} CPU(s), prealloc-threads={}, best / median of {}",
            format_size(self.size_bytes),
            self.page_size,
            self.cpus,
            self.prealloc_threads,
            self.reps
        );
        if let Some(n) = &self.note {
            let _ = writeln!(t, "  note: {n}");
        }
        let _ = writeln!(
            t,
            "  {:<48} {:>17} {:>17} {:>8} {:>8} {:>8}",
            "", "ready s", "power-off s", "GiB/s", "ready x", "off x"
        );
        let fig = |f: Option<Figure>| {
            f.map_or_else(
                || "-".to_string(),
                |f| format!("{:.3} / {:.3}", f.best, f.median),
            )
        };
        for v in &self.variants {
            if v.skipped {
                let _ = writeln!(
                    t,
                    "  {:<48} skipped: {}",
                    v.label,
                    v.note.as_deref().unwrap_or("")
                );
                continue;
            }
            let r = self.ratios.get(v.key);
            let _ = writeln!(
                t,
                "  {:<48} {:>17} {:>17} {:>8.2} {:>8} {:>8}",
                v.label,
                fig(v.ready_s),
                fig(v.poweroff_s),
                v.gib_per_s.unwrap_or(0.0),
                r.map_or("-".into(), |r| format!("{:.2}", r.ready)),
                r.map_or("-".into(), |r| format!("{:.2}", r.poweroff)),
            );
        }
        if let Some(s) = self.pool_scrub_s {
            let _ = writeln!(
                t,
                "  FREE -> pool clean (background scrub): {:.3} / {:.3} s",
                s.best, s.median
            );
        }
        let _ = writeln!(
            t,
            "  ratios: {} time / variant time (best of reps); above 1 = faster than the baseline",
            self.baseline
        );
        t
    }
}

/// `scripts/plot-compare`, compiled into the binary so that `--plot` works
/// from an installed `hugemem` with no source tree around.
const PLOT_SCRIPT: &str = include_str!("../../../scripts/plot-compare");

/// The plot script that runs: `HUGEMEM_PLOT_SCRIPT` when set (a developer's
/// edited copy), else the copy compiled in (`None`).
pub fn plot_script() -> Option<PathBuf> {
    std::env::var_os("HUGEMEM_PLOT_SCRIPT")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// Runs the plot script with `args`: the one in `HUGEMEM_PLOT_SCRIPT`, or the
/// compiled-in copy written to a private temporary file and run with
/// `python3` (the script re-executes itself by path when it needs another
/// python, so it must be a file).
fn run_plot_script(args: &[&std::ffi::OsStr]) -> Result<std::process::Output, CompareError> {
    let (script, temp) = match plot_script() {
        Some(path) => (path, None),
        None => {
            let path = std::env::temp_dir()
                .join(format!("hugemem-plot-compare-{}.py", std::process::id()));
            std::fs::write(&path, PLOT_SCRIPT).map_err(|e| CompareError::Plot {
                script: path.clone(),
                why: e.to_string(),
            })?;
            (path.clone(), Some(path))
        }
    };
    let mut cmd = match &temp {
        Some(path) => {
            let mut c = Command::new("python3");
            c.arg(path);
            c
        }
        None => Command::new(&script),
    };
    let out = cmd.args(args).stdin(Stdio::null()).output();
    if let Some(path) = temp {
        let _ = std::fs::remove_file(path);
    }
    out.map_err(|e| CompareError::Plot {
        script,
        why: e.to_string(),
    })
}

/// Renders `report` to `png` with `scripts/plot-compare` (python3 with
/// matplotlib; see the script).
///
/// # Errors
///
/// [`CompareError::Plot`] when the report cannot be written or the script
/// fails.
pub fn plot(report: &CompareReport, png: &Path) -> Result<(), CompareError> {
    let script = plot_script().unwrap_or_else(|| PathBuf::from("scripts/plot-compare (built in)"));
    let fail = |why: String| CompareError::Plot {
        script: script.clone(),
        why,
    };
    let json = serde_json::to_vec(report).map_err(|e| fail(e.to_string()))?;
    let path = std::env::temp_dir().join(format!("hugemem-compare-{}.json", std::process::id()));
    std::fs::write(&path, json).map_err(|e| fail(format!("{}: {e}", path.display())))?;
    let out = run_plot_script(&[path.as_os_str(), png.as_os_str()]);
    let _ = std::fs::remove_file(&path);
    let out = out?;
    if !out.status.success() {
        return Err(fail(format!(
            "{}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The compiled-in plot script runs with no source tree: `--check` exits
    /// 0 with matplotlib, 2 (and says so) without; either way it ran.
    #[test]
    fn the_compiled_in_plot_script_runs() {
        if plot_script().is_some() {
            test_support::skip!("HUGEMEM_PLOT_SCRIPT is set; the built-in copy is not used");
            return;
        }
        let out = match run_plot_script(&[std::ffi::OsStr::new("--check")]) {
            Ok(out) => out,
            Err(e) => {
                test_support::skip!("cannot run python3: {e}");
                return;
            }
        };
        let stderr = String::from_utf8_lossy(&out.stderr);
        match out.status.code() {
            Some(0) => {}
            Some(2) => assert!(stderr.contains("matplotlib is not installed"), "{stderr}"),
            other => panic!("plot-compare --check: {other:?}: {stderr}"),
        }
    }

    #[test]
    fn figures_and_ratios() {
        let f = Figure::of(&[3.0, 1.0, 2.0]).expect("figure");
        assert_eq!((f.best, f.median), (1.0, 2.0));
        assert!(Figure::of(&[]).is_none());
    }

    #[test]
    fn variants_have_distinct_keys_and_kinds() {
        let mut keys: Vec<&str> = Variant::ALL.iter().map(|v| v.key()).collect();
        keys.sort_unstable();
        keys.dedup();
        assert_eq!(keys.len(), Variant::ALL.len());
        assert_eq!(BASELINE.memory(), Memory::Own);
        assert_eq!(Variant::ClientPool.memory(), Memory::Pool);
        assert_eq!(Variant::ChHugememPool.runner(), Runner::CloudHypervisor);
    }

    #[test]
    fn skips_say_why() {
        let ok = Ok(String::new());
        let all = skip_reasons(&Err("no /dev/kvm".into()), &ok, None);
        assert_eq!(all.len(), Variant::ALL.len());
        assert!(all.values().all(|w| w.contains("no /dev/kvm")));
        let no_ch = skip_reasons(&Ok(()), &ok, None);
        assert_eq!(
            no_ch.keys().copied().collect::<Vec<_>>(),
            [Variant::ChPrefault, Variant::ChHugememPool]
        );
        assert!(no_ch.values().all(|w| w.contains("CLOUD_HYPERVISOR")));
        let no_qemu = skip_reasons(&Ok(()), &Err("qemu not found".into()), Some(&ok));
        assert_eq!(no_qemu.len(), 4);
        assert!(!no_qemu.contains_key(&Variant::ClientFresh));
    }

    #[test]
    fn guest_line_is_found_after_port_marks() {
        let run = VmmRun {
            first: Some(Duration::from_millis(5)),
            done: Some(Duration::from_millis(9)),
            exit: Duration::from_millis(10),
            status: std::os::unix::process::ExitStatusExt::from_raw(1 << 8),
            stdout: "{|HUGEMEM-GUEST pages=255 nonzero=0 status=0\n".into(),
            stderr: String::new(),
        };
        assert_eq!(
            run.guest_line(),
            Some("HUGEMEM-GUEST pages=255 nonzero=0 status=0")
        );
        let s = check_vmm(Variant::QemuLazy, &run, None).expect("sample");
        assert_eq!((s.first_instruction, s.ready), (0.005, 0.009));
        let s = check_vmm(Variant::QemuPrealloc, &run, None).expect("sample");
        assert_eq!(s.ready, 0.005);
        let bad = VmmRun {
            stdout: "{|HUGEMEM-GUEST pages=255 nonzero=1 status=0\n".into(),
            ..run
        };
        assert!(check_vmm(Variant::QemuPrealloc, &bad, None).is_err());
    }
}
