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
//! * A takeover while a copy clone (postcopy, the default) of a 1 GiB
//!   template is being filled: the running daemon waits for the clone's
//!   RESTORE (its reply comes once every page is filled and the clone's
//!   cloud-hypervisor has them all), then hands over; the clone runs on,
//!   its pages are the template's, the template is unchanged and the books
//!   balance. A clone whose page faults the test holds keeps its RESTORE
//!   going past the 10 s a takeover waits: the takeover is refused, the
//!   daemon serves on, the clone runs once its faults pass, and the next
//!   takeover carries it.
//!
//! Skipped (through the skip helper) without the cloud-hypervisor binary
//! that `CLOUD_HYPERVISOR` names, a usable `/dev/kvm`, the huge pages, or
//! (the tap) a tap the host lets root create.

mod clone_rig;
mod common;
mod park_rig;

use std::io::{BufRead, BufReader};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ch_migration::Command as Step;
use clone_rig::{counting, digest, digest_of, launch_clone, start_clone, template_memory, Clone};
use hugemem_client::client::{Client, ClientError};
use hugemem_client::park::RestoreOptions;
use hugemem_client::proto::Status;
use park_rig::{fault_relay, relay, Cut, Gate, Setup, HUGEMEM, STEP};
use test_support::prelude::wait_until;

use common::park::{guest_ram_mapping, RAM, START_GPA};
use common::{child_of, StopLauncher};

const CLONES: usize = 2;

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

/// The copy-clone takeover test's template: 1 GiB, so that its copy's
/// fill lasts long enough for a takeover to meet it.
const BIG: u64 = 1 << 30;

/// `hugemem launch` of the counting guest on [`BIG`] bytes of 2 MiB pages,
/// parked as `name`: its memory (the launcher's memfd, which the daemon
/// keeps) and its count once parked.
fn launch_and_park_big(socket: &Path, setup: &Setup, name: &str) -> (std::fs::File, u64) {
    let api = setup.dir.path().join(format!("{name}-launch.api"));
    let mut launch = Command::new("timeout")
        .args(["600", HUGEMEM, "launch", "--socket"])
        .arg(socket)
        .args(["--size", "1G", "--page-size", "2M", "--", &setup.ch])
        .arg("--api-socket")
        .arg(&api)
        .arg("--kernel")
        .arg(&setup.elf)
        .args(["--cpus", "boot=1", "--serial", "null", "--console", "off"])
        .spawn()
        .expect("spawn hugemem launch");
    let launcher = child_of(launch.id());
    let ram = common::launched_guest_ram(launcher, child_of(launcher));
    common::counting_past(&ram, 0, "the template to spin");
    let said = park_rig::run_ok(
        socket,
        &[
            "park".as_ref(),
            name.as_ref(),
            "--api-socket".as_ref(),
            api.as_os_str(),
        ],
    );
    assert!(said.contains(&format!("parked as {name}")), "{said}");
    assert!(launch.wait().expect("the launcher").success());
    let count = common::spin_state(&ram).count;
    (ram, count)
}

/// 4 KiB pages of `clone` that differ from `template`'s above the guest's
/// own area (its image, stack and spin block, which a running guest
/// writes: below `IMAGE_END_GPA` and `START_GPA`), over the first `len`
/// bytes: stale or foreign pages.
fn stale_pages(clone: &std::fs::File, template: &std::fs::File, len: u64) -> u64 {
    const CHUNK: u64 = 8 << 20;
    let (mut ours, mut theirs) = (vec![0u8; CHUNK as usize], vec![0u8; CHUNK as usize]);
    let own_end = microguest::IMAGE_END_GPA
        .max(START_GPA)
        .next_multiple_of(4096);
    let (mut stale, mut off) = (0, own_end);
    while off < len {
        let n = CHUNK.min(len - off) as usize;
        clone
            .read_exact_at(&mut ours[..n], off)
            .expect("read the clone");
        template
            .read_exact_at(&mut theirs[..n], off)
            .expect("read the template");
        stale += ours[..n]
            .chunks(4096)
            .zip(theirs[..n].chunks(4096))
            .filter(|(a, b)| a != b)
            .count() as u64;
        off += n as u64;
    }
    stale
}

/// Waits until the daemon on `socket` holds `active` allocations and
/// nothing in quarantine; its books balance.
fn settled(socket: &Path, active: u64, what: &str) {
    let mut last = None;
    wait_until(what, STEP, || {
        let s = park_rig::stats(socket);
        let done = s.allocations.active == active && s.pool_sum(|p| p.quarantined_bytes) == 0;
        last = Some(s);
        done
    });
    common::assert_balanced(&last.expect("stats"), what);
}

/// Where the takeover test's daemon listens, its configuration, the
/// parked template's memory and its count.
struct Rig<'a> {
    setup: &'a Setup,
    socket: &'a Path,
    config: &'a Path,
    template: &'a std::fs::File,
    parked_at: u64,
    /// Allocations with the template parked alone.
    active: u64,
}

/// A copy clone through the launcher (postcopy, the default: its guest
/// runs at once, its memory is filled meanwhile) and a takeover asked as
/// soon as it runs: `first` waits for the clone's RESTORE and hands over.
/// The successor.
fn copy_clone_across_a_takeover(
    rig: &Rig<'_>,
    mut first: test_support::process::ServeProcess,
) -> test_support::process::ServeProcess {
    let api = rig.setup.dir.path().join("copy.api");
    let mut child = Command::new("timeout")
        .args(["600", HUGEMEM, "launch", "--socket"])
        .arg(rig.socket)
        .args([
            "--clone-of",
            "tmpl",
            "--clone-mode",
            "copy",
            "--",
            &rig.setup.ch,
        ])
        .arg("--api-socket")
        .arg(&api)
        .spawn()
        .expect("spawn hugemem launch --clone-of");
    let launcher = child_of(child.id());
    let _stop = StopLauncher(launcher);
    let ram = common::park::memfd_of(child_of(launcher));
    let count = common::counting_past(&ram, rig.parked_at, "the copy clone to count on").count;
    let filling = park_rig::stats(rig.socket).parked[0].copy_clones_filling;
    let asked = Instant::now();
    let second = park_rig::serve(rig.socket, rig.config, true);
    assert!(
        first.wait("the first daemon").success(),
        "the takeover waits for the copy's RESTORE"
    );
    eprintln!(
        "a takeover asked with {filling} copy clone(s) filling went through in {:.2} s",
        asked.elapsed().as_secs_f64()
    );
    let s = park_rig::stats(rig.socket);
    assert_eq!(s.pid, second.0.id(), "served by the successor: {s}");
    assert_eq!(s.parked.len(), 1, "the template stays parked: {s}");
    assert_eq!(s.parked[0].copy_clones_filling, 0, "{s}");
    assert_eq!(s.allocations.active, rig.active + 1, "and the copy: {s}");
    let state = common::counting_past(&ram, count, "the copy clone to count on after the takeover");
    assert_eq!(state.bad, 0, "the copy clone found a page changed");
    assert_eq!(stale_pages(&ram, rig.template, BIG), 0, "the copy's pages");
    drop(ram);
    park_rig::stop_launch(&mut child);
    settled(rig.socket, rig.active, "the copy clone stopped");
    second
}

/// A copy clone whose page faults the test holds (it plays the launcher):
/// its RESTORE lasts past the 10 s a takeover waits, so `second` refuses
/// the takeover and serves on; once the faults pass the clone runs, and
/// the next takeover carries it. The successor.
fn held_copy_clone_refuses_a_takeover(
    rig: &Rig<'_>,
    mut second: test_support::process::ServeProcess,
) -> test_support::process::ServeProcess {
    let rx = park_rig::Receiver::start(&rig.setup.ch, rig.setup.dir.path(), "held", true);
    let main = rx.connect();
    let gate = Gate::closed();
    let fault = fault_relay(rx.connect(), &gate);
    let (daemon_end, ours) = UnixStream::pair().expect("socketpair");
    let (tx, memory) = mpsc::channel();
    let passed = relay(ours, main, Cut::Never, || {}, Some(tx));
    let at = rig.socket.to_owned();
    let restorer = std::thread::spawn(move || {
        let mut client = Client::connect(&at).expect("connect");
        client
            .set_timeout(Some(Duration::from_secs(120)))
            .expect("timeout");
        let how = RestoreOptions {
            paused: false,
            fault: Some(&fault),
            copy: true,
        };
        let r = client.restore_with("tmpl", &daemon_end, how);
        (client, r)
    });
    wait_until("the held copy clone runs", STEP, || {
        rx.api
            .vm_state(Duration::from_secs(5))
            .is_ok_and(|s| s == "Running")
    });
    let out = Command::new("timeout")
        .args(["120", HUGEMEM, "serve", "--takeover", "--config"])
        .arg(rig.config)
        .arg("--socket")
        .arg(rig.socket)
        .output()
        .expect("run hugemem serve --takeover");
    let said = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "a takeover went through while a copy clone's RESTORE ran: {said}"
    );
    assert!(said.contains("did not park within 10 s"), "{said}");
    let s = park_rig::stats(rig.socket);
    assert_eq!(
        (s.pid, s.parked.len()),
        (second.0.id(), 1),
        "the daemon serves on: {s}"
    );
    gate.open();
    let held = park_rig::memory_file(&memory);
    let state = common::counting_past(
        &held,
        rig.parked_at,
        "the held clone to run once its faults pass",
    );
    assert_eq!(state.bad, 0, "the held clone found a page changed");
    let (mut client, restored) = restorer.join().expect("the restore");
    let copy = restored.expect("the copy clone's RESTORE ended after the refused takeover");
    assert_eq!(
        passed.join().expect("relay").commands.last(),
        Some(&Step::Complete)
    );
    let third = park_rig::serve(rig.socket, rig.config, true);
    assert!(
        second.wait("the second daemon").success(),
        "a takeover once the copy is whole"
    );
    let s = client
        .stats()
        .expect("STATS on the connection that travelled");
    assert_eq!(s.pid, third.0.id(), "{s}");
    assert_eq!(
        (s.parked.len(), s.allocations.active),
        (1, rig.active + 1),
        "{s}"
    );
    let now = common::spin_state(&held).count;
    common::counting_past(&held, now, "the held clone to count on after the takeover");
    assert_eq!(
        stale_pages(&held, rig.template, BIG),
        0,
        "the held copy's pages"
    );
    rx.kill();
    drop(held);
    let id = copy.id;
    drop(copy);
    client.free(id).expect("FREE on the successor");
    settled(rig.socket, rig.active, "the held clone freed");
    third
}

#[test]
fn a_takeover_while_a_copy_clone_fills_waits_for_it_or_is_refused_and_the_clone_runs_on() {
    // The template and one copy at a time.
    let Some(setup) = park_rig::set_up(2 * BIG / RAM) else {
        return;
    };
    let socket = setup.dir.path().join("hugemem.sock");
    let config = setup.dir.path().join("hugemem.toml");
    std::fs::write(&config, "[pool]\nrecheck_ms = 20\n").expect("config");
    let first = park_rig::serving(&socket, &config);
    let (template, parked_at) = launch_and_park_big(&socket, &setup, "tmpl");
    let before = digest_of(&template, BIG);
    let rig = Rig {
        setup: &setup,
        socket: &socket,
        config: &config,
        template: &template,
        parked_at,
        active: park_rig::stats(&socket).allocations.active,
    };
    let second = copy_clone_across_a_takeover(&rig, first);
    let mut third = held_copy_clone_refuses_a_takeover(&rig, second);
    assert_eq!(digest_of(&template, BIG), before, "the template changed");
    third.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(third.wait("the third daemon").success());
}
