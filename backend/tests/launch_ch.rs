//! `hugemem launch … -- cloud-hypervisor …`.
//!
//! * With a real cloud-hypervisor (the `CLOUD_HYPERVISOR` environment variable
//!   names the binary): boots the project's PVH micro-guest on daemon memory,
//!   in fd mode and in hugetlbfs-path mode under `--landlock`, and checks the
//!   guest's serial report. Without it the test prints `SKIP: reason`.
//! * Always: a stand-in `cloud-hypervisor` script checks the command line
//!   launch builds and that the VMM can open the memory file it names, in fd
//!   mode and (when the daemon has a hugetlbfs mount) in path mode.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use backend::daemon::config::PoolConfig;
use backend::daemon::{Config, Daemon, DaemonHandle};
use guest_mem::{PageSize, Reservation};
use microguest::{pvh_elf, PvhConfig};
use serde_json::Value;

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");

fn start_daemon(dir: &Path) -> DaemonHandle {
    let defaults = Config::default();
    let cfg = Config {
        socket: dir.join("hugemem.sock"),
        pool: PoolConfig {
            recheck_ms: 20,
            ..defaults.pool.clone()
        },
        ..defaults
    };
    Daemon::start(cfg).expect("daemon starts")
}

fn wait_freed(daemon: &DaemonHandle) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let stats = daemon.stats();
        if stats["allocations"]["active"].as_u64() == Some(0) {
            return;
        }
        assert!(Instant::now() < deadline, "allocation not freed: {stats}");
        std::thread::sleep(Duration::from_millis(5));
    }
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
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = start_daemon(dir.path());
    let ch = fake_ch(dir.path());
    let out = launch(
        daemon.socket_path(),
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
        daemon.socket_path(),
        &["--size", "64M"],
        &[ch.to_str().expect("utf-8"), "--landlock"],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr.contains("--hugetlbfs"), "{stderr}");
    // Memory options of the user's own: refused, naming the option.
    let out = launch(
        daemon.socket_path(),
        &["--size", "64M"],
        &[ch.to_str().expect("utf-8"), "--memory", "size=1G"],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("`--memory` conflicts"), "{stderr}");
    assert_eq!(
        daemon.stats()["counters"]["allocs_ok"].as_u64(),
        Some(1),
        "refused launches must not allocate"
    );
    daemon.shutdown().expect("shutdown");
}

#[test]
fn hugetlbfs_mode_hands_out_paths() {
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = start_daemon(dir.path());
    let ch = fake_ch(dir.path());
    match Reservation::for_run(PageSize::Huge2M, 32) {
        Ok(r) if r.report().met => {}
        other => {
            test_support::skip!("32 free 2M pages are needed: {other:?}");
            return;
        }
    }
    let out = launch(
        daemon.socket_path(),
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
    daemon.shutdown().expect("shutdown");
    assert!(
        !Path::new(file).exists(),
        "{file} must be gone once the daemon stopped"
    );
}

/// Boots the micro-guest under the real cloud-hypervisor in `CLOUD_HYPERVISOR`.
#[test]
fn cloud_hypervisor_boots_on_daemon_memory() {
    let Some(ch) = std::env::var_os("CLOUD_HYPERVISOR") else {
        test_support::skip!("CLOUD_HYPERVISOR does not name a cloud-hypervisor binary");
        return;
    };
    if let Err(reason) = microguest::kvm_available() {
        test_support::skip!("{reason}");
        return;
    }
    let ch = ch.into_string().expect("CLOUD_HYPERVISOR must be UTF-8");
    let page = match Reservation::for_run(PageSize::Huge1G, 2) {
        Ok(r) if r.report().met => ("1G", r),
        _ => match Reservation::for_run(PageSize::Huge2M, 1024) {
            Ok(r) if r.report().met => ("2M", r),
            other => {
                test_support::skip!("neither 2 x 1G nor 1024 x 2M pages: {other:?}");
                return;
            }
        },
    };
    eprintln!("cloud-hypervisor launch test on {} pages", page.0);
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = start_daemon(dir.path());
    let elf = dir.path().join("guest.elf");
    let cfg = PvhConfig {
        stride: 2 << 20,
        marker: 0x1234,
        start_gpa: 1 << 20,
        ..Default::default()
    };
    std::fs::write(&elf, pvh_elf(&cfg).expect("elf")).expect("write elf");
    let elf = elf.to_str().expect("utf-8");
    for (mode, launch_extra, ch_extra) in [
        ("fd", &[][..], &[][..]),
        ("hugetlbfs", &["--hugetlbfs"][..], &["--landlock"][..]),
    ] {
        let started = Instant::now();
        let mut launch_args = vec!["--size", "2G", "--page-size", page.0];
        launch_args.extend_from_slice(launch_extra);
        let mut vmm = vec![
            ch.as_str(),
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
        let out = launch(daemon.socket_path(), &launch_args, &vmm);
        let wall = started.elapsed();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        if mode == "hugetlbfs" && stderr.contains("hugetlbfs mount") {
            test_support::skip!(
                "({mode}): the daemon has no hugetlbfs mount of {} pages",
                page.0
            );
            continue;
        }
        let line = stdout
            .lines()
            .find(|l| l.starts_with("HUGEMEM-GUEST "))
            .unwrap_or_else(|| {
                panic!("{mode}: no guest report; stdout {stdout:?}; stderr:\n{stderr}");
            });
        assert!(
            line.contains(" nonzero=0 "),
            "{mode}: guest saw non-zero memory: {line}"
        );
        let pages: u64 = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("pages="))
            .and_then(|n| n.parse().ok())
            .expect("pages=N");
        assert!(
            pages >= 1000,
            "{mode}: guest touched only {pages} pages of 2M: {line}"
        );
        assert!(
            out.status.success(),
            "{mode}: launch exited with {}; stderr:\n{stderr}",
            out.status
        );
        eprintln!(
            "cloud-hypervisor launch->poweroff ({mode}, 2G on {} pages): {:.1} ms; {line}",
            page.0,
            wall.as_secs_f64() * 1e3
        );
        wait_freed(&daemon);
    }
    let stats: Value = daemon.stats();
    eprintln!("pools after: {}", stats["pools"]);
    daemon.shutdown().expect("shutdown");
}
