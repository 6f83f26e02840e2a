//! `hugemem update`: 20 live updates in a row of a launched QEMU running the
//! counting micro-guest (`microguest::spin`) on daemon memory (issue 26).
//!
//! After each update: the guest's counter, read from guest RAM through the
//! new QEMU's own memory fd, never went back and goes on; the RAM bytes QEMU
//! sent are under 1% of guest RAM; the memory came by daemon HANDOFF; the
//! daemon cleared no byte meanwhile and `created − released == held`; the
//! guest found every page as it left it. After the VM exits the allocation
//! is released, the totals balance, and once the daemon is gone the host's
//! free 2 MiB pages are what they were before.
//!
//! Skipped (through the skip helper) without `qemu-system-x86_64`, a usable
//! `/dev/kvm` or 128 free 2 MiB pages. Deadlines only: `timeout` around
//! every command, `wait_until` around every wait.

mod common;

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

use guest_mem::PageSize;
use microguest::pattern;
use test_support::hugepages::{hold, hugepages_2m};
use test_support::prelude::{serial, wait_until, TestDaemon};

use common::{
    assert_balanced, child_of, counting_past, spin_elf, spin_state, update, StopLauncher,
};

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");
const RAM: u64 = 256 << 20;
const MARKER: u64 = 0x5550_4441_5445_0000;
const START_GPA: u64 = 1 << 20;
const STRIDE: u64 = 2 << 20;
const UPDATES: usize = 20;

fn skip_reason() -> Option<String> {
    match Command::new("qemu-system-x86_64").arg("--version").output() {
        Ok(o) if o.status.success() => {}
        _ => return Some("qemu-system-x86_64 not installed".into()),
    }
    microguest::kvm_available().err()
}

/// Guest RAM as QEMU `pid` maps it: its `/dev/fd/N` memory file, reopened
/// (waiting until its command line reads as QEMU's: right after the exec
/// it may still read empty).
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

fn start_launch(daemon: &TestDaemon, dir: &Path, elf: &Path) -> Child {
    Command::new("timeout")
        .args(["600", HUGEMEM, "launch", "--socket"])
        .arg(daemon.socket())
        .args(["--size", "256M", "--page-size", "2M", "--control-socket"])
        .arg(dir.join("vm.sock"))
        .args(["--", "qemu-system-x86_64"])
        .args(common::qemu::qemu_args(elf))
        .spawn()
        .expect("spawn hugemem launch")
}

#[test]
fn twenty_updates_keep_the_guest_counting_on_the_same_memory() {
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
    let free_before = hugepages_2m("free_hugepages");
    let dir = tempfile::tempdir().expect("tempdir");
    let elf = spin_elf(dir.path(), STRIDE, START_GPA, MARKER);
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let mut launch = start_launch(&daemon, dir.path(), &elf);
    // `timeout` is the launcher's parent: the launcher is its child.
    let launcher = child_of(launch.id());
    let _stop = StopLauncher(launcher);
    let mut qemu = child_of(launcher);
    let first = guest_ram(qemu);
    let mut state = counting_past(&first, 0, "the guest to spin");
    // Held open, it would keep the pages from the kernel at the end.
    drop(first);
    let control = dir.path().join("vm.sock");
    let cleared = daemon.stats().scrub.bytes;
    for i in 1..=UPDATES {
        let before = state.count;
        let report = update(&control);
        assert_eq!(
            report.old_pid, qemu,
            "update {i}: the QEMU that ran the guest was replaced"
        );
        assert_ne!(report.new_pid, qemu);
        assert!(
            report.handoff,
            "update {i}: memory by daemon HANDOFF: {report:?}"
        );
        assert_eq!(report.guest_ram_bytes, RAM);
        assert!(
            report.ram_transferred_bytes * 100 < RAM,
            "update {i}: {} RAM bytes sent, 1% of RAM is {}",
            report.ram_transferred_bytes,
            RAM / 100
        );
        qemu = report.new_pid;
        let ram = guest_ram(qemu);
        let now = spin_state(&ram);
        assert!(
            now.count >= before,
            "update {i}: the counter went back from {before} to {}",
            now.count
        );
        state = counting_past(&ram, now.count, "the guest to count on under the new QEMU");
        assert_eq!(
            state.bad, 0,
            "update {i}: the guest found a page changed (last at {:#x})",
            state.bad_gpa
        );
        let stats = daemon.stats();
        assert_eq!(
            stats.scrub.bytes, cleared,
            "update {i}: the daemon cleared memory: {stats}"
        );
        assert_eq!(stats.allocations.active, 1, "update {i}: {stats}");
        assert_eq!(
            stats.counters.allocs_ok - stats.counters.allocs_released,
            1,
            "update {i}: no allocation released or made by the handoffs: {stats}"
        );
        assert_balanced(&stats, &format!("after update {i}"));
        eprintln!(
            "update {i}: QEMU {} -> {}: {:.1} ms, switch {:.1} ms, QEMU downtime {} ms, {} RAM bytes sent; guest count {}, largest gap {} TSC ticks",
            report.old_pid, report.new_pid, report.update_ms, report.switch_ms,
            report.qemu_downtime_ms, report.ram_transferred_bytes, state.count, state.max_gap
        );
    }
    // A new binary that cannot start, and one that starts but is no QEMU:
    // each update fails, says why, and the running QEMU keeps the guest.
    for (bad, why) in [
        ("/nonexistent/qemu", "cannot start"),
        ("/bin/true", "monitor"),
    ] {
        let out = Command::new("timeout")
            .args(["120", HUGEMEM, "update", "--qemu", bad])
            .arg(&control)
            .output()
            .expect("run hugemem update");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{bad}: {stderr}");
        assert!(
            stderr.contains(why) && stderr.contains("the running QEMU keeps the guest"),
            "{bad}: {stderr}"
        );
        let ram = guest_ram(qemu);
        let before = spin_state(&ram).count;
        state = counting_past(&ram, before, "the guest to count on under the same QEMU");
        assert_eq!(state.bad, 0);
    }
    // The host's view of the same pages: every stride holds what the guest wrote.
    let ram = guest_ram(qemu);
    let mut word = [0u8; 8];
    let mut gpa = START_GPA.next_multiple_of(STRIDE);
    let mut checked = 0;
    while gpa + 8 <= RAM {
        ram.read_exact_at(&mut word, gpa).expect("read guest RAM");
        assert_eq!(
            u64::from_le_bytes(word),
            pattern(MARKER, gpa),
            "page {gpa:#x} lost the guest's write"
        );
        checked += 1;
        gpa += STRIDE;
    }
    assert_eq!(checked, RAM / STRIDE - 1);
    drop(ram);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(launcher).expect("pid")),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM to the launcher");
    let status = launch.wait().expect("wait for the launcher");
    assert_ne!(
        status.code(),
        Some(124),
        "the launcher did not finish in time"
    );
    let stats = daemon.wait_stats(Duration::from_secs(30), "the allocation released", |s| {
        s.allocations.active == 0
    });
    assert_balanced(&stats, "after the VM exited");
    assert_eq!(
        stats.counters.allocs_ok, 1,
        "one allocation for all 20 QEMUs: {stats}"
    );
    assert_eq!(
        stats.counters.allocs_released, 1,
        "released once, when the VM exited: {stats}"
    );
    daemon.shutdown();
    // The last mapping goes with the last QEMU process, asynchronously.
    wait_until(
        "the host's free 2 MiB pages back to their count before the VM",
        Duration::from_secs(30),
        || hugepages_2m("free_hugepages") == free_before,
    );
}
