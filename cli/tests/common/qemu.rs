//! What the QEMU park tests share: the counting micro-guest in QEMU
//! launched, parked and restored through the real `hugemem` binary, its
//! RAM as QEMU maps it, and the check of its pages.

use std::ffi::OsString;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

use microguest::pattern;
use test_support::prelude::{wait_until, TestDaemon};

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");
/// The guest's RAM.
pub const RAM: u64 = 256 << 20;
/// Its marker.
pub const MARKER: u64 = 0x5041_524b_5145_0000;
/// Where it starts writing.
pub const START_GPA: u64 = 1 << 20;
/// Its stride (one write per 2 MiB page).
pub const STRIDE: u64 = 2 << 20;

/// Why the QEMU tests cannot run here, if they cannot.
pub fn skip_reason() -> Option<String> {
    match Command::new("qemu-system-x86_64").arg("--version").output() {
        Ok(o) if o.status.success() => {}
        _ => return Some("qemu-system-x86_64 not installed".into()),
    }
    microguest::kvm_available().err()
}

/// What a QEMU test starts from; the fields drop in this order, the
/// machine's lock last.
pub struct Setup {
    pub dir: tempfile::TempDir,
    /// The counting guest (`microguest::spin`) in `dir`.
    pub elf: std::path::PathBuf,
    /// The launcher's control socket, `vm.sock` in `dir`.
    pub control: std::path::PathBuf,
    _pages: guest_mem::Reservation,
    _serial: std::sync::MutexGuard<'static, ()>,
}

/// The machine's lock, QEMU and KVM checked, `pages` 2 MiB pages held, a
/// private directory with the counting guest; `None` after a skip.
pub fn set_up(pages: u64) -> Option<Setup> {
    let serial = test_support::prelude::serial();
    if let Some(reason) = skip_reason() {
        test_support::skip!("{reason}");
        return None;
    }
    let held = match test_support::hugepages::hold(guest_mem::PageSize::Huge2M, pages) {
        Ok(r) => r,
        Err(why) => {
            test_support::skip!("{why}");
            return None;
        }
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let elf = super::spin_elf(dir.path(), STRIDE, START_GPA, MARKER);
    let control = dir.path().join("vm.sock");
    Some(Setup {
        dir,
        elf,
        control,
        _pages: held,
        _serial: serial,
    })
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

/// `hugemem launch` with a control socket, a fresh VM (`restore`: None) or
/// the parked one (with `args`, or the parked ones when empty).
pub fn launch(
    daemon: &TestDaemon,
    control: &Path,
    restore: Option<&str>,
    args: &[OsString],
) -> Child {
    let mut c = Command::new("timeout");
    c.args(["600", HUGEMEM, "launch", "--socket"])
        .arg(daemon.socket())
        .arg("--control-socket")
        .arg(control);
    match restore {
        Some(name) => c.args(["--restore", name]),
        None => c.args(["--size", "256M", "--page-size", "2M"]),
    };
    c.arg("--")
        .arg("qemu-system-x86_64")
        .args(args)
        .spawn()
        .expect("spawn hugemem launch")
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

/// Every page the guest wrote holds its pattern.
pub fn assert_pages_kept(ram: &std::fs::File, when: &str) {
    let mut word = [0u8; 8];
    let mut gpa = START_GPA.next_multiple_of(STRIDE);
    while gpa + 8 <= RAM {
        ram.read_exact_at(&mut word, gpa).expect("read guest RAM");
        assert_eq!(
            u64::from_le_bytes(word),
            pattern(MARKER, gpa),
            "{when}: page {gpa:#x} lost the guest's write"
        );
        gpa += STRIDE;
    }
}
