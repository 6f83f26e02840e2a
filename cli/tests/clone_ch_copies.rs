//! Postcopy copy clones (`hugemem launch --clone-of NAME`, the default
//! `--clone-mode copy`) with the real cloud-hypervisor, several at once
//! and round after round on the memory the last round's copies gave back:
//! each guest counts on from the parked count, and every page it checks
//! holds the template's bytes.
//!
//! Skipped (through the skip helper) without the cloud-hypervisor binary
//! that `CLOUD_HYPERVISOR` names, a usable `/dev/kvm`, or the 2 MiB pages
//! for the template and its copies.

mod common;

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use microguest::{SpinState, SPIN_BLOCK_GPA, SPIN_BLOCK_LEN};
use test_support::prelude::TestDaemon;

use common::counting_past;
use common::park::{child_now, guest_memfd_now, launch_and_park, set_up};

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");
/// Copy clones started at once, each round.
const COPIES: usize = 4;
/// Rounds: from the second on, the copies take memory the last round's
/// copies gave back.
const ROUNDS: usize = 3;

/// `hugemem launch --clone-of NAME` (postcopy copy) under `ch`, its API at `api`.
fn launch_copy(daemon: &TestDaemon, ch: &str, name: &str, api: &Path) -> Child {
    Command::new("timeout")
        .args(["600", HUGEMEM, "launch", "--socket"])
        .arg(daemon.socket())
        .args(["--clone-of", name, "--", ch])
        .arg("--api-socket")
        .arg(api)
        .spawn()
        .expect("spawn hugemem launch --clone-of")
}

/// One copy clone being started: its `timeout` process, its launcher, its
/// VMM and the VMM's guest memory, as they are found.
struct Copy {
    child: Child,
    launcher: Option<u32>,
    vmm: Option<u32>,
    ram: Option<std::fs::File>,
    counting: bool,
}

impl Drop for Copy {
    /// A test that failed leaves no VM behind: SIGTERM to its `timeout`,
    /// which passes it to the launcher, which stops its VMM and frees the
    /// copy (only while the child is not reaped: its pid is still its own).
    fn drop(&mut self) {
        if let (Ok(None), Ok(pid)) = (self.child.try_wait(), i32::try_from(self.child.id())) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGTERM,
            );
            let _ = self.child.wait();
        }
    }
}

impl Copy {
    /// One look: true once its guest counts past `past`. Fails the test
    /// when the launch ended first.
    fn look(&mut self, past: u64) -> bool {
        if self.counting {
            return true;
        }
        if let Some(status) = self.child.try_wait().expect("wait for a launch") {
            panic!("a copy clone's launch ended ({status}) before its guest counted on");
        }
        if self.launcher.is_none() {
            self.launcher = child_now(self.child.id());
        }
        if let (Some(l), None) = (self.launcher, self.vmm) {
            self.vmm = child_now(l);
        }
        if let (Some(v), None) = (self.vmm, &self.ram) {
            self.ram = guest_memfd_now(v);
        }
        let Some(ram) = &self.ram else { return false };
        let mut block = vec![0u8; SPIN_BLOCK_LEN];
        self.counting = ram.read_exact_at(&mut block, SPIN_BLOCK_GPA).is_ok()
            && SpinState::parse(&block).is_some_and(|s| s.spinning && s.count > past);
        self.counting
    }
}

/// Several postcopy copy clones of one template at once, round after
/// round: every guest counts on with every page it checks equal to the
/// template's, and the daemon's counters balance after each round.
#[test]
fn postcopy_copy_clones_at_once_run_on_the_templates_pages_round_after_round() {
    let Some(setup) = set_up(1 + COPIES as u64) else {
        return;
    };
    let (ch, dir, elf) = (&setup.ch, &setup.dir, &setup.elf);
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let api = dir.path().join("template.sock");
    let (ram, parked) = launch_and_park(&daemon, (ch, elf), &api, "template");

    for round in 0..ROUNDS {
        let mut copies: Vec<Copy> = (0..COPIES)
            .map(|i| Copy {
                child: launch_copy(
                    &daemon,
                    ch,
                    "template",
                    &dir.path().join(format!("copy{round}-{i}.sock")),
                ),
                launcher: None,
                vmm: None,
                ram: None,
                counting: false,
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(120);
        while !copies
            .iter_mut()
            .fold(true, |all, c| c.look(parked.count) & all)
        {
            assert!(
                Instant::now() < deadline,
                "round {round}: a guest did not run"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        for (i, c) in copies.iter().enumerate() {
            let s = counting_past(c.ram.as_ref().expect("its memory"), parked.count + 10, "on");
            assert_eq!(s.bad, 0, "round {round}: copy {i} found a page changed");
        }
        // Each RESTORE ends once its copy is filled and cloud-hypervisor
        // had every page (a VMM stopped before that ends its fault
        // connection early, and the restore fails).
        daemon.wait_stats(Duration::from_secs(120), "the copies filled", |s| {
            s.parked.iter().all(|p| p.copy_clones_filling == 0)
        });
        let restored = (round + 1) * COPIES;
        daemon.wait_stats(Duration::from_secs(60), "every RESTORE done", |s| {
            s.counters.clones == restored as u64
        });
        for c in &mut copies {
            common::park::stop(c.launcher.expect("a launcher"), &mut c.child);
        }
        drop(copies);
        daemon.wait_stats(Duration::from_secs(60), "the copies freed", |s| {
            s.allocations.active == 1
        });
        eprintln!("round {round}: {COPIES} postcopy copy clones counted on");
    }
    let stats = daemon.stats();
    assert_eq!(stats.counters.clones, (COPIES * ROUNDS) as u64, "{stats}");
    drop(ram);
    daemon.shutdown();
}
