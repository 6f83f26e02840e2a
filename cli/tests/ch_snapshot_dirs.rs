//! `ch_migration`'s snapshot directories and postcopy
//! restore against real cloud-hypervisors, each with the counting
//! micro-guest, which must count on after every restore:
//!
//! - a VM parked with `receive_snapshot` is written to a directory in the
//!   reference offload daemon's layout (`write_offload_dir`) and restored
//!   on demand (`memory_mode=postcopy`) into a new cloud-hypervisor that
//!   gets empty hugetlb memfds, every page filled from the directory by
//!   the fault callback;
//! - the same directory is restored by the reference `offload_daemon
//!   restore`, and what its `snapshot` writes is read by
//!   `read_offload_dir`;
//! - a `vm.snapshot file://` directory of cloud-hypervisor's own is
//!   converted (`read_ch_snapshot_dir`) and restored by local migration
//!   into hugetlb memfds filled from its `memory-ranges`.
//!
//! Skipped (through the skip helper) without the cloud-hypervisor binary
//! that `CLOUD_HYPERVISOR` names (`scripts/build-cloud-hypervisor`, which
//! also names `CH_OFFLOAD_DAEMON`), a usable `/dev/kvm` or the 2 MiB pages.

mod common;

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ch_migration::ch_snapshot_dir::read_ch_snapshot_dir;
use ch_migration::layout::with_hugetlb_zones;
use ch_migration::offload_dir::read_offload_dir;
use ch_migration::peer::{receive_snapshot, send_snapshot, Snapshot};
use ch_migration::postcopy::{open_fault_connection, restore_postcopy, PostcopySnapshot};
use ch_migration::slots::SlotRange;
use ch_migration::Limits;
use guest_mem::{PageSize, SharedMapping};
use hugemem::launch::vmm::cloud_hypervisor::api::ChApi;
use hugemem::launch::vmm::cloud_hypervisor::events::{ChEvents, RECEIVE_READY};
use hugemem_client::saved_vm::{write_saved_dir, SaveInfo, SaveOptions};
use microguest::SPIN_BLOCK_GPA;
use serde_json::json;
use test_support::hugepages::hold;
use test_support::prelude::{serial, wait_until, TestDaemon};

use common::{child_of, cloud_hypervisor, counting_past, launched_guest_ram, spin_elf, spin_state};

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");
const RAM: u64 = 128 << 20;
const STRIDE: u64 = 2 << 20;
const WAIT: Duration = Duration::from_secs(30);

/// Kills a process when the test ends, passed or not.
struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `fd` stays open across `exec` (the child gets it under its number).
fn inheritable(fd: &impl AsFd) {
    let flags = nix::fcntl::FdFlag::empty();
    nix::fcntl::fcntl(fd.as_fd(), nix::fcntl::FcntlArg::F_SETFD(flags)).expect("clear CLOEXEC");
}

/// The cloud-hypervisor, the 2 MiB pages (`pages`) and the reference
/// daemon, or a recorded skip.
fn prerequisites(pages: u64) -> Option<(String, guest_mem::Reservation, String)> {
    let ch = cloud_hypervisor()?;
    let reservation = match hold(PageSize::Huge2M, pages) {
        Ok(r) => r,
        Err(why) => {
            test_support::skip!("{why}");
            return None;
        }
    };
    let daemon = &test_support::cloud_hypervisor::binaries_or_skip()?.offload_daemon;
    if !daemon.is_file() {
        test_support::skip!("no cloud-hypervisor offload_daemon at {}", daemon.display());
        return None;
    }
    Some((ch, reservation, daemon.to_string_lossy().into_owned()))
}

/// A new cloud-hypervisor with no VM, its API on a socket it inherits and
/// its events on a pipe.
struct Receiver {
    process: Kill,
    api: ChApi,
    events: ChEvents,
    incoming: PathBuf,
}

impl Receiver {
    fn start(ch: &str, dir: &Path, name: &str) -> Self {
        let api_path = dir.join(format!("{name}-api.sock"));
        let api_listener = UnixListener::bind(&api_path).expect("bind");
        inheritable(&api_listener);
        let (events_r, events_w): (OwnedFd, OwnedFd) = nix::unistd::pipe().expect("pipe");
        nix::fcntl::fcntl(
            events_r.as_fd(),
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
        )
        .expect("CLOEXEC on the read end");
        let process = Command::new(ch)
            .arg("--api-socket")
            .arg(format!("fd={}", api_listener.as_raw_fd()))
            .arg("--event-monitor")
            .arg(format!("fd={}", events_w.as_raw_fd()))
            .stdin(Stdio::null())
            .spawn()
            .expect("start a cloud-hypervisor");
        drop((api_listener, events_w));
        Self {
            process: Kill(process),
            api: ChApi::new(&api_path),
            events: ChEvents::new(events_r),
            incoming: dir.join(format!("{name}-incoming.sock")),
        }
    }

    /// Starts `vm.receive-migration` (with `memory_mode` when given) and
    /// waits until the migration socket listens; the thread ends with
    /// the answer.
    fn receive(
        &mut self,
        memory_mode: Option<&str>,
    ) -> std::thread::JoinHandle<
        Result<Vec<u8>, hugemem::launch::vmm::cloud_hypervisor::api::ChApiError>,
    > {
        let mut body = json!({ "receiver_url": format!("unix:{}", self.incoming.display()) });
        if let Some(mode) = memory_mode {
            body["memory_mode"] = json!(mode);
        }
        let api = self.api.clone();
        let receiving =
            std::thread::spawn(move || api.put("vm.receive-migration", Some(&body), WAIT));
        self.events
            .wait_for(RECEIVE_READY, WAIT)
            .expect("the cloud-hypervisor listens for the migration");
        receiving
    }
}

/// A counting guest launched on daemon memory and parked with
/// `receive_snapshot`; its launcher has ended with the source.
struct Parked {
    snapshot: Snapshot,
    count: u64,
    daemon: TestDaemon,
}

fn park_counting_guest(ch: &str, dir: &Path) -> Parked {
    let elf = spin_elf(dir, STRIDE, 1 << 20, 0x5041_524b_0000_0000);
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let api = dir.join("source-api.sock");
    let launch = Command::new("timeout")
        .args(["300", HUGEMEM, "launch", "--socket"])
        .arg(daemon.socket())
        .args([
            "--size",
            "128M",
            "--page-size",
            "2M",
            "--",
            ch,
            "--api-socket",
        ])
        .arg(format!("path={}", api.display()))
        .arg("--kernel")
        .arg(&elf)
        .args(["--cpus", "boot=1", "--serial", "null", "--console", "off"])
        .spawn()
        .expect("spawn hugemem launch");
    let mut launch = Kill(launch);
    let launcher = child_of(launch.0.id());
    let first = child_of(launcher);
    let ram = launched_guest_ram(launcher, first);
    counting_past(&ram, 0, "the guest to spin");
    let park = dir.join("park.sock");
    let listener = UnixListener::bind(&park).expect("bind the park socket");
    let receiver = std::thread::spawn(move || {
        let (sock, _) = listener.accept().expect("accept");
        receive_snapshot(&sock, Limits::default())
    });
    let source = ChApi::new(&api);
    wait_until("the launched cloud-hypervisor's API", WAIT, || {
        source.ping(WAIT).is_ok()
    });
    source
        .send_migration(&park, true, WAIT)
        .expect("send-migration");
    let snapshot = receiver.join().expect("join").expect("the snapshot");
    let status = launch.0.wait().expect("wait for the launcher");
    assert_ne!(status.code(), Some(124), "the launcher did not end");
    let count = spin_state(&ram).count;
    Parked {
        snapshot,
        count,
        daemon,
    }
}

/// A hugetlb memfd (2 MiB pages) per slot, sized to hold the slot at its
/// file offset, nothing in it yet.
fn empty_hugetlb_memfds(slots: &[SlotRange]) -> Vec<SharedMapping> {
    slots
        .iter()
        .map(|s| {
            SharedMapping::memfd((s.file_offset + s.size) as usize, PageSize::Huge2M)
                .expect("a hugetlb memfd")
        })
        .collect()
}

/// Copies `len` bytes of `src` at `src_at` into `mapping` at `at`
/// (hugetlbfs takes no `write`: the bytes go through the mapping).
fn fill(
    mapping: &SharedMapping,
    at: u64,
    src: &File,
    src_at: u64,
    len: u64,
) -> std::io::Result<()> {
    let end = at.checked_add(len).filter(|e| *e <= mapping.len() as u64);
    if end.is_none() {
        return Err(std::io::Error::other("a fill beyond the memfd"));
    }
    let start = mapping.addr().wrapping_add(at as usize);
    // SAFETY: at..at+len was checked to lie inside the live mapping, which
    // no one else in this process reads or writes while it is filled (the
    // guest's writes go to pages not yet handed to it).
    let dst = unsafe { std::slice::from_raw_parts_mut(start, len as usize) };
    src.read_exact_at(dst, src_at)
}

/// The memory fd (a reopened `/proc/PID/fd` link) of process `pid` whose
/// link names `name`.
fn process_memfd(pid: u32, name: &str) -> File {
    let mut found = None;
    wait_until("the process's memory fd", WAIT, || {
        found = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .into_iter()
            .flatten()
            .flatten()
            .find(|e| {
                std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().contains(name))
            })
            .map(|e| e.path());
        found.is_some()
    });
    let path = found.expect("a memory fd");
    File::open(&path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
}

fn dup(fd: std::os::fd::BorrowedFd<'_>) -> File {
    File::from(fd.try_clone_to_owned().expect("dup"))
}

/// What the manifest says of the parked guest (its source is this test).
fn save_info() -> SaveInfo {
    SaveInfo {
        name: "counting".into(),
        uid: 0,
        parked_at: 0,
        page_size: 4096,
    }
}

#[test]
fn a_parked_vm_written_to_disk_is_restored_on_demand_into_empty_hugetlb_memfds() {
    let _serial = serial();
    let Some((ch, _pages, _)) = prerequisites(2 * RAM / STRIDE) else {
        return;
    };
    let tmp = tempfile::tempdir().expect("tempdir");
    let parked = park_counting_guest(&ch, tmp.path());
    let dir = tmp.path().join("vm");
    let started = Instant::now();
    let written = write_saved_dir(
        &dir,
        &parked.snapshot,
        &save_info(),
        &SaveOptions::default(),
    )
    .expect("write the directory");
    eprintln!(
        "written in {:?}: {written:?} (guest counter {} when parked)",
        started.elapsed(),
        parked.count
    );
    let on_disk = read_offload_dir(&dir, Limits::default()).expect("read the directory");
    let slots: Vec<SlotRange> = on_disk.slots.iter().map(|s| s.range).collect();
    let files: Vec<File> = on_disk
        .slots
        .iter()
        .map(|s| File::open(&s.path).expect("a memory file"))
        .collect();
    let memfds = empty_hugetlb_memfds(&slots);
    let memory: Vec<_> = slots
        .iter()
        .zip(&memfds)
        .map(|(s, m)| (s.slot, m.fd()))
        .collect();
    // The guest's RAM as the test reads it: slot 0 holds guest address 0
    // at file offset 0 (one zone, as launched).
    assert_eq!((slots[0].gpa, slots[0].file_offset), (0, 0));
    let ram = dup(memfds[0].fd());

    // The zone was declared with the source's `file=/dev/fd/5`: the
    // receiver would size its pages from a statfs of that path.
    let config = with_hugetlb_zones(&on_disk.config, STRIDE).expect("hugetlb zones");
    let mut receiver = Receiver::start(&ch, tmp.path(), "postcopy");
    let receiving = receiver.receive(Some("Postcopy"));
    let sock = UnixStream::connect(&receiver.incoming).expect("connect");
    let spin_page = SPIN_BLOCK_GPA & !(STRIDE - 1);
    let spin_page_served = Mutex::new(None);
    let (report, moved) = std::thread::scope(|scope| {
        let restoring = scope.spawn(|| {
            restore_postcopy(
                &sock,
                || open_fault_connection(&receiver.incoming),
                PostcopySnapshot {
                    memory: &memory,
                    config: &config,
                    state: &on_disk.state,
                    paused: false,
                    slots: &slots,
                },
                |f| {
                    let i = slots.iter().position(|s| s.slot == f.slot).unwrap_or(0);
                    fill(
                        &memfds[i],
                        f.file_offset,
                        &files[i],
                        f.offset_in_slot,
                        f.length,
                    )?;
                    if f.gpa <= spin_page && spin_page < f.gpa + f.length {
                        let mut at = spin_page_served.lock().expect("lock");
                        at.get_or_insert_with(Instant::now);
                    }
                    Ok::<_, std::io::Error>(())
                },
            )
        });
        let now = counting_past(&ram, parked.count, "the guest to count on, on demand");
        let moved = Instant::now();
        eprintln!(
            "counting on demand: {} (parked at {})",
            now.count, parked.count
        );
        (
            restoring
                .join()
                .expect("join")
                .expect("the postcopy restore"),
            moved,
        )
    });
    receiving
        .join()
        .expect("join")
        .expect("receive-migration answered");
    let served = spin_page_served.lock().expect("lock").take();
    eprintln!(
        "postcopy: {} faults, {} bytes, lengths {}..={} (guest RAM {RAM}), abandoned {}; \
         Complete → counter moving: {:?} (polled every 5 ms); Complete → spin page served: {:?}",
        report.faults.faults,
        report.faults.bytes,
        report.faults.min_length,
        report.faults.max_length,
        report.faults.abandoned,
        moved.saturating_duration_since(report.completed),
        served.map(|s| match s.checked_duration_since(report.completed) {
            Some(after) => format!("{after:?} after"),
            None => format!("{:?} before", report.completed - s),
        }),
    );
    assert_eq!(report.faults.bytes, RAM, "every page was asked for once");
    assert_eq!(
        report.faults.max_length, STRIDE,
        "faults of the huge page size"
    );
    assert_eq!(receiver.api.vm_state(WAIT).expect("vm.info"), "Running");
    let after = counting_past(
        &ram,
        spin_state(&ram).count,
        "the guest to count on after the drain",
    );
    assert_eq!(after.bad, 0, "the guest found a page changed");
    drop(receiver);
    drop(parked.snapshot);
    parked.daemon.shutdown();
}

#[test]
fn a_directory_is_restored_by_the_reference_daemon_and_its_snapshot_read_back() {
    let _serial = serial();
    let Some((ch, _pages, offload_daemon)) = prerequisites(RAM / STRIDE) else {
        return;
    };
    let tmp = tempfile::tempdir().expect("tempdir");
    let parked = park_counting_guest(&ch, tmp.path());
    let dir = tmp.path().join("vm");
    write_saved_dir(
        &dir,
        &parked.snapshot,
        &save_info(),
        &SaveOptions::default(),
    )
    .expect("write the directory");
    let ours = read_offload_dir(&dir, Limits::default()).expect("read the directory");

    // The reference daemon restores what this crate wrote.
    let mut receiver = Receiver::start(&ch, tmp.path(), "reference");
    let receiving = receiver.receive(None);
    let restore = Command::new("timeout")
        .arg("60")
        .arg(&offload_daemon)
        .args(["restore", "--resume", "--socket"])
        .arg(&receiver.incoming)
        .arg("--input-dir")
        .arg(&dir)
        .status()
        .expect("run offload_daemon restore");
    assert!(restore.success(), "offload_daemon restore: {restore}");
    receiving
        .join()
        .expect("join")
        .expect("receive-migration answered");
    let ram = process_memfd(receiver.process.0.id(), "offload-slot-0");
    let now = counting_past(
        &ram,
        parked.count,
        "the guest to count on after the reference restore",
    );
    assert_eq!(now.bad, 0, "the guest found a page changed");

    // And its snapshot of that VM reads back here.
    let socket = tmp.path().join("reference-snapshot.sock");
    let out = tmp.path().join("reference-out");
    let snapshotting = Command::new("timeout")
        .arg("60")
        .arg(&offload_daemon)
        .args(["snapshot", "--socket"])
        .arg(&socket)
        .arg("--output-dir")
        .arg(&out)
        .spawn()
        .expect("run offload_daemon snapshot");
    let mut snapshotting = Kill(snapshotting);
    wait_until("the reference daemon's socket", WAIT, || socket.exists());
    receiver
        .api
        .send_migration(&socket, true, WAIT)
        .expect("send-migration to the reference daemon");
    let status = snapshotting.0.wait().expect("wait for offload_daemon");
    assert!(status.success(), "offload_daemon snapshot: {status}");
    let theirs = read_offload_dir(&out, Limits::default()).expect("read the reference's directory");
    // The slot numbers are the restored process's own (it numbered its
    // KVM slots anew); where the memory lies is the same.
    let ranges = |d: &ch_migration::offload_dir::OffloadDir| {
        d.slots
            .iter()
            .map(|s| (s.range.gpa, s.range.size, s.range.file_offset))
            .collect::<Vec<_>>()
    };
    assert_eq!(ranges(&theirs), ranges(&ours));
    let memory = File::open(&theirs.slots[0].path).expect("memory-0");
    let written = spin_state(&memory);
    assert!(
        written.spinning && written.count >= now.count,
        "{written:?} after {now:?}"
    );
    eprintln!(
        "reference daemon: restored ours (counting at {}), its snapshot read back (counter {}, \
         configuration {} bytes, state {} bytes)",
        now.count,
        written.count,
        theirs.config.len(),
        theirs.state.len()
    );
    drop(receiver);
    drop(parked.snapshot);
    parked.daemon.shutdown();
}

#[test]
fn a_cloud_hypervisor_file_snapshot_is_restored_by_local_migration_into_hugetlb_memfds() {
    let _serial = serial();
    let Some((ch, _pages, _)) = prerequisites(2 * RAM / STRIDE) else {
        return;
    };
    let tmp = tempfile::tempdir().expect("tempdir");
    let elf = spin_elf(tmp.path(), STRIDE, 1 << 20, 0x534e_4150_0000_0000);
    let api_path = tmp.path().join("source-api.sock");
    // shared=on: the memory is a memfd cloud-hypervisor can pass on; here
    // a hugetlb one of its own.
    let source = Command::new(&ch)
        .arg("--api-socket")
        .arg(format!("path={}", api_path.display()))
        .arg("--kernel")
        .arg(&elf)
        .args([
            "--memory",
            "size=128M,shared=on,hugepages=on,hugepage_size=2M",
        ])
        .args(["--cpus", "boot=1", "--serial", "null", "--console", "off"])
        .stdin(Stdio::null())
        .spawn()
        .expect("start the source cloud-hypervisor");
    let source = Kill(source);
    let api = ChApi::new(&api_path);
    wait_until("the source's API", WAIT, || api.ping(WAIT).is_ok());
    let source_ram = process_memfd(source.0.id(), "memfd:");
    counting_past(&source_ram, 0, "the guest to spin");
    api.put("vm.pause", None, WAIT).expect("vm.pause");
    let paused_at = spin_state(&source_ram).count;
    let dir = tmp.path().join("ch-snapshot");
    std::fs::create_dir(&dir).expect("mkdir");
    api.put(
        "vm.snapshot",
        Some(&json!({ "destination_url": format!("file://{}", dir.display()) })),
        WAIT,
    )
    .expect("vm.snapshot");
    drop(source);
    drop(source_ram);

    let converted = read_ch_snapshot_dir(&dir, Limits::default()).expect("convert");
    let slots: Vec<SlotRange> = converted.slots.iter().map(|s| s.range).collect();
    let memfds = empty_hugetlb_memfds(&slots);
    let ranges = File::open(&converted.memory_ranges).expect("memory-ranges");
    for (slot, memfd) in converted.slots.iter().zip(&memfds) {
        for piece in &slot.pieces {
            fill(
                memfd,
                slot.range.file_offset + piece.offset_in_slot,
                &ranges,
                piece.file_offset,
                piece.length,
            )
            .expect("fill from memory-ranges");
        }
    }
    assert_eq!((slots[0].gpa, slots[0].file_offset), (0, 0));
    let ram = dup(memfds[0].fd());
    assert_eq!(spin_state(&ram).count, paused_at, "the snapshot's counter");

    let mut receiver = Receiver::start(&ch, tmp.path(), "restored");
    let receiving = receiver.receive(None);
    let sock = UnixStream::connect(&receiver.incoming).expect("connect");
    let memory: Vec<_> = slots
        .iter()
        .zip(&memfds)
        .map(|(s, m)| (s.slot, m.fd()))
        .collect();
    send_snapshot(
        &sock,
        &memory,
        &converted.migration_config,
        &converted.state,
        false,
    )
    .expect("the new cloud-hypervisor takes the converted snapshot");
    receiving
        .join()
        .expect("join")
        .expect("receive-migration answered");
    assert_eq!(receiver.api.vm_state(WAIT).expect("vm.info"), "Running");
    let now = counting_past(
        &ram,
        paused_at,
        "the guest to count on in the restored process",
    );
    assert_eq!(now.bad, 0, "the guest found a page changed");
    eprintln!(
        "cloud-hypervisor snapshot: {} slot(s), migration configuration {} bytes, state {} bytes; \
         counting on from {paused_at} to {}",
        slots.len(),
        converted.migration_config.len(),
        converted.state.len(),
        now.count
    );

    // The converted configuration against the one a live send of the
    // same VM carries: the restored VM is parked here.
    let park = tmp.path().join("park-restored.sock");
    let listener = UnixListener::bind(&park).expect("bind");
    let parking = std::thread::spawn(move || {
        let (sock, _) = listener.accept().expect("accept");
        receive_snapshot(&sock, Limits::default())
    });
    receiver
        .api
        .send_migration(&park, true, WAIT)
        .expect("send-migration");
    let live = parking.join().expect("join").expect("the live snapshot");
    let keys = |v: &serde_json::Value| {
        v.as_object()
            .map(|o| o.keys().cloned().collect::<Vec<_>>())
            .unwrap_or_default()
    };
    let ours: serde_json::Value =
        serde_json::from_slice(&converted.migration_config).expect("json");
    let theirs: serde_json::Value = serde_json::from_slice(&live.config).expect("json");
    assert_eq!(keys(&ours), keys(&theirs), "the VmMigrationConfig's fields");
    assert_eq!(
        keys(&ours["memory_manager_data"]),
        keys(&theirs["memory_manager_data"])
    );
    // The APIC ids in CPUID are those of the host CPU the process ran the
    // instruction on (leaf 1's EBX[31:24], leaves 0xB and 0x1F's EDX, the
    // x2APIC id): the two processes may have run on different CPUs.
    let cpuid = |v: &serde_json::Value| {
        let mut v = v.clone();
        for e in v.as_array_mut().into_iter().flatten() {
            if e["function"] == 1 {
                let ebx = e["ebx"].as_u64().unwrap_or(0) & 0x00ff_ffff;
                e["ebx"] = ebx.into();
            }
            if e["function"] == 0xb || e["function"] == 0x1f {
                e["edx"] = 0.into();
            }
        }
        v
    };
    assert_eq!(cpuid(&ours["common_cpuid"]), cpuid(&theirs["common_cpuid"]));
    let differing: Vec<String> = keys(&ours["memory_manager_data"])
        .into_iter()
        .filter(|k| ours["memory_manager_data"][k] != theirs["memory_manager_data"][k])
        .collect();
    eprintln!(
        "converted vs live configuration: {} vs {} bytes; vm_config {}; memory_manager_data \
         fields that differ: {differing:?}",
        converted.migration_config.len(),
        live.config.len(),
        if ours["vm_config"] == theirs["vm_config"] {
            "equal"
        } else {
            "differs"
        }
    );
}
