//! The `hugemem` command.

use anyhow::{Context, Result};
use clap::Parser;
use hugemem::bench::alloc::{self as alloc_bench, AllocBenchConfig};
use hugemem::bench::churn::{self, ChurnConfig};
use hugemem::bench::clear::{self, ClearBenchConfig};
use hugemem::bench::compare::{self, CompareConfig};
use hugemem::bench::mlock::{self, MlockBenchConfig};
use hugemem::bench::vmstart::{self, VmstartConfig};
use hugemem::launch::{self, LaunchConfig};
use tracing_subscriber::EnvFilter;

/// The clap definitions.
mod args;
use args::{Bench, Cli, Command, HugepagesArgs, LaunchArgs, QemuWrapperArgs, ServeArgs};

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
        reattach_timeout: std::time::Duration::from_secs(args.reattach_timeout),
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

fn qemu_wrapper(args: QemuWrapperArgs) -> Result<i32> {
    let cfg = hugemem::qemu_wrapper::WrapperConfig {
        qemu: args.qemu,
        socket: args.socket,
        alloc_wait: args
            .wait_ms
            .map(|ms| std::time::Duration::from_millis(ms.into())),
    };
    // Returns only on error: on success the process is QEMU.
    match hugemem::qemu_wrapper::run(&cfg, &args.args) {
        Ok(never) => match never {},
        Err(e) => Err(e).context("hugemem qemu-wrapper: QEMU not started"),
    }
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
    let mode = if args.takeover {
        backend::daemon::Start::Takeover
    } else {
        backend::daemon::Start::Fresh
    };
    let ready = if args.detach { Some(detach()?) } else { None };
    backend::daemon::serve(config, mode, args.fd_store, ready).context("hugemem serve failed")
}

/// `serve --detach`: forks; the parent waits until the child serves (or
/// fails) and exits with 0 (or 1), the child goes on with the write end of
/// the pipe it reports on. Called before any thread exists (only the
/// logger is set up, which starts none), so the fork is safe.
fn detach() -> Result<std::os::fd::OwnedFd> {
    use std::io::Read;
    let (read, write) = nix::unistd::pipe().context("pipe")?;
    // SAFETY: the process is single-threaded here (see above): the child
    // may run any code after the fork.
    match unsafe { nix::unistd::fork() }.context("fork")? {
        nix::unistd::ForkResult::Child => {
            drop(read);
            Ok(write)
        }
        nix::unistd::ForkResult::Parent { child } => {
            drop(write);
            let mut byte = [0u8; 1];
            let ok = std::fs::File::from(read).read(&mut byte).unwrap_or(0) == 1 && byte[0] == b'1';
            if ok {
                eprintln!("hugemem serve --takeover: pid {child} serves");
                std::process::exit(0);
            }
            eprintln!("hugemem serve --takeover: the new daemon (pid {child}) did not take over");
            std::process::exit(1);
        }
    }
}

fn main() {
    let cli = Cli::parse();
    // The demo prints its own progress; the daemon's info lines would bury it.
    let default_filter = match cli.command {
        Command::Demo { .. } => "warn",
        // bench compare starts private daemons; its own progress lines stay.
        Command::Bench(Bench::Compare { .. }) => "info,backend::daemon=warn,guest_mem=warn",
        // bench takeover runs its daemons as processes of their own.
        Command::Bench(Bench::Takeover { .. }) => "info,backend::daemon=warn,guest_mem=warn",
        // bench churn may start a private daemon; its warnings (page-size
        // fallbacks) stay.
        Command::Bench(Bench::Churn { .. }) => "info,backend::daemon=warn,guest_mem=warn",
        // bench vmstart starts private daemons too.
        Command::Bench(Bench::Vmstart { .. }) => {
            "info,backend::daemon=warn,guest_mem=warn,backend::fault=warn,backend::lazy=warn"
        }
        // libvirt's domain log gets the wrapper's lines; the client's debug stays out.
        Command::QemuWrapper(_) => "info,backend=warn",
        _ => "info",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter)),
        )
        .with_writer(std::io::stderr)
        // The wrapper's stderr is libvirt's domain log file: no colour codes there.
        .with_ansi(!matches!(cli.command, Command::QemuWrapper(_)))
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
        Command::QemuWrapper(args) => return qemu_wrapper(args),
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
        Command::Bench(Bench::Takeover {
            pool_gib,
            allocations,
            alloc_mib,
            page_size,
            rounds,
            idle_clients,
            json,
        }) => {
            let cfg = hugemem::bench::takeover::TakeoverConfig {
                // Whole bytes; `run` checks the size against the page size.
                pool_bytes: (pool_gib.max(0.0) * f64::from(1u32 << 30)) as u64,
                allocations,
                alloc_bytes: alloc_mib.saturating_mul(1 << 20),
                page_size,
                rounds,
                idle_clients,
                launcher: std::env::current_exe()
                    .context("cannot find the hugemem binary for `hugemem serve`")?,
            };
            let report = hugemem::bench::takeover::run(&cfg, &mut |line| tracing::info!("{line}"))
                .context("bench takeover failed")?;
            match json {
                None => print!("{}", report.to_table()),
                Some(None) => print_bench_json("takeover", &report)?,
                Some(Some(path)) => {
                    write_bench_json("takeover", &report, &path)?;
                    print!("{}", report.to_table());
                }
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

/// [`print_bench_json`] into the file `path`.
fn write_bench_json<T: serde::Serialize>(
    bench: &str,
    report: &T,
    path: &std::path::Path,
) -> Result<()> {
    use hugemem::bench::run_info::{with_run_info, RunInfo};
    let value = with_run_info(
        bench,
        serde_json::to_value(report)?,
        RUN_INFO.get_or_init(RunInfo::current),
    );
    let mut text = serde_json::to_string_pretty(&value)?;
    text.push('\n');
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

/// The run's command, date, build and machine, taken when a bench starts.
static RUN_INFO: std::sync::OnceLock<hugemem::bench::run_info::RunInfo> =
    std::sync::OnceLock::new();
