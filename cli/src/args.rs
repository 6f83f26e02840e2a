//! The command line: clap's definitions of every subcommand and its flags,
//! and the value parsers only they use (those `hugemem-bench` shares are in
//! `hugemem::arg_values`). `demo` and `bench` take every argument as it is,
//! for `hugemem-bench`. `main.rs` dispatches on them.

use clap::{Parser, Subcommand};
use hugemem::arg_values::{parse_policy_arg, parse_size_arg};
use hugemem::launch::{self, Vmm};
use hugemem_client::proto::{AllocPart, CloneMode, PagePolicy};

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
    /// Update the VMM (QEMU or cloud-hypervisor) of a running `hugemem
    /// launch --name VM` without copying guest RAM: a new process on the
    /// same memory takes the guest over
    /// (docs/operations.md, "Updating the VMM under a running VM").
    Update(UpdateArgs),
    /// Park a VM in the daemon: its memory, configuration and state kept
    /// under NAME while no process runs it (docs/operations.md, "Parking a
    /// VM"). A cloud-hypervisor VM: its offload snapshot (`--api-socket`).
    /// A QEMU launched with `hugemem launch --name NAME` (or
    /// `--control-socket`): without `--api-socket`, its launcher has QEMU
    /// migrate its device state into the daemon, and QEMU exits. Memory
    /// that came from `hugemem launch` moves without a copy; other memory
    /// is copied onto the pool's huge pages. `hugemem launch --restore
    /// NAME` brings it back.
    Park {
        /// The parked VM's name (letters, digits, '.', '_', '-'); for a
        /// launched QEMU, also the launch's `--name`.
        name: String,
        /// The cloud-hypervisor's API socket.
        #[arg(long, conflicts_with_all = ["from_dir", "control_socket"])]
        api_socket: Option<std::path::PathBuf>,
        /// A launched QEMU's control socket (`hugemem launch
        /// --control-socket`); default: the one of the launch named NAME.
        #[arg(long, conflicts_with = "from_dir")]
        control_socket: Option<std::path::PathBuf>,
        /// Park the VM saved in this directory instead (`hugemem unpark
        /// --save`, cloud-hypervisor's reference offload daemon, or
        /// cloud-hypervisor's own `snapshot destination_url=file://DIR`):
        /// its memory is read onto pool memory. A hugemem save is checked
        /// against its manifest first, and every piece of memory as it is
        /// read; the others carry no checksums and are checked for shape.
        #[arg(long, value_name = "DIR")]
        from_dir: Option<std::path::PathBuf>,
        /// With --from-dir: keep the directory's files and read the memory
        /// when the VM is restored (with `launch --restore --on-demand`,
        /// as the guest asks for it) instead of now.
        #[arg(long, requires = "from_dir")]
        on_demand: bool,
        /// The daemon's socket.
        #[arg(long, default_value = backend::daemon::config::DEFAULT_SOCKET)]
        socket: std::path::PathBuf,
        /// How long cloud-hypervisor's API may take to answer, seconds.
        #[arg(long, default_value_t = 60)]
        timeout: u64,
    },
    /// Drop a parked VM: its memory returns to the pool.
    Unpark {
        /// The parked VM's name.
        name: String,
        /// Save the VM to this directory first (see `hugemem save`), and drop
        /// it only once the save is in place.
        #[arg(long, value_name = "DIR")]
        save: Option<std::path::PathBuf>,
        /// The daemon's socket.
        #[arg(long, default_value = backend::daemon::config::DEFAULT_SOCKET)]
        socket: std::path::PathBuf,
    },
    /// Save a parked VM to a directory; it stays parked. The directory
    /// (created, or empty) gets the layout of cloud-hypervisor's reference
    /// offload daemon, so either restores the other's (a parked QEMU VM's
    /// documents go in the same files), plus a manifest of checksums
    /// written last. The save is whole or absent: it is written
    /// beside DIR and renamed into place once every file is on disk
    /// (docs/operations.md, "Saving a parked VM").
    Save {
        /// The parked VM's name.
        name: String,
        /// The directory to save to.
        dir: std::path::PathBuf,
        /// The daemon's socket.
        #[arg(long, default_value = backend::daemon::config::DEFAULT_SOCKET)]
        socket: std::path::PathBuf,
    },
    /// Check a saved VM without a daemon: every file against its manifest,
    /// every piece of memory read back.
    Verify {
        /// The saved VM's directory.
        dir: std::path::PathBuf,
    },
    /// The emulator of a libvirt domain: take its huge-page memory backends
    /// from the daemon and exec the real QEMU (docs/operations.md, "libvirt").
    QemuWrapper(QemuWrapperArgs),
    /// Start a private daemon, run the micro-guest on 1 GiB pages, free, reuse
    /// from the clean pool, and print a timeline: runs `hugemem-bench demo`
    /// with every argument (`hugemem demo --help` shows its flags).
    #[command(disable_help_flag = true)]
    Demo(ForwardArgs),
    /// Benchmarks; each reports ratios against a baseline measured in the same
    /// run: runs `hugemem-bench` with every argument (`hugemem bench alloc …`
    /// is `hugemem-bench alloc …`; `hugemem bench --help` lists them).
    #[command(disable_help_flag = true)]
    Bench(ForwardArgs),
    /// Reserve 1 GiB and 2 MiB huge pages (1 GiB first) and mount hugetlbfs.
    ///
    /// Exit status: 0 = every request met, 3 = the kernel gave fewer pages
    /// than asked (the report says how many, per node), 2 = bad usage (e.g.
    /// no such node), 1 = not root or another error. Without --1g/--2m it
    /// only shows both pools (and mounts).
    Hugepages(HugepagesArgs),
    /// Check whether this host is ready: huge pages, hugetlbfs, userfaultfd,
    /// KVM, the daemon's socket for every tenant uid, and libvirt.
    ///
    /// Each item is PASS, WARN, FAIL or SKIP (could not be checked, and why),
    /// with one line of why and one of what to do. Exit status: 0 = no FAIL,
    /// 1 = at least one FAIL.
    Check(CheckArgs),
    /// Write the man pages and shell completions (for packaging).
    #[command(hide = true)]
    PackageAssets {
        /// Directory for the man pages (section 1).
        #[arg(long, value_name = "DIR")]
        man: std::path::PathBuf,
        /// Directory for the bash, zsh and fish completions.
        #[arg(long, value_name = "DIR")]
        completions: std::path::PathBuf,
    },
}

/// `hugemem check` flags.
#[derive(Debug, clap::Args)]
pub(crate) struct CheckArgs {
    /// The daemon's configuration file (default: /etc/hugemem/hugemem.toml
    /// when it exists, else the built-in defaults).
    #[arg(long, value_name = "FILE")]
    pub(crate) config: Option<std::path::PathBuf>,
    /// Print one JSON object instead of the lines.
    #[arg(long)]
    pub(crate) json: bool,
    /// libvirt's QEMU driver configuration.
    #[arg(long, value_name = "FILE", default_value = hugemem::check::inputs::DEFAULT_QEMU_CONF)]
    pub(crate) qemu_conf: std::path::PathBuf,
    /// The emulator script libvirt domains name.
    #[arg(long, value_name = "FILE", default_value = hugemem::check::inputs::DEFAULT_EMULATOR)]
    pub(crate) emulator: std::path::PathBuf,
    /// The sysfs root to read (another root: a container's, a test's).
    #[arg(long, value_name = "DIR", default_value = "/sys")]
    pub(crate) sys: std::path::PathBuf,
    /// The procfs root to read.
    #[arg(long, value_name = "DIR", default_value = "/proc")]
    pub(crate) proc: std::path::PathBuf,
    /// The device directory (kvm, userfaultfd).
    #[arg(long, value_name = "DIR", default_value = "/dev")]
    pub(crate) dev: std::path::PathBuf,
}

/// The arguments of `hugemem demo` and `hugemem bench`, passed to
/// `hugemem-bench` untouched (`--help` and every flag included).
#[derive(Debug, clap::Args)]
pub(crate) struct ForwardArgs {
    /// `hugemem-bench`'s arguments.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, value_parser = clap::value_parser!(std::ffi::OsString))]
    pub(crate) args: Vec<std::ffi::OsString>,
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
    /// Name the VM and listen for `hugemem update NAME` (live update of the
    /// VMM, QEMU or cloud-hypervisor, under the running guest) on
    /// $XDG_RUNTIME_DIR/hugemem/vm/NAME.sock (/run/hugemem/vm/NAME.sock
    /// without XDG_RUNTIME_DIR).
    #[arg(long, conflicts_with = "control_socket")]
    pub(crate) name: Option<String>,
    /// Listen for `hugemem update` on this socket instead. Its
    /// directory must be writable by no other user, and those above it only
    /// with the sticky bit (like /tmp); a launch refuses others.
    #[arg(long, value_name = "PATH")]
    pub(crate) control_socket: Option<std::path::PathBuf>,
    /// How long each step of a live update may take, in seconds.
    #[arg(long, value_name = "SECS", default_value_t = 60)]
    pub(crate) update_timeout: u64,
    /// The VMM kind when the program name does not say: cloud-hypervisor or qemu.
    #[arg(long, value_parser = parse_vmm_arg)]
    pub(crate) vmm: Option<Vmm>,
    /// Restore the VM parked under NAME (`hugemem park`) on its parked
    /// memory, nothing copied, instead of allocating memory for a new VM
    /// (docs/operations.md, "Parking a VM"). A QEMU VM: after `--` the
    /// QEMU program alone reuses the parked command line; with arguments,
    /// they must name the parked machine, accelerator, CPU, vCPUs and
    /// devices.
    #[arg(long, value_name = "NAME", conflicts_with_all = ["size", "nodes", "node", "hugetlbfs"])]
    pub(crate) restore: Option<String>,
    /// With --restore: the guest runs at once (cloud-hypervisor's postcopy
    /// `receive-migration`); memory parked on demand is read as the guest
    /// asks for it, and in the background.
    #[arg(long, requires = "restore")]
    pub(crate) on_demand: bool,
    /// Start a clone of the VM parked under NAME (its
    /// template, which stays parked, unchanged, for further clones)
    /// instead of allocating memory for a new VM (docs/operations.md,
    /// "Clones").
    #[arg(long, value_name = "NAME", conflicts_with_all = ["size", "nodes", "node", "hugetlbfs", "restore"])]
    pub(crate) clone_of: Option<String>,
    /// With --clone-of: `shared` maps the template privately (copy-on-write:
    /// only the pages the clone writes take memory, from the kernel's free
    /// huge pages); `copy` gives the clone its own pool memory, filled from
    /// the template as the guest runs (cloud-hypervisor's postcopy: each
    /// page when the guest first touches it, the rest in the background;
    /// QEMU's copy is filled before its guest runs).
    #[arg(long, value_name = "MODE", requires = "clone_of", default_value = "copy", value_parser = parse_clone_mode)]
    pub(crate) clone_mode: CloneModeArg,
    /// With --clone-mode copy: fill the clone's memory before its guest
    /// runs, instead of as it runs (for a cloud-hypervisor without
    /// postcopy restores).
    #[arg(long, requires = "clone_of")]
    pub(crate) copy_eager: bool,
    /// The VMM and its arguments, after `--`.
    #[arg(last = true, required = true, value_parser = clap::value_parser!(std::ffi::OsString))]
    pub(crate) command: Vec<std::ffi::OsString>,
}

/// `hugemem update` arguments.
#[derive(Debug, clap::Args)]
pub(crate) struct UpdateArgs {
    /// The VM: the NAME given to `hugemem launch --name`, or the path of its control socket.
    pub(crate) vm: String,
    /// The new VMM binary, QEMU or cloud-hypervisor (default: the one
    /// running now). `--qemu` is the same option.
    #[arg(long = "vmm", visible_alias = "qemu", value_name = "PATH")]
    pub(crate) qemu: Option<std::path::PathBuf>,
    /// How long to wait for the launcher's answer, in seconds.
    #[arg(long, value_name = "SECS", default_value_t = 300)]
    pub(crate) timeout: u64,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub(crate) json: bool,
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

pub(crate) fn parse_nodes_arg(s: &str) -> Result<NodesArg, launch::NodesError> {
    launch::parse_nodes(s).map(NodesArg)
}

/// `--clone-mode`'s value.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CloneModeArg(pub(crate) CloneMode);

pub(crate) fn parse_clone_mode(
    s: &str,
) -> Result<CloneModeArg, hugemem::arg_values::ArgValueError> {
    match s {
        "shared" => Ok(CloneModeArg(CloneMode::Shared)),
        "copy" => Ok(CloneModeArg(CloneMode::Copy)),
        _ => Err(hugemem::arg_values::ArgValueError::CloneMode(s.to_owned())),
    }
}

pub(crate) fn parse_vmm_arg(s: &str) -> Result<Vmm, hugemem::arg_values::ArgValueError> {
    Vmm::parse(s).ok_or_else(|| hugemem::arg_values::ArgValueError::Vmm(s.to_owned()))
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
