//! What a churn is asked to run: the VMM and the configuration.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use backend::proto::PagePolicy;
use hugemem::launch::Vmm;
use serde::Serialize;

/// Which VMM runs the guests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChurnVmm {
    /// A VMM through `hugemem launch`.
    Launched(Vmm),
    /// hugemem's own KVM runner, in process.
    Micro,
}

impl ChurnVmm {
    /// Parses a VMM's `--vmm` name (`cloud-hypervisor`/`ch`, `qemu`) or
    /// `micro`.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "micro" => Some(Self::Micro),
            _ => Vmm::parse(text).map(Self::Launched),
        }
    }

    /// The VMM whose adapter builds its command lines; none for the
    /// micro-guest.
    pub fn kind(self) -> Option<Vmm> {
        match self {
            Self::Launched(vmm) => Some(vmm),
            Self::Micro => None,
        }
    }

    /// The name used in `--vmm` and file names.
    pub fn name(self) -> &'static str {
        self.kind().map_or("micro", |vmm| vmm.adapter().id())
    }
}

impl Serialize for ChurnVmm {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
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
