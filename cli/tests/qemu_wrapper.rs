//! `hugemem qemu-wrapper` without libvirt: a stand-in QEMU (a shell script)
//! records the command line and pid it was exec'd with, against a daemon on
//! a temporary socket. `cli/tests/libvirt.rs` runs the wrapper under real
//! libvirt and QEMU; this file pins the plumbing on any host with 2 MiB pages:
//!
//! * a capability probe reaches QEMU unchanged, under the wrapper's pid,
//!   without a daemon (the socket does not exist);
//! * a domain's JSON and key=value hugetlb memfd backends are allocated and
//!   rewritten to `/proc/self/fd/N` files of their size, everything else kept
//!   in place; QEMU is the wrapper's pid, holds the allocations while it runs,
//!   and they are freed when it exits (no FREE: the connection QEMU inherited
//!   closes);
//! * a backend with `discard-data` is refused before anything is allocated,
//!   and QEMU does not run.
//!
//! Runs under the machine lock (2 MiB pages).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use guest_mem::PageSize;
use test_support::hugepages::hold;
use test_support::prelude::{serial, TestDaemon};

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");

/// A stand-in QEMU: writes its pid and arguments, the size of each
/// `/proc/self/fd/N` mem-path, says it is ready, and exits 0 once `go` exists.
fn fake_qemu(dir: &Path) -> PathBuf {
    let path = dir.join("qemu");
    let script = r#"#!/bin/sh
out="$(dirname "$0")"
echo $$ > "$out/pid"
printf '%s\n' "$@" > "$out/args"
for fd in $(printf '%s\n' "$@" | sed -n 's|.*"mem-path":"/proc/self/fd/\([0-9]*\)".*|\1|p; s|.*mem-path=/proc/self/fd/\([0-9]*\),.*|\1|p'); do
  stat -L -c %s "/proc/self/fd/$fd" >> "$out/sizes"
done
touch "$out/ready"
while [ ! -e "$out/go" ]; do sleep 0.01; done
"#;
    std::fs::write(&path, script).expect("write fake qemu");
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    path
}

fn wrapper(qemu: &Path, socket: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(HUGEMEM);
    cmd.args(["qemu-wrapper", "--qemu"])
        .arg(qemu)
        .arg("--socket")
        .arg(socket)
        .arg("--")
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::piped());
    cmd
}

fn wait_for(path: &Path, child: &mut std::process::Child) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !path.exists() {
        if let Some(status) = child.try_wait().expect("try_wait") {
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut e, &mut err);
            }
            panic!(
                "the wrapper ended ({status}) before {}: {err}",
                path.display()
            );
        }
        assert!(
            Instant::now() < deadline,
            "{} did not appear",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn read(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn probes_go_straight_to_qemu_without_a_daemon() {
    let dir = tempfile::tempdir().expect("tempdir");
    let qemu = fake_qemu(dir.path());
    std::fs::write(dir.path().join("go"), "").expect("go");
    let probe = [
        "-S",
        "-no-user-config",
        "-machine",
        "none,accel=kvm:tcg",
        "-qmp",
        "unix:/x/qmp.monitor,server=on,wait=off",
    ];
    let mut child = wrapper(&qemu, &dir.path().join("no-daemon.sock"), &probe)
        .spawn()
        .expect("spawn");
    let pid = child.id();
    let status = child.wait().expect("wait");
    assert!(status.success(), "{status}");
    assert_eq!(
        read(dir.path(), "args").lines().collect::<Vec<_>>(),
        probe,
        "a probe must reach QEMU unchanged"
    );
    assert_eq!(
        read(dir.path(), "pid").trim(),
        pid.to_string(),
        "QEMU must be exec'd"
    );
}

#[test]
fn memory_backends_come_from_the_daemon_and_are_freed_when_qemu_exits() {
    let _serial = serial();
    let Ok(_pages) = hold(PageSize::Huge2M, 32) else {
        test_support::skip!("fewer than 32 free 2 MiB pages");
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let qemu = fake_qemu(dir.path());
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let json = r#"{"qom-type":"memory-backend-memfd","id":"ram-node0","hugetlb":true,"hugetlbsize":2097152,"share":true,"prealloc":true,"size":33554432,"host-nodes":[0],"policy":"bind"}"#;
    let keyval = "memory-backend-memfd,id=ram-node1,hugetlb=on,hugetlbsize=2M,prealloc=on,size=32M";
    let args = [
        "-name",
        "guest=t,debug-threads=on",
        "-object",
        json,
        "-numa",
        "node,nodeid=0,cpus=0,memdev=ram-node0",
        "-object",
        keyval,
        "-numa",
        "node,nodeid=1,cpus=1,memdev=ram-node1",
        "-kernel",
        "guest.elf",
    ];
    let mut child = wrapper(&qemu, &daemon.socket(), &args)
        .spawn()
        .expect("spawn");
    wait_for(&dir.path().join("ready"), &mut child);
    let seen = read(dir.path(), "args");
    let seen: Vec<&str> = seen.lines().collect();
    assert_eq!(seen.len(), args.len(), "{seen:?}");
    for (i, (s, a)) in seen.iter().zip(args).enumerate() {
        if i == 3 || i == 7 {
            continue;
        }
        assert_eq!(*s, a, "argument {i} must stay as written");
    }
    assert!(
        seen[3].starts_with(
            r#"{"qom-type":"memory-backend-file","id":"ram-node0","mem-path":"/proc/self/fd/"#
        ) && seen[3].ends_with(r#","share":true,"size":33554432}"#),
        "{}",
        seen[3]
    );
    assert!(
        seen[7].starts_with("memory-backend-file,id=ram-node1,mem-path=/proc/self/fd/")
            && seen[7].ends_with(",share=on,size=33554432"),
        "{}",
        seen[7]
    );
    assert_eq!(
        read(dir.path(), "sizes").lines().collect::<Vec<_>>(),
        ["33554432", "33554432"],
        "QEMU must open each mem-path as a file of the backend's size"
    );
    assert_eq!(read(dir.path(), "pid").trim(), child.id().to_string());
    let stats = daemon.stats();
    assert_eq!(stats.allocations.active, 2, "{stats}");
    assert_eq!(stats.allocations.bytes, 64 << 20, "{stats}");
    // QEMU exits: the connection it inherited closes, the daemon frees.
    std::fs::write(dir.path().join("go"), "").expect("go");
    let status = child.wait().expect("wait");
    assert!(status.success(), "{status}");
    daemon.wait_stats(Duration::from_secs(30), "freed on QEMU's exit", |s| {
        s.allocations.active == 0 && s.pool_sum(|p| p.dirty_bytes) == 0
    });
    daemon.shutdown();
}

#[test]
fn a_backend_the_daemon_cannot_stand_in_for_is_refused() {
    let _serial = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let qemu = fake_qemu(dir.path());
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let out = wrapper(
        &qemu,
        &daemon.socket(),
        &[
            "-object",
            r#"{"qom-type":"memory-backend-memfd","id":"ram-node0","hugetlb":true,"hugetlbsize":2097152,"share":true,"discard-data":true,"size":33554432}"#,
        ],
    )
    .output()
    .expect("run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("QEMU not started") && stderr.contains("discard-data"),
        "{stderr}"
    );
    assert!(!dir.path().join("args").exists(), "QEMU must not run");
    assert_eq!(daemon.stats().counters.allocs_ok, 0);
    daemon.shutdown();
}
