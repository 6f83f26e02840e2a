//! The `hugemem` command.

use anyhow::{Context, Result};
use backend::proto::{AllocPart, PagePolicy};
use clap::{Parser, Subcommand};
use guest_mem::size::parse_size;
use guest_mem::PageSize;
use hugemem::bench::alloc::{self as alloc_bench, AllocBenchConfig};
use hugemem::bench::churn::{self, ChurnConfig, ChurnVmm};
use hugemem::bench::clear::{self, ClearBenchConfig};
use hugemem::bench::compare::{self, CompareConfig};
use hugemem::bench::mlock::{self, MlockBenchConfig};
use hugemem::bench::vmstart::{self, VmstartConfig};
use hugemem::launch::{self, LaunchConfig, Vmm};
use tracing_subscriber::EnvFilter;

/// hugemem: guest RAM on 1 GiB pages, cleared in parallel on NUMA-local workers.
#[derive(Debug, Parser)]
#[command(name = "hugemem", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
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
struct HugepagesArgs {
    /// Take the counts, node, mode and mount from the `[hugepages]` section
    /// of this daemon configuration file (the flags below override it).
    #[arg(long, value_name = "FILE")]
    config: Option<std::path::PathBuf>,
    /// 1 GiB pages wanted.
    #[arg(long = "1g", value_name = "N")]
    one_g: Option<u64>,
    /// 2 MiB pages wanted.
    #[arg(long = "2m", value_name = "M")]
    two_m: Option<u64>,
    /// Reserve on this NUMA node only (default: host-wide).
    #[arg(long)]
    node: Option<u32>,
    /// The counts are pages wanted free and not reserved by any mapping (default: a floor on the pool size; pools only grow).
    #[arg(long, conflicts_with = "exact")]
    free: bool,
    /// Set the pools to exactly these counts, shrinking them (pages in use stay).
    #[arg(long)]
    exact: bool,
    /// Mount hugetlbfs at DIR/hugepages-1G and DIR/hugepages-2M (default: /dev).
    #[arg(long, value_name = "DIR")]
    mount_root: Option<std::path::PathBuf>,
    /// Do not mount hugetlbfs.
    #[arg(long)]
    no_mount: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// Runs `hugemem hugepages`; returns the exit status (see the command's help).
fn hugepages(args: HugepagesArgs) -> Result<i32> {
    use hugemem::hugepages::{self as hp, HugepagesConfig};
    let section = match &args.config {
        Some(path) => match backend::daemon::Config::from_toml_file(path) {
            Ok(c) => c.hugepages,
            Err(e) => {
                eprintln!("hugemem hugepages: error: {:#}", anyhow::Error::from(e));
                return Ok(2);
            }
        },
        None => backend::daemon::config::HugepagesSection::default(),
    };
    let cfg = HugepagesConfig {
        one_g: args.one_g.or(section.pages_1g),
        two_m: args.two_m.or(section.pages_2m),
        node: args.node.or(section.node),
        mode: if args.free {
            numa::ReserveMode::Free
        } else if args.exact {
            numa::ReserveMode::Exact
        } else if args.config.is_some() {
            section.mode.into()
        } else {
            numa::ReserveMode::Total
        },
        mount_root: (!args.no_mount && (section.mount || args.mount_root.is_some()))
            .then(|| args.mount_root.unwrap_or(section.mount_root)),
    };
    let report = match hp::run(&cfg) {
        Ok(report) => report,
        Err(e) => {
            eprintln!("hugemem hugepages: error: {e}");
            let mut source = std::error::Error::source(&e);
            while let Some(cause) = source {
                eprintln!("  caused by: {cause}");
                source = cause.source();
            }
            return Ok(e.exit_code());
        }
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", report.to_table());
    }
    Ok(report.exit_code())
}

/// `hugemem launch` flags.
#[derive(Debug, clap::Args)]
struct LaunchArgs {
    /// The daemon's socket.
    #[arg(long, default_value = backend::daemon::config::DEFAULT_SOCKET)]
    socket: std::path::PathBuf,
    /// Guest RAM (K/M/G suffixes); with --nodes it must equal their total.
    #[arg(long, value_parser = parse_size_arg)]
    size: Option<u64>,
    /// Put all guest RAM on this NUMA node.
    #[arg(long, conflicts_with = "nodes")]
    node: Option<u32>,
    /// One region per item: NODE:SIZE[,NODE:SIZE...], e.g. 0:2G,1:2G; a node may repeat (0:1G,0:1G).
    #[arg(long, value_parser = parse_nodes_arg)]
    nodes: Option<NodesArg>,
    /// Page size: best (1G, then 2M, then 4K), 1G, 2M or 4K.
    #[arg(long, default_value = "best", value_parser = parse_policy_arg)]
    page_size: PagePolicy,
    /// Give the VMM hugetlbfs file paths instead of /dev/fd/N (needed with cloud-hypervisor --landlock).
    #[arg(long)]
    hugetlbfs: bool,
    /// Have the daemon mlock the memory before the VMM starts.
    #[arg(long)]
    lock: bool,
    /// How long the daemon may wait for pages it holds but cannot hand out
    /// yet (a region still in quarantine or being scrubbed), in ms; default:
    /// the daemon's pool.alloc_wait_ms. 0: fail at once instead of waiting.
    #[arg(long, value_name = "MS")]
    wait_ms: Option<u32>,
    /// cloud-hypervisor: one guest NUMA node per region.
    #[arg(long)]
    guest_numa: bool,
    /// The VMM kind when the program name does not say: cloud-hypervisor or qemu.
    #[arg(long, value_parser = parse_vmm_arg)]
    vmm: Option<Vmm>,
    /// The VMM and its arguments, after `--`.
    #[arg(last = true, required = true, value_parser = clap::value_parser!(std::ffi::OsString))]
    command: Vec<std::ffi::OsString>,
}

/// A parsed `--nodes` value.
#[derive(Debug, Clone)]
struct NodesArg(Vec<AllocPart>);

fn parse_nodes_arg(s: &str) -> Result<NodesArg, String> {
    launch::parse_nodes(s)
        .map(NodesArg)
        .map_err(|e| e.to_string())
}

fn parse_policy_arg(s: &str) -> Result<PagePolicy, String> {
    launch::parse_page_policy(s)
        .ok_or_else(|| format!("invalid page size {s:?}: expected best, 1G, 2M or 4K"))
}

fn parse_churn_vmm_arg(s: &str) -> Result<ChurnVmm, String> {
    ChurnVmm::parse(s)
        .ok_or_else(|| format!("unknown VMM {s:?}: expected cloud-hypervisor, qemu or micro"))
}

fn parse_vmm_arg(s: &str) -> Result<Vmm, String> {
    Vmm::parse(s).ok_or_else(|| format!("unknown VMM {s:?}: expected cloud-hypervisor or qemu"))
}

fn launch(args: LaunchArgs) -> Result<i32> {
    let cfg = LaunchConfig {
        socket: args.socket,
        size: args.size,
        node: args.node,
        nodes: args.nodes.map(|n| n.0).unwrap_or_default(),
        page_policy: args.page_size,
        hugetlbfs: args.hugetlbfs,
        lock: args.lock,
        alloc_wait: args
            .wait_ms
            .map(|ms| std::time::Duration::from_millis(ms.into())),
        guest_numa: args.guest_numa,
        vmm: args.vmm,
        command: args.command,
    };
    let report = launch::run(&cfg).context("hugemem launch failed")?;
    if !report.note.is_empty() {
        eprintln!("hugemem launch: note from the daemon: {}", report.note);
    }
    eprintln!(
        "hugemem launch: {} on {} pages allocated in {:.1} ms; the VMM ran {:.1} ms and ended with {}",
        guest_mem::size::format_size(report.size),
        report.page_sizes.iter().map(|p| guest_mem::size::format_size(*p)).collect::<Vec<_>>().join("+"),
        report.alloc.as_secs_f64() * 1e3,
        report.vmm.as_secs_f64() * 1e3,
        report.exit
    );
    Ok(report.exit.shell_code())
}

#[derive(Debug, Subcommand)]
enum Bench {
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
struct ServeArgs {
    /// Configuration file (TOML, see scripts/hugemem.toml); defaults apply without one.
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    /// Socket path (default /run/hugemem/hugemem.sock).
    #[arg(long)]
    socket: Option<std::path::PathBuf>,
    /// Serve Prometheus text on this loopback address, e.g. 127.0.0.1:9464.
    #[arg(long)]
    metrics_listen: Option<std::net::SocketAddr>,
    /// Idle bytes per node the pool keeps (K/M/G suffixes).
    #[arg(long, value_parser = parse_size_arg)]
    pool_target: Option<u64>,
    /// Most pooled bytes per node (K/M/G suffixes).
    #[arg(long, value_parser = parse_size_arg)]
    pool_limit: Option<u64>,
    /// Scrubber threads per NUMA node.
    #[arg(long)]
    scrub_threads: Option<usize>,
    /// Also allow this uid to connect (repeatable; root and the daemon's uid always are).
    #[arg(long = "allow-uid")]
    allow_uids: Vec<u32>,
}

fn serve(args: ServeArgs) -> Result<()> {
    use backend::daemon::{Config, Overrides};
    let mut config = match &args.config {
        Some(path) => Config::from_toml_file(path)?,
        None => Config::default(),
    };
    config.apply(&Overrides {
        socket: args.socket,
        metrics_listen: args.metrics_listen,
        pool_target: args.pool_target,
        pool_limit: args.pool_limit,
        scrub_threads: args.scrub_threads,
        allowed_uids: args.allow_uids,
    });
    // Sockets and anything else the daemon creates: owner only.
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
    backend::daemon::serve(config).context("hugemem serve failed")
}

fn parse_size_arg(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.to_string())
}

fn parse_page_size_arg(s: &str) -> Result<PageSize, String> {
    PageSize::parse(s).ok_or_else(|| format!("invalid page size {s:?}: expected 1G, 2M or 4K"))
}

fn main() {
    let cli = Cli::parse();
    // The demo prints its own progress; the daemon's info lines would bury it.
    let default_filter = match cli.command {
        Command::Demo { .. } => "warn",
        // bench compare starts private daemons; its own progress lines stay.
        Command::Bench(Bench::Compare { .. }) => "info,backend::daemon=warn,guest_mem=warn",
        // bench churn may start a private daemon; its warnings (page-size
        // fallbacks) stay.
        Command::Bench(Bench::Churn { .. }) => "info,backend::daemon=warn,guest_mem=warn",
        // bench vmstart starts private daemons too.
        Command::Bench(Bench::Vmstart { .. }) => {
            "info,backend::daemon=warn,guest_mem=warn,backend::fault=warn,backend::lazy=warn"
        }
        _ => "info",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter)),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(cli) {
        Ok(0) => {}
        // `hugemem launch` exits with the VMM's status, `hugemem hugepages`
        // with 3 when the kernel gave fewer pages (2 on bad usage).
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("hugemem: error: {e}");
            for cause in e.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            std::process::exit(1);
        }
    }
}

fn run(cli: Cli) -> Result<i32> {
    if matches!(cli.command, Command::Bench(_) | Command::Demo { .. })
        && !matches!(cli.command, Command::Bench(Bench::Report { .. }))
    {
        // Date and load average as the run starts, not as it ends.
        let _ = RUN_INFO.set(hugemem::bench::run_info::RunInfo::current());
    }
    match cli.command {
        Command::Launch(args) => return launch(args),
        Command::Hugepages(args) => return hugepages(args),
        Command::Demo {
            size,
            no_guest,
            page_size,
            json,
        } => {
            let cfg = hugemem::demo::DemoConfig {
                size,
                no_guest,
                page_size,
            };
            let report = hugemem::demo::run(&cfg, &mut |line| eprintln!("hugemem demo: {line}"))
                .context("hugemem demo failed")?;
            if json {
                print_bench_json("demo", &report)?;
            } else {
                print!("{}", report.to_table());
            }
        }
        Command::Bench(Bench::Alloc {
            size,
            reps,
            page_size,
            threads,
            json,
        }) => {
            let cfg = AllocBenchConfig {
                size,
                reps,
                page_size,
                threads,
            };
            let report = alloc_bench::run(&cfg, &mut |line| tracing::info!("{line}"))
                .context("bench alloc failed")?;
            if json {
                print_bench_json("alloc", &report)?;
            } else {
                print!("{}", report.to_table());
            }
        }
        Command::Bench(Bench::Compare {
            size,
            reps,
            page_size,
            qemu,
            prealloc_threads,
            plot,
            json,
        }) => {
            let cfg = CompareConfig {
                size,
                reps,
                page_size,
                qemu,
                // cloud-hypervisor variants run only when this names a binary.
                cloud_hypervisor: std::env::var_os("CLOUD_HYPERVISOR").filter(|v| !v.is_empty()),
                prealloc_threads,
            };
            let report = compare::run(&cfg, &mut |line| tracing::info!("{line}"))
                .context("bench compare failed")?;
            if json {
                print_bench_json("compare", &report)?;
            } else {
                print!("{}", report.to_table());
            }
            if let Some(png) = plot {
                compare::plot(&report, &png)
                    .with_context(|| format!("cannot plot to {}", png.display()))?;
                tracing::info!("plot written to {}", png.display());
            }
        }
        Command::Bench(Bench::Churn {
            vms,
            size,
            parallel,
            vmm,
            page_size,
            socket,
            qemu,
            launch_timeout,
            json,
        }) => {
            let cfg = ChurnConfig {
                vms,
                size,
                parallel,
                vmm,
                page_policy: page_size,
                socket,
                launcher: std::env::current_exe()
                    .context("cannot find the hugemem binary for `hugemem launch`")?,
                cloud_hypervisor: std::env::var_os("CLOUD_HYPERVISOR").filter(|v| !v.is_empty()),
                qemu,
                timeout: std::time::Duration::from_secs(launch_timeout),
            };
            let report = churn::run(&cfg, &mut |line| tracing::info!("{line}"))
                .context("bench churn failed")?;
            if json {
                print_bench_json("churn", &report)?;
            } else {
                print!("{}", report.to_table());
            }
        }
        Command::Serve(args) => serve(args)?,
        Command::Rebalance {
            socket,
            region,
            to_node,
            range,
        } => {
            let report =
                hugemem::rebalance_cli::run_cli(&socket, region, to_node, range.as_deref())
                    .with_context(|| {
                        format!("hugemem rebalance of region {region} to node {to_node} failed")
                    })?;
            println!("{report}");
        }
        Command::Bench(Bench::Migrate { size, json }) => {
            let topology = numa::Topology::detect().context("cannot detect the NUMA topology")?;
            let report = hugemem::bench::migrate::run_bench(
                &topology,
                &hugemem::bench::migrate::BenchOptions::new(size),
            );
            if json {
                print_bench_json("migrate", &report)?;
            } else {
                for line in report.lines("") {
                    println!("{line}");
                }
            }
            let failures = report.failures();
            if !failures.is_empty() {
                anyhow::bail!("bench migrate: {}", failures.join("; "));
            }
        }
        Command::Status { socket, json } => {
            let mut client = backend::client::Client::connect(&socket)?;
            if json {
                // As the daemon sent it, keys this build does not know included.
                let stats = client.stats_json()?;
                println!("{}", serde_json::to_string_pretty(&stats)?);
            } else {
                let stats = client.stats()?;
                print!("{}", hugemem::status::render_status(&stats));
            }
        }
        Command::Bench(Bench::Clear {
            size,
            reps,
            threads,
            page_size,
            json,
        }) => {
            let cfg = ClearBenchConfig {
                size,
                reps,
                threads,
                page_size,
            };
            let report = clear::run(&cfg, &mut |line| tracing::info!("{line}"))
                .context("bench clear failed")?;
            if json {
                print_bench_json("clear", &report)?;
            } else {
                print!("{}", report.to_table());
            }
        }
        Command::Bench(Bench::Vmstart {
            size,
            page_size,
            guest_timeout,
            json,
        }) => {
            let cfg = VmstartConfig {
                size,
                page_size,
                guest_timeout: std::time::Duration::from_secs(guest_timeout),
            };
            let report = vmstart::run(&cfg, &mut |line| tracing::info!("{line}"))
                .context("bench vmstart failed")?;
            if json {
                print_bench_json("vmstart", &report.to_json())?;
            } else {
                print!("{}", report.to_table());
            }
        }
        Command::Bench(Bench::Report {
            doc,
            results,
            check,
        }) => {
            let up_to_date = hugemem::bench::report::update(&doc, &results, !check)
                .with_context(|| format!("cannot generate {}", doc.display()))?;
            match (up_to_date, check) {
                (true, _) => println!("{} is up to date with {}", doc.display(), results.display()),
                (false, false) => {
                    println!("{} rewritten from {}", doc.display(), results.display())
                }
                (false, true) => {
                    eprintln!(
                        "{} differs from what {} gives; run `hugemem bench report`",
                        doc.display(),
                        results.display()
                    );
                    return Ok(1);
                }
            }
        }
        Command::Bench(Bench::Mlock {
            size,
            chunk,
            reps,
            threads_per_node,
            hugetlb_page_size,
            no_hugetlb,
            json,
        }) => {
            let chunk = chunk
                .map(usize::try_from)
                .transpose()
                .context("--chunk does not fit this machine's address space")?;
            let cfg = MlockBenchConfig {
                size,
                reps,
                chunk,
                threads_per_node,
                hugetlb: !no_hugetlb,
                hugetlb_page: hugetlb_page_size,
            };
            let report = mlock::run(&cfg, &mut |line| tracing::info!("{line}"))
                .context("bench mlock failed")?;
            if json {
                print_bench_json("mlock", &report)?;
            } else {
                print!("{}", report.to_table());
            }
        }
    }
    Ok(0)
}

/// Prints a bench's `--json` object with its name (`"bench"`) and the run's
/// command, date, build and machine summary (`"run"`), so that a file kept
/// under docs/results/ says what produced it.
fn print_bench_json<T: serde::Serialize>(bench: &str, report: &T) -> Result<()> {
    use hugemem::bench::run_info::{with_run_info, RunInfo};
    let value = with_run_info(
        bench,
        serde_json::to_value(report)?,
        RUN_INFO.get_or_init(RunInfo::current),
    );
    println!("{}", serde_json::to_string_pretty(&value)?);
    Ok(())
}

/// The run's command, date, build and machine, taken when a bench starts.
static RUN_INFO: std::sync::OnceLock<hugemem::bench::run_info::RunInfo> =
    std::sync::OnceLock::new();
