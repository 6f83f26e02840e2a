//! `hugemem launch --clone-of NAME -- qemu-system-x86_64` (issue 46):
//! clones of a parked QEMU VM (its template), in both modes, with real
//! QEMU.
//!
//! * The counting micro-guest (`microguest::spin`), launched under QEMU
//!   and parked, is the template. Three shared clones start from it at
//!   once (two on the parked command line, one given it again): each
//!   resumes the guest and counts on from where the template stopped, on
//!   a private (`rw-p`) mapping of the template's memory, writing only a
//!   few huge pages of its own (smaps `Private_Hugetlb`, as STATS reports
//!   it).
//! * A shared clone past `clones.headroom` is refused, the shortfall
//!   named, before any QEMU starts. A shared clone of a VM with a tap of a
//!   fixed name is refused, naming it.
//! * A copy clone beside them runs on its own pool memory (`rw-s`),
//!   filled before its guest runs (QEMU has no postcopy through hugemem),
//!   and is freed when it ends.
//! * The template's bytes do not change while the clones run, nor after
//!   (a digest of its whole memory); once they ended it is restored and
//!   counts on from where it was parked. The pool balances at the end.
//!
//! Skipped (through the skip helper) without `qemu-system-x86_64`, a
//! usable `/dev/kvm` or 768 free 2 MiB pages. Deadlines only: `timeout`
//! around every command, `wait_until` around every wait.

mod common;

use std::ffi::OsString;
use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

use backend::daemon::ByteSize;
use guest_mem::PageSize;
use test_support::hugepages::{hold, hold_all_but_2m};
use test_support::prelude::{serial, wait_until, TestDaemon};

use common::park::{
    clone_spin_state, digest, guest_ram_mapping, private_hugetlb, stop, stop_and_settle, MARKER,
    RAM, START_GPA, STRIDE,
};
use common::qemu::{guest_ram, park, qemu_args, qemu_of, skip_reason};
use common::{assert_balanced, child_of, counting_past, spin_elf, spin_state, StopLauncher};

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");
const QEMU: &str = "qemu-system-x86_64";
const CLONES: usize = 3;
/// `clones.headroom`: four 2 MiB pages.
const HEADROOM: u64 = 4 * STRIDE;

/// `hugemem launch [--clone-of NAME --clone-mode MODE | --restore NAME]
/// -- qemu-system-x86_64 ARGS`, its stderr to `log` when given.
fn launch(daemon: &TestDaemon, how: &[&str], args: &[OsString], log: Option<&Path>) -> Child {
    let mut c = Command::new("timeout");
    c.args(["600", HUGEMEM, "launch", "--socket"])
        .arg(daemon.socket())
        .args(how)
        .arg("--")
        .arg(QEMU)
        .args(args);
    if let Some(log) = log {
        c.stderr(std::fs::File::create(log).expect("a log file"));
    }
    c.spawn().expect("spawn hugemem launch")
}

/// A launch that must fail; its stderr.
fn launch_fails(daemon: &TestDaemon, how: &[&str], args: &[OsString]) -> String {
    let out = Command::new("timeout")
        .args(["120", HUGEMEM, "launch", "--socket"])
        .arg(daemon.socket())
        .args(how)
        .arg("--")
        .arg(QEMU)
        .args(args)
        .output()
        .expect("run hugemem launch");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{how:?} {args:?}: {stderr}");
    assert_ne!(out.status.code(), Some(124), "{how:?}: not in time");
    stderr
}

/// Waits until the clone in QEMU `qemu` counts past `past`, then checks
/// it saw no page changed and maps its memory with `perms`; its launcher's
/// `log` is shown when it does not.
fn assert_counts_on(what: &str, qemu: u32, past: u64, perms: &str, log: &Path) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let s = loop {
        let last = clone_spin_state(qemu);
        if let Some(s) = last.filter(|s| s.spinning && s.count > past + 10) {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what} did not count on past {past} within 60 s (its state: {:?}); its launcher said:\n{}",
            clone_spin_state(qemu),
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(s.bad, 0, "{what} found a page changed at {:#x}", s.bad_gpa);
    let (_, mapped) = guest_ram_mapping(qemu).expect("the clone's guest RAM");
    assert_eq!(mapped, perms, "{what}'s guest RAM mapping");
    eprintln!("{what}: counts on ({} from {past}), {mapped}", s.count);
}

#[test]
fn qemu_clones_in_both_modes_count_on_from_a_template_that_stays_unchanged() {
    let _serial = serial();
    if let Some(reason) = skip_reason() {
        test_support::skip!("{reason}");
        return;
    }
    // The template, the shared clones' reservations, a copy and room for
    // the headroom's refusal.
    let _pages = match hold(PageSize::Huge2M, (3 + CLONES as u64) * RAM / STRIDE) {
        Ok(r) => r,
        Err(why) => {
            test_support::skip!("{why}");
            return;
        }
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let elf = spin_elf(dir.path(), STRIDE, START_GPA, MARKER);
    let daemon = TestDaemon::start(|c| {
        c.pool.recheck_ms = 20;
        c.clones.headroom = ByteSize(HEADROOM);
    });
    let args = qemu_args(&elf);
    let control = dir.path().join("template.sock");
    let control_arg = control.to_string_lossy().into_owned();
    let new = ["--control-socket", &control_arg, "--size", "256M"];
    let mut template = launch(
        &daemon,
        &[&new[..], &["--page-size", "2M"]].concat(),
        &args,
        None,
    );
    let launcher = child_of(template.id());
    let _guard = StopLauncher(launcher);
    let ram = guest_ram(child_of(launcher));
    counting_past(&ram, 0, "the template's guest to spin");
    let said = park("template", &control);
    assert!(said.contains("(0 bytes copied by the daemon"), "{said}");
    assert!(template.wait().expect("the launcher ends").success());
    let parked = spin_state(&ram);
    let before = digest(&ram);

    // Shared clones, started at once.
    let shared = ["--clone-of", "template", "--clone-mode", "shared"];
    let mut clones = Vec::new();
    for i in 0..CLONES {
        let given: &[OsString] = if i == 0 { &args } else { &[] };
        let log = dir.path().join(format!("clone{i}.log"));
        clones.push((launch(&daemon, &shared, given, Some(&log)), log));
    }
    let mut running = Vec::new();
    for (i, (child, log)) in clones.into_iter().enumerate() {
        let launcher = child_of(child.id());
        let qemu = qemu_of(launcher);
        assert_counts_on(
            &format!("shared clone {i}"),
            qemu,
            parked.count,
            "rw-p",
            &log,
        );
        let wrote = private_hugetlb(qemu);
        assert!(wrote < RAM / 4, "clone {i} wrote {wrote} bytes privately");
        eprintln!("shared clone {i}: wrote {} KiB of huge pages", wrote >> 10);
        running.push((child, launcher, qemu, log, StopLauncher(launcher)));
    }
    let stats = daemon.stats();
    assert_eq!(stats.counters.clones, CLONES as u64, "{stats}");
    assert_eq!(stats.parked.len(), 1, "the template stays parked: {stats}");
    assert_eq!(stats.parked[0].shared_clones, CLONES as u64, "{stats}");
    let qemus: Vec<u32> = running.iter().map(|c| c.2).collect();
    wait_until(
        "STATS to report what the clones wrote",
        Duration::from_secs(30),
        || {
            let ours: u64 = qemus.iter().map(|q| private_hugetlb(*q)).sum();
            ours > 0 && daemon.stats().parked[0].shared_clone_written_bytes == ours
        },
    );
    assert_eq!(
        digest(&ram),
        before,
        "the template changed under its clones"
    );

    // Past the headroom by one page: refused before QEMU starts.
    let hog = hold_all_but_2m(RAM / STRIDE + HEADROOM / STRIDE - 1);
    let refused = launch_fails(&daemon, &shared, &[]);
    drop(hog);
    assert!(refused.contains("short by 1"), "{refused}");
    eprintln!("refused at the headroom: {refused}");
    // What a second QEMU cannot hold: refused, named.
    let mut tap = args.clone();
    tap.extend(["-netdev", "tap,id=n0,ifname=hm-tmpl0"].map(OsString::from));
    let refused = launch_fails(&daemon, &["--vmm", "qemu", "--clone-of", "template"], &tap);
    assert!(refused.contains("the tap hm-tmpl0"), "{refused}");

    // A copy clone beside them: its own pool memory, filled first.
    let active = daemon.stats().allocations.active;
    let copy_log = dir.path().join("copy.log");
    let copy = ["--clone-of", "template", "--clone-mode", "copy"];
    let mut copy_child = launch(&daemon, &copy, &[], Some(&copy_log));
    let copy_launcher = child_of(copy_child.id());
    let _copy_guard = StopLauncher(copy_launcher);
    assert_counts_on(
        "the copy clone",
        qemu_of(copy_launcher),
        parked.count,
        "rw-s",
        &copy_log,
    );
    let stats = daemon.stats();
    assert_eq!(stats.allocations.active, active + 1, "the copy's: {stats}");
    stop(copy_launcher, &mut copy_child);
    let said = std::fs::read_to_string(&copy_log).unwrap_or_default();
    assert!(
        said.contains("copied from its template before the guest ran"),
        "{said}"
    );
    daemon.wait_stats(Duration::from_secs(30), "the copy freed", |s| {
        s.allocations.active == active
    });

    for (mut child, launcher, _, log, _guard) in running {
        stop(launcher, &mut child);
        let said = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(said.contains("mapped from its template (shared"), "{said}");
    }
    daemon.wait_stats(Duration::from_secs(30), "the clones' ends counted", |s| {
        s.parked.first().is_some_and(|p| p.shared_clones == 0)
    });
    assert_eq!(digest(&ram), before, "the template changed");
    assert_eq!(spin_state(&ram).count, parked.count);

    // The template comes back on its memory, counting on.
    let mut restored = launch(&daemon, &["--restore", "template"], &[], None);
    let launcher = child_of(restored.id());
    let _restored_guard = StopLauncher(launcher);
    let s = counting_past(&ram, parked.count + 10, "the restored template to count on");
    assert_eq!(s.bad, 0, "the restored template found a page changed");
    drop(ram);
    let stats = stop_and_settle(&daemon, launcher, &mut restored);
    assert!(stats.parked.is_empty(), "{stats}");
    assert_eq!(stats.counters.clones, CLONES as u64 + 1, "{stats}");
    assert_balanced(&stats, "at the end");
    daemon.shutdown();
}

/// A QEMU without `rom` (before 8.2) opens a shared clone's template
/// read-write, which only root may (a template's files are the daemon's,
/// mode 0444): as another user the launcher says so before it asks the
/// daemon, and no QEMU runs the clone.
#[test]
fn a_shared_clone_on_a_qemu_without_rom_is_refused_to_a_non_root_user_first() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    const NOBODY: u32 = 65534;
    let _serial = serial();
    if let Some(reason) = skip_reason() {
        test_support::skip!("{reason}");
        return;
    }
    if !test_support::tenant::root_or_skip() {
        return;
    }
    let help = Command::new(QEMU)
        .args(["-object", "memory-backend-file,help"])
        .output()
        .expect("QEMU's memory-backend-file options");
    if String::from_utf8_lossy(&help.stdout).contains("rom=") {
        test_support::skip!("this QEMU takes rom=: its shared clones open the template read-only");
        return;
    }
    let daemon = TestDaemon::start(|c| c.allowed_uids = vec![0, NOBODY]);
    for (path, mode) in [(daemon.dir(), 0o755), (daemon.socket().as_path(), 0o777)] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }
    let out = Command::new("timeout")
        .args(["120", HUGEMEM, "launch", "--socket"])
        .arg(daemon.socket())
        .args(["--clone-of", "tmpl", "--clone-mode", "shared", "--", QEMU])
        .current_dir("/")
        .uid(NOBODY)
        .gid(NOBODY)
        .output()
        .expect("run hugemem launch as uid 65534");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert_ne!(out.status.code(), Some(124), "not in time: {stderr}");
    for needle in [
        "has no `rom` option for memory-backend-file (QEMU before 8.2)",
        "uid 65534 cannot run it",
        "Use QEMU 8.2 or later",
    ] {
        assert!(stderr.contains(needle), "{needle:?} missing from: {stderr}");
    }
    let s = daemon.stats();
    assert_eq!(
        (s.counters.clones, s.counters.clones_refused),
        (0, 0),
        "the daemon was not asked: {s}"
    );
}
