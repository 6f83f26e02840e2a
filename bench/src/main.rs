//! The `hugemem-bench` command: the demo and the benchmarks, apart from the
//! shipped daemon binary. `hugemem demo …` and `hugemem bench X …` exec this
//! binary with the same arguments (`hugemem-bench demo …`, `hugemem-bench X
//! …`) where it is installed beside `hugemem`.

use anyhow::{Context, Result};
use clap::Parser;
use hugemem_bench::alloc::{self as alloc_bench, AllocBenchConfig};
use hugemem_bench::churn::{self, ChurnConfig};
use hugemem_bench::clear::{self, ClearBenchConfig};
use hugemem_bench::compare::{self, CompareConfig};
use hugemem_bench::fill::{self as fill_bench, FillBenchConfig};
use hugemem_bench::mlock::{self, MlockBenchConfig};
use hugemem_bench::run_info::{with_run_info, RunInfo};
use hugemem_bench::vmstart::{self, VmstartConfig};
use tracing_subscriber::EnvFilter;

/// The clap definitions.
mod args;
use args::{
    AllocArgs, ChurnArgs, ClearArgs, Cli, CloneArgs, Command, CompareArgs, DemoArgs, FillArgs,
    MigrateArgs, MlockArgs, OffloadArgs, RefaultArgs, ReportArgs, TakeoverArgs, VmmUpdateArgs,
    VmstartArgs,
};

fn main() {
    let cli = Cli::parse();
    // The demo prints its own progress; the daemon's info lines would bury it.
    let default_filter = match cli.command {
        Command::Demo(_) => "warn",
        // compare starts private daemons; its own progress lines stay.
        // takeover runs its daemons as processes of their own. churn may
        // start a private daemon; its warnings (page-size fallbacks) stay.
        Command::Compare(_)
        | Command::Takeover(_)
        | Command::Churn(_)
        | Command::VmmUpdate(_)
        | Command::Offload(_)
        | Command::Clone(_) => "info,backend::daemon=warn,guest_mem=warn",
        // vmstart starts private daemons too.
        Command::Refault(_) => "info,backend::daemon=warn,guest_mem=warn",
        Command::Vmstart(_) => {
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
        // `report --check` exits with 1 when the document is out of date.
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

/// Runs the subcommand; the process's exit status.
fn run(cli: Cli) -> Result<i32> {
    if !matches!(cli.command, Command::Report(_)) {
        // Date and load average as the run starts, not as it ends.
        let _ = RUN_INFO.set(RunInfo::current());
    }
    match cli.command {
        Command::Demo(args) => demo(args),
        Command::Report(args) => report(args),
        Command::Vmstart(args) => vmstart(args),
        Command::Clear(args) => clear(args),
        Command::Fill(args) => fill(args),
        Command::Refault(args) => refault(args),
        Command::Mlock(args) => mlock(args),
        Command::Migrate(args) => migrate(args),
        Command::Alloc(args) => alloc(args),
        Command::Churn(args) => churn(args),
        Command::Takeover(args) => takeover(args),
        Command::Compare(args) => compare(args),
        Command::VmmUpdate(args) => vmm_update(args),
        Command::Offload(args) => offload(args),
        Command::Clone(args) => clone_bench(args),
    }
}

/// Runs `demo`: the timeline, or its `--json`.
fn demo(args: DemoArgs) -> Result<i32> {
    let cfg = hugemem_bench::demo::DemoConfig {
        size: args.size,
        no_guest: args.no_guest,
        page_size: args.page_size,
    };
    let report = hugemem_bench::demo::run(&cfg, &mut |line| eprintln!("hugemem demo: {line}"))
        .context("hugemem demo failed")?;
    if args.json {
        print_bench_json("demo", &report)?;
    } else {
        print!("{}", report.to_table());
    }
    Ok(0)
}

/// Runs `alloc`.
fn alloc(args: AllocArgs) -> Result<i32> {
    let cfg = AllocBenchConfig {
        size: args.size,
        reps: args.reps,
        page_size: args.page_size,
        threads: args.threads,
    };
    let report = alloc_bench::run(&cfg, &mut |line| tracing::info!("{line}"))
        .context("bench alloc failed")?;
    if args.json {
        print_bench_json("alloc", &report)?;
    } else {
        print!("{}", report.to_table());
    }
    Ok(0)
}

/// Runs `compare`, and its plot when asked.
fn compare(args: CompareArgs) -> Result<i32> {
    let cfg = CompareConfig {
        size: args.size,
        reps: args.reps,
        page_size: args.page_size,
        qemu: args.qemu,
        // cloud-hypervisor variants run only when this names a binary.
        cloud_hypervisor: std::env::var_os("CLOUD_HYPERVISOR").filter(|v| !v.is_empty()),
        prealloc_threads: args.prealloc_threads,
        pool_holes: args.pool_holes,
        refault_ahead: !args.no_refault_ahead,
    };
    let report =
        compare::run(&cfg, &mut |line| tracing::info!("{line}")).context("bench compare failed")?;
    if args.json {
        print_bench_json("compare", &report)?;
    } else {
        print!("{}", report.to_table());
    }
    if let Some(png) = args.plot {
        compare::plot(&report, &png)
            .with_context(|| format!("cannot plot to {}", png.display()))?;
        tracing::info!("plot written to {}", png.display());
    }
    Ok(0)
}

/// Runs `churn`; its launches go through `hugemem launch` (and its private
/// daemon is `hugemem serve`) of the `hugemem` binary installed beside.
fn churn(args: ChurnArgs) -> Result<i32> {
    let cfg = ChurnConfig {
        vms: args.vms,
        size: args.size,
        parallel: args.parallel,
        vmm: args.vmm,
        page_policy: args.page_size,
        socket: args.socket,
        launcher: hugemem::companion::find("hugemem")
            .context("cannot find the hugemem binary for `hugemem launch`")?,
        cloud_hypervisor: std::env::var_os("CLOUD_HYPERVISOR").filter(|v| !v.is_empty()),
        qemu: args.qemu,
        timeout: std::time::Duration::from_secs(args.launch_timeout),
    };
    let report =
        churn::run(&cfg, &mut |line| tracing::info!("{line}")).context("bench churn failed")?;
    if args.json {
        print_bench_json("churn", &report)?;
    } else {
        print!("{}", report.to_table());
    }
    Ok(0)
}

/// Runs `migrate`; fails when a move failed.
fn migrate(args: MigrateArgs) -> Result<i32> {
    use hugemem_bench::migrate::{run_bench, BenchOptions};
    let topology = numa::Topology::detect().context("cannot detect the NUMA topology")?;
    let report = run_bench(&topology, &BenchOptions::new(args.size));
    if args.json {
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
    Ok(0)
}

/// Runs `refault`.
fn refault(args: RefaultArgs) -> Result<i32> {
    let cfg = hugemem_bench::refault::RefaultBenchConfig {
        size: args.size,
        page_size: args.page_size,
        reps: args.reps,
        chunk: args.chunk,
        tenant_window: std::time::Duration::from_millis(args.tenant_ms),
        no_daemon: args.no_daemon,
    };
    let report = hugemem_bench::refault::run(&cfg, &mut |line| tracing::info!("{line}"))
        .context("bench refault failed")?;
    if args.json {
        print_bench_json("refault", &report)?;
    } else {
        print!("{}", report.to_table());
    }
    Ok(0)
}

/// Runs `clear`.
fn clear(args: ClearArgs) -> Result<i32> {
    let cfg = ClearBenchConfig {
        size: args.size,
        reps: args.reps,
        threads: args.threads,
        page_size: args.page_size,
    };
    let report =
        clear::run(&cfg, &mut |line| tracing::info!("{line}")).context("bench clear failed")?;
    if args.json {
        print_bench_json("clear", &report)?;
    } else {
        print!("{}", report.to_table());
    }
    Ok(0)
}

/// Runs `fill`.
fn fill(args: FillArgs) -> Result<i32> {
    let cfg = FillBenchConfig {
        size: args.size,
        holes_percent: args.holes,
        dir: args.dir,
        threads: args.threads,
        reps: args.reps,
    };
    let report =
        fill_bench::run(&cfg, &mut |line| tracing::info!("{line}")).context("bench fill failed")?;
    if args.json {
        print_bench_json("fill", &report)?;
    } else {
        print!("{}", report.to_table());
    }
    Ok(0)
}

/// Runs `vmstart`.
fn vmstart(args: VmstartArgs) -> Result<i32> {
    let cfg = VmstartConfig {
        size: args.size,
        page_size: args.page_size,
        guest_timeout: std::time::Duration::from_secs(args.guest_timeout),
    };
    let report =
        vmstart::run(&cfg, &mut |line| tracing::info!("{line}")).context("bench vmstart failed")?;
    if args.json {
        print_bench_json("vmstart", &report.to_json())?;
    } else {
        print!("{}", report.to_table());
    }
    Ok(0)
}

/// Runs `takeover`; its daemons are `hugemem serve` of the `hugemem`
/// binary installed beside.
fn takeover(args: TakeoverArgs) -> Result<i32> {
    let cfg = hugemem_bench::takeover::TakeoverConfig {
        // Whole bytes; `run` checks the size against the page size.
        pool_bytes: (args.pool_gib.max(0.0) * f64::from(1u32 << 30)) as u64,
        allocations: args.allocations,
        alloc_bytes: args.alloc_mib.saturating_mul(1 << 20),
        page_size: args.page_size,
        rounds: args.rounds,
        idle_clients: args.idle_clients,
        launcher: hugemem::companion::find("hugemem")
            .context("cannot find the hugemem binary for `hugemem serve`")?,
    };
    let report = hugemem_bench::takeover::run(&cfg, &mut |line| tracing::info!("{line}"))
        .context("bench takeover failed")?;
    match args.json {
        None => print!("{}", report.to_table()),
        Some(None) => print_bench_json("takeover", &report)?,
        Some(Some(path)) => {
            write_bench_json("takeover", &report, &path)?;
            print!("{}", report.to_table());
        }
    }
    Ok(0)
}

/// Runs `vmm-update`; its VMMs run through `hugemem launch`/`update` (and
/// its private daemon is `hugemem serve`) of the `hugemem` binary beside.
fn vmm_update(args: VmmUpdateArgs) -> Result<i32> {
    use hugemem::launch::Vmm;
    let vmm = Vmm::parse(&args.vmm).context("--vmm names no VMM")?;
    // Each VMM's program flag.
    let programs = hugemem_bench::vmm_side::PerVmm {
        qemu: args.qemu,
        cloud_hypervisor: args.cloud_hypervisor,
    };
    let program = programs.get(vmm).clone();
    let cfg = hugemem_bench::vmm_update::VmmUpdateConfig {
        vmm,
        size: args.size,
        updates: args.updates.max(1),
        program,
        launcher: hugemem::companion::find("hugemem")
            .context("cannot find the hugemem binary for `hugemem launch`")?,
        no_copy: args.no_copy,
    };
    let report = hugemem_bench::vmm_update::run(&cfg, &mut |line| tracing::info!("{line}"))
        .with_context(|| format!("bench vmm-update --vmm {} failed", args.vmm))?;
    match args.json {
        None => print!("{}", report.to_table()),
        Some(None) => print_bench_json("vmm-update", &report)?,
        Some(Some(path)) => {
            write_bench_json("vmm-update", &report, &path)?;
            print!("{}", report.to_table());
        }
    }
    Ok(0)
}

/// Runs `offload`; its VMs run through `hugemem launch`, `park` and
/// `unpark` (and its private daemons are `hugemem serve`) of the `hugemem`
/// binary beside.
fn offload(args: OffloadArgs) -> Result<i32> {
    let from_env = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    let cfg = hugemem_bench::offload::OffloadConfig {
        size: args.size,
        page_size: args.page_size,
        reps: args.reps,
        dir: args.dir,
        cloud_hypervisor: args
            .cloud_hypervisor
            .or_else(|| from_env("CLOUD_HYPERVISOR"))
            .unwrap_or_else(|| "cloud-hypervisor".into()),
        offload_daemon: args
            .offload_daemon
            .or_else(|| from_env("CH_OFFLOAD_DAEMON")),
        launcher: hugemem::companion::find("hugemem")
            .context("cannot find the hugemem binary for `hugemem launch`")?,
        dense: args.dense,
        qemu: args
            .qemu
            .or_else(|| from_env("QEMU"))
            .or_else(|| Some("qemu-system-x86_64".into()))
            .filter(|q| q != "none"),
    };
    let report = hugemem_bench::offload::run(&cfg, &mut |line| tracing::info!("{line}"))
        .context("bench offload failed")?;
    match args.json {
        None => print!("{}", report.to_table()),
        Some(None) => print_bench_json("offload", &report)?,
        Some(Some(path)) => {
            write_bench_json("offload", &report, &path)?;
            print!("{}", report.to_table());
        }
    }
    Ok(0)
}

/// Runs `clone` (or, with `--plan`, prints its plan); its VMs run through
/// `hugemem launch`, `park` and `serve` of the `hugemem` binary beside.
fn clone_bench(args: CloneArgs) -> Result<i32> {
    use hugemem_bench::clone::{self as clone, CloneConfig};
    let from_env = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    let cfg = CloneConfig {
        budget: args
            .memory
            .map(|m| args.page_sizes.0.iter().map(|p| (*p, m)).collect()),
        sizes: args.sizes.0,
        counts: args.counts.0,
        page_sizes: args.page_sizes.0,
        reps: args.reps,
        dir: args.dir,
        cloud_hypervisor: args
            .cloud_hypervisor
            .or_else(|| from_env("CLOUD_HYPERVISOR"))
            .unwrap_or_else(|| "cloud-hypervisor".into()),
        launcher: if args.plan {
            std::path::PathBuf::new()
        } else {
            hugemem::companion::find("hugemem")
                .context("cannot find the hugemem binary for `hugemem launch`")?
        },
        vmm: hugemem::launch::Vmm::parse(&args.vmm).context("--vmm names no VMM")?,
        qemu: args
            .qemu
            .or_else(|| from_env("QEMU"))
            .unwrap_or_else(|| "qemu-system-x86_64".into()),
    };
    if args.plan {
        println!("{}", serde_json::to_string_pretty(&clone::plan(&cfg).0)?);
        return Ok(0);
    }
    let report =
        clone::run(&cfg, &mut |line| tracing::info!("{line}")).context("bench clone failed")?;
    match args.json {
        None => print!("{}", report.to_table()),
        Some(None) => print_bench_json("clone", &report)?,
        Some(Some(path)) => {
            write_bench_json("clone", &report, &path)?;
            print!("{}", report.to_table());
        }
    }
    Ok(0)
}

/// Runs `report`: regenerates docs/benchmarks.md, or with `--check` exits
/// with 1 when it is out of date.
fn report(args: ReportArgs) -> Result<i32> {
    let ReportArgs {
        doc,
        results,
        check,
    } = args;
    let up_to_date = hugemem_bench::report::update(&doc, &results, !check)
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
    Ok(0)
}

/// Runs `mlock`.
fn mlock(args: MlockArgs) -> Result<i32> {
    let chunk = args
        .chunk
        .map(usize::try_from)
        .transpose()
        .context("--chunk does not fit this machine's address space")?;
    let cfg = MlockBenchConfig {
        size: args.size,
        reps: args.reps,
        chunk,
        threads_per_node: args.threads_per_node,
        hugetlb: !args.no_hugetlb,
        hugetlb_page: args.hugetlb_page_size,
    };
    let report =
        mlock::run(&cfg, &mut |line| tracing::info!("{line}")).context("bench mlock failed")?;
    if args.json {
        print_bench_json("mlock", &report)?;
    } else {
        print!("{}", report.to_table());
    }
    Ok(0)
}

/// A bench's `--json` object with its name (`"bench"`) and the run's
/// command, date, build and machine summary (`"run"`), so that a file kept
/// under docs/results/ says what produced it.
fn bench_json<T: serde::Serialize>(bench: &str, report: &T) -> Result<String> {
    let value = with_run_info(
        bench,
        serde_json::to_value(report)?,
        RUN_INFO.get_or_init(RunInfo::current),
    );
    Ok(serde_json::to_string_pretty(&value)?)
}

/// Prints [`bench_json`].
fn print_bench_json<T: serde::Serialize>(bench: &str, report: &T) -> Result<()> {
    println!("{}", bench_json(bench, report)?);
    Ok(())
}

/// [`bench_json`] into the file `path`.
fn write_bench_json<T: serde::Serialize>(
    bench: &str,
    report: &T,
    path: &std::path::Path,
) -> Result<()> {
    let mut text = bench_json(bench, report)?;
    text.push('\n');
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

/// The run's command, date, build and machine, taken when a bench starts.
static RUN_INFO: std::sync::OnceLock<RunInfo> = std::sync::OnceLock::new();
