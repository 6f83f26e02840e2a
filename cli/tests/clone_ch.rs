//! `hugemem launch --clone-of NAME --clone-mode shared` with the real
//! cloud-hypervisor (`scripts/build-cloud-hypervisor`): clones of a
//! parked VM (its template) that map its memory privately.
//!
//! * A launched counting guest (`microguest::spin`) is parked; three
//!   shared clones start from it, each resumes the guest and counts on
//!   from where the template stopped, each on a private (`rw-p`) mapping
//!   of the template's memory, each writing only a few huge pages of its
//!   own (smaps `Private_Hugetlb`, printed).
//! * The template's bytes do not change while the clones run, nor after:
//!   a digest of its whole memory before and after.
//! * While the clones run, UNPARK of the template is refused; another uid
//!   cannot clone it (its names are its own); a clone that would leave
//!   fewer free huge pages than `clones.headroom` is refused, naming the
//!   shortfall. Once the clones end, UNPARK drops the template.
//!
//! Skipped (through the skip helper) without the cloud-hypervisor binary
//! that `CLOUD_HYPERVISOR` names, a usable `/dev/kvm`, 768 free 2 MiB
//! pages or root (the other uid).

mod common;

use std::os::unix::fs::{FileExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

use backend::daemon::ByteSize;
use hugemem_client::client::{Client, ClientError};
use hugemem_client::proto::{CloneMode, Status};
use microguest::{SpinState, SPIN_BLOCK_GPA, SPIN_BLOCK_LEN};
use test_support::hugepages::hold_all_but_2m;
use test_support::prelude::{wait_until, TestDaemon};
use test_support::tenant::{in_child, root_or_skip, NOBODY};

use common::park::{
    child_now, clone_spin_state, digest, guest_memfd_now, guest_ram_mapping, launch_and_park,
    private_hugetlb, set_up, stop, RAM,
};
use common::{child_of, counting_past, spin_state, StopLauncher};

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");
const CLONES: usize = 3;
const PAGE: u64 = 2 << 20;
/// `clones.headroom`: four 2 MiB pages.
const HEADROOM: u64 = 4 * PAGE;

/// `hugemem launch --clone-of NAME --clone-mode MODE` under
/// cloud-hypervisor `ch`, its API at `api`.
fn launch_clone(daemon: &TestDaemon, ch: &str, (name, mode): (&str, &str), api: &Path) -> Child {
    Command::new("timeout")
        .args(["600", HUGEMEM, "launch", "--socket"])
        .arg(daemon.socket())
        .args(["--clone-of", name, "--clone-mode", mode, "--", ch])
        .arg("--api-socket")
        .arg(api)
        .spawn()
        .expect("spawn hugemem launch --clone-of")
}

/// CLONE straight from a client, for a refusal (nothing is sent then).
fn clone_refusal(socket: &Path, name: &str) -> Result<(), (Status, String)> {
    let mut c = Client::connect(socket).map_err(|e| (Status::Internal, e.to_string()))?;
    let (ours, theirs) = UnixStream::pair().map_err(|e| (Status::Internal, e.to_string()))?;
    let got = c.clone_parked(name, CloneMode::Shared, &theirs);
    drop(ours);
    match got {
        Ok(_) => Ok(()),
        Err(ClientError::Refused { status, message }) => Err((status, message)),
        Err(e) => Err((Status::Internal, e.to_string())),
    }
}

#[test]
fn shared_clones_count_on_from_a_template_that_stays_unchanged() {
    if !root_or_skip() {
        return;
    }
    // The template, the shared clones' reservations, one copy clone, and
    // room for the headroom's refusal.
    let Some(setup) = set_up(3 + CLONES as u64) else {
        return;
    };
    let (ch, dir, elf) = (&setup.ch, &setup.dir, &setup.elf);
    let daemon = TestDaemon::start(|c| {
        c.pool.recheck_ms = 20;
        c.allowed_uids = vec![0, NOBODY];
        c.clones.headroom = ByteSize(HEADROOM);
    });
    for (path, mode) in [(daemon.dir(), 0o755), (daemon.socket().as_path(), 0o777)] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }
    let api = dir.path().join("template.sock");
    let (ram, parked) = launch_and_park(&daemon, (ch, elf), &api, "template");
    let before = digest(&ram);

    let mut clones = Vec::new();
    for i in 0..CLONES {
        let api = dir.path().join(format!("clone{i}.sock"));
        let child = launch_clone(&daemon, ch, ("template", "shared"), &api);
        let launcher = child_of(child.id());
        let vmm = child_of(launcher);
        clones.push((child, launcher, vmm, StopLauncher(launcher)));
    }
    for (i, (_, _, vmm, _)) in clones.iter().enumerate() {
        let mut last = None;
        wait_until("a clone to count on", Duration::from_secs(60), || {
            last = clone_spin_state(*vmm);
            last.as_ref()
                .is_some_and(|s| s.spinning && s.count > parked.count + 10)
        });
        let s = last.expect("a state");
        assert_eq!(s.bad, 0, "clone {i} found a page changed");
        let (_, perms) = guest_ram_mapping(*vmm).expect("the clone's guest RAM");
        assert_eq!(perms, "rw-p", "clone {i} maps the template privately");
        let wrote = private_hugetlb(*vmm);
        assert!(
            wrote < RAM / 4,
            "clone {i} wrote {wrote} bytes of huge pages"
        );
        eprintln!(
            "clone {i}: counts on ({} from {}), wrote {} KiB of huge pages privately",
            s.count,
            parked.count,
            wrote >> 10
        );
    }
    let stats = daemon.stats();
    assert_eq!(stats.counters.clones, CLONES as u64, "{stats}");
    assert_eq!(stats.parked.len(), 1, "the template stays parked: {stats}");
    assert_eq!(stats.parked[0].shared_clones, CLONES as u64, "{stats}");
    // What the daemon reports the clones wrote is what their processes hold.
    let vmms: Vec<u32> = clones.iter().map(|c| c.2).collect();
    wait_until(
        "STATS to report what the clones wrote",
        Duration::from_secs(30),
        || {
            let ours: u64 = vmms.iter().map(|v| private_hugetlb(*v)).sum();
            ours > 0 && daemon.stats().parked[0].shared_clone_written_bytes == ours
        },
    );
    eprintln!(
        "the daemon reports {} KiB written by {CLONES} shared clones",
        daemon.stats().parked[0].shared_clone_written_bytes >> 10
    );
    assert_eq!(
        digest(&ram),
        before,
        "the template changed while clones ran"
    );
    assert_eq!(spin_state(&ram).count, parked.count);

    // While they run: UNPARK refused; another uid cannot clone it.
    let mut owner = daemon.client();
    match owner.unpark("template") {
        Err(ClientError::Refused { status, message }) => {
            assert_eq!(status, Status::Invalid, "{message}");
            assert!(message.contains("3 running shared clone"), "{message}");
        }
        other => panic!("UNPARK of a template with clones: {other:?}"),
    }
    let socket = daemon.socket();
    let code = in_child(Some(NOBODY), move || {
        match clone_refusal(&socket, "template") {
            Err((Status::NotFound, _)) => 0,
            Ok(()) => 20,
            Err(_) => 21,
        }
    });
    assert_eq!(code, 0, "uid {NOBODY} cloning root's template");

    // The headroom: one page short.
    let need = RAM / PAGE;
    let hog = hold_all_but_2m(need + HEADROOM / PAGE - 1);
    let refused = clone_refusal(&daemon.socket(), "template");
    drop(hog);
    match refused {
        Err((Status::NoMemory, msg)) => {
            assert!(msg.contains("short by 1"), "{msg}");
            eprintln!("refused at the headroom: {msg}");
        }
        other => panic!("a clone past the headroom: {other:?}"),
    }

    // A copy clone beside them: its own pool memory, mapped shared.
    let active = daemon.stats().allocations.active;
    let api = dir.path().join("copy.sock");
    let clones_before = daemon.stats().counters.clones;
    let mut copy = launch_clone(&daemon, ch, ("template", "copy"), &api);
    let copy_launcher = child_of(copy.id());
    let copy_vmm = child_of(copy_launcher);
    let _copy_guard = StopLauncher(copy_launcher);
    let mut last = None;
    wait_until(
        "the copy clone to count on",
        Duration::from_secs(60),
        || {
            last = clone_spin_state(copy_vmm);
            last.as_ref()
                .is_some_and(|s| s.spinning && s.count > parked.count + 10)
        },
    );
    assert_eq!(
        last.map(|s| s.bad),
        Some(0),
        "the copy found a page changed"
    );
    let (_, perms) = guest_ram_mapping(copy_vmm).expect("the copy's guest RAM");
    assert_eq!(perms, "rw-s", "a copy clone's memory is mapped shared");
    let stats = daemon.stats();
    assert_eq!(
        stats.allocations.active,
        active + 1,
        "the copy's allocation: {stats}"
    );
    // Its RESTORE ends once the copy is filled and cloud-hypervisor had
    // every page; a VMM stopped before that ends its fault connection
    // early, and the restore fails (a refusal more).
    wait_filled(&daemon);
    daemon.wait_stats(Duration::from_secs(60), "the copy's RESTORE done", |s| {
        s.counters.clones == clones_before + 1
    });
    stop(copy_launcher, &mut copy);
    daemon.wait_stats(Duration::from_secs(30), "the copy freed", |s| {
        s.allocations.active == active
    });
    assert_eq!(digest(&ram), before, "a copy clone changed the template");

    for (mut child, launcher, _, _guard) in clones {
        stop(launcher, &mut child);
    }
    wait_until(
        "the clones' connections closed",
        Duration::from_secs(30),
        || owner.unpark("template").is_ok(),
    );
    assert_eq!(digest(&ram), before, "the template changed");
    let stats = daemon.stats();
    assert!(stats.parked.is_empty(), "{stats}");
    assert_eq!(stats.counters.clones_refused, 2, "{stats}");
    drop(ram);
    daemon.shutdown();
}

/// One VM being started: when its launch was spawned, the `timeout`
/// process that runs the launcher, and what has been found of it.
struct Starting {
    spawned: std::time::Instant,
    child: Child,
    launcher: Option<u32>,
    vmm: Option<u32>,
    ram: Option<std::fs::File>,
    running: Option<Duration>,
}

impl Starting {
    fn spawn(child: Child, spawned: std::time::Instant) -> Self {
        Self {
            spawned,
            child,
            launcher: None,
            vmm: None,
            ram: None,
            running: None,
        }
    }

    /// One look: true once its guest counts past `past` (the time from the
    /// spawn to that look is kept).
    fn look(&mut self, past: u64) -> bool {
        if self.running.is_some() {
            return true;
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
        let counts = ram.read_exact_at(&mut block, SPIN_BLOCK_GPA).is_ok()
            && SpinState::parse(&block).is_some_and(|s| s.spinning && s.count > past);
        if counts {
            self.running = Some(self.spawned.elapsed());
        }
        counts
    }
}

/// Looks at every one of `vms` in turn, 0.2 ms apart, until each guest
/// counts past `past` (within 60 s).
fn wait_running(vms: &mut [Starting], past: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let mut all = true;
        for vm in vms.iter_mut() {
            all &= vm.look(past);
        }
        if all {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "a guest did not run");
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// `hugemem launch --clone-of NAME --clone-mode copy [--copy-eager]`.
fn launch_copy(daemon: &TestDaemon, ch: &str, name: &str, api: &Path, eager: bool) -> Child {
    let mut cmd = Command::new("timeout");
    cmd.args(["600", HUGEMEM, "launch", "--socket"])
        .arg(daemon.socket())
        .args(["--clone-of", name, "--clone-mode", "copy"]);
    if eager {
        cmd.arg("--copy-eager");
    }
    cmd.args(["--", ch])
        .arg("--api-socket")
        .arg(api)
        .spawn()
        .expect("spawn hugemem launch --clone-of --clone-mode copy")
}

/// Waits until no copy clone of a parked VM is being filled.
fn wait_filled(daemon: &TestDaemon) {
    daemon.wait_stats(Duration::from_secs(120), "the copies filled", |s| {
        s.parked.iter().all(|p| p.copy_clones_filling == 0)
    });
}

fn ms(d: Option<Duration>) -> f64 {
    d.map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)
}

/// Copy clones in postcopy mode (the default), several at once: each runs
/// at once on its own pool memory (`rw-s`), counting on from the parked
/// count, every page filled from the template as the guest touches it and
/// in the background; the template stays unchanged. Printed: the time from
/// each launch's spawn to its guest counting on, for the postcopy copies,
/// an eager copy (`--copy-eager`) and a RESTORE of the same template from
/// the park (the floor: the same protocol with the memory handed over),
/// all measured the same way.
#[test]
fn copy_clones_run_at_once_and_fill_from_the_template_as_they_run() {
    const COPIES: usize = 3;
    // The template and the copies.
    let Some(setup) = set_up(1 + COPIES as u64) else {
        return;
    };
    let (ch, dir, elf) = (&setup.ch, &setup.dir, &setup.elf);
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let api = dir.path().join("template.sock");
    let (ram, parked) = launch_and_park(&daemon, (ch, elf), &api, "template");
    let before = digest(&ram);

    let mut copies: Vec<Starting> = (0..COPIES)
        .map(|i| {
            let api = dir.path().join(format!("copy{i}.sock"));
            let spawned = std::time::Instant::now();
            Starting::spawn(launch_copy(&daemon, ch, "template", &api, false), spawned)
        })
        .collect();
    wait_running(&mut copies, parked.count);
    let mut guards = Vec::new();
    for (i, c) in copies.iter().enumerate() {
        let vmm = c.vmm.expect("a clone's VMM");
        guards.push(StopLauncher(c.launcher.expect("a launcher")));
        let s = counting_past(c.ram.as_ref().expect("its memory"), parked.count + 10, "on");
        assert_eq!(s.bad, 0, "copy {i} found a page changed");
        let (_, perms) = guest_ram_mapping(vmm).expect("the copy's guest RAM");
        assert_eq!(perms, "rw-s", "copy {i}'s memory is its own, mapped shared");
        eprintln!(
            "postcopy copy clone {i} of {COPIES} started at once: counting on {:.1} ms after its launch was spawned",
            ms(c.running)
        );
    }
    let stats = daemon.stats();
    assert_eq!(stats.allocations.active, 1 + COPIES as u64, "{stats}");
    assert_eq!(stats.parked.len(), 1, "the template stays parked: {stats}");
    assert_eq!(
        digest(&ram),
        before,
        "the template changed while copies ran"
    );
    // Each guard's SIGTERM stops its launcher, which frees its copy; once
    // the copies are filled (a VMM stopped before ends its fault
    // connection early, and its RESTORE fails).
    wait_filled(&daemon);
    drop(guards);
    for mut vm in copies {
        let status = vm.child.wait().expect("wait for a launcher");
        assert_ne!(
            status.code(),
            Some(124),
            "a launcher did not finish in time"
        );
    }
    daemon.wait_stats(Duration::from_secs(30), "the copies freed", |s| {
        s.allocations.active == 1
    });

    // One at a time: postcopy, then eager (`--copy-eager`).
    for (eager, what) in [(false, "postcopy"), (true, "eager (--copy-eager)")] {
        let api = dir.path().join(format!("alone-{eager}.sock"));
        let spawned = std::time::Instant::now();
        let child = launch_copy(&daemon, ch, "template", &api, eager);
        let mut alone = [Starting::spawn(child, spawned)];
        wait_running(&mut alone, parked.count);
        let [mut alone] = alone;
        let s = counting_past(
            alone.ram.as_ref().expect("its memory"),
            parked.count + 10,
            "on",
        );
        assert_eq!(s.bad, 0, "the {what} copy found a page changed");
        eprintln!(
            "{what} copy clone alone: counting on {:.1} ms after its launch was spawned",
            ms(alone.running)
        );
        wait_filled(&daemon);
        stop(alone.launcher.expect("a launcher"), &mut alone.child);
        daemon.wait_stats(Duration::from_secs(30), "the copy freed", |s| {
            s.allocations.active == 1
        });
    }
    let stats = daemon.stats();
    assert_eq!(stats.counters.clones, COPIES as u64 + 2, "{stats}");
    assert_eq!(digest(&ram), before, "the template changed");
    // The floor: a RESTORE of the same template from the park.
    let api = dir.path().join("restored.sock");
    let spawned = std::time::Instant::now();
    let mut restored = [Starting::spawn(
        common::park::restore(&daemon, ch, "template", &api),
        spawned,
    )];
    wait_running(&mut restored, parked.count);
    let [mut restored] = restored;
    eprintln!(
        "RESTORE of the template from the park: counting on {:.1} ms after its launch was spawned",
        ms(restored.running)
    );
    let s = counting_past(&ram, parked.count + 10, "the restored template to count on");
    assert_eq!(s.bad, 0, "the restored template found a page changed");
    drop(ram);
    let launcher = restored.launcher.expect("a launcher");
    common::park::stop_and_settle(&daemon, launcher, &mut restored.child);
    daemon.shutdown();
}
