//! The command line of `hugemem-bench`: clap's definitions of the demo and
//! every bench, with their flags (the same as `hugemem demo …` and `hugemem
//! bench X …`, which run this binary). `main.rs` dispatches on them.

use backend::proto::PagePolicy;
use clap::{Parser, Subcommand};
use guest_mem::PageSize;
use hugemem::arg_values::{parse_page_size_arg, parse_policy_arg, parse_size_arg};
use hugemem_bench::churn::ChurnVmm;
use hugemem_bench::clone::{parse_list, List};

/// hugemem-bench: hugemem's demo and benchmarks; each bench reports ratios
/// against a baseline measured in the same run.
#[derive(Debug, Parser)]
#[command(name = "hugemem-bench", version, about)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Start a private daemon, run the micro-guest on 1 GiB pages, free, reuse
    /// from the clean pool, and print a timeline.
    Demo(DemoArgs),
    /// Regenerate the tables and quoted figures of docs/benchmarks.md from
    /// the runs' --json kept under docs/results/ (marker comments; see
    /// bench/src/report). With --check, only say whether they differ.
    Report(ReportArgs),
    /// ALLOC to the micro-guest's first instruction and to every huge page
    /// touched: eager (fresh, clean pool, dirty pool cleared by the ALLOC),
    /// lazy (dirty pool, fresh with kernel demand faults) and
    /// cloud-hypervisor-style prefault; lazy fault counts and latency
    /// percentiles.
    Vmstart(VmstartArgs),
    /// Clearing kernels and the parallel runner against the kernel's fault-time clearing.
    Clear(ClearArgs),
    /// The fill engine reading a sparse file on disk into a 2 MiB-page
    /// region, cold and warm, against the disk's own sequential read rate.
    Fill(FillArgs),
    /// The refault of punched huge pages: fault helpers (the daemon's),
    /// threads of one process and fallocate with 1..all CPUs beside the
    /// memory bandwidth; a CPU-bound tenant's loss; STATS latency while a
    /// private daemon refaults, helpers against the scrubber thread.
    Refault(RefaultArgs),
    /// One mlock/munlock call over a region against the batched path, with the
    /// stall another thread's mmap+munmap sees, on 4 KiB shmem and hugetlb.
    Mlock(MlockArgs),
    /// Moving memory between NUMA nodes with 4 KiB, 2 MiB and 1 GiB pages (node A -> B -> A),
    /// and the share of the clearing runner's pages that land on its workers' node.
    Migrate(MigrateArgs),
    /// Time until a VM's RAM is ready: fresh (daemon-less and through the
    /// daemon), from the clean pool, and cloud-hypervisor's prefault.
    Alloc(AllocArgs),
    /// N launches back to back (K at once) of the micro-guest against one
    /// daemon, each probing what the earlier guests wrote; the same churn on
    /// the VMM's own preallocated memory is the baseline, and on a resident
    /// memfd with no daemon the floor.
    Churn(ChurnArgs),
    /// `hugemem serve --takeover` against a plain stop and start of the
    /// daemon (the baseline), under running allocations, a clean pool and
    /// clients: time to the first ALLOC served, client stalls, refused
    /// connections, bytes zeroed again, allocations kept.
    Takeover(TakeoverArgs),
    /// Launch to guest power-off of the micro-guest: QEMU with prealloc (the
    /// baseline) and without, QEMU and cloud-hypervisor on hugemem memory
    /// (fresh and from the clean pool), cloud-hypervisor's prefault, and
    /// hugemem's own rust-vmm client.
    Compare(CompareArgs),
    /// A live update of QEMU under a running guest on hugemem memory
    /// (`hugemem update`: same pages, no RAM copied) against a plain local
    /// QEMU migration that copies RAM: guest-visible downtime, update time,
    /// RAM bytes sent, stale pages, allocation accounting.
    VmmUpdate(VmmUpdateArgs),
    /// hugemem as cloud-hypervisor's offload daemon: park and restore from
    /// the park, save to disk and restore from it, against
    /// cloud-hypervisor's own file:// snapshot and restore and its
    /// reference offload_daemon, on the same spinning guest.
    Offload(OffloadArgs),
    /// Clones of a parked VM (`hugemem launch --clone-of`, shared and copy),
    /// one after another and N at once, against restores from the park of
    /// the same VM and cloud-hypervisor's own restore of its snapshot.
    Clone(CloneArgs),
}

/// `hugemem-bench demo` flags.
#[derive(Debug, clap::Args)]
pub(crate) struct DemoArgs {
    /// VM size (smaller, said out loud, when fewer huge pages can be had).
    #[arg(long, default_value = "2G", value_parser = parse_size_arg)]
    pub(crate) size: u64,
    /// Do not run the micro-guest even when KVM works.
    #[arg(long)]
    pub(crate) no_guest: bool,
    /// Page size: 1G, 2M or 4K (default: 1G, then 2M, then 4K, said out loud).
    #[arg(long, value_parser = parse_page_size_arg)]
    pub(crate) page_size: Option<PageSize>,
    /// Print one JSON object instead of the timeline.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `hugemem-bench report` flags.
#[derive(Debug, clap::Args)]
pub(crate) struct ReportArgs {
    /// The document.
    #[arg(long, default_value = "docs/benchmarks.md")]
    pub(crate) doc: std::path::PathBuf,
    /// The directory of the runs' JSON files (NAME.json).
    #[arg(long, default_value = "docs/results")]
    pub(crate) results: std::path::PathBuf,
    /// Change nothing; exit 1 when the document is not what the JSON gives.
    #[arg(long)]
    pub(crate) check: bool,
}

/// `hugemem-bench vmstart` flags.
#[derive(Debug, clap::Args)]
pub(crate) struct VmstartArgs {
    /// Guest RAM (K/M/G suffixes).
    #[arg(long, default_value = "8G", value_parser = parse_size_arg)]
    pub(crate) size: u64,
    /// Page size: 2M or 1G.
    #[arg(long, default_value = "2M", value_parser = parse_page_size_arg)]
    pub(crate) page_size: PageSize,
    /// Limit for one guest run, seconds.
    #[arg(long, default_value_t = 300)]
    pub(crate) guest_timeout: u64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `hugemem-bench clear` flags.
#[derive(Debug, clap::Args)]
pub(crate) struct ClearArgs {
    /// Bytes to clear (K/M/G suffixes, powers of 1024).
    #[arg(long, default_value = "1G", value_parser = parse_size_arg)]
    pub(crate) size: u64,
    /// Repetitions per figure; the best is reported.
    #[arg(long, default_value_t = 5)]
    pub(crate) reps: usize,
    /// Worker counts for the parallel runner, e.g. `1,2,4` (default: 1..=all CPUs).
    #[arg(long, value_delimiter = ',')]
    pub(crate) threads: Vec<usize>,
    /// Page size: 1G, 2M or 4K (default: 1G, then 2M, then 4K, said out loud).
    #[arg(long, value_parser = parse_page_size_arg)]
    pub(crate) page_size: Option<PageSize>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `hugemem-bench fill` flags.
#[derive(Debug, clap::Args)]
pub(crate) struct FillArgs {
    /// Bytes of the file and the region, whole 2 MiB pages (K/M/G suffixes, powers of 1024).
    #[arg(long, default_value = "1G", value_parser = parse_size_arg)]
    pub(crate) size: u64,
    /// Percent of the file that is holes, spread in 1 MiB blocks.
    #[arg(long, default_value_t = 25)]
    pub(crate) holes: u64,
    /// Directory for the file (on the disk to measure; not tmpfs).
    #[arg(long, default_value = "/var/tmp")]
    pub(crate) dir: std::path::PathBuf,
    /// Most fill workers (default: the node's CPUs).
    #[arg(long)]
    pub(crate) threads: Option<usize>,
    /// Repetitions, each measuring everything once in turn; medians are reported.
    #[arg(long, default_value_t = 3)]
    pub(crate) reps: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `hugemem-bench refault` flags.
#[derive(Debug, clap::Args)]
pub(crate) struct RefaultArgs {
    /// Bytes of the region (K/M/G suffixes, powers of 1024).
    #[arg(long, default_value = "256M", value_parser = parse_size_arg)]
    pub(crate) size: u64,
    /// Huge page size, 2M or 1G.
    #[arg(long, default_value = "2M", value_parser = parse_page_size_arg)]
    pub(crate) page_size: PageSize,
    /// Repetitions per figure.
    #[arg(long, default_value_t = 3)]
    pub(crate) reps: usize,
    /// Bytes per chunk of work (the daemon's scrub.batch).
    #[arg(long, default_value = "64M", value_parser = parse_size_arg)]
    pub(crate) chunk: u64,
    /// The tenant's window per measurement, milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub(crate) tenant_ms: u64,
    /// Leave the private daemon out (the rates and the tenant only).
    #[arg(long)]
    pub(crate) no_daemon: bool,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `hugemem-bench mlock` flags.
#[derive(Debug, clap::Args)]
pub(crate) struct MlockArgs {
    /// Bytes per region (K/M/G suffixes, powers of 1024).
    #[arg(long, default_value = "2G", value_parser = parse_size_arg)]
    pub(crate) size: u64,
    /// Bytes per call of the batched path (a multiple of 4K; default 8M on
    /// 4 KiB pages, 32M on huge pages).
    #[arg(long, value_parser = parse_size_arg)]
    pub(crate) chunk: Option<u64>,
    /// Repetitions; times are the best, stalls the median of per-rep worst.
    #[arg(long, default_value_t = 3)]
    pub(crate) reps: usize,
    /// Workers per NUMA node on the batched path.
    #[arg(long, default_value_t = 1)]
    pub(crate) threads_per_node: usize,
    /// hugetlb page size, 2M or 1G (default: 2M, then 1G).
    #[arg(long, value_parser = parse_page_size_arg)]
    pub(crate) hugetlb_page_size: Option<PageSize>,
    /// Measure 4 KiB shmem only.
    #[arg(long)]
    pub(crate) no_hugetlb: bool,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `hugemem-bench migrate` flags.
#[derive(Debug, clap::Args)]
pub(crate) struct MigrateArgs {
    /// Bytes moved per page size (K/M/G suffixes; rounded up to whole pages).
    #[arg(long, default_value = "512M", value_parser = parse_size_arg)]
    pub(crate) size: u64,
    /// Print one JSON object instead of lines.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `hugemem-bench alloc` flags.
#[derive(Debug, clap::Args)]
pub(crate) struct AllocArgs {
    /// VM size (K/M/G suffixes); smaller, said out loud, when the pages cannot be had.
    #[arg(long, default_value = "8G", value_parser = parse_size_arg)]
    pub(crate) size: u64,
    /// Repetitions; the best and the median of each figure are reported.
    #[arg(long, default_value_t = 5)]
    pub(crate) reps: usize,
    /// Page size: 1G or 2M (default: 1G, then 2M, said out loud).
    #[arg(long, value_parser = parse_page_size_arg)]
    pub(crate) page_size: Option<PageSize>,
    /// Worker counts for the fresh-populate scaling run, e.g. `1,2,4`
    /// (default: 1..=all CPUs).
    #[arg(long, value_delimiter = ',')]
    pub(crate) threads: Vec<usize>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `hugemem-bench churn` flags.
#[derive(Debug, clap::Args)]
pub(crate) struct ChurnArgs {
    /// Timed launches per side (each side also runs one untimed warm-up launch).
    #[arg(long, default_value_t = 10)]
    pub(crate) vms: usize,
    /// Guest RAM per launch (K/M/G suffixes, a multiple of 2M).
    #[arg(long, default_value = "2G", value_parser = parse_size_arg)]
    pub(crate) size: u64,
    /// Launches at once.
    #[arg(long, default_value_t = 1)]
    pub(crate) parallel: usize,
    /// cloud-hypervisor (needs CLOUD_HYPERVISOR), qemu or micro (hugemem's own KVM runner);
    /// default: cloud-hypervisor when CLOUD_HYPERVISOR is set, else qemu when it runs, else micro.
    #[arg(long, value_parser = parse_churn_vmm_arg)]
    pub(crate) vmm: Option<ChurnVmm>,
    /// Page size policy of the ALLOCs: best, 1G, 2M or 4K.
    #[arg(long, default_value = "best", value_parser = parse_policy_arg)]
    pub(crate) page_size: PagePolicy,
    /// A live daemon's socket (default: a private daemon for the run, started after the baseline and the floor).
    #[arg(long)]
    pub(crate) socket: Option<std::path::PathBuf>,
    /// The QEMU binary.
    #[arg(long, default_value = "qemu-system-x86_64")]
    pub(crate) qemu: std::ffi::OsString,
    /// Limit for one launch, seconds.
    #[arg(long, default_value_t = 120)]
    pub(crate) launch_timeout: u64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `hugemem-bench takeover` flags.
#[derive(Debug, clap::Args)]
pub(crate) struct TakeoverArgs {
    /// GiB of clean pool before each switch (fractions allowed: 0.25).
    #[arg(long, default_value_t = 1.0)]
    pub(crate) pool_gib: f64,
    /// Running allocations, each held on a connection of its own.
    #[arg(long, default_value_t = 4)]
    pub(crate) allocations: usize,
    /// MiB per allocation (and per pool region).
    #[arg(long, default_value_t = 64)]
    pub(crate) alloc_mib: u64,
    /// Page size: 2M or 1G.
    #[arg(long, default_value = "2M", value_parser = parse_page_size_arg)]
    pub(crate) page_size: PageSize,
    /// Rounds, each running both modes; median and worst are reported.
    #[arg(long, default_value_t = 3)]
    pub(crate) rounds: usize,
    /// Connections that only send STATS, besides the allocations'.
    #[arg(long, default_value_t = 2)]
    pub(crate) idle_clients: usize,
    /// Print one JSON object instead of the table; with PATH, write it there and print the table.
    #[arg(long, value_name = "PATH", num_args = 0..=1)]
    pub(crate) json: Option<Option<std::path::PathBuf>>,
}

/// `hugemem-bench vmm-update` flags.
#[derive(Debug, clap::Args)]
pub(crate) struct VmmUpdateArgs {
    /// The VMM: qemu or cloud-hypervisor.
    #[arg(long, default_value = "qemu", value_parser = ["qemu", "cloud-hypervisor"])]
    pub(crate) vmm: String,
    /// Guest RAM (K/M/G suffixes), on 2 MiB pages.
    #[arg(long, default_value = "1G", value_parser = parse_size_arg)]
    pub(crate) size: u64,
    /// Live updates in a row on the hugemem side and the floor (median and
    /// each reported; 6 and more give 95 % intervals over the floor).
    #[arg(long, default_value_t = 5)]
    pub(crate) updates: usize,
    /// The QEMU binary (`--vmm qemu`).
    #[arg(long, default_value = "qemu-system-x86_64")]
    pub(crate) qemu: std::ffi::OsString,
    /// The cloud-hypervisor binary (`--vmm cloud-hypervisor`).
    #[arg(long, default_value = "cloud-hypervisor")]
    pub(crate) cloud_hypervisor: std::ffi::OsString,
    /// Skip the copying baseline (it holds twice the guest RAM in huge pages).
    #[arg(long)]
    pub(crate) no_copy: bool,
    /// Print one JSON object instead of the table; with PATH, write it there and print the table.
    #[arg(long, value_name = "PATH", num_args = 0..=1)]
    pub(crate) json: Option<Option<std::path::PathBuf>>,
}

/// `hugemem-bench compare` flags.
#[derive(Debug, clap::Args)]
pub(crate) struct CompareArgs {
    /// VM size (K/M/G suffixes); never changed, only the page size falls back.
    #[arg(long, default_value = "4G", value_parser = parse_size_arg)]
    pub(crate) size: u64,
    /// Repetitions; the best and the median of each figure are reported.
    #[arg(long, default_value_t = 3)]
    pub(crate) reps: usize,
    /// Page size for every variant: 1G or 2M (default: 1G, then 2M, said out loud).
    #[arg(long, value_parser = parse_page_size_arg)]
    pub(crate) page_size: Option<PageSize>,
    /// The QEMU binary.
    #[arg(long, default_value = "qemu-system-x86_64")]
    pub(crate) qemu: std::ffi::OsString,
    /// QEMU's prealloc-threads (default: online CPUs).
    #[arg(long)]
    pub(crate) prealloc_threads: Option<usize>,
    /// Pool variants take the region the moment the pool shows it clean
    /// (punched holes, still being refaulted) instead of once it is
    /// resident again.
    #[arg(long)]
    pub(crate) pool_holes: bool,
    /// With --pool-holes: the daemon faults no hole in ahead of the VMM
    /// (`pool.refault_ahead = false`), so nothing refaults while the VMM
    /// starts; set against a run without it, what the background refault
    /// costs a start.
    #[arg(long, requires = "pool_holes")]
    pub(crate) no_refault_ahead: bool,
    /// Also render a bar chart to this PNG (scripts/plot-compare; needs python3-matplotlib).
    #[arg(long)]
    pub(crate) plot: Option<std::path::PathBuf>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

fn parse_churn_vmm_arg(s: &str) -> Result<ChurnVmm, String> {
    ChurnVmm::parse(s)
        .ok_or_else(|| format!("unknown VMM {s:?}: expected cloud-hypervisor, qemu or micro"))
}

/// `hugemem-bench offload` flags.
#[derive(Debug, clap::Args)]
pub(crate) struct OffloadArgs {
    /// Guest RAM (K/M/G suffixes).
    #[arg(long, default_value = "1G", value_parser = parse_size_arg)]
    pub(crate) size: u64,
    /// Page size of every variant's guest RAM: 2M or 1G.
    #[arg(long, default_value = "2M", value_parser = parse_page_size_arg)]
    pub(crate) page_size: PageSize,
    /// Repetitions, each running every variant once (6 and more give 95 %
    /// intervals).
    #[arg(long, default_value_t = 3)]
    pub(crate) reps: usize,
    /// Where the snapshots are written (a private directory in it): a real
    /// disk, not tmpfs.
    #[arg(long, default_value = "/var/tmp")]
    pub(crate) dir: std::path::PathBuf,
    /// Fill every guest's RAM with incompressible bytes before its first
    /// park or snapshot (all but the words the guest checks): a guest that
    /// wrote all its memory. Without it each 4 KiB page holds one word.
    #[arg(long)]
    pub(crate) dense: bool,
    /// The cloud-hypervisor binary (default: $CLOUD_HYPERVISOR, else
    /// cloud-hypervisor on the PATH).
    #[arg(long)]
    pub(crate) cloud_hypervisor: Option<std::ffi::OsString>,
    /// cloud-hypervisor's reference offload_daemon (default:
    /// $CH_OFFLOAD_DAEMON; without it that baseline does not run).
    #[arg(long)]
    pub(crate) offload_daemon: Option<std::ffi::OsString>,
    /// QEMU for QEMU's rows: a launched QEMU parked and restored through
    /// hugemem against QEMU's own migrate to a file and its floor
    /// (default: $QEMU, else qemu-system-x86_64 on the PATH; `none`: the
    /// rows do not run).
    #[arg(long)]
    pub(crate) qemu: Option<std::ffi::OsString>,
    /// Print one JSON object instead of the table; with PATH, write it there and print the table.
    #[arg(long, value_name = "PATH", num_args = 0..=1)]
    pub(crate) json: Option<Option<std::path::PathBuf>>,
}

/// `hugemem-bench clone` flags.
#[derive(Debug, clap::Args)]
pub(crate) struct CloneArgs {
    /// Template sizes, comma-separated (K/M/G suffixes).
    #[arg(long, default_value = "1G,4G,8G", value_parser = |s: &str| parse_list(s, parse_size_arg))]
    pub(crate) sizes: List<u64>,
    /// Clone counts N, comma-separated.
    #[arg(long, default_value = "1,8,25", value_parser = |s: &str| parse_list(s, str::parse::<usize>))]
    pub(crate) counts: List<usize>,
    /// Page sizes of the templates' memory, comma-separated (2M, 1G); a
    /// combination the host's pages cannot hold is left out, and said so.
    #[arg(long, default_value = "2M,1G", value_parser = |s: &str| parse_list(s, parse_page_size_arg))]
    pub(crate) page_sizes: List<PageSize>,
    /// Repetitions of every combination.
    #[arg(long, default_value_t = 3)]
    pub(crate) reps: usize,
    /// Huge-page bytes the run may use per page size (default: what the
    /// host has free and could add, less 2 GiB for the rest of it).
    #[arg(long, value_parser = parse_size_arg)]
    pub(crate) memory: Option<u64>,
    /// Print the plan (what runs, what is left out and why) as JSON and exit.
    #[arg(long)]
    pub(crate) plan: bool,
    /// Where cloud-hypervisor's snapshots are written (a private directory in it).
    #[arg(long, default_value = "/var/tmp")]
    pub(crate) dir: std::path::PathBuf,
    /// The cloud-hypervisor binary (default: $CLOUD_HYPERVISOR, else
    /// cloud-hypervisor on the PATH).
    #[arg(long)]
    pub(crate) cloud_hypervisor: Option<std::ffi::OsString>,
    /// The VMM of every VM: cloud-hypervisor (beside its own restores) or
    /// qemu (beside QEMU's own migrate to a file and its floor).
    #[arg(long, default_value = "cloud-hypervisor", value_parser = ["cloud-hypervisor", "qemu"])]
    pub(crate) vmm: String,
    /// The QEMU binary for `--vmm qemu` (default: $QEMU, else
    /// qemu-system-x86_64 on the PATH).
    #[arg(long)]
    pub(crate) qemu: Option<std::ffi::OsString>,
    /// Print one JSON object instead of the table; with PATH, write it there and print the table.
    #[arg(long, value_name = "PATH", num_args = 0..=1)]
    pub(crate) json: Option<Option<std::path::PathBuf>>,
}
