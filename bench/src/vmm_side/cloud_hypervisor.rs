//! cloud-hypervisor in the benches: `--kernel`, its debug console, ACPI
//! power-off.

use std::ffi::OsString;
use std::path::Path;

use super::bench_vmm::{os, BenchVmm};

/// cloud-hypervisor's side.
pub struct CloudHypervisor;

impl BenchVmm for CloudHypervisor {
    fn guest_args(&self, elf: &Path) -> Vec<OsString> {
        let mut v = os(&[
            "--cpus",
            "boot=1",
            "--serial",
            "tty",
            "--console",
            "off",
            "--debug-console",
            "file=/dev/stdout,iobase=0x3f0",
            "--kernel",
        ]);
        v.push(elf.into());
        v
    }

    fn machine_args(&self) -> Vec<OsString> {
        Vec::new()
    }

    fn own_memory_args(
        &self,
        size: &str,
        page: &str,
        prefault_threads: Option<usize>,
    ) -> Vec<OsString> {
        let prefault = if prefault_threads.is_some() {
            "on"
        } else {
            "off"
        };
        vec![
            "--memory".into(),
            format!("size={size},hugepages=on,hugepage_size={page},prefault={prefault}").into(),
        ]
    }

    fn shared_memory_args(&self, size: u64, page: &str) -> Vec<OsString> {
        vec![
            "--memory".into(),
            format!("size={size},shared=on,hugepages=on,hugepage_size={page}").into(),
        ]
    }

    fn spin_guest_args(&self, program: &OsString, elf: &Path) -> Vec<OsString> {
        let mut args = vec![program.clone(), "--kernel".into(), elf.into()];
        args.extend(os(&[
            "--cpus",
            "boot=1",
            "--serial",
            "null",
            "--console",
            "off",
        ]));
        args
    }
}
