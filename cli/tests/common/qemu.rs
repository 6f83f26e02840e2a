//! What the QEMU park and clone tests share: their skip reason, the
//! counting guest's QEMU arguments, guest RAM as a QEMU maps it, and a
//! park through the launcher's control socket.

use std::ffi::OsString;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use test_support::prelude::wait_until;

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");

/// Why the QEMU tests cannot run here, if they cannot.
pub fn skip_reason() -> Option<String> {
    match Command::new("qemu-system-x86_64").arg("--version").output() {
        Ok(o) if o.status.success() => {}
        _ => return Some("qemu-system-x86_64 not installed".into()),
    }
    microguest::kvm_available().err()
}

/// Guest RAM as QEMU `pid` maps it: its `/dev/fd/N` memory file, reopened.
pub fn guest_ram(pid: u32) -> std::fs::File {
    let mut fd = None;
    wait_until("QEMU's command line", Duration::from_secs(30), || {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        fd = String::from_utf8_lossy(&cmdline).split('\0').find_map(|a| {
            a.split(',')
                .find_map(|kv| kv.strip_prefix("mem-path=/dev/fd/"))
                .map(str::to_owned)
        });
        fd.is_some()
    });
    let fd = fd.expect("mem-path=/dev/fd/N on QEMU's command line");
    std::fs::File::open(format!("/proc/{pid}/fd/{fd}")).expect("open QEMU's memory fd")
}

/// The micro-guest's QEMU arguments.
pub fn qemu_args(elf: &Path) -> Vec<OsString> {
    let mut args: Vec<OsString> = [
        "-M",
        "microvm",
        "-accel",
        "kvm",
        "-cpu",
        hugemem::launch::vmm::qemu::KVM_CPU,
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-serial",
        "none",
        "-kernel",
    ]
    .iter()
    .map(OsString::from)
    .collect();
    args.push(elf.into());
    args
}

/// `hugemem park NAME --control-socket PATH`; its stdout.
pub fn park(name: &str, control: &Path) -> String {
    let out = Command::new("timeout")
        .args(["120", HUGEMEM, "park", name, "--control-socket"])
        .arg(control)
        .output()
        .expect("run hugemem park");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "hugemem park failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}
