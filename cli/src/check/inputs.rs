//! What `hugemem check` looks at: the daemon's configuration and where the
//! host's files are. Every path can be pointed elsewhere (a container's
//! root, a test's fake tree); the defaults are the host's.

use std::path::PathBuf;

use backend::daemon::Config;

use super::cloud_hypervisor::{self, Found};

/// Where the packaged configuration lives (the unit's `--config`).
pub const DEFAULT_CONFIG: &str = "/etc/hugemem/hugemem.toml";
/// Where the package installs the libvirt emulator script.
pub const DEFAULT_EMULATOR: &str = "/usr/bin/hugemem-qemu";
/// libvirt's QEMU driver configuration.
pub const DEFAULT_QEMU_CONF: &str = "/etc/libvirt/qemu.conf";
/// The user Debian's libvirt runs QEMU as when `qemu.conf` names none.
pub const DEBIAN_QEMU_USER: &str = "libvirt-qemu";
/// The group Debian's libvirt runs QEMU as when `qemu.conf` names none.
pub const DEBIAN_QEMU_GROUP: &str = "libvirt-qemu";

/// Everything the checks read.
#[derive(Debug, Clone)]
pub struct CheckInputs {
    /// The daemon's configuration (as `hugemem serve --config` loads it).
    pub config: Config,
    /// The file it came from; `None`: the built-in defaults.
    pub config_path: Option<PathBuf>,
    /// The sysfs root (`/sys`).
    pub sys: PathBuf,
    /// The procfs root (`/proc`).
    pub proc: PathBuf,
    /// The `/dev` directory (`kvm`, `userfaultfd`).
    pub dev: PathBuf,
    /// libvirt's `qemu.conf`.
    pub qemu_conf: PathBuf,
    /// The emulator script a libvirt domain names.
    pub emulator: PathBuf,
    /// This `hugemem` executable (run as each tenant uid for the socket probe).
    pub exe: PathBuf,
    /// The effective uid `hugemem check` runs as.
    pub euid: u32,
    /// The cloud-hypervisor to check (`CLOUD_HYPERVISOR`, else `PATH`);
    /// `None`: there is none.
    pub cloud_hypervisor: Option<Found>,
}

impl CheckInputs {
    /// The host's paths with `config` (from `config_path`).
    pub fn host(config: Config, config_path: Option<PathBuf>) -> Self {
        Self {
            config,
            config_path,
            sys: PathBuf::from("/sys"),
            proc: PathBuf::from("/proc"),
            dev: PathBuf::from("/dev"),
            qemu_conf: PathBuf::from(DEFAULT_QEMU_CONF),
            emulator: PathBuf::from(DEFAULT_EMULATOR),
            exe: std::env::current_exe().unwrap_or_else(|_| PathBuf::from("/usr/bin/hugemem")),
            euid: nix::unistd::geteuid().as_raw(),
            cloud_hypervisor: cloud_hypervisor::find(
                std::env::var_os("CLOUD_HYPERVISOR"),
                std::env::var_os("PATH"),
            ),
        }
    }

    /// Whether the check runs as root (probes as other uids need it).
    pub fn is_root(&self) -> bool {
        self.euid == 0
    }
}
