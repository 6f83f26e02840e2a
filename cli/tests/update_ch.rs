//! `hugemem update` of a launched cloud-hypervisor: 20 live updates in a
//! row through cloud-hypervisor's own local migration, of the counting
//! micro-guest (`microguest::spin`) on daemon memory, with fds (`/dev/fd/N`)
//! and again with hugetlbfs paths under `--landlock`.
//!
//! After each update: the guest's counter never went back and goes on; the
//! new process maps the very file the launcher holds (its inode is in the
//! new process's `/proc/PID/maps`); the memory never left the launcher's
//! connection (no HANDOFF), the old process wrote under 1 % of guest RAM
//! during the switch (the fds moved, the RAM did not); the daemon cleared
//! nothing, quarantined nothing, and `created − released == held`. Before
//! the first update, the launcher holds no copy of the cloud-hypervisor's
//! API listener (only the process does). Then
//! three failing updates (a binary that does not exist, one that exits at
//! once, one that is no cloud-hypervisor) each fail with the reason while
//! the guest counts on under the same process. After the VM exits the
//! allocation is released once and the host's free 2 MiB pages come back.
//!
//! Skipped (through the skip helper) without the cloud-hypervisor binary
//! that `CLOUD_HYPERVISOR` names (`scripts/build-cloud-hypervisor`), a
//! usable `/dev/kvm` or 128 free 2 MiB pages.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use guest_mem::PageSize;
use test_support::hugepages::{hold, hugepages_2m};
use test_support::prelude::{serial, wait_until, TestDaemon};

use common::{
    assert_balanced, child_of, cloud_hypervisor, counting_past, launched_guest_ram, maps_inode,
    spin_elf, spin_state, update, StopLauncher,
};

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");
const RAM: u64 = 256 << 20;
const MARKER: u64 = 0x4348_5550_4454_0000;
const START_GPA: u64 = 1 << 20;
const STRIDE: u64 = 2 << 20;
const UPDATES: usize = 20;

fn start_launch(daemon: &TestDaemon, dir: &Path, ch: &str, elf: &Path, paths: bool) -> Child {
    let mut cmd = Command::new("timeout");
    cmd.args(["600", HUGEMEM, "launch", "--socket"])
        .arg(daemon.socket())
        .args([
            "--size",
            "256M",
            "--page-size",
            "2M",
            "--update-timeout",
            "20",
        ])
        .arg("--control-socket")
        .arg(dir.join("vm.sock"));
    if paths {
        cmd.arg("--hugetlbfs");
    }
    cmd.args(["--", ch]);
    if paths {
        cmd.arg("--landlock");
    }
    cmd.arg("--kernel")
        .arg(elf)
        .args(["--cpus", "boot=1", "--serial", "null", "--console", "off"]);
    cmd.spawn().expect("spawn hugemem launch")
}

/// The inode of the UNIX socket listening at `path` (`/proc/net/unix`).
fn listening_socket(path: &Path) -> u64 {
    const ACCEPTING: &str = "00010000";
    let table = std::fs::read_to_string("/proc/net/unix").expect("read /proc/net/unix");
    let path = path.to_str().expect("UTF-8 path");
    table
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.len() == 8 && f[3] == ACCEPTING && f[7] == path)
        .and_then(|f| f[6].parse().ok())
        .unwrap_or_else(|| panic!("no socket listens at {path}"))
}

/// Whether process `pid` has socket inode `ino` open.
fn holds_socket(pid: u32, ino: u64) -> bool {
    let wanted = format!("socket:[{ino}]");
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("list the process's fds")
        .filter_map(Result::ok)
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .any(|target| target.as_os_str() == wanted.as_str())
}

fn quarantined(stats: &backend::stats::Stats) -> u64 {
    stats.pools.iter().map(|p| p.regions.quarantined).sum()
}

/// A program that is no cloud-hypervisor and keeps running: it never
/// answers on the API socket it is given.
fn impostor(dir: &Path) -> PathBuf {
    let path = dir.join("not-cloud-hypervisor");
    std::fs::write(&path, "#!/bin/sh\nexec sleep 600\n").expect("write the impostor");
    std::fs::set_permissions(
        &path,
        <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o755),
    )
    .expect("chmod");
    path
}

fn updates_keep_the_guest_counting(paths: bool) {
    let _serial = serial();
    let Some(ch) = cloud_hypervisor() else {
        return;
    };
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
    let mut launch = start_launch(&daemon, dir.path(), &ch, &elf, paths);
    let launcher = child_of(launch.id());
    let _stop = StopLauncher(launcher);
    let mut vmm = child_of(launcher);
    let ram = launched_guest_ram(launcher, vmm);
    let ino = ram.metadata().expect("fstat guest RAM").ino();
    let mut state = counting_past(&ram, 0, "the guest to spin");
    let control = dir.path().join("vm.sock");
    // The launcher keeps no copy of the first process's API listener: with
    // one, the socket would go on accepting after that process is gone, and
    // the first update's `vmm.shutdown` to it would wait out the update
    // timeout instead of being refused.
    let api = listening_socket(&dir.path().join("vm.sock.api"));
    assert!(
        holds_socket(vmm, api),
        "the cloud-hypervisor holds its API listener (socket inode {api})"
    );
    assert!(
        !holds_socket(launcher, api),
        "the launcher still holds the cloud-hypervisor's API listener (socket inode {api})"
    );
    let cleared = daemon.stats().scrub.bytes;
    for i in 1..=UPDATES {
        let before = state.count;
        let report = update(&control);
        assert_eq!(
            report.old_pid, vmm,
            "update {i}: the process that ran the guest"
        );
        assert_ne!(report.new_pid, vmm);
        assert!(
            !report.handoff,
            "update {i}: the memory stays on the launcher's connection: {report:?}"
        );
        assert_eq!(report.guest_ram_bytes, RAM);
        assert!(
            report.ram_transferred_bytes * 100 < RAM,
            "update {i}: the old process wrote {} bytes during the switch, 1% of RAM is {}",
            report.ram_transferred_bytes,
            RAM / 100
        );
        vmm = report.new_pid;
        assert!(
            maps_inode(vmm, ino),
            "update {i}: the new cloud-hypervisor does not map the launcher's file (inode {ino})"
        );
        let now = spin_state(&ram);
        assert!(
            now.count >= before,
            "update {i}: the counter went back from {before} to {}",
            now.count
        );
        state = counting_past(&ram, now.count, "the guest to count on in the new process");
        assert_eq!(
            state.bad, 0,
            "update {i}: the guest found a page changed (last at {:#x})",
            state.bad_gpa
        );
        let stats = daemon.stats();
        assert_eq!(stats.scrub.bytes, cleared, "update {i}: cleared: {stats}");
        assert_eq!(quarantined(&stats), 0, "update {i}: quarantined: {stats}");
        assert_eq!(stats.allocations.active, 1, "update {i}: {stats}");
        assert_eq!(
            stats.counters.allocs_ok - stats.counters.allocs_released,
            1,
            "update {i}: {stats}"
        );
        assert_eq!(stats.counters.handoff_ok, 0, "update {i}: no HANDOFF");
        assert_balanced(&stats, &format!("after update {i}"));
        eprintln!(
            "update {i}: cloud-hypervisor {} -> {}: {:.1} ms, switch {:.1} ms, {} bytes written by the old process; guest count {}, largest gap {} TSC ticks",
            report.old_pid, report.new_pid, report.update_ms, report.switch_ms,
            report.ram_transferred_bytes, state.count, state.max_gap
        );
    }
    let not_ch = impostor(dir.path());
    for (bad, why) in [
        (
            PathBuf::from("/nonexistent/cloud-hypervisor"),
            "cannot start",
        ),
        (PathBuf::from("/bin/true"), "did not listen"),
        (not_ch, "did not listen"),
    ] {
        let out = Command::new("timeout")
            .args(["120", HUGEMEM, "update", "--vmm"])
            .arg(&bad)
            .arg(&control)
            .output()
            .expect("run hugemem update");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{}: {stderr}", bad.display());
        assert!(
            stderr.contains(why) && stderr.contains("the running cloud-hypervisor keeps the guest"),
            "{}: {stderr}",
            bad.display()
        );
        let before = spin_state(&ram).count;
        state = counting_past(&ram, before, "the guest to count on in the same process");
        assert_eq!(state.bad, 0);
        assert!(
            maps_inode(vmm, ino),
            "{}: the guest's process changed",
            bad.display()
        );
    }
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
        "one allocation for every process: {stats}"
    );
    assert_eq!(stats.counters.allocs_released, 1, "released once: {stats}");
    daemon.shutdown();
    wait_until(
        "the host's free 2 MiB pages back to their count before the VM",
        Duration::from_secs(30),
        || hugepages_2m("free_hugepages") == free_before,
    );
}

#[test]
fn twenty_updates_keep_the_guest_counting_on_the_same_memory() {
    updates_keep_the_guest_counting(false);
}

#[test]
fn twenty_updates_on_hugetlbfs_paths_under_landlock() {
    updates_keep_the_guest_counting(true);
}
