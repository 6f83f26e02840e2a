//! What the benches run on each VMM besides `hugemem launch` and `hugemem
//! update` (which go through the VMM's adapter, `hugemem::launch::vmm`):
//! the micro-guest's command lines and a VMM's own memory for the
//! baselines, behind `BenchVmm`. `PerVmm::get` (through `Vmm::pick`) is the one place in the
//! benches that turns a VMM kind into its part; a bench's own part for each
//! VMM (such as `vmm-update`'s baselines) is a `PerVmm` of its own.

mod bench_vmm;
mod cloud_hypervisor;
mod qemu;

use hugemem::launch::Vmm;

pub use bench_vmm::BenchVmm;
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
        vmm.pick(&self.qemu, &self.cloud_hypervisor)
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
