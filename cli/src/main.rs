//! The `hugemem` command.

use anyhow::{Context, Result};
use clap::Parser;
use hugemem::launch::{self, LaunchConfig};
use tracing_subscriber::EnvFilter;

/// The clap definitions.
mod args;
use args::{
    CheckArgs, Cli, Command, ForwardArgs, HugepagesArgs, LaunchArgs, QemuWrapperArgs, ServeArgs,
    UpdateArgs,
};

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

/// Runs `hugemem launch`; exits with the VMM's status.
fn launch(args: LaunchArgs) -> Result<i32> {
    let control = match (&args.name, args.control_socket) {
        (Some(name), _) => Some(launch::control_socket_path(name)?),
        (None, path) => path,
    };
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
        control,
        update_timeout: std::time::Duration::from_secs(args.update_timeout),
        vmm: args.vmm,
        command: args.command,
        restore: args.restore,
        on_demand: args.on_demand,
        clone_of: args.clone_of,
        clone_mode: args.clone_mode.0,
        copy_eager: args.copy_eager,
    };
    let report = launch::run(&cfg).context("hugemem launch failed")?;
    if !report.note.is_empty() {
        eprintln!("hugemem launch: note from the daemon: {}", report.note);
    }
    let pages = report
        .page_sizes
        .iter()
        .map(|p| guest_mem::size::format_size(*p))
        .collect::<Vec<_>>()
        .join("+");
    let got = match (report.restored, report.cloned) {
        (true, _) => "restored from the park",
        (false, Some(hugemem_client::proto::CloneMode::Shared)) => {
            "mapped from its template (shared, copy-on-write)"
        }
        (false, Some(hugemem_client::proto::CloneMode::Copy)) if report.filled_first => {
            "copied from its template before the guest ran"
        }
        (false, Some(hugemem_client::proto::CloneMode::Copy)) => {
            "filled from its template as the guest ran (postcopy)"
        }
        (false, None) => "allocated",
    };
    let end = match &report.parked_as {
        Some(name) => format!("; parked as {name}"),
        None => String::new(),
    };
    eprintln!(
        "hugemem launch: {} on {pages} pages {got} in {:.1} ms; the VMM ran {:.1} ms and ended with {}{end}",
        guest_mem::size::format_size(report.size),
        report.alloc.as_secs_f64() * 1e3,
        report.vmm.as_secs_f64() * 1e3,
        report.exit
    );
    Ok(report.exit.shell_code())
}

/// Runs `hugemem park`: from a running cloud-hypervisor, a launched QEMU
/// (through its launcher's control socket, `control` or the one of the
/// launch named `name`), or from a directory.
fn park(
    socket: &std::path::Path,
    name: &str,
    (api_socket, control): (Option<&std::path::Path>, Option<&std::path::Path>),
    from_dir: Option<(std::path::PathBuf, bool)>,
    timeout: u64,
) -> Result<i32> {
    use guest_mem::size::format_size;
    let (dir, on_demand) = match (api_socket, from_dir) {
        (_, Some(d)) => d,
        (Some(api), None) => {
            let p =
                hugemem::park_cli::park(socket, name, api, std::time::Duration::from_secs(timeout))
                    .with_context(|| format!("hugemem park {name} failed"))?;
            let how = if p.copied_bytes == 0 {
                "nothing copied: its memory moved".to_string()
            } else {
                format!("{} copied onto pool memory", format_size(p.copied_bytes))
            };
            println!(
                "parked as {name}: {} in {} slot(s), {how}",
                format_size(p.bytes),
                p.slots
            );
            return Ok(0);
        }
        (None, None) => {
            let control = match control {
                Some(path) => path.to_owned(),
                None => hugemem::launch::control_socket_path(name)?,
            };
            let r = hugemem::park_cli::park_launched(
                &control,
                name,
                std::time::Duration::from_secs(timeout),
            )
            .with_context(|| format!("hugemem park {name} failed"))?;
            println!(
                "parked as {name}: {} {} in {} slot(s), its memory moved ({} bytes copied by \
                 the daemon; {}'s stream: {} bytes of device state, {} bytes of RAM); {:.1} \
                 ms, the {} exits",
                r.vmm,
                format_size(r.bytes),
                r.slots,
                r.copied_bytes,
                r.vmm,
                r.state_bytes,
                r.ram_transferred_bytes,
                r.park_ms,
                r.vmm
            );
            return Ok(0);
        }
    };
    let r = hugemem_client::saved_vm::park_from_dir(socket, name, &dir, on_demand)
        .with_context(|| format!("hugemem park {name} --from-dir {} failed", dir.display()))?;
    let (p, checked) = (r.parked, r.kind == hugemem_client::saved_vm::DirKind::Saved);
    let how = match (on_demand, checked) {
        (false, true) => format!(
            "{} read onto pool memory, every piece checked against its manifest",
            format_size(p.copied_bytes)
        ),
        (false, false) => format!("{} read onto pool memory", format_size(p.copied_bytes)),
        (true, true) => {
            "to be read when it is restored (on demand), each piece checked against its manifest as it is read"
                .into()
        }
        (true, false) => "to be read when it is restored (on demand)".into(),
    };
    println!(
        "parked as {name} from {}: {} in {} slot(s), {how}",
        dir.display(),
        format_size(p.bytes),
        p.slots
    );
    if !checked {
        eprintln!(
            "hugemem park: note: {} is {}",
            dir.display(),
            r.kind.describe()
        );
    }
    Ok(0)
}

/// Runs `hugemem unpark` without a save.
fn unpark(socket: &std::path::Path, name: &str) -> Result<i32> {
    hugemem::park_cli::unpark(socket, name)
        .with_context(|| format!("hugemem unpark {name} failed"))?;
    println!("unparked {name}: its memory returns to the pool");
    Ok(0)
}

/// Runs `hugemem save` (the VM stays parked) and `hugemem unpark --save`
/// (`drop_after`: dropped once the save is in place), with progress.
fn save_vm(
    socket: &std::path::Path,
    name: &str,
    dir: &std::path::Path,
    drop_after: bool,
) -> Result<i32> {
    use guest_mem::size::format_size;
    let what = if drop_after { "unpark --save" } else { "save" };
    let progress = |done: u64| {
        eprintln!(
            "hugemem {what}: {name}: {} written or skipped",
            format_size(done)
        )
    };
    let opts = hugemem_client::saved_vm::SaveOptions {
        progress: Some(&progress),
        ..Default::default()
    };
    let r = hugemem_client::saved_vm::save_parked(socket, name, dir, drop_after, &opts)
        .with_context(|| format!("hugemem {what} {name} {} failed", dir.display()))?;
    let rate = r.write.written as f64 / r.seconds.max(1e-9) / 1e9;
    println!(
        "saved {name} to {} in {:.2} s: {} slot(s), {} of memory, {} written ({} direct, {rate:.2} GB/s), {} left as holes; manifest written last{}",
        dir.display(),
        r.seconds,
        r.slots,
        format_size(r.memory_bytes),
        format_size(r.write.written),
        format_size(r.write.written_direct),
        format_size(r.write.holes),
        if drop_after {
            "; unparked: its memory returns to the pool"
        } else {
            "; it stays parked"
        }
    );
    Ok(0)
}

/// Runs `hugemem verify`: a saved VM checked against its manifest.
fn verify_saved(dir: &std::path::Path) -> Result<i32> {
    use guest_mem::size::format_size;
    let mut next = 1u64 << 30;
    let mut progress = |done: u64| {
        if done >= next {
            eprintln!("hugemem verify: {} checked", format_size(done));
            next = done + (1 << 30);
        }
    };
    let (m, bytes) = hugemem_client::saved_vm::check_saved_dir(dir, &mut progress)
        .with_context(|| format!("hugemem verify {} failed", dir.display()))?;
    println!(
        "{}: whole: {} file(s) and {} of memory match the manifest ({} pieces); a {} VM parked as {} by uid {} on {} ({} pages), parked at {}, saved at {} by hugemem {}",
        dir.display(),
        m.files.len() + m.memory.len(),
        format_size(bytes),
        m.memory.iter().map(|f| f.crc32c.len()).sum::<usize>(),
        m.vmm,
        m.source.name,
        m.source.uid,
        m.source.host,
        format_size(m.page_size),
        m.source.parked_at,
        m.source.saved_at,
        m.source.hugemem
    );
    Ok(0)
}

/// Runs `hugemem update`: one live update, its report on stdout.
fn update(args: UpdateArgs) -> Result<i32> {
    let path = if args.vm.contains('/') {
        std::path::PathBuf::from(&args.vm)
    } else {
        launch::control_socket_path(&args.vm)?
    };
    let report = launch::request_update(
        &path,
        args.qemu.as_deref(),
        std::time::Duration::from_secs(args.timeout),
    )
    .with_context(|| format!("hugemem update {} failed", args.vm))?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        match launch::vmm::by_name(&report.vmm) {
            Some(vmm) => println!("{}", vmm.describe_update(&report)),
            None => println!(
                "updated: {} pid {} -> {} ({}); {:.1} ms in all",
                report.vmm, report.old_pid, report.new_pid, report.program, report.update_ms
            ),
        }
    }
    Ok(0)
}

/// Runs `hugemem qemu-wrapper`: becomes QEMU, or fails.
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

/// Runs `hugemem serve` until SIGTERM/SIGINT (or a takeover).
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

/// Runs the subcommand; the process's exit status.
fn run(cli: Cli) -> Result<i32> {
    match cli.command {
        Command::Serve(args) => serve(args).map(|()| 0),
        Command::Status { socket, json } => status(&socket, json),
        Command::Rebalance {
            socket,
            region,
            to_node,
            range,
        } => rebalance(&socket, region, to_node, range.as_deref()),
        Command::Launch(args) => launch(args),
        Command::Update(args) => update(args),
        Command::QemuWrapper(args) => qemu_wrapper(args),
        Command::Park {
            name,
            api_socket,
            control_socket,
            from_dir,
            on_demand,
            socket,
            timeout,
        } => park(
            &socket,
            &name,
            (api_socket.as_deref(), control_socket.as_deref()),
            from_dir.map(|d| (d, on_demand)),
            timeout,
        ),
        Command::Unpark { name, save, socket } => match save {
            Some(dir) => save_vm(&socket, &name, &dir, true),
            None => unpark(&socket, &name),
        },
        Command::Save { name, dir, socket } => save_vm(&socket, &name, &dir, false),
        Command::Verify { dir } => verify_saved(&dir),
        Command::Demo(args) => run_bench_binary(Some("demo"), args),
        Command::Bench(args) => run_bench_binary(None, args),
        Command::Hugepages(args) => hugepages(args),
        Command::Check(args) => check(args),
        Command::PackageAssets { man, completions } => package_assets(&man, &completions),
    }
}

/// Runs `hugemem check`: the report as lines or JSON; 1 on any FAIL.
fn check(args: CheckArgs) -> Result<i32> {
    use hugemem::check::{self, CheckInputs};
    let (config, config_path, config_item) = check::load_config(args.config.as_deref());
    let inputs = CheckInputs {
        sys: args.sys,
        proc: args.proc,
        dev: args.dev,
        qemu_conf: args.qemu_conf,
        emulator: args.emulator,
        ..CheckInputs::host(config, config_path)
    };
    let report = check::run(&inputs, config_item);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report.to_json())?);
    } else {
        print!("{}", report.to_text());
    }
    Ok(report.exit_code())
}

/// Writes the man pages (one per subcommand) and the bash, zsh and fish
/// completions, from this very command line definition.
fn package_assets(man: &std::path::Path, completions: &std::path::Path) -> Result<i32> {
    use clap::CommandFactory;
    std::fs::create_dir_all(man).with_context(|| format!("create {}", man.display()))?;
    std::fs::create_dir_all(completions)
        .with_context(|| format!("create {}", completions.display()))?;
    let cmd = Cli::command();
    clap_mangen::generate_to(cmd.clone(), man)
        .with_context(|| format!("write the man pages to {}", man.display()))?;
    for shell in [
        clap_complete::Shell::Bash,
        clap_complete::Shell::Zsh,
        clap_complete::Shell::Fish,
    ] {
        let mut cmd = cmd.clone();
        clap_complete::generate_to(shell, &mut cmd, "hugemem", completions)
            .with_context(|| format!("write the {shell} completion"))?;
    }
    Ok(0)
}

/// Runs `hugemem status`: STATS as a table, or as the daemon sent it.
fn status(socket: &std::path::Path, json: bool) -> Result<i32> {
    let mut client = hugemem_client::client::Client::connect(socket)?;
    if json {
        // As the daemon sent it, keys this build does not know included.
        let stats = client.stats_json()?;
        println!("{}", serde_json::to_string_pretty(&stats)?);
    } else {
        let stats = client.stats()?;
        print!("{}", hugemem::status::render_status(&stats));
    }
    Ok(0)
}

/// Runs `hugemem rebalance`: one REBALANCE, its report on stdout.
fn rebalance(
    socket: &std::path::Path,
    region: u64,
    to_node: u32,
    range: Option<&str>,
) -> Result<i32> {
    let report =
        hugemem::rebalance_cli::run_cli(socket, region, to_node, range).with_context(|| {
            format!("hugemem rebalance of region {region} to node {to_node} failed")
        })?;
    println!("{report}");
    Ok(0)
}

/// Runs `hugemem demo …` and `hugemem bench …`: execs `hugemem-bench`
/// (beside this executable, else on PATH) with `first` and every argument,
/// so that its exit status, signals and output are the bench's own. Returns
/// only when it cannot be run.
fn run_bench_binary(first: Option<&str>, args: ForwardArgs) -> Result<i32> {
    use std::os::unix::process::CommandExt;
    const BENCH: &str = "hugemem-bench";
    let program = hugemem::companion::find(BENCH).with_context(|| {
        format!(
            "`hugemem demo` and `hugemem bench` run {BENCH}, which is built and shipped \
             apart from the daemon: build it with `cargo build --release -p {BENCH}` \
             (it lands beside target/release/hugemem), or install the package that ships it"
        )
    })?;
    let err = std::process::Command::new(&program)
        .args(first)
        .args(&args.args)
        .exec();
    Err(err).with_context(|| format!("cannot run {}", program.display()))
}
