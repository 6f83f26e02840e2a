//! What the live-update tests of `hugemem update` share: finding the
//! launcher and its VMM among the processes, stopping the launcher, the
//! counting micro-guest's state read from guest RAM, one update through
//! the real binary, and the daemon's balance.

// Each test binary that includes this uses a part of it.
#![allow(dead_code)]

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use hugemem::launch::UpdateReport;
use microguest::{SpinState, SPIN_BLOCK_GPA, SPIN_BLOCK_LEN};
use test_support::prelude::wait_until;

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");

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
