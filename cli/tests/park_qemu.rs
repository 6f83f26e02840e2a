//! `hugemem park` and `hugemem launch --restore` of a launched QEMU
//! (issue 46): the counting micro-guest (`microguest::spin`) parked in the
//! daemon and restored 10 times, on the same memory.
//!
//! After each park: the launcher and its QEMU ended, the VM is listed
//! parked with 0 bytes copied, the daemon cleared no byte, and QEMU's
//! stream carried no RAM. After each restore: the guest's counter, read
//! from guest RAM through the new QEMU's memory fd, never went back and
//! goes on, and every page holds what the guest wrote. Restores alternate
//! between the parked command line (none given) and the same one given
//! again. At the end one allocation served every QEMU and the totals
//! balance.
//!
//! Skipped (through the skip helper) without `qemu-system-x86_64`, a
//! usable `/dev/kvm` or 128 free 2 MiB pages. Deadlines only: `timeout`
//! around every command, `wait_until` around every wait.

mod common;

use std::ffi::OsString;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use test_support::prelude::TestDaemon;

use common::park::{stop as stop_launcher, stop_and_settle};
use common::qemu::{assert_pages_kept, guest_ram, launch, park, qemu_args, set_up, RAM, STRIDE};
use common::{assert_balanced, child_of, counting_past, spin_state, StopLauncher};

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");
const CYCLES: usize = 10;

#[test]
fn ten_parks_and_restores_keep_the_guest_counting_on_the_same_memory() {
    let Some(setup) = set_up(RAM / STRIDE) else {
        return;
    };
    let (elf, control) = (setup.elf.clone(), setup.control.clone());
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

/// SIGTERM to a launcher whose QEMU has just started on the VM parked as
/// `vm`: the launcher sends it on to QEMU and ends once QEMU has; the VM
/// stays parked. (A helper thread of the launcher that did not block the
/// signal used to take it: its default action ended the launcher, and
/// QEMU ran on, an orphan holding the VM's memory.)
fn stop_mid_restore(daemon: &TestDaemon, control: &Path) {
    use std::os::unix::process::ExitStatusExt;
    let mut launched = launch(daemon, control, Some("vm"), &[]);
    let launcher = child_of(launched.id());
    let qemu = child_of(launcher);
    let pid = |p: u32| nix::unistd::Pid::from_raw(i32::try_from(p).expect("pid"));
    nix::sys::signal::kill(pid(launcher), nix::sys::signal::Signal::SIGTERM)
        .expect("SIGTERM to the launcher");
    let status = launched.wait().expect("wait for the launcher");
    let left = std::fs::read_to_string(format!("/proc/{qemu}/stat"))
        .is_ok_and(|stat| !stat.contains(") Z "));
    if left {
        let _ = nix::sys::signal::kill(pid(qemu), nix::sys::signal::Signal::SIGKILL);
    }
    assert!(!left, "QEMU {qemu} outlived its launcher ({status})");
    // `timeout` says 128 + the signal for a command a signal ended.
    assert!(
        status.code() != Some(128 + 15) && status.signal().is_none(),
        "the SIGTERM ended the launcher instead of its QEMU: {status}"
    );
    assert_ne!(status.code(), Some(124), "the launcher did not end in time");
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
    // The VM's pages and the forged VM's one.
    let Some(setup) = set_up(RAM / STRIDE + 1) else {
        return;
    };
    let (elf, control) = (setup.elf.clone(), setup.control.clone());
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
    stop_mid_restore(&daemon, &control);
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
