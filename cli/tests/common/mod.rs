//! What the live-update tests of `hugemem update` share: finding the
//! launcher and its VMM among the processes, stopping the launcher, the
//! counting micro-guest (its image, its state read from guest RAM), the
//! cloud-hypervisor the tests run and the memory a launched one maps, one
//! update through the real binary, and the daemon's balance.

// Each test binary that includes this uses a part of it.
#![allow(dead_code)]

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use hugemem::launch::UpdateReport;
use microguest::{pvh_elf, PvhConfig, SpinState, SPIN_BLOCK_GPA, SPIN_BLOCK_LEN};
use test_support::prelude::wait_until;

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");

pub mod park;
pub mod qemu;

/// The child of `parent`, once it has exec'd its own program (between fork
/// and exec it is a copy of the parent).
pub fn child_of(parent: u32) -> u32 {
    let exe = |pid: u32| std::fs::read_link(format!("/proc/{pid}/exe")).ok();
    let mut pid = None;
    wait_until("the child's exec", Duration::from_secs(30), || {
        let children = std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children"))
            .unwrap_or_default();
        pid = children
            .split_whitespace()
            .next()
            .and_then(|p| p.parse::<u32>().ok());
        pid.is_some_and(|p| exe(p).is_some() && exe(p) != exe(parent))
    });
    pid.expect("a child pid")
}

/// SIGTERM to the launcher when the test ends, passed or not (it forwards
/// it to QEMU and frees the memory).
pub struct StopLauncher(pub u32);

impl Drop for StopLauncher {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.0) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
    }
}

pub fn spin_state(ram: &std::fs::File) -> SpinState {
    let mut block = vec![0u8; SPIN_BLOCK_LEN];
    ram.read_exact_at(&mut block, SPIN_BLOCK_GPA)
        .expect("read the spin block");
    SpinState::parse(&block).expect("a whole block")
}

/// Waits until the guest's counter passes `past`.
pub fn counting_past(ram: &std::fs::File, past: u64, what: &str) -> SpinState {
    let mut last = None;
    wait_until(what, Duration::from_secs(30), || {
        let s = spin_state(ram);
        let on = s.spinning && s.count > past;
        last = Some(s);
        on
    });
    last.expect("a state")
}

pub fn update(control: &Path) -> UpdateReport {
    let out = Command::new("timeout")
        .args(["120", HUGEMEM, "update", "--json"])
        .arg(control)
        .output()
        .expect("run hugemem update");
    assert!(
        out.status.success(),
        "hugemem update failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the update report")
}

pub fn assert_balanced(stats: &backend::stats::Stats, when: &str) {
    let t = &stats.totals;
    assert_eq!(
        t.created_bytes - t.released_bytes,
        t.held_bytes,
        "{when}: created − released ≠ held: {stats}"
    );
}

/// The cloud-hypervisor binary (`CLOUD_HYPERVISOR`, or the project's build:
/// `test_support::cloud_hypervisor`), with a usable KVM; `None` after
/// recording the skip.
pub fn cloud_hypervisor() -> Option<String> {
    let ch = test_support::cloud_hypervisor::binaries_or_skip()?;
    let ch = ch.cloud_hypervisor.to_string_lossy().into_owned();
    if let Err(reason) = microguest::kvm_available() {
        test_support::skip!("{reason}");
        return None;
    }
    Some(ch)
}

/// Guest RAM as the launcher holds it: the memory zone's `file=` on the
/// first cloud-hypervisor's command line, a hugetlbfs path or `/dev/fd/N`
/// of a descriptor the launcher holds for the VM's whole life.
pub fn launched_guest_ram(launcher: u32, first_vmm: u32) -> std::fs::File {
    let mut file = None;
    wait_until(
        "cloud-hypervisor's command line",
        Duration::from_secs(30),
        || {
            let cmdline = std::fs::read(format!("/proc/{first_vmm}/cmdline")).unwrap_or_default();
            file = String::from_utf8_lossy(&cmdline).split('\0').find_map(|a| {
                a.split(',')
                    .find_map(|kv| kv.strip_prefix("file="))
                    .map(str::to_owned)
            });
            file.is_some()
        },
    );
    let file = file.expect("a memory zone's file= on cloud-hypervisor's command line");
    let path = match file.strip_prefix("/dev/fd/") {
        Some(fd) => PathBuf::from(format!("/proc/{launcher}/fd/{fd}")),
        None => PathBuf::from(file),
    };
    std::fs::File::open(&path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
}

/// True when process `pid` maps the file with inode `ino`.
pub fn maps_inode(pid: u32, ino: u64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap_or_default()
        .lines()
        .any(|l| l.split_whitespace().nth(4).and_then(|w| w.parse().ok()) == Some(ino))
}

/// The counting micro-guest's PVH image (`microguest::spin`), written
/// into `dir`: it touches a page every `stride` from `start_gpa`, writing
/// `marker`'s pattern, and counts.
pub fn spin_elf(dir: &Path, stride: u64, start_gpa: u64, marker: u64) -> PathBuf {
    let elf = dir.join("spin.elf");
    let image = pvh_elf(&PvhConfig {
        stride,
        marker,
        start_gpa,
        spin: true,
        ..Default::default()
    })
    .expect("elf");
    std::fs::write(&elf, image).expect("write elf");
    elf
}
