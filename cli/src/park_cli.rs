//! `hugemem park NAME --api-socket PATH` and `hugemem unpark NAME`: a VM
//! parked in the daemon (its memory, configuration and state kept under a
//! name while no process runs it), and dropped.
//!
//! The park is the VM's adapter's (`launch/vmm/`): a cloud-hypervisor's,
//! whose API socket `--api-socket` names
//! (`launch/vmm/cloud_hypervisor/park.rs`: its own offload snapshot, sent
//! to the daemon), or a launched QEMU's, which its launcher parks when
//! asked on its control socket (`launch/vmm/qemu/park.rs`).

use std::path::Path;
use std::time::Duration;

use hugemem_client::client::{Client, ClientError};
use hugemem_client::park::Parked;

use crate::launch::vmm::ParkError;
use crate::launch::{ControlError, ParkReport, Vmm};

/// Parks the VM of the cloud-hypervisor whose API is at `api_socket`
/// under `name` in the daemon at `socket`.
///
/// # Errors
///
/// [`ParkError`]; when the daemon refused, the VM keeps running in its
/// cloud-hypervisor (it answered the last step with an error).
pub fn park(
    socket: &Path,
    name: &str,
    api_socket: &Path,
    timeout: Duration,
) -> Result<Parked, ParkError> {
    // An API socket is cloud-hypervisor's: the one VMM that parks today.
    Vmm::CloudHypervisor
        .adapter()
        .park(socket, name, api_socket, timeout)
}

/// Parks the VM of the launch (a QEMU) whose control socket is `control`
/// under `name`, in the launch's daemon.
///
/// # Errors
///
/// [`ControlError`]; when the park failed, the VM runs on in its QEMU.
pub fn park_launched(
    control: &Path,
    name: &str,
    timeout: Duration,
) -> Result<ParkReport, ControlError> {
    crate::launch::request_park(control, name, timeout)
}

/// Drops the VM parked under `name`.
///
/// # Errors
///
/// The daemon's refusal (no such VM).
pub fn unpark(socket: &Path, name: &str) -> Result<(), ClientError> {
    Client::connect(socket)?.unpark(name)
}
