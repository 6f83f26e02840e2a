//! What the shared-clone tests across the daemon's restarts share
//! (`clone_ch_restart.rs`, `clone_ch_fdstore.rs`): starting a clone with
//! the real binary, watching it count, and the template's bytes.

#![allow(dead_code)] // Each test binary uses its own subset.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};

use ch_migration::peer::receive_snapshot;
use hugemem_client::client::Client;
use hugemem_client::proto::CloneMode;
use test_support::prelude::wait_until;

use crate::common::park::{clone_spin_state, RAM};
use crate::common::{child_of, StopLauncher};
use crate::park_rig::{Setup, HUGEMEM, STEP};

/// `hugemem launch --clone-of NAME --clone-mode MODE` on the daemon at
/// `socket`, its API at `api`, its stderr `stderr`.
pub fn launch_clone(
    socket: &Path,
    (ch, mode): (&str, &str),
    name: &str,
    api: &Path,
    stderr: Stdio,
) -> Child {
    Command::new("timeout")
        .args(["600", HUGEMEM, "launch", "--socket"])
        .arg(socket)
        .args(["--clone-of", name, "--clone-mode", mode, "--", ch])
        .arg("--api-socket")
        .arg(api)
        .stderr(stderr)
        .spawn()
        .expect("spawn hugemem launch --clone-of")
}

/// The template's memory as a read-only fd: a CLONE by the test itself,
/// which maps nothing (it counts as a clone while `client` lasts).
pub fn template_memory(client: &mut Client, name: &str) -> OwnedFd {
    let (daemon_end, ours) = UnixStream::pair().expect("socketpair");
    let snapshot = std::thread::scope(|s| {
        let receiver = s.spawn(|| receive_snapshot(&ours, ch_migration::Limits::default()));
        client
            .clone_parked(name, CloneMode::Shared, &daemon_end)
            .expect("CLONE of the template");
        drop(daemon_end);
        receiver
            .join()
            .expect("the receiver")
            .expect("the template")
    });
    let mut memory = snapshot.memory;
    assert_eq!(memory.len(), 1, "one slot");
    memory.pop().expect("one slot").1
}

pub use crate::common::park::digest_of;

/// A digest of every byte of the template's memory.
pub fn digest(memory: &OwnedFd) -> u64 {
    digest_of(&std::fs::File::from(memory.try_clone().expect("dup")), RAM)
}

/// A started shared clone: its `timeout` child, the launcher, the VMM.
pub struct Clone {
    /// The `timeout` around the launcher.
    pub child: Child,
    /// The clone's cloud-hypervisor.
    pub vmm: u32,
    _stop: StopLauncher,
}

/// Waits until the clone in `vmm` counts past `past`; its count.
pub fn counting(vmm: u32, past: u64, what: &str) -> u64 {
    let mut last = None;
    wait_until(what, STEP, || {
        last = clone_spin_state(vmm);
        last.as_ref().is_some_and(|s| s.spinning && s.count > past)
    });
    let s = last.expect("a state");
    assert_eq!(s.bad, 0, "{what}: the clone found a page changed");
    s.count
}

/// Shared clone number `i` of `name`, started.
pub fn start_clone(socket: &Path, setup: &Setup, name: &str, i: usize) -> Clone {
    let api = setup.dir.path().join(format!("clone{i}.api"));
    let child = launch_clone(socket, (&setup.ch, "shared"), name, &api, Stdio::inherit());
    let launcher = child_of(child.id());
    let vmm = child_of(launcher);
    Clone {
        child,
        vmm,
        _stop: StopLauncher(launcher),
    }
}
