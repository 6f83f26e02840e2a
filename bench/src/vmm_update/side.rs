//! The bench's side of each VMM: what `bench vmm-update` runs for it
//! besides `hugemem launch` and `hugemem update`, which go through the
//! VMM's adapter (`hugemem::launch::vmm`). The one place in this bench
//! that turns a VMM kind into its code.

use std::ffi::OsString;
use std::path::Path;

use hugemem::launch::Vmm;

use super::error::VmmUpdateError;
use super::report::{CopyResult, UpdateSeries, VmmUpdateConfig};
use super::{ch, ch_baselines, copy, plain_update, qemu};

/// What the bench runs for one VMM.
pub(crate) trait VmmSide: Sync {
    /// The guest's command line (program first, no memory options).
    fn guest_args(&self, program: &OsString, elf: &Path) -> Vec<OsString>;

    /// The floor: the same update by plain VMMs on one memfd, no daemon.
    fn floor(
        &self,
        cfg: &VmmUpdateConfig,
        dir: &Path,
        elf: &Path,
        tsc_hz: f64,
        progress: &mut dyn FnMut(&str),
    ) -> Result<UpdateSeries, VmmUpdateError>;

    /// The copying baseline: a migration that copies guest RAM.
    fn copy(
        &self,
        cfg: &VmmUpdateConfig,
        dir: &Path,
        elf: &Path,
        tsc_hz: f64,
        progress: &mut dyn FnMut(&str),
    ) -> Result<CopyResult, VmmUpdateError>;
}

struct QemuSide;
struct ChSide;

/// `vmm`'s side.
pub(crate) fn of(vmm: Vmm) -> &'static dyn VmmSide {
    match vmm {
        Vmm::Qemu => &QemuSide,
        Vmm::CloudHypervisor => &ChSide,
    }
}

impl VmmSide for QemuSide {
    fn guest_args(&self, program: &OsString, elf: &Path) -> Vec<OsString> {
        qemu::guest_args(program, elf)
    }

    fn floor(
        &self,
        cfg: &VmmUpdateConfig,
        dir: &Path,
        elf: &Path,
        tsc_hz: f64,
        progress: &mut dyn FnMut(&str),
    ) -> Result<UpdateSeries, VmmUpdateError> {
        plain_update::run(cfg, dir, elf, tsc_hz, progress)
    }

    fn copy(
        &self,
        cfg: &VmmUpdateConfig,
        dir: &Path,
        elf: &Path,
        tsc_hz: f64,
        progress: &mut dyn FnMut(&str),
    ) -> Result<CopyResult, VmmUpdateError> {
        copy::run(cfg, dir, elf, tsc_hz, progress)
    }
}

impl VmmSide for ChSide {
    fn guest_args(&self, program: &OsString, elf: &Path) -> Vec<OsString> {
        ch::ch_guest_args(program, elf)
    }

    fn floor(
        &self,
        cfg: &VmmUpdateConfig,
        dir: &Path,
        elf: &Path,
        tsc_hz: f64,
        progress: &mut dyn FnMut(&str),
    ) -> Result<UpdateSeries, VmmUpdateError> {
        ch_baselines::floor(cfg, dir, elf, tsc_hz, progress)
    }

    fn copy(
        &self,
        cfg: &VmmUpdateConfig,
        dir: &Path,
        elf: &Path,
        tsc_hz: f64,
        progress: &mut dyn FnMut(&str),
    ) -> Result<CopyResult, VmmUpdateError> {
        ch_baselines::copy(cfg, dir, elf, tsc_hz, progress)
    }
}
