//! The trait each VMM's side implements.

use std::ffi::OsString;
use std::path::Path;

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

    /// The VMM's own memory of `size` bytes in pages of `page` (as the
    /// VMM's options spell it), shared (a hugetlb memfd another process
    /// can map, or a migration can hand over), not prefaulted: the memory
    /// of a VMM run without hugemem whose guest RAM the bench reads.
    fn shared_memory_args(&self, size: u64, page: &str) -> Vec<OsString>;

    /// The spinning micro-guest's command line (`elf`), program first,
    /// memory aside: no console, no serial port.
    fn spin_guest_args(&self, program: &OsString, elf: &Path) -> Vec<OsString>;
}

pub(super) fn os(list: &[&str]) -> Vec<OsString> {
    list.iter().map(OsString::from).collect()
}
