//! The bench's baselines for each VMM: what `bench vmm-update` runs for it
//! besides `hugemem launch` and `hugemem update`, which go through the
//! VMM's adapter (`hugemem::launch::vmm`); picked through the benches'
//! one choice of a VMM's part ([`PerVmm`]).

use hugemem::launch::Vmm;

use crate::vmm_side::PerVmm;

use super::baselines::{copy, floor, BaselineRun};
use super::ch::BenchCh;
use super::error::VmmUpdateError;
use super::qemu::BenchQemu;
use super::report::{CopyResult, UpdateSeries};

/// A baseline: progress lines go to the second argument.
type Baseline<T> = fn(&BaselineRun<'_>, &mut dyn FnMut(&str)) -> Result<T, VmmUpdateError>;

/// What the bench runs for one VMM.
pub(crate) struct Baselines {
    /// The floor: the same update by plain VMMs on one memfd, no daemon.
    pub(crate) floor: Baseline<UpdateSeries>,
    /// The copying baseline: a migration that copies guest RAM.
    pub(crate) copy: Baseline<CopyResult>,
}

/// `vmm`'s baselines.
pub(crate) fn of(vmm: Vmm) -> &'static Baselines {
    static BASELINES: PerVmm<Baselines> = PerVmm {
        qemu: Baselines {
            floor: floor::<BenchQemu>,
            copy: copy::<BenchQemu>,
        },
        cloud_hypervisor: Baselines {
            floor: floor::<BenchCh>,
            copy: copy::<BenchCh>,
        },
    };
    BASELINES.get(vmm)
}
