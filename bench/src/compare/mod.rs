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
//!   process: [`Client::alloc`], [`backend::client::Allocation::guest_memory`],
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
//!
//! [`Client::alloc`]: backend::client::Client::alloc

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use guest_mem::{PageSize, SharedMapping};
use serde::Serialize;

use crate::private_dir::PrivateDir;
use crate::stats::{best, median};
use backend::client::ClientError;
use backend::daemon::DaemonError;
use backend::guest_memory::GuestMemoryError;
use guest_mem::size::format_size;
use hugemem::launch::BuildError;
mod bench;
mod report;
mod vmm;

pub use report::{plot, plot_script};

use bench::Bench;
use vmm::*;

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

#[cfg(test)]
mod tests {
    use super::report::run_plot_script;
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
