//! Faults of a restore with the real cloud-hypervisor and the project's
//! counting guest (issue 43); the daemon runs in this process.
//!
//! * The restoring cloud-hypervisor killed at each step of the restore
//!   (before `Start`, after `MemoryFd`, `Config`, `State`, before
//!   `Complete`; moved and on demand): the test plays the launcher and
//!   passes the daemon's requests on through a relay that kills the
//!   process at the step. The VM stays parked each time, and the next
//!   cloud-hypervisor runs it: its counter goes on from where it was
//!   parked, no page changed. Killed after it ran the VM, the VM is gone
//!   with it (its own process was running it) and its memory comes back.
//! * The launcher of an on-demand restore killed while the guest runs:
//!   the guest's faults are still served (it counts on), the restore ends,
//!   and once its cloud-hypervisor is gone every page is back.
//!
//! Skipped (through the skip helper) without the cloud-hypervisor binary
//! that `CLOUD_HYPERVISOR` names, a usable `/dev/kvm` or the huge pages.

mod common;
mod park_rig;

use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::time::Duration;

use backend::client::{Client, ClientError};
use ch_migration::Command as Step;
use park_rig::{memory_file, relay, Cut, Receiver, Setup};
use test_support::hugepages::hugepages_2m;
use test_support::prelude::TestDaemon;

use common::{assert_balanced, child_of, counting_past};

const SETTLE: Duration = Duration::from_secs(60);

/// The steps a restoring cloud-hypervisor is killed at.
const CUTS: [Cut; 5] = [
    Cut::Before(Step::Start),
    Cut::After(Step::MemoryFd),
    Cut::After(Step::Config),
    Cut::After(Step::State),
    Cut::Before(Step::Complete),
];

/// One RESTORE of `name` to a new cloud-hypervisor through a relay that
/// cuts at `cut`: the reply, what passed, and the receiver (and its
/// memory fd when the relay passed one on).
fn restore_through(
    client: &mut Client,
    setup: &Setup,
    tag: &str,
    name: &str,
    cut: Cut,
    on_demand: bool,
) -> (
    Result<hugemem_client::client::Allocation, ClientError>,
    park_rig::Relayed,
    Receiver,
    mpsc::Receiver<std::os::fd::OwnedFd>,
) {
    let rx = Receiver::start(&setup.ch, setup.dir.path(), tag, on_demand);
    let main = rx.connect();
    // Its second connection is the fault connection (postcopy).
    let fault = on_demand.then(|| rx.connect());
    let (daemon_end, ours) = UnixStream::pair().expect("socketpair");
    let (tx, memory) = mpsc::channel();
    let kill: Box<dyn FnOnce() + Send> = match cut {
        Cut::Never => Box::new(|| {}),
        _ => Box::new(rx.killer()),
    };
    let passed = relay(ours, main, cut, kill, Some(tx));
    let r = match &fault {
        Some(f) => client.restore_postcopy(name, &daemon_end, f, false),
        None => client.restore(name, &daemon_end, false),
    };
    drop((daemon_end, fault));
    (r, passed.join().expect("the relay"), rx, memory)
}

fn killed_at_each_step(on_demand: bool) {
    let Some(setup) = park_rig::set_up(1) else {
        return;
    };
    let free_before = hugepages_2m("free_hugepages");
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let socket = daemon.socket();
    let parked_at = if on_demand {
        park_rig::park_from_disk(&socket, &setup, "vm", true)
    } else {
        park_rig::launch_and_park(&socket, &setup, "vm")
    };
    let mut client = daemon.client();
    for (i, cut) in CUTS.into_iter().enumerate() {
        let (r, passed, rx, _) = restore_through(
            &mut client,
            &setup,
            &format!("cut{i}"),
            "vm",
            cut,
            on_demand,
        );
        assert!(passed.cut, "{cut:?}: the relay never got there: {passed:?}");
        match r {
            Err(ClientError::Refused { message, .. }) => {
                assert!(message.contains("stays parked"), "{cut:?}: {message}")
            }
            other => panic!("{cut:?}: a RESTORE to a cloud-hypervisor killed there: {other:?}"),
        }
        drop(rx);
        let s = daemon.stats();
        assert_eq!(s.parked.len(), 1, "{cut:?}: the VM stays parked: {s}");
        assert_eq!(s.allocations.active, 1, "{cut:?}: {s}");
        assert_balanced(&s, &format!("{cut:?}"));
        eprintln!("cloud-hypervisor killed {cut:?}: the VM stays parked");
    }
    // The next one takes it and runs it from where it was parked.
    let (r, passed, rx, memory) =
        restore_through(&mut client, &setup, "final", "vm", Cut::Never, on_demand);
    let a = r.expect("RESTORE to a cloud-hypervisor that runs the VM");
    assert_eq!(passed.commands.last(), Some(&Step::Complete));
    let ram = memory_file(&memory);
    let state = counting_past(&ram, parked_at, "the restored guest to count on");
    assert_eq!(state.bad, 0, "the guest found a page changed");
    eprintln!(
        "restored after the kills: the guest counts on from {parked_at} ({})",
        state.count
    );
    // Its own process was running it: killed, the VM is gone with it, and
    // its memory comes back once the restorer frees it.
    rx.kill();
    drop(ram);
    let id = a.id;
    drop(a);
    client.free(id).expect("the restorer owns the VM it ran");
    let s = daemon.wait_stats(SETTLE, "the memory back in the pool", |s| {
        s.allocations.active == 0 && s.pool_sum(|p| p.quarantined_bytes) == 0
    });
    assert!(s.parked.is_empty(), "{s}");
    assert_balanced(&s, "after the VM's process was killed");
    daemon.shutdown();
    assert_eq!(
        hugepages_2m("free_hugepages"),
        free_before,
        "every page back"
    );
}

#[test]
fn the_restoring_cloud_hypervisor_killed_at_each_step_leaves_the_vm_parked() {
    killed_at_each_step(false);
}

#[test]
fn the_restoring_cloud_hypervisor_killed_at_each_step_of_an_on_demand_restore() {
    killed_at_each_step(true);
}

/// `hugemem launch --restore --on-demand` killed (SIGKILL) once its guest
/// runs: its cloud-hypervisor goes on, every page the guest asks for is
/// still read and answered (it counts on), the restore ends, and the
/// memory is released (the reply could not be delivered, or the orphaned
/// allocation timed out) and back in the pool once the process is gone.
#[test]
fn the_launcher_killed_during_an_on_demand_restore() {
    let Some(setup) = park_rig::set_up(1) else {
        return;
    };
    let free_before = hugepages_2m("free_hugepages");
    let daemon = TestDaemon::start(|c| {
        c.pool.recheck_ms = 20;
        c.limits.reattach_timeout_secs = 1;
    });
    let socket = daemon.socket();
    let parked_at = park_rig::park_from_disk(&socket, &setup, "lazy", true);
    let restores = daemon.stats().counters.restores;
    let api = setup.dir.path().join("restored.api");
    let mut launch = park_rig::restore(&socket, &setup.ch, "lazy", &api, true);
    let launcher = child_of(launch.id());
    let vmm = child_of(launcher);
    let ram = common::park::memfd_of(vmm);
    let running = counting_past(&ram, parked_at, "the guest to run on demand");
    park_rig::kill_9(launcher);
    let _ = launch.wait();
    let on = counting_past(
        &ram,
        running.count,
        "the guest to count on without its launcher",
    );
    assert_eq!(on.bad, 0, "the guest found a page changed");
    let s = daemon.wait_stats(SETTLE, "the restore ended and its memory released", |s| {
        s.parked.is_empty() && s.allocations.active == 0
    });
    assert_eq!(s.counters.restores, restores + 1, "the restore ended: {s}");
    assert!(
        s.pool_sum(|p| p.quarantined_bytes) > 0,
        "the memory waits in quarantine while its process runs: {s}"
    );
    eprintln!(
        "launcher killed at guest count {}: the guest counted on to {}; the memory waits for its process",
        running.count, on.count
    );
    drop(ram);
    park_rig::kill_9(vmm);
    let s = daemon.wait_stats(SETTLE, "the memory back in the pool", |s| {
        s.pool_sum(|p| p.quarantined_bytes) == 0
    });
    assert_balanced(&s, "after the process was gone");
    daemon.shutdown();
    assert_eq!(
        hugepages_2m("free_hugepages"),
        free_before,
        "every page back"
    );
}

/// An on-demand restore whose file reads `EIO` (the saved directory on a
/// disk cut short inside the guest's memory): the fill fails, the
/// cloud-hypervisor that asked for the page stops (no guest runs on a
/// page that could not be read), the launcher fails saying why, and the
/// VM stays parked with its books balanced.
#[test]
fn an_on_demand_restore_that_reads_eio_fails_and_the_vm_stays_parked() {
    const TEST: &str = "an_on_demand_restore_that_reads_eio_fails_and_the_vm_stays_parked";
    let Some(setup) = park_rig::set_up(1) else {
        return;
    };
    let Some(disk) = test_support::faulty_disk::FaultyDisk::new(128 << 20, TEST) else {
        return;
    };
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let socket = daemon.socket();
    park_rig::launch_and_park(&socket, &setup, "vm");
    let saved = disk.path().join("vm");
    park_rig::run_ok(
        &socket,
        &[
            "unpark".as_ref(),
            "vm".as_ref(),
            "--save".as_ref(),
            saved.as_os_str(),
        ],
    );
    // A page the guest wrote (it re-reads every one), past half its memory.
    let memory = saved.join("memory-0");
    let file = std::fs::File::open(&memory).expect("open");
    let at = nix::unistd::lseek(
        &file,
        i64::try_from(common::park::RAM / 2).expect("off"),
        nix::unistd::Whence::SeekData,
    )
    .expect("a page of data past the middle");
    drop(file);
    disk.fail_reads_of(&memory, u64::try_from(at).expect("offset"));
    park_rig::run_ok(
        &socket,
        &[
            "park".as_ref(),
            "vm".as_ref(),
            "--from-dir".as_ref(),
            saved.as_os_str(),
            "--on-demand".as_ref(),
        ],
    );
    let api = setup.dir.path().join("eio.api");
    let out = std::process::Command::new("timeout")
        .args(["120", park_rig::HUGEMEM, "launch", "--socket"])
        .arg(&socket)
        .args([
            "--restore",
            "vm",
            "--on-demand",
            "--",
            &setup.ch,
            "--api-socket",
        ])
        .arg(&api)
        .output()
        .expect("run hugemem launch --restore --on-demand");
    let said = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success(),
        "a restore that read EIO succeeded: {said}"
    );
    assert_ne!(out.status.code(), Some(124), "the launcher hung: {said}");
    assert!(said.contains("Input/output error"), "{said}");
    eprintln!(
        "{TEST}: {}",
        said.lines()
            .rfind(|l| l.contains("Input/output"))
            .unwrap_or_default()
    );
    let s = daemon.wait_stats(SETTLE, "the failed restore settled", |s| {
        s.allocations.active == 1 && s.pool_sum(|p| p.quarantined_bytes) == 0
    });
    assert_eq!(s.parked.len(), 1, "the VM stays parked: {s}");
    assert_eq!(s.counters.restores_refused, 1, "{s}");
    assert_balanced(&s, "after the failed restore");
    park_rig::run_ok(&socket, &["unpark".as_ref(), "vm".as_ref()]);
    let s = daemon.wait_stats(SETTLE, "unparked", |s| {
        s.allocations.active == 0 && s.pool_sum(|p| p.quarantined_bytes) == 0
    });
    assert_balanced(&s, "unparked");
    daemon.shutdown();
}
