//! `hugemem park` and `hugemem launch --restore` of a launched QEMU
//! (issue 46): the counting micro-guest (`microguest::spin`) parked in the
//! daemon and restored 10 times, on the same memory.
//!
//! After each park: the launcher and its QEMU ended, the VM is listed
//! parked with 0 bytes copied, as a QEMU VM (STATS' `vmm`; `hugemem
//! status` and `/metrics` too in the test of QEMUs killed mid-park), the daemon cleared no byte, and QEMU's
//! stream carried no RAM. After each restore: the guest's counter, read
//! from guest RAM through the new QEMU's memory fd, never went back and
//! goes on, and every page holds what the guest wrote. Restores alternate
//! between the parked command line (none given) and the same one given
//! again. At the end one allocation served every QEMU and the totals
//! balance.
//!
//! A QEMU SIGKILLed mid-park (stopped while the park waits on it; as its
//! migration starts; once it handed its state over) leaves the VM parked
//! whole or its memory freed: the park fails and says QEMU ended, or it
//! succeeded and the VM restores counting on; the launcher exits as QEMU
//! did, leaving no QEMU behind, and the daemon's books balance. A
//! restore stopped (SIGTERM) as its QEMU starts leaves no QEMU behind.
//!
//! Skipped (through the skip helper) without `qemu-system-x86_64`, a
//! usable `/dev/kvm` or 128 free 2 MiB pages. Deadlines only: `timeout`
//! around every command, `wait_until` around every wait.

mod common;

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use guest_mem::PageSize;
use microguest::pattern;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use test_support::hugepages::hold;
use test_support::prelude::{serial, wait_until, TestDaemon};

use common::park::{stop as stop_launcher, stop_and_settle};
use common::{assert_balanced, child_of, counting_past, spin_elf, spin_state, StopLauncher};

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");
const RAM: u64 = 256 << 20;
const MARKER: u64 = 0x5041_524b_5145_0000;
const START_GPA: u64 = 1 << 20;
const STRIDE: u64 = 2 << 20;
const CYCLES: usize = 10;

fn skip_reason() -> Option<String> {
    match Command::new("qemu-system-x86_64").arg("--version").output() {
        Ok(o) if o.status.success() => {}
        _ => return Some("qemu-system-x86_64 not installed".into()),
    }
    microguest::kvm_available().err()
}

/// Guest RAM as QEMU `pid` maps it: its `/dev/fd/N` memory file, reopened.
fn guest_ram(pid: u32) -> std::fs::File {
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
fn qemu_args(elf: &Path) -> Vec<OsString> {
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
fn launch(daemon: &TestDaemon, control: &Path, restore: Option<&str>, args: &[OsString]) -> Child {
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
fn park(name: &str, control: &Path) -> String {
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
fn assert_pages_kept(ram: &std::fs::File, when: &str) {
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

#[test]
fn ten_parks_and_restores_keep_the_guest_counting_on_the_same_memory() {
    let _serial = serial();
    if let Some(reason) = skip_reason() {
        test_support::skip!("{reason}");
        return;
    }
    let _pages = match hold(PageSize::Huge2M, RAM / STRIDE) {
        Ok(r) => r,
        Err(why) => {
            test_support::skip!("{why}");
            return;
        }
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let elf = spin_elf(dir.path(), STRIDE, START_GPA, MARKER);
    let control = dir.path().join("vm.sock");
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let args = qemu_args(&elf);
    let mut launched = launch(&daemon, &control, None, &args);
    let mut launcher = child_of(launched.id());
    let mut qemu = child_of(launcher);
    let ram = guest_ram(qemu);
    let mut count = counting_past(&ram, 0, "the guest to spin").count;
    drop(ram);
    let cleared = daemon.stats().scrub.bytes;
    let mut stop = StopLauncher(launcher);
    for i in 1..=CYCLES {
        let said = park("vm", &control);
        assert!(
            said.contains("(0 bytes copied by the daemon"),
            "park {i}: {said}"
        );
        let status = launched.wait().expect("wait for the launcher");
        assert!(
            status.success(),
            "park {i}: the launcher ended with {status}"
        );
        let stats = daemon.stats();
        let parked = stats.parked.iter().find(|p| p.name == "vm");
        let parked = parked.unwrap_or_else(|| panic!("park {i}: not listed: {stats}"));
        assert_eq!((parked.bytes, parked.copied_bytes), (RAM, 0), "park {i}");
        assert_eq!(parked.vmm.as_deref(), Some("qemu"), "park {i}");
        assert_eq!(stats.scrub.bytes, cleared, "park {i}: memory cleared");
        assert_eq!(stats.counters.park_copied_bytes, 0, "park {i}");
        assert_balanced(&stats, &format!("park {i}"));
        // Every other restore reuses the parked command line.
        let given: &[OsString] = if i % 2 == 0 { &args } else { &[] };
        launched = launch(&daemon, &control, Some("vm"), given);
        launcher = child_of(launched.id());
        std::mem::forget(std::mem::replace(&mut stop, StopLauncher(launcher)));
        qemu = child_of(launcher);
        let ram = guest_ram(qemu);
        let now = spin_state(&ram);
        assert!(
            now.count >= count,
            "restore {i}: the counter went back from {count} to {}",
            now.count
        );
        let state = counting_past(&ram, now.count, "the restored guest to count on");
        assert_eq!(
            state.bad, 0,
            "restore {i}: a page changed at {:#x}",
            state.bad_gpa
        );
        assert_pages_kept(&ram, &format!("restore {i}"));
        count = state.count;
        drop(ram);
        if i == CYCLES / 2 {
            // A restored VM is updated, and the updated QEMU parked next.
            let report = common::update(&control);
            assert_eq!(report.old_pid, qemu, "the restored QEMU was replaced");
            let ram = guest_ram(report.new_pid);
            let now = spin_state(&ram);
            assert!(now.count >= count, "update: the counter went back");
            count = counting_past(&ram, now.count, "the updated guest to count on").count;
        }
        // The guest runs just before the daemon hands the allocation over.
        let stats = daemon.wait_stats(Duration::from_secs(30), "the restore done", |s| {
            s.counters.restores == i as u64 && s.parked.is_empty()
        });
        assert_eq!(stats.scrub.bytes, cleared, "restore {i}: memory cleared");
        eprintln!("cycle {i}: {said}");
    }
    let stats = daemon.stats();
    assert_eq!(
        (stats.counters.parks, stats.counters.restores),
        (CYCLES as u64, CYCLES as u64),
        "parks and restores counted: {stats}"
    );
    std::mem::forget(stop);
    let stats = stop_and_settle(&daemon, launcher, &mut launched);
    assert_eq!(
        (stats.counters.allocs_ok, stats.counters.allocs_released),
        (1, 1),
        "one allocation for all QEMUs, released once: {stats}"
    );
    daemon.shutdown();
}

/// `hugemem launch --restore NAME` that must fail, with `program` and
/// `args` (`--vmm qemu` named); its stderr.
fn restore_fails(daemon: &TestDaemon, name: &str, program: &str, args: &[OsString]) -> String {
    let out = Command::new("timeout")
        .args(["120", HUGEMEM, "launch", "--socket"])
        .arg(daemon.socket())
        .args(["--vmm", "qemu", "--restore", name, "--", program])
        .args(args)
        .output()
        .expect("run hugemem launch --restore");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "restore of {name} with {program}: {stderr}"
    );
    assert_ne!(
        out.status.code(),
        Some(124),
        "{name}: not in time: {stderr}"
    );
    stderr
}

/// Parks a forged QEMU VM `name` on a fresh 2 MiB allocation of the
/// test's own: the parked configuration of `args`, `stream` as its
/// migration stream.
fn park_forged(daemon: &TestDaemon, name: &str, args: &[OsString], stream: &[u8]) {
    use hugemem::launch::vmm::qemu::parked::{ParkedConfig, ParkedRegion, ParkedState};
    use std::os::fd::AsFd;
    let mut client = hugemem_client::client::Client::connect(&daemon.socket()).expect("connect");
    let alloc = test_support::daemon::alloc_2m_pages(&mut client, 1);
    let region = ParkedRegion {
        size: 2 << 20,
        node: Some(0),
    };
    let config =
        ParkedConfig::new(&"qemu-system-x86_64".into(), args, vec![region]).expect("config");
    let config = serde_json::to_vec(&config).expect("json");
    let state = serde_json::to_vec(&ParkedState::new(stream)).expect("json");
    let (ours, daemons) = std::os::unix::net::UnixStream::pair().expect("socketpair");
    let memory = [(0u32, alloc.fds[0].as_fd())];
    std::thread::scope(|s| {
        let sender =
            s.spawn(|| ch_migration::peer::send_snapshot(&ours, &memory, &config, &state, false));
        client.park(name, &daemons).expect("PARK of the forged VM");
        sender.join().expect("sender").expect("snapshot sent");
    });
}

#[test]
fn refused_parks_and_restores_leave_the_vm_running_or_parked() {
    let _serial = serial();
    if let Some(reason) = skip_reason() {
        test_support::skip!("{reason}");
        return;
    }
    // The VM's pages and the forged VM's one.
    let _pages = match hold(PageSize::Huge2M, RAM / STRIDE + 1) {
        Ok(r) => r,
        Err(why) => {
            test_support::skip!("{why}");
            return;
        }
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let elf = spin_elf(dir.path(), STRIDE, START_GPA, MARKER);
    let control = dir.path().join("vm.sock");
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let args = qemu_args(&elf);
    park_forged(&daemon, "forged", &args, b"not a QEMU migration stream");
    let mut launched = launch(&daemon, &control, None, &args);
    let launcher = child_of(launched.id());
    let mut stop = StopLauncher(launcher);
    let qemu = child_of(launcher);
    let ram = guest_ram(qemu);
    let mut count = counting_past(&ram, 0, "the guest to spin").count;
    // Refused parks (a bad name; a name in use): QEMU runs the guest on.
    for (name, why) in [("no/such", "name"), ("forged", "forged")] {
        let out = Command::new("timeout")
            .args(["120", HUGEMEM, "park", name, "--control-socket"])
            .arg(&control)
            .output()
            .expect("run hugemem park");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {stderr}");
        assert!(
            stderr.contains(why) && stderr.contains("the running QEMU keeps the guest"),
            "{name}: {stderr}"
        );
        count = counting_past(&ram, count, "the guest to count on after a refused park").count;
        assert_eq!(
            child_of(launcher),
            qemu,
            "{name}: the same QEMU runs the guest"
        );
    }
    drop(ram);
    let said = park("vm", &control);
    assert!(said.contains("(0 bytes copied by the daemon"), "{said}");
    assert!(launched.wait().expect("wait").success());
    let refused_before = daemon.stats().counters.restores_refused;
    // A forged state: QEMU refuses it, and the VM stays parked.
    let stderr = restore_fails(&daemon, "forged", "qemu-system-x86_64", &[]);
    assert!(stderr.contains("migration"), "forged: {stderr}");
    eprintln!("forged: {stderr}");
    // Another machine: said before QEMU starts.
    let q35: Vec<OsString> = ["-M", "q35", "-accel", "kvm"]
        .iter()
        .map(OsString::from)
        .collect();
    let stderr = restore_fails(&daemon, "vm", "qemu-system-x86_64", &q35);
    assert!(
        stderr.contains("-machine microvm") && stderr.contains("q35"),
        "{stderr}"
    );
    // A "QEMU" that dies at once.
    restore_fails(&daemon, "vm", "/bin/true", &[]);
    // Another VM's name is not found.
    let stderr = restore_fails(&daemon, "nobody", "qemu-system-x86_64", &[]);
    assert!(stderr.contains("nobody"), "{stderr}");
    let stats = daemon.wait_stats(Duration::from_secs(30), "the refusals counted", |s| {
        s.counters.restores_refused >= refused_before + 4
    });
    let mut names: Vec<&str> = stats.parked.iter().map(|p| p.name.as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, ["forged", "vm"], "both still parked: {stats}");
    assert_eq!(stats.counters.restores, 0, "{stats}");
    assert_balanced(&stats, "after the refused restores");
    // The real one comes back, counting on.
    launched = launch(&daemon, &control, Some("vm"), &[]);
    let launcher = child_of(launched.id());
    std::mem::forget(std::mem::replace(&mut stop, StopLauncher(launcher)));
    let ram = guest_ram(child_of(launcher));
    let now = spin_state(&ram);
    assert!(
        now.count >= count,
        "the counter went back from {count} to {}",
        now.count
    );
    let state = counting_past(&ram, now.count, "the restored guest to count on");
    assert_eq!(state.bad, 0);
    drop(ram);
    hugemem::park_cli::unpark(&daemon.socket(), "forged").expect("UNPARK forged");
    std::mem::forget(stop);
    stop_launcher(launcher, &mut launched);
    let stats = daemon.wait_stats(Duration::from_secs(30), "everything released", |s| {
        s.allocations.active == 0 && s.parked.is_empty()
    });
    assert_balanced(&stats, "at the end");
    daemon.shutdown();
}

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
    let _serial = serial();
    if let Some(reason) = skip_reason() {
        test_support::skip!("{reason}");
        return;
    }
    let _pages = match hold(PageSize::Huge2M, RAM / STRIDE) {
        Ok(r) => r,
        Err(why) => {
            test_support::skip!("{why}");
            return;
        }
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let elf = spin_elf(dir.path(), STRIDE, START_GPA, MARKER);
    let control = dir.path().join("vm.sock");
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
