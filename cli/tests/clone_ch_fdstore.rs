//! A template with shared clones running across restarts from systemd's
//! fd store, with the real binary, the real cloud-hypervisor and the
//! project's counting guest (issue 45):
//!
//! * The template parked, two shared clones counting, then `systemctl
//!   restart` (SIGTERM, a new start from the store) and a crash
//!   (`kill -9`, a new start from the document the store kept while the
//!   daemon served). No connection survives either, so no clone is
//!   counted any more; but the clones still map the template privately,
//!   and a page a clone has not written is still the template's file.
//!   After each restart, UNPARK and `hugemem launch --restore` of the
//!   template are refused, naming the clones' processes, while the clones
//!   count on; once the clones end, the template's bytes are unchanged and
//!   it restores and counts on from where it was parked.
//!
//! Should the RESTORE be let through, the test shows what it would cost:
//! it writes a page of the restored VM's memory and reads it back through
//! a clone that never wrote that page.
//!
//! systemd itself cannot run here; `test_support::fake_systemd` speaks its
//! side (as `fdstore.rs` does). Skipped (through the skip helper) without
//! the cloud-hypervisor binary that `CLOUD_HYPERVISOR` names, a usable
//! `/dev/kvm`, or the huge pages.

mod clone_rig;
mod common;
mod park_rig;

use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Command, Stdio};

use hugemem_client::client::{Client, ClientError};
use hugemem_client::proto::Status;
use nix::sys::signal::Signal;
use test_support::fake_systemd::FakeSystemd;
use test_support::prelude::wait_until;

use clone_rig::{counting, digest, start_clone, template_memory, Clone};
use common::park::{guest_ram_mapping, RAM};
use park_rig::{Setup, HUGEMEM, STEP};

const CLONES: usize = 2;

/// RESTORE and UNPARK of the template are refused while `clones` run, the
/// refusal naming each clone's process.
fn refused_while_clones_run(socket: &Path, setup: &Setup, clones: &[Clone], after: &str) {
    let api = setup.dir.path().join("restored.api");
    let mut launch = Command::new("timeout")
        .args(["600", HUGEMEM, "launch", "--socket"])
        .arg(socket)
        .args(["--restore", "tmpl", "--", &setup.ch, "--api-socket"])
        .arg(&api)
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn hugemem launch --restore");
    let mut stderr = launch.stderr.take().expect("stderr");
    let said = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    // Either the launcher ends (refused), or a restored VM maps the
    // template's memory shared: then show what its writes do to a clone.
    let mut restored = None;
    wait_until("the RESTORE refused or running", STEP, || {
        if launch.try_wait().expect("try_wait").is_some() {
            return true;
        }
        restored = restored_vmm(launch.id());
        restored.is_some()
    });
    if let Some(vmm) = restored {
        let (before, wrote, seen) = write_through(vmm, &clones[0]);
        park_rig::stop_launch(&mut launch);
        panic!(
            "{after}: RESTORE of the template was let through while {} shared clones map it; \
             the restored VM wrote {wrote:#x} over {before:#x} at a page clone {} never wrote, \
             and the clone reads {seen:#x} there{}",
            clones.len(),
            clones[0].vmm,
            if seen == wrote {
                ": the clone runs on wrong memory"
            } else {
                ""
            }
        );
    }
    let status = launch.wait().expect("the launcher");
    let said = said.join().expect("stderr");
    assert!(!status.success(), "{after}: {said}");
    assert!(said.contains("still mapped by"), "{after}: {said}");
    for c in clones {
        assert!(said.contains(&c.vmm.to_string()), "{after}: {said}");
    }
    match Client::connect(socket).expect("connect").unpark("tmpl") {
        Err(ClientError::Refused { status, message }) => {
            assert_eq!(status, Status::Invalid, "{message}");
            for c in clones {
                assert!(message.contains(&c.vmm.to_string()), "{after}: {message}");
            }
            eprintln!("{after}: UNPARK refused: {message}");
        }
        other => panic!("{after}: UNPARK of a template its clones map: {other:?}"),
    }
}

/// The restored VM's cloud-hypervisor, once it maps its guest RAM shared
/// (the launcher `timeout_pid`'s grandchild).
fn restored_vmm(timeout_pid: u32) -> Option<u32> {
    let children = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default()
    };
    let launcher: u32 = children(timeout_pid)
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    let vmm: u32 = children(launcher).split_whitespace().next()?.parse().ok()?;
    let (_, perms) = guest_ram_mapping(vmm)?;
    (perms == "rw-s").then_some(vmm)
}

/// Writes the last byte of the restored VM's RAM (in `vmm`), and reads it through `clone`'s own mapping: the byte
/// before, the byte written, and what the clone sees there after.
fn write_through(vmm: u32, clone: &Clone) -> (u8, u8, u8) {
    let at = RAM - 1;
    let (base, _) = guest_ram_mapping(clone.vmm).expect("the clone's guest RAM");
    let clone_mem = std::fs::File::open(format!("/proc/{}/mem", clone.vmm)).expect("clone mem");
    let mut before = [0u8];
    clone_mem
        .read_exact_at(&mut before, base + at)
        .expect("read the clone");
    // Through the restored VMM's shared mapping (hugetlbfs has no write(2)).
    let (vmm_base, _) = guest_ram_mapping(vmm).expect("the restored VM's guest RAM");
    let vmm_mem = std::fs::OpenOptions::new()
        .write(true)
        .open(format!("/proc/{vmm}/mem"))
        .expect("restored VM mem");
    let wrote = before[0] ^ 0xa5;
    vmm_mem
        .write_all_at(&[wrote], vmm_base + at)
        .expect("write the restored VM's RAM");
    let mut after = [0u8];
    clone_mem
        .read_exact_at(&mut after, base + at)
        .expect("read the clone");
    (before[0], wrote, after[0])
}

#[test]
fn a_template_is_not_restored_under_shared_clones_that_outlived_an_fd_store_restart() {
    let Some(setup) = park_rig::set_up(2 + CLONES as u64) else {
        return;
    };
    let socket = setup.dir.path().join("hugemem.sock");
    let config = setup.dir.path().join("hugemem.toml");
    std::fs::write(&config, "[pool]\nrecheck_ms = 20\n").expect("config");
    let systemd = FakeSystemd::new(setup.dir.path());
    let bin = Path::new(HUGEMEM);
    let mut daemon = systemd.start(bin, &socket, &config);
    wait_until("READY=1", STEP, || systemd.ready_count() == 1);
    let parked_at = park_rig::launch_and_park(&socket, &setup, "tmpl");
    let before = {
        let mut inspector = Client::connect(&socket).expect("connect");
        digest(&template_memory(&mut inspector, "tmpl"))
    };
    let clones: Vec<Clone> = (0..CLONES)
        .map(|i| start_clone(&socket, &setup, "tmpl", i))
        .collect();
    let mut counts: Vec<u64> = clones
        .iter()
        .map(|c| counting(c.vmm, parked_at, "a clone to count on"))
        .collect();
    wait_until("the clones counted", STEP, || {
        park_rig::stats(&socket).parked[0].shared_clones == CLONES as u64
    });

    for (n, (signal, how)) in (0u32..).zip([
        (Signal::SIGTERM, "systemctl restart"),
        (Signal::SIGKILL, "kill -9"),
    ]) {
        daemon.signal(signal);
        let stopped = daemon.wait("the daemon");
        assert!(signal == Signal::SIGKILL || stopped.success(), "{how}");
        daemon = systemd.start(bin, &socket, &config);
        wait_until("READY=1 again", STEP, || systemd.ready_count() == n + 2);
        let s = park_rig::stats(&socket);
        assert_eq!(s.parked.len(), 1, "{how}: the template stays parked: {s}");
        refused_while_clones_run(&socket, &setup, &clones, how);
        for (c, count) in clones.iter().zip(counts.iter_mut()) {
            *count = counting(c.vmm, *count, "a clone to count on after the restart");
        }
        eprintln!("after {how}: the clones count on: {counts:?}");
    }

    for mut c in clones {
        park_rig::stop_launch(&mut c.child);
    }
    {
        let mut inspector = Client::connect(&socket).expect("connect");
        let after = digest(&template_memory(&mut inspector, "tmpl"));
        assert_eq!(after, before, "the template changed");
    }
    wait_until("the test's CLONE ended", STEP, || {
        park_rig::stats(&socket).parked[0].shared_clones == 0
    });
    // The clones gone: it restores and counts on from where it was parked.
    park_rig::restore_and_check(&socket, &setup, "tmpl", parked_at, false);
    daemon.signal(Signal::SIGTERM);
    assert!(daemon.wait("the daemon").success());
}
