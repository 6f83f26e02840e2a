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

use std::hash::Hasher;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

use backend::daemon::ByteSize;
use hugemem_client::client::{Client, ClientError};
use hugemem_client::proto::{CloneMode, Status};
use test_support::hugepages::hugepages_2m;
use test_support::prelude::{wait_until, TestDaemon};
use test_support::tenant::{in_child, root_or_skip, NOBODY};

use common::park::{
    clone_spin_state, guest_ram_mapping, launch_counting, park, private_hugetlb, set_up, stop, RAM,
};
use common::{child_of, counting_past, launched_guest_ram, spin_state, StopLauncher};

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

/// A digest of every byte of `ram`.
fn digest(ram: &std::fs::File) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let mut buf = vec![0u8; 8 << 20];
    let mut off = 0;
    while off < RAM {
        ram.read_exact_at(&mut buf, off).expect("read the template");
        h.write(&buf);
        off += buf.len() as u64;
    }
    h.finish()
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

/// Reserves (without faulting) all but `leave` of the host's free,
/// unreserved 2 MiB pages, until dropped.
struct Hog(*mut libc::c_void, usize);

impl Hog {
    fn leaving(leave: u64) -> Self {
        let spare = hugepages_2m("free_hugepages") - hugepages_2m("resv_hugepages");
        let len = usize::try_from(spare.saturating_sub(leave) * PAGE).expect("a length");
        // SAFETY: a fresh anonymous hugetlb mapping (reserved, not faulted);
        // it aliases nothing and is unmapped by Drop.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED, "reserve {len} bytes of 2 MiB pages");
        Self(p, len)
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        // SAFETY: the mapping Hog::leaving made, unmapped once.
        unsafe { libc::munmap(self.0, self.1) };
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
    let mut launch = launch_counting(&daemon, ch, &api, elf);
    let launcher = child_of(launch.id());
    let ram = launched_guest_ram(launcher, child_of(launcher));
    counting_past(&ram, 0, "the guest to spin");
    let said = park(&daemon, "template", &api);
    assert!(said.contains("parked as template"), "{said}");
    assert!(launch.wait().expect("the launcher ends").success());
    let parked = spin_state(&ram);
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
    let hog = Hog::leaving(need + HEADROOM / PAGE - 1);
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
