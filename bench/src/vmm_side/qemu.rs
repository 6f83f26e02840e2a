//! QEMU in the benches: `microvm`, `isa-debug-exit`, `-kernel`.

use std::ffi::OsString;
use std::path::Path;

use hugemem::launch::vmm::qemu::KVM_CPU;

use super::bench_vmm::{os, BenchVmm};

/// QEMU's side.
pub struct Qemu;

impl BenchVmm for Qemu {
    fn guest_args(&self, elf: &Path) -> Vec<OsString> {
        let mut v = os(&[
            "-accel",
            "kvm",
            "-cpu",
            KVM_CPU,
            "-nodefaults",
            "-no-user-config",
            "-nographic",
            "-no-reboot",
            "-serial",
            "stdio",
            "-device",
            "isa-debug-exit",
            // The guest's marks on port 0x3f0 (first instruction, all RAM
            // touched) come on stdout, timed as they arrive.
            "-chardev",
            "file,id=hmmarks,path=/dev/stdout",
            "-device",
            "isa-debugcon,iobase=0x3f0,chardev=hmmarks",
            "-kernel",
        ]);
        v.push(elf.into());
        v
    }

    fn machine_args(&self) -> Vec<OsString> {
        os(&["-M", "microvm"])
    }

    fn own_memory_args(
        &self,
        size: &str,
        page: &str,
        prefault_threads: Option<usize>,
    ) -> Vec<OsString> {
        let prealloc = prefault_threads
            .map(|n| format!(",prealloc=on,prealloc-threads={n}"))
            .unwrap_or_default();
        vec![
            "-object".into(),
            format!(
                "memory-backend-memfd,id=ram0,size={size},hugetlb=on,hugetlbsize={page}{prealloc}"
            )
            .into(),
            "-m".into(),
            size.into(),
            "-M".into(),
            "microvm,memory-backend=ram0".into(),
        ]
    }

    fn shared_memory_args(&self, size: u64, page: &str) -> Vec<OsString> {
        vec![
            "-object".into(),
            format!(
                "memory-backend-memfd,id=ram0,size={size},hugetlb=on,hugetlbsize={page},share=on"
            )
            .into(),
            "-m".into(),
            format!("{}", size >> 20).into(),
            "-machine".into(),
            "memory-backend=ram0".into(),
        ]
    }

    fn spin_guest_args(&self, program: &OsString, elf: &Path) -> Vec<OsString> {
        let mut args = vec![program.clone()];
        args.extend(os(&[
            "-M",
            "microvm",
            "-accel",
            "kvm",
            "-cpu",
            KVM_CPU,
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-serial",
            "none",
            "-kernel",
        ]));
        args.push(elf.into());
        args
    }
}
