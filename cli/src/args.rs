//! The command line: clap's definitions of every subcommand and its flags,
//! and the value parsers they use. `main.rs` dispatches on them.

use backend::proto::{AllocPart, PagePolicy};
use clap::{Parser, Subcommand};
use guest_mem::size::parse_size;
use guest_mem::PageSize;
use hugemem::bench::churn::ChurnVmm;
use hugemem::launch::{self, Vmm};

/// hugemem: guest RAM on 1 GiB pages, cleared in parallel on NUMA-local workers.
#[derive(Debug, Parser)]
#[command(name = "hugemem", version, about)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Run the daemon: serve guest RAM over the UNIX socket until SIGTERM/SIGINT.
    Serve(ServeArgs),
    /// Show the daemon's pools, sessions and scrub progress.
    Status {
        /// The daemon's socket.
        #[arg(long, default_value = backend::daemon::config::DEFAULT_SOCKET)]
        socket: std::path::PathBuf,
        /// Print the STATS JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Move an in-use region (or a range of it) to another NUMA node while the guest runs.
    Rebalance {
        /// The daemon's socket.
        #[arg(long, default_value = backend::daemon::config::DEFAULT_SOCKET)]
        socket: std::path::PathBuf,
        /// The region id (`hugemem status` lists them); it must be in use.
        #[arg(long)]
        region: u64,
        /// The target NUMA node.
        #[arg(long)]
        to_node: u32,
        /// Only this byte range of the region: START..END, START.. or ..END (K/M/G suffixes), page aligned.
        #[arg(long)]
        range: Option<String>,
    },
    /// Allocate guest RAM through the daemon and run cloud-hypervisor or QEMU on it.
    Launch(LaunchArgs),
    /// The emulator of a libvirt domain: take its huge-page memory backends
    /// from the daemon and exec the real QEMU (docs/operations.md, "libvirt").
    QemuWrapper(QemuWrapperArgs),
    /// Start a private daemon, run the micro-guest on 1 GiB pages, free, reuse
    /// from the clean pool, and print a timeline.
    Demo {
        /// VM size (smaller, said out loud, when fewer huge pages can be had).
        #[arg(long, default_value = "2G", value_parser = parse_size_arg)]
        size: u64,
        /// Do not run the micro-guest even when KVM works.
        #[arg(long)]
        no_guest: bool,
        /// Page size: 1G, 2M or 4K (default: 1G, then 2M, then 4K, said out loud).
        #[arg(long, value_parser = parse_page_size_arg)]
        page_size: Option<PageSize>,
        /// Print one JSON object instead of the timeline.
        #[arg(long)]
        json: bool,
    },
    /// Benchmarks; each reports ratios against a baseline measured in the same run.
    #[command(subcommand)]
    Bench(Bench),
    /// Reserve 1 GiB and 2 MiB huge pages (1 GiB first) and mount hugetlbfs.
    ///
    /// Exit status: 0 = every request met, 3 = the kernel gave fewer pages
    /// than asked (the report says how many, per node), 2 = bad usage (e.g.
    /// no such node), 1 = not root or another error. Without --1g/--2m it
    /// only shows both pools (and mounts).
    Hugepages(HugepagesArgs),
}

/// `hugemem hugepages` flags.
#[derive(Debug, clap::Args)]
pub(crate) struct HugepagesArgs {
    /// Take the counts, node, mode and mount from the `[hugepages]` section
    /// of this daemon configuration file (the flags below override it).
    #[arg(long, value_name = "FILE")]
    pub(crate) config: Option<std::path::PathBuf>,
    /// 1 GiB pages wanted.
    #[arg(long = "1g", value_name = "N")]
    pub(crate) one_g: Option<u64>,
    /// 2 MiB pages wanted.
    #[arg(long = "2m", value_name = "M")]
    pub(crate) two_m: Option<u64>,
    /// Reserve on this NUMA node only (default: host-wide).
    #[arg(long)]
    pub(crate) node: Option<u32>,
    /// The counts are pages wanted free and not reserved by any mapping (default: a floor on the pool size; pools only grow).
    #[arg(long, conflicts_with = "exact")]
    pub(crate) free: bool,
    /// Set the pools to exactly these counts, shrinking them (pages in use stay).
    #[arg(long)]
    pub(crate) exact: bool,
    /// Mount hugetlbfs at DIR/hugepages-1G and DIR/hugepages-2M (default: /dev).
    #[arg(long, value_name = "DIR")]
    pub(crate) mount_root: Option<std::path::PathBuf>,
    /// Do not mount hugetlbfs.
    #[arg(long)]
    pub(crate) no_mount: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `hugemem launch` flags.
#[derive(Debug, clap::Args)]
pub(crate) struct LaunchArgs {
    /// The daemon's socket.
    #[arg(long, default_value = backend::daemon::config::DEFAULT_SOCKET)]
    pub(crate) socket: std::path::PathBuf,
    /// Guest RAM (K/M/G suffixes); with --nodes it must equal their total.
    #[arg(long, value_parser = parse_size_arg)]
    pub(crate) size: Option<u64>,
    /// Put all guest RAM on this NUMA node.
    #[arg(long, conflicts_with = "nodes")]
    pub(crate) node: Option<u32>,
    /// One region per item: NODE:SIZE[,NODE:SIZE...], e.g. 0:2G,1:2G; a node may repeat (0:1G,0:1G).
    #[arg(long, value_parser = parse_nodes_arg)]
    pub(crate) nodes: Option<NodesArg>,
    /// Page size: best (1G, then 2M, then 4K), 1G, 2M or 4K.
    #[arg(long, default_value = "best", value_parser = parse_policy_arg)]
    pub(crate) page_size: PagePolicy,
    /// Give the VMM hugetlbfs file paths instead of /dev/fd/N (needed with cloud-hypervisor --landlock).
    #[arg(long)]
    pub(crate) hugetlbfs: bool,
    /// Have the daemon mlock the memory before the VMM starts.
    #[arg(long)]
    pub(crate) lock: bool,
    /// How long the daemon may wait for pages it holds but cannot hand out
    /// yet (a region still in quarantine or being scrubbed), in ms; default:
    /// the daemon's pool.alloc_wait_ms. 0: fail at once instead of waiting.
    #[arg(long, value_name = "MS")]
    pub(crate) wait_ms: Option<u32>,
    /// cloud-hypervisor: one guest NUMA node per region.
    #[arg(long)]
    pub(crate) guest_numa: bool,
    /// When the daemon connection closes while the VMM runs (a daemon
    /// restart), how long to try to reconnect and re-attach the allocation,
    /// in seconds. The VMM keeps running either way.
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    pub(crate) reattach_timeout: u64,
    /// The VMM kind when the program name does not say: cloud-hypervisor or qemu.
    #[arg(long, value_parser = parse_vmm_arg)]
    pub(crate) vmm: Option<Vmm>,
    /// The VMM and its arguments, after `--`.
    #[arg(last = true, required = true, value_parser = clap::value_parser!(std::ffi::OsString))]
    pub(crate) command: Vec<std::ffi::OsString>,
}

/// `hugemem qemu-wrapper` flags.
#[derive(Debug, clap::Args)]
pub(crate) struct QemuWrapperArgs {
    /// The real QEMU.
    #[arg(long, default_value = hugemem::qemu_wrapper::DEFAULT_QEMU)]
    pub(crate) qemu: std::path::PathBuf,
    /// The daemon's socket.
    #[arg(long, default_value = backend::daemon::config::DEFAULT_SOCKET)]
    pub(crate) socket: std::path::PathBuf,
    /// How long the daemon may wait for pages it holds but cannot hand out
    /// yet, in ms; default: the daemon's pool.alloc_wait_ms.
    #[arg(long, value_name = "MS")]
    pub(crate) wait_ms: Option<u32>,
    /// QEMU's arguments as libvirt wrote them, after `--`.
    #[arg(last = true, value_parser = clap::value_parser!(std::ffi::OsString))]
    pub(crate) args: Vec<std::ffi::OsString>,
}

/// A parsed `--nodes` value.
#[derive(Debug, Clone)]
pub(crate) struct NodesArg(pub(crate) Vec<AllocPart>);

pub(crate) fn parse_nodes_arg(s: &str) -> Result<NodesArg, String> {
    launch::parse_nodes(s)
        .map(NodesArg)
        .map_err(|e| e.to_string())
}

pub(crate) fn parse_policy_arg(s: &str) -> Result<PagePolicy, String> {
    launch::parse_page_policy(s)
        .ok_or_else(|| format!("invalid page size {s:?}: expected best, 1G, 2M or 4K"))
}

pub(crate) fn parse_churn_vmm_arg(s: &str) -> Result<ChurnVmm, String> {
    ChurnVmm::parse(s)
        .ok_or_else(|| format!("unknown VMM {s:?}: expected cloud-hypervisor, qemu or micro"))
}

pub(crate) fn parse_vmm_arg(s: &str) -> Result<Vmm, String> {
    Vmm::parse(s).ok_or_else(|| format!("unknown VMM {s:?}: expected cloud-hypervisor or qemu"))
}

#[derive(Debug, Subcommand)]
pub(crate) enum Bench {
    /// Regenerate the tables and quoted figures of docs/benchmarks.md from
    /// the runs' --json kept under docs/results/ (marker comments; see
    /// cli/src/bench/report). With --check, only say whether they differ.
    Report {
        /// The document.
        #[arg(long, default_value = "docs/benchmarks.md")]
        doc: std::path::PathBuf,
        /// The directory of the runs' JSON files (NAME.json).
        #[arg(long, default_value = "docs/results")]
        results: std::path::PathBuf,
        /// Change nothing; exit 1 when the document is not what the JSON gives.
        #[arg(long)]
        check: bool,
    },
    /// ALLOC to the micro-guest's first instruction and to every huge page
    /// touched: eager (fresh, clean pool, dirty pool cleared by the ALLOC),
    /// lazy (dirty pool, fresh with kernel demand faults) and
    /// cloud-hypervisor-style prefault; lazy fault counts and latency
    /// percentiles.
    Vmstart {
        /// Guest RAM (K/M/G suffixes).
        #[arg(long, default_value = "8G", value_parser = parse_size_arg)]
        size: u64,
        /// Page size: 2M or 1G.
        #[arg(long, default_value = "2M", value_parser = parse_page_size_arg)]
        page_size: PageSize,
        /// Limit for one guest run, seconds.
        #[arg(long, default_value_t = 300)]
        guest_timeout: u64,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Clearing kernels and the parallel runner against the kernel's fault-time clearing.
    Clear {
        /// Bytes to clear (K/M/G suffixes, powers of 1024).
        #[arg(long, default_value = "1G", value_parser = parse_size_arg)]
        size: u64,
        /// Repetitions per figure; the best is reported.
        #[arg(long, default_value_t = 5)]
        reps: usize,
        /// Worker counts for the parallel runner, e.g. `1,2,4` (default: 1..=all CPUs).
        #[arg(long, value_delimiter = ',')]
        threads: Vec<usize>,
        /// Page size: 1G, 2M or 4K (default: 1G, then 2M, then 4K, said out loud).
        #[arg(long, value_parser = parse_page_size_arg)]
        page_size: Option<PageSize>,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// One mlock/munlock call over a region against the batched path, with the
    /// stall another thread's mmap+munmap sees, on 4 KiB shmem and hugetlb.
    Mlock {
        /// Bytes per region (K/M/G suffixes, powers of 1024).
        #[arg(long, default_value = "2G", value_parser = parse_size_arg)]
        size: u64,
        /// Bytes per call of the batched path (a multiple of 4K; default 8M on
        /// 4 KiB pages, 32M on huge pages).
        #[arg(long, value_parser = parse_size_arg)]
        chunk: Option<u64>,
        /// Repetitions; times are the best, stalls the median of per-rep worst.
        #[arg(long, default_value_t = 3)]
        reps: usize,
        /// Workers per NUMA node on the batched path.
        #[arg(long, default_value_t = 1)]
        threads_per_node: usize,
        /// hugetlb page size, 2M or 1G (default: 2M, then 1G).
        #[arg(long, value_parser = parse_page_size_arg)]
        hugetlb_page_size: Option<PageSize>,
        /// Measure 4 KiB shmem only.
        #[arg(long)]
        no_hugetlb: bool,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Moving memory between NUMA nodes with 4 KiB, 2 MiB and 1 GiB pages (node A -> B -> A),
    /// and the share of the clearing runner's pages that land on its workers' node.
    Migrate {
        /// Bytes moved per page size (K/M/G suffixes; rounded up to whole pages).
        #[arg(long, default_value = "512M", value_parser = parse_size_arg)]
        size: u64,
        /// Print one JSON object instead of lines.
        #[arg(long)]
        json: bool,
    },
    /// Time until a VM's RAM is ready: fresh (daemon-less and through the
    /// daemon), from the clean pool, and cloud-hypervisor's prefault.
    Alloc {
        /// VM size (K/M/G suffixes); smaller, said out loud, when the pages cannot be had.
        #[arg(long, default_value = "8G", value_parser = parse_size_arg)]
        size: u64,
        /// Repetitions; the best and the median of each figure are reported.
        #[arg(long, default_value_t = 5)]
        reps: usize,
        /// Page size: 1G or 2M (default: 1G, then 2M, said out loud).
        #[arg(long, value_parser = parse_page_size_arg)]
        page_size: Option<PageSize>,
        /// Worker counts for the fresh-populate scaling run, e.g. `1,2,4`
        /// (default: 1..=all CPUs).
        #[arg(long, value_delimiter = ',')]
        threads: Vec<usize>,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// N launches back to back (K at once) of the micro-guest against one
    /// daemon, each probing what the earlier guests wrote; the same churn on
    /// the VMM's own preallocated memory is the baseline.
    Churn {
        /// Timed launches per side (each side also runs one untimed warm-up launch).
        #[arg(long, default_value_t = 10)]
        vms: usize,
        /// Guest RAM per launch (K/M/G suffixes, a multiple of 2M).
        #[arg(long, default_value = "2G", value_parser = parse_size_arg)]
        size: u64,
        /// Launches at once.
        #[arg(long, default_value_t = 1)]
        parallel: usize,
        /// cloud-hypervisor (needs CLOUD_HYPERVISOR), qemu or micro (hugemem's own KVM runner);
        /// default: cloud-hypervisor when CLOUD_HYPERVISOR is set, else qemu when it runs, else micro.
        #[arg(long, value_parser = parse_churn_vmm_arg)]
        vmm: Option<ChurnVmm>,
        /// Page size policy of the ALLOCs: best, 1G, 2M or 4K.
        #[arg(long, default_value = "best", value_parser = parse_policy_arg)]
        page_size: PagePolicy,
        /// A live daemon's socket (default: a private daemon for the run, started after the baseline).
        #[arg(long)]
        socket: Option<std::path::PathBuf>,
        /// The QEMU binary.
        #[arg(long, default_value = "qemu-system-x86_64")]
        qemu: std::ffi::OsString,
        /// Limit for one launch, seconds.
        #[arg(long, default_value_t = 120)]
        launch_timeout: u64,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// `hugemem serve --takeover` against a plain stop and start of the
    /// daemon (the baseline), under running allocations, a clean pool and
    /// clients: time to the first ALLOC served, client stalls, refused
    /// connections, bytes zeroed again, allocations kept.
    Takeover {
        /// GiB of clean pool before each switch (fractions allowed: 0.25).
        #[arg(long, default_value_t = 1.0)]
        pool_gib: f64,
        /// Running allocations, each held on a connection of its own.
        #[arg(long, default_value_t = 4)]
        allocations: usize,
        /// MiB per allocation (and per pool region).
        #[arg(long, default_value_t = 64)]
        alloc_mib: u64,
        /// Page size: 2M or 1G.
        #[arg(long, default_value = "2M", value_parser = parse_page_size_arg)]
        page_size: PageSize,
        /// Rounds, each running both modes; median and worst are reported.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Connections that only send STATS, besides the allocations'.
        #[arg(long, default_value_t = 2)]
        idle_clients: usize,
        /// Print one JSON object instead of the table; with PATH, write it there and print the table.
        #[arg(long, value_name = "PATH", num_args = 0..=1)]
        json: Option<Option<std::path::PathBuf>>,
    },
    /// Launch to guest power-off of the micro-guest: QEMU with prealloc (the
    /// baseline) and without, QEMU and cloud-hypervisor on hugemem memory
    /// (fresh and from the clean pool), cloud-hypervisor's prefault, and
    /// hugemem's own rust-vmm client.
    Compare {
        /// VM size (K/M/G suffixes); never changed, only the page size falls back.
        #[arg(long, default_value = "4G", value_parser = parse_size_arg)]
        size: u64,
        /// Repetitions; the best and the median of each figure are reported.
        #[arg(long, default_value_t = 3)]
        reps: usize,
        /// Page size for every variant: 1G or 2M (default: 1G, then 2M, said out loud).
        #[arg(long, value_parser = parse_page_size_arg)]
        page_size: Option<PageSize>,
        /// The QEMU binary.
        #[arg(long, default_value = "qemu-system-x86_64")]
        qemu: std::ffi::OsString,
        /// QEMU's prealloc-threads (default: online CPUs).
        #[arg(long)]
        prealloc_threads: Option<usize>,
        /// Also render a bar chart to this PNG (scripts/plot-compare; needs python3-matplotlib).
        #[arg(long)]
        plot: Option<std::path::PathBuf>,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// `hugemem serve` flags; each overrides the configuration file.
#[derive(Debug, clap::Args)]
pub(crate) struct ServeArgs {
    /// Configuration file (TOML, see scripts/hugemem.toml); defaults apply without one.
    #[arg(long)]
    pub(crate) config: Option<std::path::PathBuf>,
    /// Socket path (default /run/hugemem/hugemem.sock).
    #[arg(long)]
    pub(crate) socket: Option<std::path::PathBuf>,
    /// Serve Prometheus text on this loopback address, e.g. 127.0.0.1:9464.
    #[arg(long)]
    pub(crate) metrics_listen: Option<std::net::SocketAddr>,
    /// Idle bytes per node the pool keeps (K/M/G suffixes).
    #[arg(long, value_parser = parse_size_arg)]
    pub(crate) pool_target: Option<u64>,
    /// Most pooled bytes per node (K/M/G suffixes).
    #[arg(long, value_parser = parse_size_arg)]
    pub(crate) pool_limit: Option<u64>,
    /// Scrubber threads per NUMA node.
    #[arg(long)]
    pub(crate) scrub_threads: Option<usize>,
    /// Also allow this uid to connect (repeatable; root and the daemon's uid always are).
    #[arg(long = "allow-uid")]
    pub(crate) allow_uids: Vec<u32>,
    /// Take over from the daemon running on the same socket (an upgrade or
    /// restart): its listening socket, pool, allocations, connections and
    /// fault services come over its control socket; it exits once this one
    /// serves (docs/operations.md, "Upgrading").
    #[arg(long)]
    pub(crate) takeover: bool,
    /// With --takeover: fork, and exit once the new daemon serves (0) or
    /// failed (1), leaving it running; for systemd's ExecReload= (the new
    /// daemon announces itself as the main process: NotifyAccess=all).
    #[arg(long, requires = "takeover")]
    pub(crate) detach: bool,
    /// Keep the pool, the allocations and the socket in systemd's
    /// file-descriptor store, so that `systemctl restart` and a crash lose
    /// none of them (the unit needs FileDescriptorStoreMax=; see
    /// docs/operations.md, "Upgrading").
    #[arg(long)]
    pub(crate) fd_store: bool,
}

pub(crate) fn parse_size_arg(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.to_string())
}

pub(crate) fn parse_page_size_arg(s: &str) -> Result<PageSize, String> {
    PageSize::parse(s).ok_or_else(|| format!("invalid page size {s:?}: expected 1G, 2M or 4K"))
}
