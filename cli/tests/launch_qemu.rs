//! `hugemem launch … -- qemu-system-x86_64 …` against a daemon on a temporary
//! socket, with real QEMU (`-M microvm -accel kvm`) booting the project's PVH
//! micro-guest on the daemon's memory, plus launch's own plumbing (inherited
//! fds, refused options, SIGTERM forwarding, FREE) with a stand-in VMM.
//!
//! The QEMU test is skipped with `SKIP: reason` when `qemu-system-x86_64` or a
//! usable `/dev/kvm` is missing. It runs on 1 GiB pages when two can be
//! reserved, else on 2 MiB pages, and prints which.
//!
//! Deadlines: child processes run under coreutils `timeout`, and waits for the
//! daemon's state poll with a deadline; nothing sleeps for a fixed time.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use guest_mem::{PageSize, Reservation};
use microguest::{pvh_elf, PvhConfig};
use test_support::hugepages::hold;
use test_support::prelude::TestDaemon;

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");

fn qemu_skip_reason() -> Option<String> {
    match Command::new("qemu-system-x86_64").arg("--version").output() {
        Ok(o) if o.status.success() => {}
        _ => return Some("qemu-system-x86_64 not installed".into()),
    }
    microguest::kvm_available().err()
}

/// 1 GiB pages when two can be reserved, else 2 MiB; the reservation lives
/// as long as the returned value.
fn pages_for_2g() -> Option<(&'static str, Option<Reservation>)> {
    match hold(PageSize::Huge1G, 2) {
        Ok(r) => return Some(("1G", Some(r))),
        Err(why) => eprintln!("NOTE: {why}; trying 2M pages"),
    }
    match hold(PageSize::Huge2M, 1024) {
        Ok(r) => Some(("2M", Some(r))),
        Err(why) => {
            test_support::skip!("no 2 x 1G pages, and {why}");
            None
        }
    }
}

/// `hugemem launch` with a 60 s deadline; returns the output and the wall time.
fn launch(socket: &Path, launch_args: &[&str], vmm: &[&str]) -> (Output, Duration) {
    let started = Instant::now();
    let out = Command::new("timeout")
        .args(["60", HUGEMEM, "launch", "--socket"])
        .arg(socket)
        .args(launch_args)
        .arg("--")
        .args(vmm)
        .output()
        .expect("run hugemem launch");
    let wall = started.elapsed();
    assert_ne!(
        out.status.code(),
        Some(124),
        "hugemem launch did not finish within 60 s: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (out, wall)
}

fn guest_elf(dir: &Path) -> PathBuf {
    // start_gpa 1 MiB: QEMU's firmware writes the real-mode IVT at GPA 0.
    let cfg = PvhConfig {
        stride: 2 << 20,
        marker: 0x1234,
        start_gpa: 1 << 20,
        ..Default::default()
    };
    let path = dir.join("guest.elf");
    std::fs::write(&path, pvh_elf(&cfg).expect("pvh elf")).expect("write elf");
    path
}

#[test]
fn qemu_microvm_boots_on_daemon_memory_and_reuses_it_clean() {
    if let Some(reason) = qemu_skip_reason() {
        test_support::skip!("{reason}");
        return;
    }
    let Some((page, _reservation)) = pages_for_2g() else {
        return;
    };
    eprintln!("QEMU launch test on {page} pages");
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let elf = guest_elf(dir.path());
    let elf = elf.to_str().expect("utf-8 path");
    let vmm = [
        "qemu-system-x86_64",
        "-M",
        "microvm",
        "-accel",
        "kvm",
        "-cpu",
        hugemem::launch::vmm::qemu::KVM_CPU,
        "-nodefaults",
        "-no-user-config",
        "-nographic",
        "-serial",
        "stdio",
        "-device",
        "isa-debug-exit",
        "-no-reboot",
        "-kernel",
        elf,
    ];
    let mut times = Vec::new();
    // fresh: new pages; pooled: the same region again, scrubbed after the
    // first guest wrote markers into it; hugetlbfs: a file path on the
    // daemon's hugetlbfs mount instead of /dev/fd/N.
    for run in ["fresh", "pooled", "hugetlbfs"] {
        let before = daemon.stats();
        let mut args = vec!["--size", "2G", "--page-size", page];
        if run == "hugetlbfs" {
            args.push("--hugetlbfs");
        }
        let (out, wall) = launch(&daemon.socket(), &args, &vmm);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        // 2 GiB / 2 MiB = 1024 strides, the first below start_gpa. isa-debug-exit:
        // QEMU exits (value << 1) | 1, the guest writes 0 when it read only zeros.
        assert!(
            stdout.contains("HUGEMEM-GUEST pages=1023 nonzero=0 status=0\n"),
            "{run}: guest report missing or wrong; stdout {stdout:?}; stderr:\n{stderr}"
        );
        assert_eq!(
            out.status.code(),
            Some(1),
            "{run}: launch must exit with QEMU's isa-debug-exit status 1; stderr:\n{stderr}"
        );
        // FREE went through: nothing allocated, the region back in the pool and scrubbed.
        let after = daemon.wait_stats(Duration::from_secs(30), "FREE and scrub", |s| {
            s.allocations.active == 0
                && s.pool_sum(|p| p.clean_bytes) >= 2 << 30
                && s.pool_sum(|p| p.dirty_bytes) == 0
        });
        if run == "pooled" {
            assert!(
                after.counters.regions_pooled > before.counters.regions_pooled,
                "second launch not served from the pool: {after}"
            );
        }
        eprintln!(
            "QEMU launch->poweroff ({run}, 2G on {page} pages): {:.1} ms; {}",
            wall.as_secs_f64() * 1e3,
            stderr.trim()
        );
        times.push(wall);
    }
    eprintln!(
        "SUMMARY launch->poweroff on {page} pages: fresh {:.1} ms, pooled {:.1} ms, hugetlbfs path (fresh) {:.1} ms",
        times[0].as_secs_f64() * 1e3,
        times[1].as_secs_f64() * 1e3,
        times[2].as_secs_f64() * 1e3
    );
    daemon.shutdown();
}

/// A stand-in QEMU: records its arguments and the size of the memory file it
/// was given, says it is ready, and exits 42 on SIGTERM.
fn fake_qemu(dir: &Path) -> PathBuf {
    let path = dir.join("qemu-system-x86_64");
    let script = r#"#!/bin/sh
out="$(dirname "$0")"
printf '%s\n' "$@" > "$out/args"
fd=$(printf '%s\n' "$@" | sed -n 's|.*mem-path=/dev/fd/\([0-9]*\),.*|\1|p')
stat -L -c %s "/dev/fd/$fd" > "$out/size" 2> "$out/stat-error"
trap 'echo term > "$out/term"; exit 42' TERM
touch "$out/ready"
while :; do sleep 0.01; done
"#;
    std::fs::write(&path, script).expect("write fake qemu");
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    path
}

#[test]
fn sigterm_reaches_the_vmm_and_the_memory_is_freed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let qemu = fake_qemu(dir.path());
    let mut child = Command::new(HUGEMEM)
        .args(["launch", "--socket"])
        .arg(daemon.socket())
        .args(["--size", "64M", "--"])
        .arg(&qemu)
        .args(["-kernel", "none"])
        .spawn()
        .expect("spawn hugemem launch");
    let ready = dir.path().join("ready");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ready.exists() {
        if let Some(status) = child.try_wait().expect("try_wait") {
            panic!("launch ended before the VMM was ready: {status}");
        }
        assert!(Instant::now() < deadline, "the stand-in VMM did not start");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(daemon.stats().allocations.active, 1);
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pid"));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM to launch");
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "launch did not exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(
        status.code(),
        Some(42),
        "launch exits with the VMM's status"
    );
    assert!(
        dir.path().join("term").exists(),
        "the VMM did not get SIGTERM"
    );
    // The VMM could open /dev/fd/N, and saw the whole region.
    let size = std::fs::read_to_string(dir.path().join("size")).expect("size file");
    assert_eq!(
        size.trim(),
        (64u64 << 20).to_string(),
        "stat error: {:?}",
        std::fs::read_to_string(dir.path().join("stat-error"))
    );
    let args = std::fs::read_to_string(dir.path().join("args")).expect("args file");
    let args: Vec<&str> = args.lines().collect();
    assert!(
        args[0] == "-object"
            && args[1].starts_with("memory-backend-file,id=ram0,mem-path=/dev/fd/"),
        "{args:?}"
    );
    assert!(args[1].ends_with(",share=on,size=64M"), "{args:?}");
    assert!(args.windows(2).any(|w| w == ["-m", "64M"]), "{args:?}");
    assert!(
        args.windows(2)
            .any(|w| w == ["-machine", "memory-backend=ram0"]),
        "{args:?}"
    );
    assert!(args.ends_with(&["-kernel", "none"]), "{args:?}");
    daemon.wait_stats(Duration::from_secs(10), "FREE", |s| {
        s.allocations.active == 0
    });
    daemon.shutdown();
}

#[test]
fn conflicting_memory_options_are_refused_before_allocating() {
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let qemu = fake_qemu(dir.path());
    let qemu = qemu.to_str().expect("utf-8");
    for (vmm_args, option) in [
        (vec![qemu, "-m", "1G"], "`-m`"),
        (
            vec![qemu, "-object", "memory-backend-ram,id=x,size=1G"],
            "memory-backend-ram",
        ),
        (vec![qemu, "-M", "microvm", "-numa", "node"], "`-numa`"),
        (vec![qemu, "-mem-path", "/dev/hugepages"], "`-mem-path`"),
    ] {
        let (out, _) = launch(&daemon.socket(), &["--size", "64M"], &vmm_args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains("conflicts with the guest RAM hugemem launch provides"),
            "{stderr}"
        );
        assert!(stderr.contains(option), "{option} not named in: {stderr}");
        assert!(!dir.path().join("args").exists(), "the VMM must not start");
    }
    // Several regions under microvm (no NUMA there): refused before ALLOC too.
    let (out, _) = launch(
        &daemon.socket(),
        &["--nodes", "0:32M,1:32M"],
        &[qemu, "-M", "microvm"],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("microvm has no NUMA support"), "{stderr}");
    let stats = daemon.stats();
    assert_eq!(
        stats.counters.allocs_ok, 0,
        "nothing may be allocated for a refused command line: {stats}"
    );
    // An unknown VMM is refused too, naming --vmm.
    let (out, _) = launch(&daemon.socket(), &["--size", "64M"], &["/bin/true"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--vmm"), "{stderr}");
    daemon.shutdown();
}
