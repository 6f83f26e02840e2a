//! The one raw call of `hugemem check`: KVM's API version ioctl.

use std::os::fd::AsRawFd;

/// `KVM_GET_API_VERSION`, `_IO(KVMIO, 0x00)` (linux/kvm.h).
const KVM_GET_API_VERSION: libc::c_ulong = 0xAE00;

/// The API version `/dev/kvm` (opened as `kvm`) reports; 12 on every Linux
/// since 2.6.22.
pub fn kvm_api_version(kvm: &std::fs::File) -> std::io::Result<i32> {
    // SAFETY: KVM_GET_API_VERSION takes no argument and only returns an int;
    // the fd is open for the duration of the call (borrowed from `kvm`).
    let r = unsafe { libc::ioctl(kvm.as_raw_fd(), KVM_GET_API_VERSION, 0) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(r)
}
