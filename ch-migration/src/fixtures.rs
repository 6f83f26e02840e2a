//! Snapshots and configurations for tests, here and in the crates that
//! read and write snapshot directories (`hugemem-client`'s saved VMs):
//! built with the `fixtures` feature, which only dev-dependencies turn on.

use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;

use crate::peer::Snapshot;

const MIB: u64 = 1 << 20;

/// A 4 KiB memfd of `len` bytes.
pub fn memfd(len: u64) -> OwnedFd {
    let fd = nix::sys::memfd::memfd_create(c"dir-test", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
        .expect("memfd");
    nix::unistd::ftruncate(&fd, len as i64).expect("size");
    fd
}

/// A migration configuration with these `guest_ram_mappings`.
pub fn config(mappings: &str) -> Vec<u8> {
    format!(r#"{{"vm_config":{{}},"memory_manager_data":{{"guest_ram_mappings":[{mappings}]}}}}"#)
        .into_bytes()
}

/// One `guest_ram_mappings` entry.
pub fn mapping(slot: u32, gpa: u64, size: u64, file_offset: u64) -> String {
    format!(
        r#"{{"slot":{slot},"gpa":{gpa},"size":{size},"zone_id":"z","virtio_mem":false,"file_offset":{file_offset}}}"#
    )
}

/// Two slots, the second at an offset in its fd; a few pages written in
/// each, the rest holes or zero.
pub fn parked() -> Snapshot {
    let (a, b) = (memfd(80 * MIB), memfd(8 * MIB));
    let (fa, fb) = (std::fs::File::from(a), std::fs::File::from(b));
    fa.write_all_at(&[0xAA; 4096], 0).expect("write");
    fa.write_all_at(&[0xBB; 8192], 70 * MIB).expect("write");
    fa.write_all_at(&[0; 4096], 71 * MIB)
        .expect("a zero page, allocated");
    fb.write_all_at(&[0xCC; 4096], 2 * MIB + 4096)
        .expect("write");
    Snapshot {
        memory: vec![(0, fa.into()), (5, fb.into())],
        config: config(&format!(
            "{},{}",
            mapping(0, 0, 80 * MIB, 0),
            mapping(5, 0x1_0000_0000, 4 * MIB, 2 * MIB)
        )),
        state: b"{\"state\":1}".to_vec(),
        paused: false,
    }
}
