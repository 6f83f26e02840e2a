//! `hugemem park --from-dir` (eager and on demand) against faults of the
//! disk and of the pool (issue 43), with the real binary and the daemon in
//! this process:
//!
//! * the VM's directory on a disk whose reads fail with `EIO` past a point
//!   (`test_support::faulty_disk`: an ext4 image on a loop device cut
//!   short): the eager load is refused, naming the file and the offset,
//!   with nothing parked and every page back; parked on demand (nothing
//!   read yet) it parks, and a restore that must read it fails the same
//!   way while the VM stays parked;
//! * too few huge pages for the VM: the load is refused before anything
//!   is read, with nothing parked and every page back.
//!
//! Skipped (through the skip helper) without root, the loop-device tools
//! (`losetup`, `mkfs.ext4`, `filefrag`) or the huge pages.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use test_support::faulty_disk::FaultyDisk;
use test_support::hugepages::hugepages_2m;
use test_support::prelude::{reserve_2m, serial, TestDaemon};

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");
const MIB: u64 = 1 << 20;
/// The VM's memory: 32 pages of 2 MiB.
const SIZE: u64 = 64 * MIB;
const SETTLE: Duration = Duration::from_secs(60);

/// Byte `i` of the VM's memory (never zero: every page is data, no hole).
fn pattern(i: u64) -> u8 {
    (i.wrapping_mul(131) % 251) as u8 + 1
}

/// Writes `bytes` to `path` and flushes them to the disk: the filesystem
/// places each file's blocks now, one after the other.
fn write_synced(path: &Path, bytes: &[u8]) {
    let mut f = std::fs::File::create(path).expect("create");
    std::io::Write::write_all(&mut f, bytes).expect("write");
    f.sync_all().expect("fsync");
}

/// A saved VM in the layout `hugemem unpark --save` writes (one slot of
/// `SIZE` bytes at guest address 0), in `dir`: the small files first.
fn write_saved_vm(dir: &Path) {
    std::fs::create_dir(dir).expect("mkdir");
    let config = serde_json::json!({
        "cpus": {"boot_vcpus": 1},
        "vm_config": {"memory": {"size": SIZE}},
        "memory_manager_data": {"guest_ram_mappings": [{
            "slot": 0, "gpa": 0, "size": SIZE, "file_offset": 0,
            "zone_id": "mem0", "virtio_mem": false
        }]}
    });
    write_synced(
        &dir.join("migration_config.json"),
        config.to_string().as_bytes(),
    );
    write_synced(&dir.join("state.json"), b"{\"vcpus\":[],\"devices\":[]}");
    let memory: Vec<u8> = (0..SIZE).map(pattern).collect();
    write_synced(&dir.join("memory-0"), &memory);
}

fn hugemem(daemon: &TestDaemon, args: &[&std::ffi::OsStr]) -> Output {
    Command::new("timeout")
        .arg("120")
        .arg(HUGEMEM)
        .args(args)
        .arg("--socket")
        .arg(daemon.socket())
        .output()
        .expect("run hugemem")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// How many fds of this process (the daemon runs in it) name `path`.
fn fds_of(path: &Path) -> usize {
    let Ok(want) = std::fs::metadata(path) else {
        return 0;
    };
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .flatten()
        .filter(|e| {
            std::fs::metadata(e.path())
                .is_ok_and(|m| (m.dev(), m.ino()) == (want.dev(), want.ino()))
        })
        .count()
}

/// The daemon's books balanced, with `parked` VMs and `active`
/// allocations, once nothing is left in quarantine.
fn settled(daemon: &TestDaemon, active: u64, parked: usize, case: &str) {
    let s = daemon.wait_stats(SETTLE, case, |s| {
        s.pool_sum(|p| p.quarantined_bytes) == 0 && s.allocations.active == active
    });
    assert_eq!(s.parked.len(), parked, "{case}: {s}");
    assert_eq!(
        s.counters.allocs_ok - s.counters.allocs_released,
        active,
        "{case}: allocations made − released: {s}"
    );
    assert_eq!(
        s.totals.created_bytes - s.totals.released_bytes,
        s.totals.held_bytes,
        "{case}: region totals: {s}"
    );
}

/// The refusal of a read that hit `EIO` names the error, the file and an
/// offset in it.
fn assert_names_the_read(said: &str, file: &Path, case: &str) {
    assert!(said.contains("Input/output error"), "{case}: {said}");
    assert!(
        said.contains(&file.display().to_string()),
        "{case}: the refusal does not name {}: {said}",
        file.display()
    );
    assert!(said.contains("file offset 0x"), "{case}: {said}");
}

#[test]
fn a_directory_that_reads_eio_is_refused_and_an_on_demand_vm_stays_parked() {
    const TEST: &str = "a_directory_that_reads_eio_is_refused_and_an_on_demand_vm_stays_parked";
    let _s = serial();
    // One block group: the small files lie before the memory's data.
    let Some(disk) = FaultyDisk::new(2 * SIZE, TEST) else {
        return;
    };
    // One VM's pages: the eager load's, then the one parked on demand.
    if !reserve_2m(SIZE / (2 * MIB), TEST) {
        return;
    }
    let free_before = hugepages_2m("free_hugepages");
    let vm = disk.path().join("vm");
    write_saved_vm(&vm);
    let memory = vm.join("memory-0");
    // Only the memory's second half lies past the cut.
    let at = disk.device_offset(&memory, SIZE / 2);
    for small in ["migration_config.json", "state.json"] {
        let end = disk.device_offset(&vm.join(small), 0);
        assert!(end < at, "{small} lies past the cut ({end:#x} ≥ {at:#x})");
    }
    let cut = disk.fail_reads_of(&memory, SIZE / 2);
    eprintln!(
        "{TEST}: reads of memory-0 from byte {} on fail (device offset {cut:#x})",
        SIZE / 2
    );
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);

    let out = hugemem(
        &daemon,
        &[
            "park".as_ref(),
            "eio".as_ref(),
            "--from-dir".as_ref(),
            vm.as_os_str(),
        ],
    );
    let said = text(&out);
    assert!(!out.status.success(), "a load that read EIO parked: {said}");
    assert_names_the_read(&said, &memory, "the eager load");
    eprintln!("{TEST}: the eager load: {}", said.trim());
    settled(&daemon, 0, 0, "the refused load");
    assert_eq!(fds_of(&memory), 0, "the daemon kept the VM's file");

    // On demand nothing is read at park time: it parks.
    let out = hugemem(
        &daemon,
        &[
            "park".as_ref(),
            "lazy".as_ref(),
            "--from-dir".as_ref(),
            vm.as_os_str(),
            "--on-demand".as_ref(),
        ],
    );
    assert!(out.status.success(), "{}", text(&out));
    settled(&daemon, 1, 1, "parked on demand");
    // A restore that reads it all (a save) hits the bad block: refused,
    // and the VM stays parked with its files.
    let saved = tempfile::tempdir().expect("tempdir");
    let to = saved.path().join("copy");
    let out = hugemem(
        &daemon,
        &[
            "unpark".as_ref(),
            "lazy".as_ref(),
            "--save".as_ref(),
            to.as_os_str(),
        ],
    );
    let said = text(&out);
    assert!(
        !out.status.success(),
        "a save that read EIO succeeded: {said}"
    );
    assert_names_the_read(&said, &memory, "the on-demand fill");
    assert!(said.contains("stays parked"), "{said}");
    eprintln!("{TEST}: the on-demand fill: {}", said.trim());
    settled(&daemon, 1, 1, "the failed fill");
    assert_eq!(
        fds_of(&memory),
        1,
        "the daemon keeps the VM's file while it is parked"
    );

    let out = hugemem(&daemon, &["unpark".as_ref(), "lazy".as_ref()]);
    assert!(out.status.success(), "{}", text(&out));
    settled(&daemon, 0, 0, "unparked");
    assert_eq!(fds_of(&memory), 0, "the file closed with the VM");
    daemon.shutdown();
    assert_eq!(
        hugepages_2m("free_hugepages"),
        free_before,
        "every page back"
    );
}

#[test]
fn too_few_huge_pages_for_a_load_is_refused_with_nothing_parked() {
    const TEST: &str = "too_few_huge_pages_for_a_load_is_refused_with_nothing_parked";
    let _s = serial();
    // A quarter of the VM's pages.
    let pages = SIZE / (2 * MIB) / 4;
    if !reserve_2m(pages, TEST) {
        return;
    }
    let free_before = hugepages_2m("free_hugepages");
    let dir = tempfile::tempdir().expect("tempdir");
    let vm = dir.path().join("vm");
    write_saved_vm(&vm);
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    for on_demand in [false, true] {
        let mut args = vec![
            "park".as_ref(),
            "big".as_ref(),
            "--from-dir".as_ref(),
            vm.as_os_str(),
        ];
        if on_demand {
            args.push("--on-demand".as_ref());
        }
        let out = hugemem(&daemon, &args);
        let said = text(&out);
        assert!(!out.status.success(), "parked on too few pages: {said}");
        assert!(
            said.contains("no pool memory to copy the VM into"),
            "{said}"
        );
        eprintln!("{TEST}: on_demand={on_demand}: {}", said.trim());
        settled(&daemon, 0, 0, "the refused load");
        assert_eq!(
            fds_of(&vm.join("memory-0")),
            0,
            "the daemon kept the VM's file"
        );
        let s = daemon.stats();
        assert_eq!(s.counters.parks, 0, "{s}");
    }
    daemon.shutdown();
    assert_eq!(
        hugepages_2m("free_hugepages"),
        free_before,
        "every page back"
    );
}
