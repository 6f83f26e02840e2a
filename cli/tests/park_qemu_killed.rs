//! QEMUs SIGKILLed mid-park (issue 46): the counting micro-guest
//! (`microguest::spin`) under a launched QEMU with a control socket.
//!
//! A QEMU killed mid-park (stopped while the park waits on it; as its
//! migration starts; once it handed its state over) leaves the VM parked
//! whole or its memory freed: the park fails and says QEMU ended, or it
//! succeeded and the VM restores counting on; the launcher exits as QEMU
//! did, leaving no QEMU behind, and the daemon's books balance. A parked
//! QEMU VM is listed as one by STATS' `vmm`, `hugemem status` and
//! `/metrics`. A restore stopped (SIGTERM) as its QEMU starts leaves no
//! QEMU behind.
//!
//! Skipped (through the skip helper) without `qemu-system-x86_64`, a
//! usable `/dev/kvm` or 128 free 2 MiB pages. Deadlines only: `timeout`
//! around every command, `wait_until` around every wait.

mod common;

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use test_support::prelude::TestDaemon;

use common::park::stop as stop_launcher;
use common::qemu::{assert_pages_kept, guest_ram, launch, qemu_args, set_up, RAM, STRIDE};
use common::{assert_balanced, child_of, counting_past, spin_state, StopLauncher};

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");

/// A launcher's log lines (`RUST_LOG` debug for QEMU's adapter), as they
/// come; each is echoed to the test's output too.
fn log_lines(launched: &mut Child) -> mpsc::Receiver<String> {
    let stderr = launched
        .stderr
        .take()
        .expect("the launcher's stderr, piped");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            eprintln!("launcher: {line}");
            // Drained to the end even once nobody listens.
            let _ = tx.send(line);
        }
    });
    rx
}

/// Waits for the launcher's log line that contains `marker`.
fn wait_for_line(log: &mpsc::Receiver<String>, marker: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match log.recv_timeout(left) {
            Ok(line) if line.contains(marker) => return,
            Ok(_) => {}
            Err(e) => panic!("no {marker:?} in the launcher's log: {e}"),
        }
    }
}

fn signal(pid: u32, signal: Signal) {
    kill(Pid::from_raw(i32::try_from(pid).expect("pid")), signal).expect("signal QEMU");
}

/// How one park of a QEMU killed mid-park went.
struct KilledMidPark {
    park: std::process::Output,
    launcher: std::process::ExitStatus,
    /// The guest's counter before the park.
    count: u64,
}

/// Launches the counting guest, parks it as `name` and SIGKILLs its QEMU
/// once the launcher's log says `marker` (QEMU stopped from before the
/// park when `stopped`, so that the park waits on it); waits for the park
/// and the launcher to end, and checks the launcher left no QEMU behind.
fn kill_mid_park(
    daemon: &TestDaemon,
    control: &Path,
    args: &[OsString],
    (name, marker, stopped): (&str, &str, bool),
) -> KilledMidPark {
    let mut launched = Command::new("timeout");
    launched
        .args(["600", HUGEMEM, "launch", "--socket"])
        .arg(daemon.socket())
        .arg("--control-socket")
        .arg(control)
        .args(["--size", "256M", "--page-size", "2M", "--"])
        .arg("qemu-system-x86_64")
        .args(args)
        .env("RUST_LOG", "info,hugemem::launch::vmm::qemu=debug")
        .stderr(Stdio::piped());
    let mut launched = launched.spawn().expect("spawn hugemem launch");
    let log = log_lines(&mut launched);
    let launcher = child_of(launched.id());
    let stop = StopLauncher(launcher);
    let qemu = child_of(launcher);
    let ram = guest_ram(qemu);
    let count = counting_past(&ram, 0, "the guest to spin").count;
    drop(ram);
    if stopped {
        signal(qemu, Signal::SIGSTOP);
    }
    let park = Command::new("timeout")
        .args(["120", HUGEMEM, "park", name, "--control-socket"])
        .arg(control)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn hugemem park");
    wait_for_line(&log, marker);
    signal(qemu, Signal::SIGKILL);
    let park = park.wait_with_output().expect("wait for hugemem park");
    let launcher_status = launched.wait().expect("wait for the launcher");
    std::mem::forget(stop);
    assert_ne!(park.status.code(), Some(124), "{name}: the park hung");
    assert_ne!(
        launcher_status.code(),
        Some(124),
        "{name}: the launcher hung"
    );
    // The launcher reaped its QEMU before it exited: no orphan, no zombie.
    assert_no_orphan(qemu, name);
    KilledMidPark {
        park,
        launcher: launcher_status,
        count,
    }
}

/// The park failed and said why: QEMU ended, nothing parked.
fn assert_failed_clearly(run: &KilledMidPark, name: &str) {
    let stderr = String::from_utf8_lossy(&run.park.stderr);
    assert_eq!(run.park.status.code(), Some(1), "{name}: {stderr}");
    assert!(
        stderr.contains("QEMU ended during the park")
            && stderr.contains("nothing parked")
            && !stderr.contains("keeps the guest"),
        "{name}: {stderr}"
    );
}

/// `name` is parked whole: restored, its guest counts on from where it
/// was, every page kept; then the VM is stopped and its memory freed.
fn assert_parked_whole(daemon: &TestDaemon, control: &Path, name: &str, count: u64) {
    let stats = daemon.stats();
    let parked = stats.parked.iter().find(|p| p.name == name);
    let parked = parked.unwrap_or_else(|| panic!("{name}: not listed: {stats}"));
    assert_eq!((parked.bytes, parked.copied_bytes), (RAM, 0), "{name}");
    assert_eq!(parked.vmm.as_deref(), Some("qemu"), "{name}");
    assert_balanced(&stats, &format!("{name} parked"));
    assert_listed_as_qemu(daemon, name);
    let mut launched = launch(daemon, control, Some(name), &[]);
    let launcher = child_of(launched.id());
    let stop = StopLauncher(launcher);
    let qemu = child_of(launcher);
    let ram = guest_ram(qemu);
    let now = spin_state(&ram);
    assert!(now.count >= count, "{name}: the counter went back");
    let state = counting_past(&ram, now.count, "the restored guest to count on");
    assert_eq!(
        state.bad, 0,
        "{name}: a page changed at {:#x}",
        state.bad_gpa
    );
    assert_pages_kept(&ram, name);
    drop(ram);
    // The guest runs just before the daemon hands the allocation over.
    daemon.wait_stats(Duration::from_secs(30), "the restore done", |s| {
        s.parked.iter().all(|p| p.name != name)
    });
    std::mem::forget(stop);
    stop_launcher(launcher, &mut launched);
    assert_no_orphan(qemu, name);
}

/// `hugemem status` and `/metrics` name the parked VM's VMM.
fn assert_listed_as_qemu(daemon: &TestDaemon, name: &str) {
    let out = Command::new("timeout")
        .args(["60", HUGEMEM, "status", "--socket"])
        .arg(daemon.socket())
        .output()
        .expect("run hugemem status");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.lines()
            .any(|l| l.starts_with(&format!("parked: {name} (uid ")) && l.contains(", qemu): ")),
        "{name}: {said}"
    );
    let addr = daemon.handle().metrics_addr().expect("metrics on");
    let (_, _, body) = test_support::metrics::http_get(addr, "GET", "/metrics");
    assert!(
        body.lines().any(|l| l.starts_with("hugemem_parked_bytes{")
            && l.contains(&format!("name=\"{name}\""))
            && l.contains("vmm=\"qemu\"")),
        "{name}: {body}"
    );
}

/// QEMU `qemu` is gone (its launcher reaped it), not left running.
fn assert_no_orphan(qemu: u32, name: &str) {
    assert!(
        !Path::new(&format!("/proc/{qemu}")).exists(),
        "{name}: QEMU {qemu} outlived its launcher"
    );
}

/// A restore of `name` whose launcher is stopped (SIGTERM) as soon as its
/// QEMU started, while the daemon's RESTORE is under way: the launcher
/// ends its QEMU with it, and the VM stays parked (or, when the restore
/// was done first, was restored and freed). True when it stays parked.
fn stop_restore_midway(daemon: &TestDaemon, control: &Path, name: &str) -> bool {
    let mut launched = launch(daemon, control, Some(name), &[]);
    let launcher = child_of(launched.id());
    let qemu = child_of(launcher);
    stop_launcher(launcher, &mut launched);
    assert_no_orphan(qemu, name);
    // Its launcher's session ended: nothing holds the VM but the daemon.
    let stats = daemon.wait_stats(Duration::from_secs(30), "the restore ended", |s| {
        s.sessions.active == 0
    });
    assert_balanced(&stats, &format!("{name}: restore stopped"));
    stats.parked.iter().any(|p| p.name == name)
}

/// Nothing parked, nothing held: the killed VM's memory went back.
fn assert_freed(daemon: &TestDaemon, name: &str) {
    let stats = daemon.wait_stats(Duration::from_secs(30), "the memory freed", |s| {
        s.allocations.active == 0 && s.parked.is_empty()
    });
    assert_balanced(&stats, name);
}

#[test]
fn a_qemu_killed_mid_park_leaves_its_vm_parked_whole_or_its_memory_freed() {
    let Some(setup) = set_up(RAM / STRIDE) else {
        return;
    };
    let (elf, control) = (setup.elf.clone(), setup.control.clone());
    let daemon = TestDaemon::start(|c| {
        c.pool.recheck_ms = 20;
        c.metrics.listen = Some("127.0.0.1:0".parse().expect("addr"));
    });
    let args = qemu_args(&elf);
    // Killed while the park waits on it (stopped): the park fails and
    // says QEMU ended; the launcher exits as QEMU did and frees the memory.
    // (Its first QMP command: the handshake, or the park's first one.)
    let first = ("stopped", "sending QMP command", true);
    let run = kill_mid_park(&daemon, &control, &args, first);
    assert_failed_clearly(&run, "stopped");
    assert_eq!(
        run.launcher.code(),
        Some(128 + 9),
        "stopped: {:?}",
        run.launcher
    );
    assert_freed(&daemon, "stopped");
    // Killed once it handed its device state over (paused, its migration
    // completed), while the launcher parks it in the daemon: parked whole.
    let handed = ("handed", "QEMU's device state read", false);
    let run = kill_mid_park(&daemon, &control, &args, handed);
    let said = String::from_utf8_lossy(&run.park.stdout);
    assert!(
        run.park.status.success() && said.contains("(0 bytes copied by the daemon"),
        "handed: {said}{}",
        String::from_utf8_lossy(&run.park.stderr)
    );
    assert_eq!(
        run.launcher.code(),
        Some(128 + 9),
        "handed: {:?}",
        run.launcher
    );
    // A restore stopped midway leaves no QEMU behind and the VM parked.
    let parked = stop_restore_midway(&daemon, &control, "handed");
    eprintln!("handed: still parked after the stopped restore: {parked}");
    if parked {
        assert_parked_whole(&daemon, &control, "handed", run.count);
    }
    assert_freed(&daemon, "handed");
    // Killed as its migration starts: whichever comes first, the kill or
    // the end of the stream, the VM is parked whole or its memory freed.
    let migrating = ("migrating", "sending QMP command \"migrate\"", false);
    let run = kill_mid_park(&daemon, &control, &args, migrating);
    if run.park.status.success() {
        eprintln!("migrating: the migration ended before the kill");
        assert_parked_whole(&daemon, &control, "migrating", run.count);
    } else {
        assert_failed_clearly(&run, "migrating");
    }
    assert_freed(&daemon, "migrating");
    daemon.shutdown();
}
