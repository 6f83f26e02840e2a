//! Shared clones with the real binary, the real cloud-hypervisor and the
//! project's counting guest, the daemon a process of its own:
//!
//! * A takeover (`hugemem serve --takeover`, as an upgrade does) with a
//!   template parked and shared clones running: the clones keep running
//!   and counting on, the successor counts them against the template, the
//!   template's bytes do not change, and once the clones end the template
//!   is still parked: it restores and counts on from where it was parked.
//! * A template on a named tap with a vsock, cloned in both modes: a
//!   shared clone's launcher (a copy clone's daemon) gives the clone a new
//!   tap of its own (cloud-hypervisor creates it, and it goes with the
//!   clone) and a vsock socket of its own (bound by the clone's
//!   cloud-hypervisor), the launcher says so naming both, and the clone
//!   counts on.
//!
//! Skipped (through the skip helper) without the cloud-hypervisor binary
//! that `CLOUD_HYPERVISOR` names, a usable `/dev/kvm`, the huge pages, or
//! (the tap) a tap the host lets root create.

mod common;
mod park_rig;

use std::hash::Hasher;
use std::io::{BufRead, BufReader};
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};

use ch_migration::peer::receive_snapshot;
use hugemem_client::client::{Client, ClientError};
use hugemem_client::proto::{CloneMode, Status};
use park_rig::{Setup, HUGEMEM, STEP};
use test_support::prelude::wait_until;

use common::park::{clone_spin_state, guest_ram_mapping, RAM};
use common::{child_of, StopLauncher};

const CLONES: usize = 2;

/// `hugemem launch --clone-of NAME --clone-mode MODE` on the daemon at
/// `socket`, its API at `api`, its stderr `stderr`.
fn launch_clone(
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
fn template_memory(client: &mut Client, name: &str) -> OwnedFd {
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

/// A digest of every byte of the template's memory.
fn digest(memory: &OwnedFd) -> u64 {
    let file = std::fs::File::from(memory.try_clone().expect("dup"));
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let mut buf = vec![0u8; 8 << 20];
    let mut off = 0;
    while off < RAM {
        file.read_exact_at(&mut buf, off)
            .expect("read the template");
        h.write(&buf);
        off += buf.len() as u64;
    }
    h.finish()
}

/// A started shared clone: its `timeout` child, the launcher, the VMM.
struct Clone {
    child: Child,
    vmm: u32,
    _stop: StopLauncher,
}

/// Waits until the clone in `vmm` counts past `past`; its count.
fn counting(vmm: u32, past: u64, what: &str) -> u64 {
    let mut last = None;
    wait_until(what, STEP, || {
        last = clone_spin_state(vmm);
        last.as_ref().is_some_and(|s| s.spinning && s.count > past)
    });
    let s = last.expect("a state");
    assert_eq!(s.bad, 0, "{what}: the clone found a page changed");
    s.count
}

fn start_clone(socket: &Path, setup: &Setup, name: &str, i: usize) -> Clone {
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

#[test]
fn shared_clones_run_on_across_a_takeover_and_their_template_stays_parked() {
    let Some(setup) = park_rig::set_up(2 + CLONES as u64) else {
        return;
    };
    let socket = setup.dir.path().join("hugemem.sock");
    let config = setup.dir.path().join("hugemem.toml");
    std::fs::write(&config, "[pool]\nrecheck_ms = 20\n").expect("config");
    let mut old = park_rig::serving(&socket, &config);
    let parked_at = park_rig::launch_and_park(&socket, &setup, "tmpl");
    let mut inspector = Client::connect(&socket).expect("connect");
    let template = template_memory(&mut inspector, "tmpl");
    let before = digest(&template);

    let clones: Vec<Clone> = (0..CLONES)
        .map(|i| start_clone(&socket, &setup, "tmpl", i))
        .collect();
    let counts: Vec<u64> = clones
        .iter()
        .map(|c| counting(c.vmm, parked_at, "a clone to count on"))
        .collect();
    for c in &clones {
        let (_, perms) = guest_ram_mapping(c.vmm).expect("the clone's guest RAM");
        assert_eq!(perms, "rw-p", "a shared clone maps the template privately");
    }
    // The test's own CLONE counts too, while its connection lasts.
    let running = CLONES as u64 + 1;
    assert_eq!(park_rig::stats(&socket).parked[0].shared_clones, running);

    let mut new = park_rig::serve(&socket, &config, true);
    assert!(old.wait("the old daemon").success(), "the takeover");
    let s = park_rig::stats(&socket);
    assert_eq!(s.pid, new.0.id(), "served by the successor");
    assert_eq!(s.counters.takeovers, 1, "{s}");
    assert_eq!(s.parked.len(), 1, "the template stays parked: {s}");
    assert_eq!(
        s.parked[0].shared_clones, running,
        "the clones count on: {s}"
    );
    for (c, count) in clones.iter().zip(&counts) {
        let now = counting(c.vmm, *count, "a clone to count on after the takeover");
        eprintln!("a clone counted from {parked_at} to {count} before the takeover, {now} after");
    }
    match Client::connect(&socket).expect("connect").unpark("tmpl") {
        Err(ClientError::Refused { status, message }) => {
            assert_eq!(status, Status::Invalid, "{message}");
            assert!(
                message.contains(&format!("{running} running shared clone")),
                "{message}"
            );
        }
        other => panic!("UNPARK of a template with clones after a takeover: {other:?}"),
    }
    assert_eq!(digest(&template), before, "the template changed");

    for mut c in clones {
        park_rig::stop_launch(&mut c.child);
    }
    drop((template, inspector));
    wait_until("the clones' connections ended", STEP, || {
        park_rig::stats(&socket).parked[0].shared_clones == 0
    });
    // Still parked, unchanged: it restores and counts on from its count.
    park_rig::restore_and_check(&socket, &setup, "tmpl", parked_at, false);
    new.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(new.wait("the successor").success());
}

/// `ip ARGS`, as root; whether it succeeded.
fn ip(args: &[&str]) -> bool {
    Command::new("ip")
        .args(args)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A persistent tap, deleted when dropped.
struct Tap(&'static str);

impl Drop for Tap {
    fn drop(&mut self) {
        ip(&["tuntap", "del", "dev", self.0, "mode", "tap"]);
    }
}

#[test]
fn a_clone_of_a_template_on_a_named_tap_with_a_vsock_gets_its_own_and_says_so() {
    const TAP: &str = "hmtpltap0";
    let Some(setup) = park_rig::set_up(3) else {
        return;
    };
    if !nix::unistd::Uid::effective().is_root()
        || !ip(&["tuntap", "add", "dev", TAP, "mode", "tap"])
    {
        test_support::skip!("cannot create the tap {TAP} (root and `ip tuntap` needed)");
        return;
    }
    let _tap = Tap(TAP);
    let socket = setup.dir.path().join("hugemem.sock");
    let config = setup.dir.path().join("hugemem.toml");
    std::fs::write(&config, "[pool]\nrecheck_ms = 20\n").expect("config");
    let mut daemon = park_rig::serving(&socket, &config);
    let api = setup.dir.path().join("tmpl.api");
    let vsock = setup.dir.path().join("v.sock");
    let mut launch = Command::new("timeout")
        .args(["600", HUGEMEM, "launch", "--socket"])
        .arg(&socket)
        .args([
            "--size",
            "256M",
            "--page-size",
            "2M",
            "--",
            &setup.ch,
            "--api-socket",
        ])
        .arg(&api)
        .arg("--kernel")
        .arg(&setup.elf)
        .args(["--cpus", "boot=1", "--serial", "null", "--console", "off"])
        .args(["--net", &format!("tap={TAP},id=net0")])
        .arg("--vsock")
        .arg(format!("cid=3,socket={},id=vsock0", vsock.display()))
        .spawn()
        .expect("spawn hugemem launch");
    let launcher = child_of(launch.id());
    let ram = common::launched_guest_ram(launcher, child_of(launcher));
    common::counting_past(&ram, 0, "the template to spin");
    let said = park_rig::run_ok(
        &socket,
        &[
            "park".as_ref(),
            "tmpl".as_ref(),
            "--api-socket".as_ref(),
            api.as_os_str(),
        ],
    );
    assert!(said.contains("parked as tmpl"), "{said}");
    assert!(launch.wait().expect("the launcher").success());
    let parked_at = common::spin_state(&ram).count;
    drop(ram);

    // A shared clone's launcher replaces them; for a copy clone the daemon
    // does, and the launcher says what it replied.
    for mode in ["shared", "copy"] {
        let clone_api = setup.dir.path().join(format!("clone-{mode}.api"));
        let mut child = launch_clone(
            &socket,
            (&setup.ch, mode),
            "tmpl",
            &clone_api,
            Stdio::piped(),
        );
        let launcher = child_of(child.id());
        let _stop = StopLauncher(launcher);
        let new_tap = format!("hmc{launcher}n0");
        let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
        let said = lines
            .by_ref()
            .map_while(Result::ok)
            .find(|l| l.contains("clone of tmpl: net0"))
            .expect("the launcher says what it replaced");
        let said_vsock = lines
            .by_ref()
            .map_while(Result::ok)
            .find(|l| l.contains("clone of tmpl: vsock0"))
            .expect("the launcher says what it replaced");
        eprintln!("{said}\n{said_vsock}");
        let clone_vsock = format!("{}.clone-{launcher}", vsock.display());
        assert!(
            said_vsock.contains(&format!("is replaced by {clone_vsock}"))
                && said_vsock.contains("CID 3 stays"),
            "{said_vsock}"
        );
        // Keep draining the launcher's stderr.
        let drain =
            std::thread::spawn(move || lines.map_while(Result::ok).for_each(|l| eprintln!("{l}")));
        assert!(
            said.contains(&format!(
                "the template's tap {TAP} is replaced by a new tap {new_tap}"
            )),
            "{said}"
        );
        let vmm = child_of(launcher);
        counting(
            vmm,
            parked_at,
            &format!("the {mode} clone on its own tap to count on"),
        );
        assert!(
            Path::new("/sys/class/net").join(&new_tap).exists(),
            "the clone's tap {new_tap} exists"
        );
        let bound = std::fs::symlink_metadata(&clone_vsock).expect("the clone's vsock socket");
        assert!(
            std::os::unix::fs::FileTypeExt::is_socket(&bound.file_type()),
            "{clone_vsock} is a socket"
        );
        park_rig::stop_launch(&mut child);
        drain.join().expect("the drain");
        assert!(
            !Path::new("/sys/class/net").join(&new_tap).exists(),
            "the clone's tap {new_tap} went with it"
        );
        assert!(
            Path::new("/sys/class/net").join(TAP).exists(),
            "the template's tap stays"
        );
    }
    wait_until("UNPARK once the clone's connection ended", STEP, || {
        Client::connect(&socket).is_ok_and(|mut c| c.unpark("tmpl").is_ok())
    });
    daemon.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(daemon.wait("the daemon").success());
}
