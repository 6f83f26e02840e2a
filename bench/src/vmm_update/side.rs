//! The bench's baselines for each VMM: what `bench vmm-update` runs for it
//! besides `hugemem launch` and `hugemem update`, which go through the
//! VMM's adapter (`hugemem::launch::vmm`); picked through the benches'
//! one choice of a VMM's part ([`PerVmm`]).

use std::ffi::OsString;
use std::path::Path;

use guest_mem::{PageSize, Reservation};
use hugemem::launch::Vmm;

use crate::floor::{vmm_argv, FloorMemory};
use crate::vmm_side::PerVmm;

use super::baselines::{copy, floor};
use super::ch::BenchCh;
use super::error::VmmUpdateError;
use super::qemu::BenchQemu;
use super::report::{CopyResult, UpdateSeries, VmmUpdateConfig};
use super::setup::reserve;

/// What a baseline is run with.
pub(crate) struct BaselineRun<'a> {
    /// The run's configuration.
    pub(crate) cfg: &'a VmmUpdateConfig,
    /// The run's private directory (sockets, logs).
    pub(crate) dir: &'a Path,
    /// The spinning guest's kernel.
    pub(crate) elf: &'a Path,
    /// The host's TSC rate, ticks per second.
    pub(crate) tsc_hz: f64,
}

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

/// A floor's VM before it starts: a resident memfd of the guest's size on
/// 2 MiB pages, and the command line `hugemem launch` builds for the
/// spinning guest on it (`/dev/fd/N`, the fd to be inherited), no daemon.
pub(crate) struct FloorVm {
    /// The guest's RAM.
    pub(crate) memory: FloorMemory,
    /// Its whole command line, program first.
    pub(crate) argv: Vec<OsString>,
    /// The memfd's pages, held until after it is gone.
    _pages: Reservation,
}

impl FloorVm {
    /// Makes the memory and the command line for `run`'s VMM.
    ///
    /// # Errors
    ///
    /// [`VmmUpdateError::Setup`] when the guest RAM in 2 MiB pages is not
    /// there, or the VMM's command line cannot carry it.
    pub(crate) fn new(run: &BaselineRun<'_>) -> Result<Self, VmmUpdateError> {
        let cfg = run.cfg;
        let pages = reserve(cfg.size).map_err(VmmUpdateError::Setup)?;
        let (memory, _) = FloorMemory::populated(cfg.size, PageSize::Huge2M)
            .map_err(|e| VmmUpdateError::Setup(format!("the floor's memory: {e}")))?;
        let mut user = crate::vmm_side::of(cfg.vmm).spin_guest_args(&cfg.program, run.elf);
        let program = user.remove(0);
        let argv =
            vmm_argv(cfg.vmm, program, &user, &[memory.region()], &[memory.fd()]).map_err(|e| {
                let vmm = cfg.vmm.adapter().name();
                VmmUpdateError::Setup(format!("the plain {vmm}'s command line: {e}"))
            })?;
        Ok(Self {
            memory,
            argv,
            _pages: pages,
        })
    }
}
