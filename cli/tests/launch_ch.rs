//! `hugemem launch … -- cloud-hypervisor …`.
//!
//! * With a real cloud-hypervisor (the `CLOUD_HYPERVISOR` environment variable
//!   names the binary; tests `cloud_hypervisor_*`): boots the project's PVH
//!   micro-guest (an ELF64 with the Xen PVH note: cloud-hypervisor refuses a
//!   32-bit ELF with "Invalid bzImage") on daemon memory, in fd mode, in
//!   hugetlbfs-path mode under `--landlock`, and with two memory zones and two
//!   guest NUMA nodes on one host node (`--nodes 0:1G,0:1G --guest-numa`),
//!   and checks the guest's serial report. Without the binary they skip
//!   through `test_support::skip!`.
//! * Always: a stand-in `cloud-hypervisor` script checks the command line
//!   launch builds and that the VMM can open the memory file it names, in fd
//!   mode and (when the daemon has a hugetlbfs mount) in path mode, and that a
//!   hugetlbfs launch right after an fd launch that used every free page
//!   waits for the freed region instead of failing with NoMemory.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use guest_mem::{PageSize, PoolCounts, Reservation};
use microguest::{pvh_elf, PvhConfig};
// The tests share the host's huge-page pools (each reserves, allocates and
// frees them): one at a time.
use test_support::hugepages::hold;
use test_support::prelude::{serial, TestDaemon};

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");

/// Waits until every allocation is FREEd (the VMM exited and `hugemem
/// launch` gave its memory back).
fn wait_freed(daemon: &TestDaemon) {
    daemon.wait_stats(Duration::from_secs(30), "allocation freed", |s| {
        s.allocations.active == 0
    });
}

fn launch(socket: &Path, launch_args: &[&str], vmm: &[&str]) -> Output {
    let out = Command::new("timeout")
        .args(["60", HUGEMEM, "launch", "--socket"])
        .arg(socket)
        .args(launch_args)
        .arg("--")
        .args(vmm)
        .output()
        .expect("run hugemem launch");
    assert_ne!(
        out.status.code(),
        Some(124),
        "hugemem launch did not finish within 60 s"
    );
    out
}

/// A stand-in cloud-hypervisor: records its arguments and the size of the
/// zone file it was given (through the path it names, as cloud-hypervisor
/// opens it), then exits 0.
fn fake_ch(dir: &Path) -> PathBuf {
    let path = dir.join("cloud-hypervisor");
    let script = r#"#!/bin/sh
out="$(dirname "$0")"
printf '%s\n' "$@" > "$out/args"
file=$(printf '%s\n' "$@" | sed -n 's|^id=hugemem0,size=[^,]*,file=\([^,]*\),shared=on$|\1|p')
echo "$file" > "$out/file"
stat -L -c %s "$file" > "$out/size" 2> "$out/stat-error"
"#;
    std::fs::write(&path, script).expect("write fake cloud-hypervisor");
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    path
}

fn read(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn fd_mode_command_line_and_memory_file() {
    let _serial = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let ch = fake_ch(dir.path());
    let out = launch(
        &daemon.socket(),
        &["--size", "64M"],
        &[
            ch.to_str().expect("utf-8"),
            "--kernel",
            "k",
            "--cpus",
            "boot=1",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let args = read(dir.path(), "args");
    let args: Vec<&str> = args.lines().collect();
    assert_eq!(
        args[..3],
        ["--memory", "size=0", "--memory-zone"],
        "{args:?}"
    );
    assert!(
        args[3].starts_with("id=hugemem0,size=64M,file=/dev/fd/")
            && args[3].ends_with(",shared=on"),
        "{args:?}"
    );
    assert_eq!(args[4..], ["--kernel", "k", "--cpus", "boot=1"]);
    assert_eq!(
        read(dir.path(), "size").trim(),
        (64u64 << 20).to_string(),
        "{}",
        read(dir.path(), "stat-error")
    );
    wait_freed(&daemon);
    // --landlock cannot open /dev/fd/N: refused before anything is allocated.
    let out = launch(
        &daemon.socket(),
        &["--size", "64M"],
        &[ch.to_str().expect("utf-8"), "--landlock"],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr.contains("--hugetlbfs"), "{stderr}");
    // Memory options of the user's own: refused, naming the option.
    let out = launch(
        &daemon.socket(),
        &["--size", "64M"],
        &[ch.to_str().expect("utf-8"), "--memory", "size=1G"],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("`--memory` conflicts"), "{stderr}");
    assert_eq!(
        daemon.stats().counters.allocs_ok,
        1,
        "refused launches must not allocate"
    );
    daemon.shutdown();
}

/// The 32 free 2 MiB pages the stand-in tests allocate, held for the test's
/// lifetime; `None` after a recorded skip when the host cannot give them.
fn stand_in_pages() -> Option<Reservation> {
    hold(PageSize::Huge2M, 32)
        .map_err(|why| test_support::skip!("stand-in tests: {why}"))
        .ok()
}

#[test]
fn hugetlbfs_mode_hands_out_paths() {
    let _serial = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let ch = fake_ch(dir.path());
    let Some(_reservation) = stand_in_pages() else {
        return;
    };
    let out = launch(
        &daemon.socket(),
        &["--size", "64M", "--page-size", "2M", "--hugetlbfs"],
        &[ch.to_str().expect("utf-8"), "--landlock", "--kernel", "k"],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() && stderr.contains("hugetlbfs mount") {
        test_support::skip!("the daemon has no hugetlbfs mount of 2M pages: {stderr}");
        return;
    }
    assert!(out.status.success(), "{stderr}");
    let file = read(dir.path(), "file");
    let file = file.trim();
    assert!(
        file.starts_with('/') && !file.starts_with("/dev/fd/"),
        "not a hugetlbfs path: {file:?}"
    );
    eprintln!("cloud-hypervisor (stand-in) got zone file {file}");
    assert_eq!(
        read(dir.path(), "size").trim(),
        (64u64 << 20).to_string(),
        "{}",
        read(dir.path(), "stat-error")
    );
    wait_freed(&daemon);
    daemon.shutdown();
    assert!(
        !Path::new(file).exists(),
        "{file} must be gone once the daemon stopped"
    );
}

/// Every free 2 MiB page of node 0 through the stand-in in fd mode, then at
/// once the same size as hugetlbfs files (`--hugetlbfs --landlock`): the
/// second ALLOC finds no free page and must wait for the region the first
/// one freed (quarantined, then scrubbed) to become evictable instead of
/// failing with NoMemory.
#[test]
fn hugetlbfs_launch_right_after_an_fd_launch_reuses_its_pages() {
    let _serial = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let ch = fake_ch(dir.path());
    let Some(_reservation) = stand_in_pages() else {
        return;
    };
    let count = |node| {
        PoolCounts::read(PageSize::Huge2M, node)
            .ok()
            .flatten()
            .map_or(0, |c| c.available())
    };
    let pages = count(Some(0)).min(count(None));
    let size = format!("{}M", pages * 2);
    let ch = ch.to_str().expect("utf-8");
    let base = ["--node", "0", "--size", size.as_str(), "--page-size", "2M"];
    let out = launch(&daemon.socket(), &base, &[ch, "--kernel", "k"]);
    assert!(
        out.status.success(),
        "fd launch of {size}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut hugetlbfs = base.to_vec();
    hugetlbfs.push("--hugetlbfs");
    let out = launch(&daemon.socket(), &hugetlbfs, &[ch, "--landlock"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() && stderr.contains("hugetlbfs mount") {
        test_support::skip!("the daemon has no hugetlbfs mount of 2M pages: {stderr}");
        return;
    }
    assert!(
        out.status.success(),
        "hugetlbfs launch of {size} right after the fd launch: {stderr}"
    );
    assert_eq!(
        read(dir.path(), "size").trim(),
        (pages << 21).to_string(),
        "{}",
        read(dir.path(), "stat-error")
    );
    wait_freed(&daemon);
    daemon.shutdown();
}

/// The cloud-hypervisor binary in `CLOUD_HYPERVISOR`, KVM, and the huge pages
/// for `bytes` of guest RAM (1 GiB pages when there are enough, else 2 MiB);
/// `None` after recording a skip.
fn cloud_hypervisor_setup(bytes: u64) -> Option<(String, &'static str, Reservation)> {
    let ch = test_support::cloud_hypervisor::binaries_or_skip()?;
    let Ok(ch) = ch.cloud_hypervisor.clone().into_os_string().into_string() else {
        test_support::skip!("CLOUD_HYPERVISOR is not UTF-8");
        return None;
    };
    let is_program = std::fs::metadata(&ch).is_ok_and(|m| {
        m.is_file() && std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o111 != 0
    });
    if !is_program {
        test_support::skip!("CLOUD_HYPERVISOR={ch} is not an executable file");
        return None;
    }
    if let Err(reason) = microguest::kvm_available() {
        test_support::skip!("{reason}");
        return None;
    }
    if let Ok(r) = hold(PageSize::Huge1G, bytes >> 30) {
        return Some((ch, "1G", r));
    }
    match hold(PageSize::Huge2M, bytes >> 21) {
        Ok(r) => Some((ch, "2M", r)),
        Err(why) => {
            test_support::skip!("no {} x 1G pages, and {why}", bytes >> 30);
            None
        }
    }
}

/// Writes the micro-guest's PVH ELF64 into `dir`.
fn guest_elf(dir: &Path) -> String {
    let elf = dir.join("guest.elf");
    let cfg = PvhConfig {
        stride: 2 << 20,
        marker: 0x1234,
        start_gpa: 1 << 20,
        ..Default::default()
    };
    std::fs::write(&elf, pvh_elf(&cfg).expect("elf")).expect("write elf");
    elf.into_os_string().into_string().expect("utf-8")
}

/// One `hugemem launch … -- cloud-hypervisor --kernel ELF …` run to the
/// guest's power-off: checks the guest's report (all memory read as zero, at
/// least `min_pages` pages of 2 MiB touched) and the exit status; returns the
/// report line, hugemem's stderr and the wall time. `None` when the daemon
/// has no hugetlbfs mount for a `--hugetlbfs` launch (skip recorded).
fn boot(
    socket: &Path,
    ch: &str,
    elf: &str,
    launch_args: &[&str],
    ch_extra: &[&str],
    min_pages: u64,
    what: &str,
) -> Option<(String, String, Duration)> {
    let started = Instant::now();
    let mut vmm = vec![
        ch,
        "--kernel",
        elf,
        "--cpus",
        "boot=1",
        "--serial",
        "tty",
        "--console",
        "off",
    ];
    vmm.extend_from_slice(ch_extra);
    let out = launch(socket, launch_args, &vmm);
    let wall = started.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if launch_args.contains(&"--hugetlbfs") && stderr.contains("hugetlbfs mount") {
        test_support::skip!("{what}: the daemon has no hugetlbfs mount for these pages: {stderr}");
        return None;
    }
    let line = stdout
        .lines()
        .find(|l| l.starts_with("HUGEMEM-GUEST "))
        .unwrap_or_else(|| {
            panic!("{what}: no guest report; stdout {stdout:?}; stderr:\n{stderr}");
        })
        .to_string();
    assert!(
        line.contains(" nonzero=0 "),
        "{what}: guest saw non-zero memory: {line}"
    );
    let pages: u64 = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("pages="))
        .and_then(|n| n.parse().ok())
        .expect("pages=N");
    assert!(
        pages >= min_pages,
        "{what}: guest touched only {pages} pages of 2M, expected at least {min_pages}: {line}"
    );
    assert!(
        out.status.success(),
        "{what}: launch exited with {}; stderr:\n{stderr}",
        out.status
    );
    Some((line, stderr, wall))
}

/// Boots the micro-guest under the real cloud-hypervisor in `CLOUD_HYPERVISOR`
/// on 2 GiB of daemon memory: fd mode, then `--hugetlbfs` with `--landlock`.
#[test]
fn cloud_hypervisor_boots_on_daemon_memory() {
    let _serial = serial();
    let Some((ch, page, _reservation)) = cloud_hypervisor_setup(2 << 30) else {
        return;
    };
    eprintln!("cloud-hypervisor launch test on {page} pages");
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let elf = guest_elf(dir.path());
    for (mode, launch_extra, ch_extra) in [
        ("fd", &[][..], &[][..]),
        ("hugetlbfs", &["--hugetlbfs"][..], &["--landlock"][..]),
    ] {
        let mut launch_args = vec!["--size", "2G", "--page-size", page];
        launch_args.extend_from_slice(launch_extra);
        // 2 GiB of 2 MiB pages less the guest's image and the first MiB.
        let Some((line, _, wall)) = boot(
            &daemon.socket(),
            &ch,
            &elf,
            &launch_args,
            ch_extra,
            1000,
            mode,
        ) else {
            continue;
        };
        eprintln!(
            "cloud-hypervisor launch->poweroff ({mode}, 2G on {page} pages): {:.1} ms; {line}",
            wall.as_secs_f64() * 1e3
        );
        // No wait for the scrub: the hugetlbfs ALLOC right after the fd run
        // must wait for the freed memfd region itself when pages are short.
        wait_freed(&daemon);
    }
    let stats = daemon.stats();
    eprintln!("pools after: {:?}", stats.pools);
    daemon.shutdown();
}

/// Two memory zones, two guest NUMA nodes, one host node: `hugemem launch
/// --nodes 0:1G,0:1G --guest-numa` asks the daemon for two regions on node 0
/// and gives cloud-hypervisor `--memory-zone id=hugemem0,… id=hugemem1,…
/// --numa guest_numa_id=0,memory_zones=hugemem0 guest_numa_id=1,…`. The guest
/// must boot and walk both zones.
#[test]
fn cloud_hypervisor_two_zones_on_one_host_node() {
    let _serial = serial();
    let Some((ch, page, _reservation)) = cloud_hypervisor_setup(2 << 30) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let elf = guest_elf(dir.path());
    let launch_args = ["--nodes", "0:1G,0:1G", "--guest-numa", "--page-size", page];
    // More than the 512 pages of one zone: the walk crossed into the second.
    let Some((line, stderr, wall)) = boot(
        &daemon.socket(),
        &ch,
        &elf,
        &launch_args,
        &[],
        1000,
        "two zones",
    ) else {
        return;
    };
    for expected in [
        "id=hugemem0,size=1G,file=/dev/fd/",
        "id=hugemem1,size=1G,file=/dev/fd/",
        "guest_numa_id=0,memory_zones=hugemem0",
        "guest_numa_id=1,memory_zones=hugemem1",
    ] {
        assert!(
            stderr.contains(expected),
            "the launch log does not show {expected:?}:\n{stderr}"
        );
    }
    eprintln!(
        "cloud-hypervisor two zones on host node 0 ({page} pages): launch->poweroff {:.1} ms; {line}",
        wall.as_secs_f64() * 1e3
    );
    wait_freed(&daemon);
    // The daemon made two 1 GiB regions, both on node 0 (now back in its pool).
    let stats = daemon.stats();
    let regions: Vec<(u32, u64)> = stats
        .regions
        .iter()
        .flatten()
        .map(|r| (r.node, r.bytes))
        .collect();
    assert_eq!(regions, [(0, 1 << 30), (0, 1 << 30)], "{stats}");
    daemon.shutdown();
}
