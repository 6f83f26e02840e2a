//! What a churn is asked to run: the VMM and the configuration.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use backend::proto::PagePolicy;
use serde::Serialize;

/// Which VMM runs the guests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ChurnVmm {
    /// cloud-hypervisor through `hugemem launch`.
    CloudHypervisor,
    /// QEMU microvm through `hugemem launch`.
    Qemu,
    /// hugemem's own KVM runner, in process.
    Micro,
}

impl ChurnVmm {
    /// Parses `cloud-hypervisor`/`ch`, `qemu` or `micro`.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "cloud-hypervisor" | "ch" => Some(Self::CloudHypervisor),
            "qemu" => Some(Self::Qemu),
            "micro" => Some(Self::Micro),
            _ => None,
        }
    }

    /// The VMM whose adapter builds its command lines; none for the
    /// micro-guest.
    pub fn kind(self) -> Option<hugemem::launch::Vmm> {
        match self {
            Self::CloudHypervisor => Some(hugemem::launch::Vmm::CloudHypervisor),
            Self::Qemu => Some(hugemem::launch::Vmm::Qemu),
            Self::Micro => None,
        }
    }

    /// The name used in `--vmm` and file names.
    pub fn name(self) -> &'static str {
        match self {
            Self::CloudHypervisor => "cloud-hypervisor",
            Self::Qemu => "qemu",
            Self::Micro => "micro",
        }
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct ChurnConfig {
    /// Timed launches per side.
    pub vms: usize,
    /// Guest RAM per launch, a multiple of 2 MiB.
    pub size: u64,
    /// Launches at once.
    pub parallel: usize,
    /// The VMM; `None`: cloud-hypervisor when `cloud_hypervisor` is set, else
    /// QEMU when `qemu` runs, else `micro`.
    pub vmm: Option<ChurnVmm>,
    /// Page policy of the ALLOCs.
    pub page_policy: PagePolicy,
    /// A live daemon's socket; `None`: a private daemon for the run.
    pub socket: Option<PathBuf>,
    /// The `hugemem` binary whose `launch` subcommand runs the VMMs.
    pub launcher: PathBuf,
    /// The cloud-hypervisor binary (the CLI passes `CLOUD_HYPERVISOR`).
    pub cloud_hypervisor: Option<OsString>,
    /// The QEMU binary.
    pub qemu: OsString,
    /// Longest one launch may take.
    pub timeout: Duration,
}
