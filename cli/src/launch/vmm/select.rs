//! The one place that turns a VMM kind into its adapter.

use std::fmt;

use super::adapter::VmmAdapter;
use super::cloud_hypervisor::CloudHypervisor;
use super::qemu::Qemu;
use crate::launch::command_line::Vmm;

impl Vmm {
    /// This VMM's adapter.
    pub fn adapter(self) -> &'static dyn VmmAdapter {
        match self {
            Self::CloudHypervisor => &CloudHypervisor,
            Self::Qemu => &Qemu,
        }
    }

    /// Of two values kept per VMM (a bench's own command lines, say), this
    /// VMM's: so that code outside the adapters keeps values per VMM
    /// without matching on the kind itself.
    pub fn pick<T>(self, qemu: T, cloud_hypervisor: T) -> T {
        match self {
            Self::CloudHypervisor => cloud_hypervisor,
            Self::Qemu => qemu,
        }
    }
}

impl fmt::Display for Vmm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.adapter().name())
    }
}

/// The adapter whose [`name`](VmmAdapter::name) is `name` (an update
/// report's `vmm`).
pub fn by_name(name: &str) -> Option<&'static dyn VmmAdapter> {
    Vmm::ALL
        .into_iter()
        .map(Vmm::adapter)
        .find(|a| a.name() == name)
}
