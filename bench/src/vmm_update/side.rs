//! The bench's side of each VMM: what `bench vmm-update` runs for it
//! besides `hugemem launch` and `hugemem update`, which go through the
//! VMM's adapter (`hugemem::launch::vmm`); picked through the benches'
//! one choice of a VMM's part ([`PerVmm`]).

use std::path::Path;

use hugemem::launch::Vmm;

use crate::vmm_side::PerVmm;

use super::error::VmmUpdateError;
use super::report::{CopyResult, UpdateSeries, VmmUpdateConfig};
use super::{ch_baselines, copy, plain_update};

/// What the bench runs for one VMM.
pub(crate) trait VmmSide: Sync {
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
    static SIDES: PerVmm<&'static dyn VmmSide> = PerVmm {
        qemu: &QemuSide,
        cloud_hypervisor: &ChSide,
    };
    *SIDES.get(vmm)
}

impl VmmSide for QemuSide {
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
