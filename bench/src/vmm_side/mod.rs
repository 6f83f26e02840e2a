//! What the benches run on each VMM besides `hugemem launch` and `hugemem
//! update` (which go through the VMM's adapter, `hugemem::launch::vmm`):
//! the micro-guest's command lines and a VMM's own memory for the
//! baselines, behind [`BenchVmm`]. [`PerVmm::get`] is the one place in the
//! benches that turns a VMM kind into its part; a bench's own part for each
//! VMM (such as `vmm-update`'s baselines) is a [`PerVmm`] of its own.

mod cloud_hypervisor;
mod qemu;

use std::ffi::OsString;
use std::path::Path;

use hugemem::launch::Vmm;

pub use cloud_hypervisor::CloudHypervisor;
pub use qemu::Qemu;

/// One value for each VMM.
#[derive(Debug, Clone, Default)]
pub struct PerVmm<T> {
    /// QEMU's.
    pub qemu: T,
    /// cloud-hypervisor's.
    pub cloud_hypervisor: T,
}

impl<T> PerVmm<T> {
    /// `vmm`'s value.
    pub fn get(&self, vmm: Vmm) -> &T {
        match vmm {
            Vmm::Qemu => &self.qemu,
            Vmm::CloudHypervisor => &self.cloud_hypervisor,
        }
    }
}

static SIDES: PerVmm<&'static dyn BenchVmm> = PerVmm {
    qemu: &Qemu,
    cloud_hypervisor: &CloudHypervisor,
};

/// `vmm`'s side in the benches.
pub fn of(vmm: Vmm) -> &'static dyn BenchVmm {
    *SIDES.get(vmm)
}

/// How the benches run the micro-guest on one VMM.
pub trait BenchVmm: Sync {
    /// The micro-guest as the PVH kernel `elf`, one vCPU, its marks (port
    /// 0x3f0) and its report on stdout, ending the VMM when it ends: the
    /// VMM's arguments, program, machine and memory aside.
    fn guest_args(&self, elf: &Path) -> Vec<OsString>;

    /// The machine the guest runs on, when the memory options do not name
    /// it (QEMU's `-M microvm`).
    fn machine_args(&self) -> Vec<OsString>;

    /// The VMM's own memory of `size` in pages of `page` (both as the
    /// VMM's options spell them), prefaulted by `prefault_threads` threads
    /// when set: a baseline without hugemem. Includes the machine.
    fn own_memory_args(
        &self,
        size: &str,
        page: &str,
        prefault_threads: Option<usize>,
    ) -> Vec<OsString>;

    /// The spinning micro-guest's command line (`elf`), program first,
    /// memory aside: no console, no serial port.
    fn spin_guest_args(&self, program: &OsString, elf: &Path) -> Vec<OsString>;
}

fn os(list: &[&str]) -> Vec<OsString> {
    list.iter().map(OsString::from).collect()
}
