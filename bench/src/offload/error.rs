//! Why `bench offload` failed.

/// Errors of `bench offload`: those of `bench vmm-update`, whose guest,
/// cloud-hypervisor processes and private daemon it shares.
pub type OffloadError = crate::vmm_update::VmmUpdateError;
