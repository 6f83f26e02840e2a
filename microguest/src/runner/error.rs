//! Why a run fails: [`Error`], from a configuration refused before any
//! KVM call to a guest whose reports disagree.

use std::time::Duration;

use crate::layout::ConfigError;

/// A run that failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration or the RAM slots were refused before any KVM call.
    #[error("invalid run configuration")]
    Config(#[from] ConfigError),
    /// Opening `/dev/kvm` failed.
    #[error("cannot open /dev/kvm")]
    OpenKvm(#[source] kvm_ioctls::Error),
    /// `KVM_CREATE_VM` failed.
    #[error("cannot create a VM")]
    CreateVm(#[source] kvm_ioctls::Error),
    /// `KVM_GET_SUPPORTED_CPUID` failed.
    #[error("cannot read the supported CPUID")]
    SupportedCpuid(#[source] kvm_ioctls::Error),
    /// Mapping the control slot failed.
    #[error("cannot map the control slot")]
    ControlSlot(#[source] std::io::Error),
    /// `KVM_SET_USER_MEMORY_REGION` failed.
    #[error(
        "cannot register memory slot {slot} at guest-physical {guest_phys:#x} ({len:#x} bytes)"
    )]
    MemorySlot {
        /// KVM slot number (the control slot comes last).
        slot: u32,
        /// Guest-physical address.
        guest_phys: u64,
        /// Length.
        len: u64,
        /// The ioctl error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// `KVM_CREATE_VCPU` failed.
    #[error("cannot create the vCPU")]
    CreateVcpu(#[source] kvm_ioctls::Error),
    /// Setting the vCPU's CPUID or registers failed.
    #[error("cannot set the vCPU's {what}")]
    VcpuSetup {
        /// Which state.
        what: &'static str,
        /// The ioctl error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// Installing the signal that interrupts `KVM_RUN` failed.
    #[error("cannot install the vCPU kick signal")]
    Signal(#[source] std::io::Error),
    /// `KVM_RUN` failed.
    #[error("KVM_RUN failed")]
    Run(#[source] kvm_ioctls::Error),
    /// The guest did not finish within [`RunConfig::timeout`](super::RunConfig::timeout).
    #[error("the guest did not finish within {timeout:?} (stuck {stage})")]
    Timeout {
        /// The configured timeout.
        timeout: Duration,
        /// How far the guest got.
        stage: &'static str,
    },
    /// The vCPU stopped in a way the guest never asks for.
    #[error("the guest stopped unexpectedly ({exit}) at rip {rip:#x}")]
    GuestFault {
        /// The exit, as KVM reported it.
        exit: String,
        /// The guest's instruction pointer afterwards (0 if unreadable).
        rip: u64,
    },
    /// [`run_pvh`](super::run_pvh) was given something that is not a loadable PVH kernel.
    #[error("not a loadable PVH ELF kernel: {0}")]
    Elf(String),
    /// The guest's reports disagree with each other or with the host.
    #[error("inconsistent guest report: {0}")]
    Protocol(String),
}
