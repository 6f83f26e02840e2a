//! `hugemem park` and `hugemem launch --restore` with the real
//! cloud-hypervisor (`scripts/build-cloud-hypervisor`): hugemem as
//! cloud-hypervisor's offload daemon.
//!
//! * A launched counting guest (`microguest::spin`) is parked and restored
//!   10 times in a row: each park moves the launcher's allocation into the
//!   parked record (nothing copied, nothing cleared, the launcher reports
//!   "parked as"), each restore hands the same memory (same inode) to a new
//!   cloud-hypervisor, the counter never goes back and counts on, and the
//!   daemon's totals balance throughout.
//! * A cloud-hypervisor started on its own (`shared=on`, 4 KiB memfd
//!   pages) is parked (its memory copied onto the pool's huge pages) and
//!   restored on them, its counter intact.
//! * UNPARK drops a parked VM; its memory returns to the pool.
//!
//! Skipped (through the skip helper) without the cloud-hypervisor binary
//! that `CLOUD_HYPERVISOR` names, a usable `/dev/kvm` or 128 free 2 MiB pages.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use test_support::hugepages::hugepages_2m;
use test_support::prelude::{wait_until, TestDaemon};

use common::park::{
    launch_and_park, launch_counting, memfd_of, park, restore, run_ok, run_ok_both, set_up, stop,
    stop_and_settle, RAM,
};
use common::{
    assert_balanced, child_of, counting_past, launched_guest_ram, maps_inode, spin_state,
    StopLauncher,
};

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");
const ROUNDS: usize = 10;

#[test]
fn a_launched_guest_parks_and_restores_ten_times_on_the_same_memory() {
    let Some(setup) = set_up(1) else {
        return;
    };
    let (ch, dir, elf) = (&setup.ch, &setup.dir, &setup.elf);
    let free_before = hugepages_2m("free_hugepages");
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let mut api = dir.path().join("api0.sock");
    let mut launch = launch_counting(&daemon, ch, &api, elf);
    let mut launcher = child_of(launch.id());
    let mut vmm = child_of(launcher);
    let ram = launched_guest_ram(launcher, vmm);
    let ino = ram.metadata().expect("fstat guest RAM").ino();
    let mut state = counting_past(&ram, 0, "the guest to spin");
    let cleared = daemon.stats().scrub.bytes;
    for i in 1..=ROUNDS {
        let said = park(&daemon, "counter", &api);
        assert!(said.contains("parked as counter"), "round {i}: {said}");
        let status = launch
            .wait()
            .expect("the launcher ends once its VM is parked");
        assert!(
            status.success(),
            "round {i}: the launcher ended with {status}"
        );
        let stats = daemon.stats();
        assert_eq!(stats.parked.len(), 1, "round {i}: {stats}");
        assert_eq!(stats.parked[0].name, "counter");
        assert_eq!(stats.parked[0].bytes, RAM);
        assert_eq!(stats.parked[0].vmm.as_deref(), Some("cloud-hypervisor"));
        assert_eq!(
            stats.parked[0].copied_bytes, 0,
            "round {i}: moved, not copied"
        );
        assert_eq!(
            stats.scrub.bytes, cleared,
            "round {i}: nothing cleared: {stats}"
        );
        assert_balanced(&stats, &format!("parked, round {i}"));
        let parked_at = spin_state(&ram).count;
        assert!(parked_at >= state.count, "round {i}: the counter went back");

        api = dir.path().join(format!("api{i}.sock"));
        launch = restore(&daemon, ch, "counter", &api);
        launcher = child_of(launch.id());
        vmm = child_of(launcher);
        state = counting_past(&ram, parked_at, "the restored guest to count on");
        assert_eq!(state.bad, 0, "round {i}: the guest found a page changed");
        assert!(
            maps_inode(vmm, ino),
            "round {i}: the new cloud-hypervisor maps another file"
        );
        // The guest runs from the receiver's `Complete`; the daemon records
        // the allocation as the launcher's right after that answer.
        let stats = daemon.wait_stats(Duration::from_secs(30), "the restore recorded", |s| {
            s.counters.restores == i as u64
        });
        assert!(stats.parked.is_empty(), "round {i}: {stats}");
        assert_eq!(stats.counters.parks, i as u64, "round {i}: {stats}");
        assert_eq!(
            stats.scrub.bytes, cleared,
            "round {i}: nothing cleared: {stats}"
        );
        assert_eq!(stats.allocations.active, 1, "round {i}: {stats}");
        assert_balanced(&stats, &format!("restored, round {i}"));
        eprintln!(
            "round {i}: parked and restored; guest count {}",
            state.count
        );
    }
    let _guard = StopLauncher(launcher);
    drop(ram);
    let stats = stop_and_settle(&daemon, launcher, &mut launch);
    assert_eq!(
        stats.counters.allocs_ok, 1,
        "one allocation for every process: {stats}"
    );
    daemon.shutdown();
    wait_until(
        "the host's free 2 MiB pages back to their count before the VM",
        Duration::from_secs(30),
        || hugepages_2m("free_hugepages") == free_before,
    );
}

#[test]
fn a_cloud_hypervisor_of_its_own_parks_onto_huge_pages_and_restores() {
    let Some(setup) = set_up(1) else {
        return;
    };
    let (ch, dir, elf) = (&setup.ch, &setup.dir, &setup.elf);
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let api = dir.path().join("own.sock");
    let mut own = Command::new(ch)
        .arg("--api-socket")
        .arg(&api)
        .args(["--memory", "size=256M,shared=on", "--kernel"])
        .arg(elf)
        .args(["--cpus", "boot=1", "--serial", "null", "--console", "off"])
        .spawn()
        .expect("spawn cloud-hypervisor");
    let ram = memfd_of(own.id());
    let before = counting_past(&ram, 0, "the guest to spin on its own memory");
    let said = park(&daemon, "own", &api);
    assert!(said.contains("parked as own"), "{said}");
    let status = own
        .wait()
        .expect("cloud-hypervisor ends once its VM is parked");
    assert!(status.success(), "cloud-hypervisor ended with {status}");
    let parked_at = spin_state(&ram).count;
    assert!(parked_at >= before.count);
    drop(ram);
    let stats = daemon.stats();
    assert_eq!(stats.parked.len(), 1, "{stats}");
    assert!(stats.parked[0].copied_bytes > 0, "copied: {stats}");
    assert!(
        stats.parked[0].page_size >= 2 << 20,
        "on huge pages: {stats}"
    );
    assert_eq!(
        stats.counters.park_copied_bytes,
        stats.parked[0].copied_bytes
    );
    assert_balanced(&stats, "parked");

    let api2 = dir.path().join("restored.sock");
    let mut launch = restore(&daemon, ch, "own", &api2);
    let launcher = child_of(launch.id());
    let _guard = StopLauncher(launcher);
    let vmm = child_of(launcher);
    let ram = memfd_of(vmm);
    let state = counting_past(
        &ram,
        parked_at,
        "the restored guest to count on, on huge pages",
    );
    assert_eq!(state.bad, 0, "the guest found a page changed");
    drop(ram);
    stop_and_settle(&daemon, launcher, &mut launch);
    daemon.shutdown();
}

#[test]
fn unpark_returns_the_memory_and_names_are_per_tenant() {
    let Some(setup) = set_up(1) else {
        return;
    };
    let (ch, dir, elf) = (&setup.ch, &setup.dir, &setup.elf);
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let api = dir.path().join("api.sock");
    launch_and_park(&daemon, (ch, elf), &api, "dropme");
    // A second park under the same name is refused before anything moves.
    let out = Command::new(HUGEMEM)
        .args(["unpark", "nosuch", "--socket"])
        .arg(daemon.socket())
        .output()
        .expect("run hugemem unpark");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no VM named"));
    let out = Command::new(HUGEMEM)
        .args(["unpark", "dropme", "--socket"])
        .arg(daemon.socket())
        .output()
        .expect("run hugemem unpark");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stats = daemon.wait_stats(
        Duration::from_secs(30),
        "the parked memory back in the pool",
        |s| s.allocations.active == 0 && s.parked.is_empty(),
    );
    assert_balanced(&stats, "after UNPARK");
    daemon.shutdown();
}

/// A launched guest parked, saved to a directory (its memory back in the
/// pool), parked again from that directory onto pool memory and restored:
/// its counter goes on from where it stopped.
#[test]
fn a_parked_guest_goes_to_disk_and_back() {
    let Some(setup) = set_up(2) else {
        return;
    };
    let (ch, dir, elf) = (&setup.ch, &setup.dir, &setup.elf);
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let api = dir.path().join("api.sock");
    let parked_at = launch_and_park(&daemon, (ch, elf), &api, "disk").1.count;
    let saved = dir.path().join("saved");
    let socket = daemon.socket();
    let said = run_ok(&[
        "unpark".as_ref(),
        "disk".as_ref(),
        "--save".as_ref(),
        saved.as_os_str(),
        "--socket".as_ref(),
        socket.as_os_str(),
    ]);
    assert!(said.contains("saved disk to"), "{said}");
    assert!(saved.join("migration_config.json").is_file());
    assert!(saved.join("state.json").is_file());
    let stats = daemon.wait_stats(
        Duration::from_secs(30),
        "the saved VM's memory back in the pool",
        |s| s.allocations.active == 0 && s.parked.is_empty(),
    );
    assert_balanced(&stats, "saved");

    let said = run_ok(&[
        "park".as_ref(),
        "back".as_ref(),
        "--from-dir".as_ref(),
        saved.as_os_str(),
        "--socket".as_ref(),
        socket.as_os_str(),
    ]);
    assert!(
        said.contains("parked as back") && said.contains("onto pool memory"),
        "{said}"
    );
    let stats = daemon.stats();
    assert_eq!(stats.parked.len(), 1, "{stats}");
    assert!(stats.parked[0].copied_bytes > 0, "{stats}");
    let api2 = dir.path().join("api2.sock");
    let mut launch = restore(&daemon, ch, "back", &api2);
    let launcher = child_of(launch.id());
    let _guard = StopLauncher(launcher);
    let vmm = child_of(launcher);
    let ram = memfd_of(vmm);
    assert!(spin_state(&ram).count >= parked_at, "the counter went back");
    let state = counting_past(&ram, parked_at, "the guest to count on after disk and back");
    assert_eq!(state.bad, 0, "the guest found a page changed");
    drop(ram);
    stop_and_settle(&daemon, launcher, &mut launch);
    daemon.shutdown();
}

/// cloud-hypervisor's own `vm.snapshot destination_url=file://DIR` of a
/// guest on its own memory is parked from the directory onto pool memory
/// and restored: the guest counts on from the snapshot.
#[test]
fn a_cloud_hypervisor_file_snapshot_parks_from_its_directory() {
    let Some(setup) = set_up(2) else {
        return;
    };
    let (ch, dir, elf) = (&setup.ch, &setup.dir, &setup.elf);
    let ch_remote = Path::new(&ch).with_file_name("ch-remote");
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let api = dir.path().join("own.sock");
    let mut own = Command::new(ch)
        .arg("--api-socket")
        .arg(&api)
        .args([
            "--memory",
            "size=256M,shared=on,hugepages=on,hugepage_size=2M",
            "--kernel",
        ])
        .arg(elf)
        .args(["--cpus", "boot=1", "--serial", "null", "--console", "off"])
        .spawn()
        .expect("spawn cloud-hypervisor");
    let paused_at = {
        let ram = memfd_of(own.id());
        counting_past(&ram, 0, "the guest to spin");
        let remote = |args: &[&str]| {
            let out = Command::new(&ch_remote)
                .arg("--api-socket")
                .arg(&api)
                .args(args)
                .output()
                .expect("run ch-remote");
            assert!(
                out.status.success(),
                "ch-remote {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        remote(&["pause"]);
        let at = spin_state(&ram).count;
        let snap = dir.path().join("snap");
        std::fs::create_dir(&snap).expect("mkdir");
        remote(&["snapshot", &format!("file://{}", snap.display())]);
        at
    };
    let _ = own.kill();
    let _ = own.wait();
    let socket = daemon.socket();
    let snap = dir.path().join("snap");
    let (said, noted) = run_ok_both(&[
        "park".as_ref(),
        "fromch".as_ref(),
        "--from-dir".as_ref(),
        snap.as_os_str(),
        "--socket".as_ref(),
        socket.as_os_str(),
    ]);
    assert!(said.contains("parked as fromch"), "{said}");
    assert!(
        noted.contains("a cloud-hypervisor file:// snapshot") && noted.contains("no checksums"),
        "the park says plainly that the snapshot carries no checksums: {noted}"
    );
    let api2 = dir.path().join("api2.sock");
    let mut launch = restore(&daemon, ch, "fromch", &api2);
    let launcher = child_of(launch.id());
    let _guard = StopLauncher(launcher);
    let vmm = child_of(launcher);
    let ram = memfd_of(vmm);
    assert!(spin_state(&ram).count >= paused_at, "the counter went back");
    let state = counting_past(&ram, paused_at, "the guest to count on from its snapshot");
    assert_eq!(state.bad, 0, "the guest found a page changed");
    drop(ram);
    stop(launcher, &mut launch);
    daemon.wait_stats(Duration::from_secs(30), "released", |s| {
        s.allocations.active == 0
    });
    daemon.shutdown();
}

/// A guest saved to disk, parked from its directory on demand (the files
/// kept, nothing read yet) and restored with cloud-hypervisor's postcopy:
/// the guest runs at once and counts on from where it stopped, its pages
/// read as it asks for them and in the background.
#[test]
fn an_on_demand_restore_runs_the_guest_while_its_memory_is_read() {
    let Some(setup) = set_up(2) else {
        return;
    };
    let (ch, dir, elf) = (&setup.ch, &setup.dir, &setup.elf);
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let api = dir.path().join("api.sock");
    let parked_at = launch_and_park(&daemon, (ch, elf), &api, "lazy").1.count;
    let saved = dir.path().join("saved");
    let socket = daemon.socket();
    run_ok(&[
        "unpark".as_ref(),
        "lazy".as_ref(),
        "--save".as_ref(),
        saved.as_os_str(),
        "--socket".as_ref(),
        socket.as_os_str(),
    ]);
    let said = run_ok(&[
        "park".as_ref(),
        "lazy2".as_ref(),
        "--from-dir".as_ref(),
        saved.as_os_str(),
        "--on-demand".as_ref(),
        "--socket".as_ref(),
        socket.as_os_str(),
    ]);
    assert!(said.contains("when it is restored (on demand)"), "{said}");
    let api2 = dir.path().join("api2.sock");
    let started = std::time::Instant::now();
    let mut launch = Command::new("timeout")
        .args(["600", HUGEMEM, "launch", "--socket"])
        .arg(daemon.socket())
        .args([
            "--restore",
            "lazy2",
            "--on-demand",
            "--",
            ch,
            "--api-socket",
        ])
        .arg(&api2)
        .spawn()
        .expect("spawn hugemem launch --restore --on-demand");
    let launcher = child_of(launch.id());
    let _guard = StopLauncher(launcher);
    let vmm = child_of(launcher);
    let ram = memfd_of(vmm);
    let state = counting_past(&ram, parked_at, "the guest to count on, restored on demand");
    eprintln!(
        "on demand: the guest counted on {:.1} ms after the restore began",
        started.elapsed().as_secs_f64() * 1e3
    );
    assert_eq!(state.bad, 0, "the guest found a page changed");
    // The save was an EXPORT (the VM stayed parked until it was in place);
    // the on-demand restore ends once every piece was read and checked
    // against the save's manifest.
    let stats = daemon.wait_stats(Duration::from_secs(60), "the restore recorded", |s| {
        s.counters.restores == 1 && s.counters.exports == 1
    });
    assert!(stats.parked.is_empty(), "{stats}");
    assert_eq!(stats.counters.park_verified_bytes, RAM, "{stats}");
    drop(ram);
    stop_and_settle(&daemon, launcher, &mut launch);
    daemon.shutdown();
}

/// A restored VM is any launch's: `hugemem update` moves it to a new
/// cloud-hypervisor on the same memory, and it counts on.
#[test]
fn a_restored_guest_is_updated_under_its_name() {
    let Some(setup) = set_up(1) else {
        return;
    };
    let (ch, dir, elf) = (&setup.ch, &setup.dir, &setup.elf);
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let api = dir.path().join("api.sock");
    let mut launch = launch_counting(&daemon, ch, &api, elf);
    let launcher = child_of(launch.id());
    let vmm = child_of(launcher);
    let ram = launched_guest_ram(launcher, vmm);
    let ino = ram.metadata().expect("fstat guest RAM").ino();
    counting_past(&ram, 0, "the guest to spin");
    park(&daemon, "upd", &api);
    assert!(launch.wait().expect("launcher").success());
    let parked_at = spin_state(&ram).count;
    let control = dir.path().join("vm.sock");
    let api2 = dir.path().join("api2.sock");
    let mut launch = Command::new("timeout")
        .args(["600", HUGEMEM, "launch", "--socket"])
        .arg(daemon.socket())
        .arg("--control-socket")
        .arg(&control)
        .args(["--restore", "upd", "--", ch, "--api-socket"])
        .arg(&api2)
        .spawn()
        .expect("spawn hugemem launch --restore");
    let launcher = child_of(launch.id());
    let _guard = StopLauncher(launcher);
    let vmm = child_of(launcher);
    let state = counting_past(&ram, parked_at, "the restored guest to count on");
    daemon.wait_stats(Duration::from_secs(30), "the restore recorded", |s| {
        s.counters.restores == 1
    });
    let report = common::update(&control);
    assert_eq!(report.old_pid, vmm);
    assert_ne!(report.new_pid, vmm);
    assert_eq!(report.guest_ram_bytes, RAM);
    assert!(
        maps_inode(report.new_pid, ino),
        "the updated cloud-hypervisor maps another file"
    );
    let after = counting_past(&ram, state.count, "the guest to count on after the update");
    assert_eq!(after.bad, 0, "the guest found a page changed");
    drop(ram);
    stop_and_settle(&daemon, launcher, &mut launch);
    daemon.shutdown();
}
