//! What the QEMU park tests share: the counting micro-guest in QEMU
//! launched, parked and restored through the real `hugemem` binary, its
//! RAM as QEMU maps it, and the check of its pages.

use std::ffi::{OsStr, OsString};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

use microguest::pattern;
use test_support::prelude::{wait_until, TestDaemon};

use super::assert_balanced;
use super::park::run_ok;

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");
/// The guest's RAM.
pub const RAM: u64 = 256 << 20;
/// Its marker.
pub const MARKER: u64 = 0x5041_524b_5145_0000;
/// Where it starts writing.
pub const START_GPA: u64 = 1 << 20;
/// Its stride (one write per 2 MiB page).
pub const STRIDE: u64 = 2 << 20;
/// How long the daemon may take to settle after a request.
const SETTLE: Duration = Duration::from_secs(60);

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
    qemu_args_on("microvm", elf)
}

/// The micro-guest's QEMU arguments on machine `machine`.
pub fn qemu_args_on(machine: &str, elf: &Path) -> Vec<OsString> {
    let mut args: Vec<OsString> = [
        "-M",
        machine,
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

/// The names in `dir`, sorted.
pub fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .expect("read_dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// A copy of the save `from` at `to`, holes kept.
pub fn copy_save(from: &Path, to: &Path) {
    let ok = Command::new("cp")
        .args(["-r", "--sparse=always"])
        .arg(from)
        .arg(to)
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "cp -r {} {}", from.display(), to.display());
}

/// `hugemem park NAME --from-dir DIR` that must fail; its stderr, once
/// the daemon holds nothing.
pub fn load_refused(daemon: &TestDaemon, dir: &Path) -> String {
    let out = Command::new("timeout")
        .args(["120", HUGEMEM, "park", "bad", "--from-dir"])
        .arg(dir)
        .arg("--socket")
        .arg(daemon.socket())
        .output()
        .expect("run hugemem park --from-dir");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{}: {stderr}", dir.display());
    let s = daemon.wait_stats(SETTLE, "nothing parked or held", |s| {
        s.parked.is_empty() && s.allocations.active == 0
    });
    assert_balanced(&s, &format!("after loading {}", dir.display()));
    eprintln!("refused: {stderr}");
    stderr
}

/// `hugemem park NAME --from-dir DIR [--on-demand]`; its stdout.
pub fn load(daemon: &TestDaemon, name: &str, dir: &Path, on_demand: bool) -> String {
    let socket = daemon.socket();
    let mut args: Vec<&OsStr> = vec![
        "park".as_ref(),
        name.as_ref(),
        "--from-dir".as_ref(),
        dir.as_os_str(),
        "--socket".as_ref(),
        socket.as_os_str(),
    ];
    if on_demand {
        args.push("--on-demand".as_ref());
    }
    let said = run_ok(&args);
    assert!(said.contains("checked against its manifest"), "{said}");
    said
}

/// The QEMU that `launcher` runs the VM in (not a QEMU it only asked for
/// its options): its child with guest memory on its command line.
pub fn qemu_of(launcher: u32) -> u32 {
    let mut found = None;
    wait_until("the launcher's QEMU", Duration::from_secs(30), || {
        let children =
            std::fs::read_to_string(format!("/proc/{launcher}/task/{launcher}/children"))
                .unwrap_or_default();
        found = children.split_whitespace().find_map(|p| {
            let pid = p.parse::<u32>().ok()?;
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            String::from_utf8_lossy(&cmdline)
                .contains("mem-path=")
                .then_some(pid)
        });
        found.is_some()
    });
    found.expect("a QEMU")
}
