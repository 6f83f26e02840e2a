//! What a QEMU of 8.2 or later does that Debian 12's QEMU 7.2 cannot:
//! with real QEMU from Debian's bookworm-backports
//! (`scripts/fetch-qemu-backports`, found through
//! `test_support::qemu_backport`), run by a user who is not root.
//!
//! * The counting micro-guest (`microguest::spin`), launched and parked by
//!   uid 65534 under that QEMU, is the template.
//! * A shared clone of it, run by the same uid, counts on: its QEMU got
//!   `readonly=on,rom=off` (the launcher asked QEMU for `rom`), so it
//!   opened the template's memory read-only (every fd it holds on the
//!   file is `O_RDONLY` in `/proc/PID/fdinfo`) and maps it privately
//!   (`rw-p`). The guest writes its own copy (smaps `Private_Hugetlb`,
//!   its counter past the template's), and the template's bytes do not
//!   change, while the clone runs nor after.
//! * The template is then restored under the same QEMU and counts on, then
//!   parked and restored once more: the launcher's QEMU handling
//!   (migration capabilities, `x-ignore-shared`, `-incoming defer`) on
//!   this QEMU.
//!
//! * A VM moves between the system's QEMU (7.2 on Debian 12) and the
//!   newer one, by live update and by park and restore, both ways, where
//!   its machine type is versioned; on microvm, whose firmware differs
//!   between Debian's two QEMUs, a refused restore leaves the VM parked.
//!
//! Skipped (through the skip helper) without the fetched QEMU, a usable
//! `/dev/kvm`, root (to run as uid 65534) or 384 free 2 MiB pages.
//! Deadlines only: `timeout` around every command, `wait_until` around
//! every wait.

mod common;

use std::ffi::OsString;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

use guest_mem::PageSize;
use test_support::hugepages::hold;
use test_support::prelude::{serial, TestDaemon};
use test_support::tenant::NOBODY;

use common::park::{
    clone_spin_state, digest, guest_ram_mapping, private_hugetlb, stop, stop_and_settle, MARKER,
    RAM, START_GPA, STRIDE,
};
use common::qemu::{guest_ram, qemu_args, qemu_of, skip_reason};
use common::{child_of, counting_past, spin_elf, spin_state, StopLauncher};

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");

/// `hugemem ARGS` as uid 65534, with `/dev/kvm`'s group, in `/`.
fn as_tenant(kvm_gid: u32, args: &[OsString]) -> Command {
    let mut c = Command::new("timeout");
    c.arg("600")
        .arg(HUGEMEM)
        .args(args)
        .current_dir("/")
        .uid(NOBODY)
        .gid(kvm_gid);
    c
}

/// The tenant's `hugemem launch --socket S ARGS -- QEMU QEMU_ARGS`, its
/// stderr to `log`.
fn launch(
    (daemon, kvm_gid): (&TestDaemon, u32),
    how: &[&str],
    qemu: &Path,
    args: &[OsString],
    log: &Path,
) -> Child {
    let mut all: Vec<OsString> = vec!["launch".into(), "--socket".into()];
    all.push(daemon.socket().into());
    all.extend(how.iter().map(OsString::from));
    all.push("--".into());
    all.push(qemu.into());
    all.extend(args.iter().cloned());
    as_tenant(kvm_gid, &all)
        .stderr(std::fs::File::create(log).expect("a log file"))
        .spawn()
        .expect("spawn hugemem launch as uid 65534")
}

/// The tenant's `hugemem park NAME --control-socket PATH`; its stdout.
fn park(kvm_gid: u32, name: &str, control: &Path) -> String {
    let args: Vec<OsString> = vec![
        "park".into(),
        name.into(),
        "--control-socket".into(),
        control.into(),
    ];
    let out = as_tenant(kvm_gid, &args)
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

/// Every fd of process `pid` on the file `ram` is: its number and its
/// open flags (`flags:` of `/proc/PID/fdinfo/N`, octal).
fn fds_on(pid: u32, ram: &std::fs::File) -> Vec<(u32, u32)> {
    let file = ram.metadata().expect("fstat the template");
    let mut found = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd")).expect("QEMU's fds") {
        let entry = entry.expect("an fd");
        let Ok(fd) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let same = std::fs::metadata(entry.path())
            .is_ok_and(|m| (m.dev(), m.ino()) == (file.dev(), file.ino()));
        if !same {
            continue;
        }
        let info = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}")).unwrap_or_default();
        let flags = info
            .lines()
            .find_map(|l| l.strip_prefix("flags:"))
            .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
            .expect("flags: in fdinfo");
        found.push((fd, flags));
    }
    found
}

/// The fd number of `mem-path=/dev/fd/N` on QEMU `pid`'s command line.
fn mem_path_fd(pid: u32) -> u32 {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).expect("QEMU's command line");
    String::from_utf8_lossy(&cmdline)
        .split('\0')
        .find_map(|a| {
            a.split(',')
                .find_map(|kv| kv.strip_prefix("mem-path=/dev/fd/"))
                .and_then(|n| n.parse().ok())
        })
        .expect("mem-path=/dev/fd/N on QEMU's command line")
}

/// Waits until the clone in QEMU `qemu` counts past `past` and saw no page
/// changed; its launcher's `log` is shown when it does not.
fn clone_counts_on(qemu: u32, past: u64, log: &Path) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let s = loop {
        if let Some(s) = clone_spin_state(qemu).filter(|s| s.spinning && s.count > past + 10) {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the clone did not count on past {past} within 60 s (its state: {:?}); its launcher said:\n{}",
            clone_spin_state(qemu),
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(
        s.bad, 0,
        "the clone found a page changed at {:#x}",
        s.bad_gpa
    );
    eprintln!("shared clone: counts on ({} from {past})", s.count);
}

/// `/dev/kvm`'s group, when that group may open it for writing.
fn kvm_group() -> Option<u32> {
    let kvm = std::fs::metadata("/dev/kvm").ok()?;
    (kvm.permissions().mode() & 0o060 == 0o060).then(|| kvm.gid())
}

#[test]
fn a_non_root_shared_clone_under_qemu_8_2_opens_its_template_read_only_and_leaves_it_unchanged() {
    let _serial = serial();
    if let Some(reason) = skip_reason() {
        test_support::skip!("{reason}");
        return;
    }
    let Some(qemu_new) = test_support::qemu_backport::qemu_or_skip() else {
        return;
    };
    if !test_support::tenant::root_or_skip() {
        return;
    }
    let Some(kvm_gid) = kvm_group() else {
        test_support::skip!("/dev/kvm is not open to its group (a non-root QEMU needs it)");
        return;
    };
    // The template, the clone's reservation (a private mapping reserves
    // all of it) and the restored template's slack.
    let _pages = match hold(PageSize::Huge2M, 3 * RAM / STRIDE) {
        Ok(r) => r,
        Err(why) => {
            test_support::skip!("{why}");
            return;
        }
    };
    let version = Command::new(qemu_new)
        .arg("--version")
        .output()
        .expect("the newer QEMU's --version");
    eprintln!(
        "QEMU: {}",
        String::from_utf8_lossy(&version.stdout)
            .lines()
            .next()
            .unwrap_or_default()
    );
    // The tenant's directory: the guest image and the control socket.
    let dir = tempfile::tempdir().expect("tempdir");
    std::os::unix::fs::chown(dir.path(), Some(NOBODY), Some(NOBODY)).expect("chown the tempdir");
    let elf = spin_elf(dir.path(), STRIDE, START_GPA, MARKER);
    std::fs::set_permissions(&elf, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let daemon = TestDaemon::start(|c| {
        c.pool.recheck_ms = 20;
        c.allowed_uids = vec![0, NOBODY];
    });
    for (path, mode) in [(daemon.dir(), 0o755), (daemon.socket().as_path(), 0o777)] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }
    let tenant = (&daemon, kvm_gid);
    let args = qemu_args(&elf);
    let control = dir.path().join("template.sock");
    let control_arg = control.to_string_lossy().into_owned();
    let with_control = ["--control-socket", control_arg.as_str()];
    let log = |name: &str| dir.path().join(format!("{name}.log"));

    let new = [&with_control[..], &["--size", "256M", "--page-size", "2M"]].concat();
    let mut template = launch(tenant, &new, qemu_new, &args, &log("template"));
    let launcher = child_of(template.id());
    let _guard = StopLauncher(launcher);
    let ram = guest_ram(child_of(launcher));
    counting_past(&ram, 0, "the template's guest to spin");
    let said = park(kvm_gid, "template", &control);
    assert!(said.contains("(0 bytes copied by the daemon"), "{said}");
    assert!(template.wait().expect("the launcher ends").success());
    let parked = spin_state(&ram);
    let before = digest(&ram);

    // A shared clone, by the same uid, on the parked command line.
    let shared = ["--clone-of", "template", "--clone-mode", "shared"];
    let mut clone = launch(tenant, &shared, qemu_new, &[], &log("clone"));
    let clone_launcher = child_of(clone.id());
    let _clone_guard = StopLauncher(clone_launcher);
    let qemu = qemu_of(clone_launcher);
    clone_counts_on(qemu, parked.count, &log("clone"));
    let status = std::fs::read_to_string(format!("/proc/{qemu}/status")).expect("QEMU's status");
    let uid = status.lines().find_map(|l| l.strip_prefix("Uid:"));
    let uids: Vec<u32> = uid
        .expect("Uid: in status")
        .split_whitespace()
        .filter_map(|u| u.parse().ok())
        .collect();
    assert_eq!(uids, [NOBODY; 4], "the clone's QEMU's uids");
    let cmdline = String::from_utf8_lossy(
        &std::fs::read(format!("/proc/{qemu}/cmdline")).expect("the clone's command line"),
    )
    .replace('\0', " ");
    assert!(
        cmdline.contains("share=off,readonly=on,rom=off"),
        "{cmdline}"
    );
    let (_, perms) = guest_ram_mapping(qemu).expect("the clone's guest RAM");
    assert_eq!(perms, "rw-p", "the clone's guest RAM mapping");
    // QEMU opened the template itself (an fd besides the inherited one),
    // read-only, as every fd it holds on it.
    let fds = fds_on(qemu, &ram);
    let inherited = mem_path_fd(qemu);
    assert!(
        fds.iter().any(|&(fd, _)| fd != inherited),
        "QEMU holds no fd of its own on the template: {fds:?} (inherited {inherited})"
    );
    for &(fd, flags) in &fds {
        let mode = flags & libc::O_ACCMODE as u32;
        assert_eq!(
            mode,
            libc::O_RDONLY as u32,
            "fd {fd} on the template: flags {flags:o}"
        );
    }
    let shown: Vec<String> = fds
        .iter()
        .map(|(fd, f)| format!("fd {fd}: {f:o}"))
        .collect();
    eprintln!("shared clone's fds on the template (octal flags): {shown:?}");
    let wrote = private_hugetlb(qemu);
    assert!(
        wrote > 0 && wrote < RAM / 4,
        "the clone wrote {wrote} bytes privately"
    );
    eprintln!("shared clone: wrote {} KiB of huge pages", wrote >> 10);
    assert_eq!(
        spin_state(&ram).count,
        parked.count,
        "the template's counter moved"
    );
    assert_eq!(digest(&ram), before, "the template changed under its clone");
    stop(clone_launcher, &mut clone);
    let said = std::fs::read_to_string(log("clone")).unwrap_or_default();
    assert!(said.contains("mapped from its template (shared"), "{said}");
    daemon.wait_stats(Duration::from_secs(30), "the clone's end counted", |s| {
        s.parked.first().is_some_and(|p| p.shared_clones == 0)
    });
    assert_eq!(digest(&ram), before, "the template changed");

    // The template restored under this QEMU, parked and restored again.
    let restore = [&with_control[..], &["--restore", "template"]].concat();
    let mut past = parked.count;
    for round in 0..2 {
        let name = format!("restore{round}");
        let mut restored = launch(tenant, &restore, qemu_new, &[], &log(&name));
        let launcher = child_of(restored.id());
        let guard = StopLauncher(launcher);
        let s = counting_past(&ram, past + 10, "the restored template to count on");
        assert_eq!(s.bad, 0, "the restored template found a page changed");
        eprintln!(
            "round {round}: restored, counts on ({} from {past})",
            s.count
        );
        if round == 0 {
            let said = park(kvm_gid, "template", &control);
            assert!(said.contains("(0 bytes copied by the daemon"), "{said}");
            assert!(restored.wait().expect("the launcher ends").success());
            past = spin_state(&ram).count;
            drop(guard);
        } else {
            let stats = stop_and_settle(&daemon, launcher, &mut restored);
            assert!(stats.parked.is_empty(), "{stats}");
        }
    }
    drop(ram);
    daemon.shutdown();
}

/// `hugemem ARGS` as root; its exit status and stderr.
fn hugemem(args: &[OsString]) -> (bool, String) {
    let out = Command::new("timeout")
        .arg("300")
        .arg(HUGEMEM)
        .args(args)
        .output()
        .expect("run hugemem");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

/// `hugemem launch --socket S --control-socket C HOW -- PROGRAM ARGS` as root.
fn launch_as_root(
    daemon: &TestDaemon,
    control: &Path,
    how: &[&str],
    program: &Path,
    args: &[OsString],
    log: &Path,
) -> Child {
    Command::new("timeout")
        .args(["600", HUGEMEM, "launch", "--socket"])
        .arg(daemon.socket())
        .arg("--control-socket")
        .arg(control)
        .args(how)
        .arg("--")
        .arg(program)
        .args(args)
        .stderr(std::fs::File::create(log).expect("a log file"))
        .spawn()
        .expect("spawn hugemem launch")
}

/// `hugemem update CONTROL --vmm PROGRAM`, which must succeed; its report.
fn update_to(control: &Path, program: &Path) -> String {
    let (ok, said) = hugemem(&[
        "update".into(),
        control.into(),
        "--vmm".into(),
        program.into(),
    ]);
    assert!(ok, "update to {}: {said}", program.display());
    eprintln!("{said}");
    said
}

/// `hugemem launch --restore vm -- PROGRAM`, the guest's RAM read through
/// `ram` (the parked pages): true once the guest counts on
/// (the launcher still runs), false when the launcher ended first (its
/// log then shows QEMU's refusal).
fn restore_counts_on(
    (daemon, ram): (&TestDaemon, &std::fs::File),
    control: &Path,
    program: &Path,
    log: &Path,
) -> (Child, bool) {
    let mut restored = launch_as_root(daemon, control, &["--restore", "vm"], program, &[], log);
    let past = spin_state(ram).count;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let s = spin_state(ram);
        if s.spinning && s.count > past + 10 {
            assert_eq!(s.bad, 0, "the restored guest found a page changed");
            return (restored, true);
        }
        if restored
            .try_wait()
            .expect("the launcher's status")
            .is_some()
        {
            return (restored, false);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{} neither ran the guest nor ended within 30 s",
            program.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The system's QEMU (7.2 on Debian 12) and the newer one run the same VM
/// in turn, when its machine type is versioned (`pc-q35-7.2`): a live
/// `hugemem update` from one to the other and back, then a park under
/// one and a restore under the other, both ways, the guest counting on
/// each time. On `-M microvm` Debian's two QEMUs load different firmware
/// (7.2's `bios-microvm.bin` is qboot, 64 KiB; 10.0's is SeaBIOS's, 128
/// KiB), and the newer QEMU refuses a VM parked under 7.2 (`Size mismatch:
/// pc.bios: 0x10000 != 0x20000`): the VM then stays parked and restores
/// under the QEMU it was parked from.
#[test]
fn a_vm_moves_between_the_system_qemu_and_the_newer_one() {
    let Some(set) = common::qemu::set_up(2 * RAM / STRIDE) else {
        return;
    };
    let Some(newer) = test_support::qemu_backport::qemu_or_skip() else {
        return;
    };
    let system = Path::new("qemu-system-x86_64");
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let control = set.control.clone();
    let log = |name: &str| set.dir.path().join(format!("{name}.log"));
    let new = ["--size", "256M", "--page-size", "2M"];

    let args = common::qemu::qemu_args_on("pc-q35-7.2", &set.elf);
    let mut launched = launch_as_root(&daemon, &control, &new, system, &args, &log("q35"));
    let launcher = child_of(launched.id());
    let _guard = StopLauncher(launcher);
    let ram = guest_ram(child_of(launcher));
    let mut s = counting_past(&ram, 0, "the guest under the system QEMU to spin");
    for program in [newer, system] {
        let said = update_to(&control, program);
        assert!(said.contains("memory by daemon HANDOFF"), "{said}");
        s = counting_past(&ram, s.count + 10, "the guest to count on after the update");
    }
    let said = common::qemu::park("vm", &control);
    assert!(said.contains("(0 bytes copied by the daemon"), "{said}");
    assert!(launched.wait().expect("the launcher ends").success());
    for (round, program) in [newer, system].into_iter().enumerate() {
        let (mut restored, ran) = restore_counts_on(
            (&daemon, &ram),
            &control,
            program,
            &log(&format!("q35-{round}")),
        );
        assert!(
            ran,
            "{} did not restore the VM parked under the other QEMU: {}",
            program.display(),
            std::fs::read_to_string(log(&format!("q35-{round}"))).unwrap_or_default()
        );
        let said = common::qemu::park("vm", &control);
        assert!(said.contains("(0 bytes copied by the daemon"), "{said}");
        assert!(restored.wait().expect("the launcher ends").success());
    }
    drop(ram);
    let (ok, said) = hugemem(&[
        "unpark".into(),
        "vm".into(),
        "--socket".into(),
        daemon.socket().into(),
    ]);
    assert!(ok, "{said}");

    // microvm: parked under the system QEMU, tried under the newer one.
    let args = qemu_args(&set.elf);
    let mut launched = launch_as_root(&daemon, &control, &new, system, &args, &log("microvm"));
    let launcher = child_of(launched.id());
    let _guard = StopLauncher(launcher);
    let ram = guest_ram(child_of(launcher));
    counting_past(&ram, 0, "the microvm guest to spin");
    common::qemu::park("vm", &control);
    assert!(launched.wait().expect("the launcher ends").success());
    let (mut tried, ran) =
        restore_counts_on((&daemon, &ram), &control, newer, &log("microvm-newer"));
    let said = std::fs::read_to_string(log("microvm-newer")).unwrap_or_default();
    if ran {
        eprintln!("the newer QEMU restored a microvm VM parked under the system's");
        stop(child_of(tried.id()), &mut tried);
        common::qemu::park("vm", &control);
    } else {
        assert!(said.contains("the VM stays parked"), "{said}");
        eprintln!(
            "the newer QEMU refused the microvm VM: {}",
            said.lines()
                .filter(|l| l.starts_with("qemu-system"))
                .collect::<Vec<_>>()
                .join(" / ")
        );
        assert_eq!(daemon.stats().parked.len(), 1, "still parked");
    }
    let (mut restored, ran) =
        restore_counts_on((&daemon, &ram), &control, system, &log("microvm-system"));
    assert!(
        ran,
        "{}",
        std::fs::read_to_string(log("microvm-system")).unwrap_or_default()
    );
    drop(ram);
    let stats = stop_and_settle(&daemon, child_of(restored.id()), &mut restored);
    assert!(stats.parked.is_empty(), "{stats}");
    daemon.shutdown();
}
