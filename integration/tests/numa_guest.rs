//! Runs hugemem's NUMA tests (`tests/numa_guest_tests.rs`) inside a Linux
//! guest with several NUMA nodes.
//!
//! This machine has one NUMA node, and its KVM cannot boot a stock kernel, so
//! the nodes exist only in a guest under QEMU's software emulation (TCG). The
//! test:
//! 1. checks the prerequisites: an x86_64 Linux host, `scripts/numa-guest
//!    check` (QEMU, static busybox, the Debian kernel extracted), running
//!    `scripts/numa-guest setup` first when that is missing and we are root,
//!    and enough free memory for the guest. Anything missing prints
//!    `SKIP: <reason>` and the test returns;
//! 2. builds the in-guest tests as a static release binary in a separate
//!    target directory (`<target dir>-static`, so the `crt-static` RUSTFLAGS
//!    never invalidate the normal build);
//! 3. boots the guest with 2 nodes (4 with `HUGEMEM_NUMA_NODES=4`) through
//!    `scripts/numa-guest run`, which runs the binary with
//!    `--test-threads=1 --nocapture`;
//! 4. fails unless the guest's exit marker says 0, libtest reports
//!    `test result: ok. N passed` with N at least the number of NUMA tests,
//!    every NUMA test printed its `NUMA-TEST-DONE` line (so none skipped
//!    inside the guest), no line says `SKIP`, and every placement line has
//!    all pages local.
//!
//! Progress goes straight to stderr (not through libtest's capture), so a
//! run of a minute or more is visible as it happens; the full console is
//! kept in `<target dir>-static/numa-guest-<N>nodes.log`.
//! `HUGEMEM_SKIP_NUMA_GUEST=1` skips the whole thing (quick local runs).

use std::env;
use std::ffi::OsString;
use std::fs;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread;
use std::time::{Duration, Instant};

/// The tests of `numa_guest_tests.rs` that must run their checks in the guest.
const NUMA_TESTS: &[&str] = &[
    "numa_topology",
    "numa_region_placement",
    "numa_runner_placement",
    "numa_pool_per_node",
    "numa_migrate_shared_2m",
    "numa_migrate_shared_1g",
    "numa_uffd_minor_hugetlbfs",
    "numa_rebalance_through_daemon",
    "numa_migrate_bench",
    "numa_mlock_per_node",
];
const TARGET: &str = "x86_64-unknown-linux-gnu";
const EXIT_MARKER: &str = "HUGEMEM-NUMA-GUEST-EXIT";
/// A static release build from scratch takes a few minutes on 2 cores.
const BUILD_DEADLINE: Duration = Duration::from_secs(20 * 60);
/// Extra time the driver gives the script beyond its own `--timeout`.
const RUN_GRACE: Duration = Duration::from_secs(30);

/// Writes a progress line to stderr directly: libtest captures `eprintln!`.
fn progress(started: Instant, msg: &str) {
    let line = format!(
        "numa_guest [{:6.1} s] {msg}\n",
        started.elapsed().as_secs_f64()
    );
    let _ = io::stderr().write_all(line.as_bytes());
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("integration/ has a parent")
        .to_path_buf()
}

/// `<target dir>-static`: beside the normal target dir, so that a
/// `CARGO_TARGET_DIR` of `/x/tgt` gives `/x/tgt-static` and the default
/// `target/` gives `target-static/` (git-ignored as `/target-*`).
fn static_target_dir() -> PathBuf {
    if let Some(dir) = env::var_os("HUGEMEM_NUMA_STATIC_TARGET_DIR") {
        return PathBuf::from(dir);
    }
    let normal =
        env::var_os("CARGO_TARGET_DIR").map_or_else(|| workspace().join("target"), PathBuf::from);
    let mut name = normal.file_name().map(OsString::from).unwrap_or_default();
    name.push("-static");
    normal.with_file_name(name)
}

/// `MemAvailable` in bytes.
fn mem_available() -> Option<u64> {
    let text = fs::read_to_string("/proc/meminfo").ok()?;
    let kb: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// Runs `scripts/numa-guest <args>`; returns (success, combined output).
fn script(args: &[&str]) -> io::Result<(bool, String)> {
    let out = Command::new(workspace().join("scripts/numa-guest"))
        .args(args)
        .stdin(Stdio::null())
        .output()?;
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    Ok((out.status.success(), text))
}

fn is_root() -> bool {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|ids| ids.split_whitespace().nth(1).map(|e| e == "0"))
        })
        .unwrap_or(false)
}

/// `Err(reason)` when the guest cannot run here.
fn prerequisites(started: Instant, nodes: u32) -> Result<(), String> {
    if env::var_os("HUGEMEM_SKIP_NUMA_GUEST").is_some_and(|v| v != "0") {
        return Err("HUGEMEM_SKIP_NUMA_GUEST is set".into());
    }
    if !cfg!(all(target_arch = "x86_64", target_os = "linux")) {
        return Err("the NUMA guest runs x86_64 Linux binaries built on this host".into());
    }
    let (ready, out) =
        script(&["check"]).map_err(|e| format!("cannot run scripts/numa-guest: {e}"))?;
    if !ready {
        if !is_root() {
            return Err(format!(
                "the NUMA guest is not set up and setup needs root: {}",
                out.trim()
            ));
        }
        progress(
            started,
            "setting up: scripts/numa-guest setup (QEMU, busybox-static, Debian kernel)",
        );
        let (ok, out) =
            script(&["setup"]).map_err(|e| format!("cannot run scripts/numa-guest setup: {e}"))?;
        if !ok {
            let tail: Vec<&str> = out.lines().rev().take(5).collect();
            return Err(format!(
                "scripts/numa-guest setup failed: {}",
                tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
            ));
        }
    }
    // The guest touches well under its RAM, but a 1 GiB page and its
    // migration target must fit, plus the kernel and the initramfs.
    let need = u64::from(nodes) * (2 << 30);
    match mem_available() {
        Some(have) if have < need => Err(format!(
            "{nodes}-node guest wants {} GiB available, the host has {} MiB",
            need >> 30,
            have >> 20
        )),
        _ => Ok(()),
    }
}

/// Builds `numa_guest_tests` statically; returns the executable.
fn build_static_tests(started: Instant) -> PathBuf {
    let target_dir = static_target_dir();
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let rustflags = match env::var("RUSTFLAGS") {
        Ok(flags) if !flags.trim().is_empty() => {
            format!("{flags} -C target-feature=+crt-static --cfg hugemem_numa_guest")
        }
        _ => "-C target-feature=+crt-static --cfg hugemem_numa_guest".to_owned(),
    };
    progress(
        started,
        &format!(
            "building the in-guest tests: RUSTFLAGS=\"{rustflags}\" \
             CARGO_PROFILE_RELEASE_DEBUG=0 cargo test --release -p integration \
             --test numa_guest_tests --no-run --target {TARGET} (CARGO_TARGET_DIR={})",
            target_dir.display()
        ),
    );
    let mut child = Command::new(cargo)
        .current_dir(workspace())
        .args([
            "test",
            "--release",
            "-p",
            "integration",
            "--test",
            "numa_guest_tests",
            "--no-run",
            "--target",
            TARGET,
            "--message-format=json-render-diagnostics",
        ])
        .env("CARGO_TARGET_DIR", &target_dir)
        .env("RUSTFLAGS", &rustflags)
        // Either would take precedence over RUSTFLAGS.
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("CARGO_BUILD_RUSTFLAGS")
        // The workspace's release profile keeps line tables for profiling;
        // the guest copy is stripped of them anyway, so skip making them.
        .env("CARGO_PROFILE_RELEASE_DEBUG", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        // Cargo's progress and diagnostics go to our stderr, uncaptured.
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start cargo for the static build");
    let stdout = child.stdout.take().expect("cargo stdout is piped");
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let mut text = String::new();
        let result = BufReader::new(stdout)
            .read_to_string(&mut text)
            .map(|_| text);
        let _ = tx.send(result);
    });
    let json = match rx.recv_timeout(BUILD_DEADLINE) {
        Ok(result) => result.expect("read cargo's JSON messages"),
        Err(_) => {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the static build did not finish within {BUILD_DEADLINE:?}");
        }
    };
    let status = child.wait().expect("wait for cargo");
    assert!(status.success(), "the static build failed: {status}");
    let executable = json
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact")
        .filter(|m| m["target"]["name"] == "numa_guest_tests" && m["profile"]["test"] == true)
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .expect("cargo reported the numa_guest_tests executable");
    assert!(
        is_static(&executable),
        "{} is dynamically linked (has PT_INTERP); it cannot run in the busybox guest",
        executable.display()
    );
    executable
}

/// True when the ELF file has no `PT_INTERP` program header.
fn is_static(path: &Path) -> bool {
    const PT_INTERP: u32 = 3;
    let data = fs::read(path).expect("read the test binary");
    let u16_at = |o: usize| u16::from_le_bytes([data[o], data[o + 1]]);
    let u32_at = |o: usize| u32::from_le_bytes(data[o..o + 4].try_into().expect("4 bytes"));
    let u64_at = |o: usize| u64::from_le_bytes(data[o..o + 8].try_into().expect("8 bytes"));
    assert!(
        data.len() > 64 && data.starts_with(b"\x7fELF\x02\x01"),
        "not a little-endian ELF64 file"
    );
    let phoff = usize::try_from(u64_at(0x20)).expect("phoff fits usize");
    let (phentsize, phnum) = (usize::from(u16_at(0x36)), usize::from(u16_at(0x38)));
    (0..phnum).all(|i| u32_at(phoff + i * phentsize) != PT_INTERP)
}

/// Whether a console line is worth showing live (everything goes to the log).
fn interesting(line: &str) -> bool {
    const KEYS: &[&str] = &[
        "numa-guest",
        "HUGEMEM-NUMA-GUEST",
        "NUMA-",
        "test ",
        "running ",
        "SKIP",
        "panicked",
        "node ",
        "topology:",
        "failures",
        "error",
        "Kernel panic",
    ];
    KEYS.iter().any(|k| line.contains(k))
}

/// Boots the guest and returns (script exit code, console lines).
fn run_guest(
    started: Instant,
    nodes: u32,
    binary: &Path,
    log: &Path,
) -> (Option<i32>, Vec<String>) {
    let timeout = if nodes > 2 { 600 } else { 300 };
    progress(
        started,
        &format!(
            "booting a {nodes}-node guest under QEMU TCG (timeout {timeout} s); console log: {}",
            log.display()
        ),
    );
    let mut child = Command::new(workspace().join("scripts/numa-guest"))
        .args([
            "run",
            "--nodes",
            &nodes.to_string(),
            "--timeout",
            &timeout.to_string(),
            "--binary",
        ])
        .arg(binary)
        .args(["--", "--test-threads=1", "--nocapture"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start scripts/numa-guest run");
    let (tx, rx) = mpsc::channel();
    let stdout = child.stdout.take().expect("stdout is piped");
    let stderr = child.stderr.take().expect("stderr is piped");
    let forward = |pipe: Box<dyn Read + Send>, tx: mpsc::Sender<String>| {
        thread::spawn(move || {
            for line in BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        })
    };
    forward(Box::new(stdout), tx.clone());
    forward(Box::new(stderr), tx);
    let mut log_file = fs::File::create(log).expect("create the console log");
    let deadline = Instant::now() + Duration::from_secs(timeout) + RUN_GRACE;
    let mut lines = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                let _ = writeln!(log_file, "{line}");
                if interesting(&line) {
                    let _ = io::stderr().write_all(format!("  guest| {line}\n").as_bytes());
                }
                lines.push(line);
            }
            Err(RecvTimeoutError::Disconnected) => break,
            Err(RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "scripts/numa-guest ran past its own timeout plus {RUN_GRACE:?}; console log: {}",
                    log.display()
                );
            }
        }
    }
    let status = child.wait().expect("wait for scripts/numa-guest");
    (status.code(), lines)
}

/// `N` of the in-guest binary's own `test result: ok. N passed; …` line
/// (its last one: the migration tests' child processes print theirs, marked
/// `child|`, earlier), if that run was ok.
fn passed_count(lines: &[String]) -> Option<usize> {
    let last = lines
        .iter()
        .rfind(|l| l.contains("test result: ") && !l.contains("child|"))?;
    let rest = &last[last.find("test result: ok. ")? + "test result: ok. ".len()..];
    rest.split_whitespace().next()?.parse().ok()
}

/// The `key=value` fields of a result line.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

#[test]
fn numa_tests_in_qemu_guest() {
    let started = Instant::now();
    let nodes: u32 = match env::var("HUGEMEM_NUMA_NODES").as_deref() {
        Err(_) | Ok("" | "2") => 2,
        Ok("4") => 4,
        Ok(other) => panic!("HUGEMEM_NUMA_NODES must be 2 or 4, not {other:?}"),
    };
    progress(
        started,
        &format!("{nodes}-node guest test: checking prerequisites"),
    );
    if let Err(reason) = prerequisites(started, nodes) {
        test_support::skip!("{reason}");
        progress(started, &format!("SKIP: {reason}"));
        return;
    }
    let binary = build_static_tests(started);
    progress(started, &format!("built {}", binary.display()));
    let log = static_target_dir().join(format!("numa-guest-{nodes}nodes.log"));
    let (code, lines) = run_guest(started, nodes, &binary, &log);
    let tail = lines[lines.len().saturating_sub(60)..].join("\n");
    let context = format!("console log: {}; last lines:\n{tail}", log.display());

    let marker = lines.iter().find_map(|l| {
        let at = l.find(EXIT_MARKER)?;
        l[at + EXIT_MARKER.len()..].trim().parse::<i32>().ok()
    });
    assert_eq!(
        marker,
        Some(0),
        "the guest's tests did not all pass (exit marker {marker:?}); {context}"
    );
    assert_eq!(
        code,
        Some(0),
        "scripts/numa-guest run exited with {code:?}; {context}"
    );
    let passed = passed_count(&lines);
    assert!(
        passed.is_some_and(|n| n >= NUMA_TESTS.len()),
        "libtest reported {passed:?} passed, want at least {}; {context}",
        NUMA_TESTS.len()
    );
    let missing: Vec<&str> = NUMA_TESTS
        .iter()
        .copied()
        .filter(|t| {
            !lines
                .iter()
                .any(|l| l.contains(&format!("NUMA-TEST-DONE {t}")))
        })
        .collect();
    assert!(
        missing.is_empty(),
        "tests that did not run their checks in the guest: {missing:?}; {context}"
    );
    let skips: Vec<&String> = lines.iter().filter(|l| l.contains("SKIP:")).collect();
    assert!(
        skips.is_empty(),
        "a test skipped inside the guest: {skips:?}"
    );

    let placements: Vec<&String> = lines
        .iter()
        .filter(|l| l.contains("NUMA-PLACEMENT "))
        .collect();
    assert_eq!(
        placements.len(),
        2 * nodes as usize,
        "one region and one runner placement line per node: {placements:?}"
    );
    for p in &placements {
        let (pages, local) = (field(p, "pages"), field(p, "local"));
        assert!(
            pages.is_some() && pages == local,
            "pages off their node: {p}"
        );
    }
    let topology = lines
        .iter()
        .filter(|l| l.contains("NUMA-TOPOLOGY "))
        .count();
    assert_eq!(topology, nodes as usize, "one topology line per node");

    progress(started, "summary:");
    for l in lines.iter().filter(|l| {
        [
            "NUMA-PLACEMENT",
            "NUMA-CLEAR",
            "NUMA-MIGRATE",
            "NUMA-UFFD",
            "test result",
            "numa-guest: guest exit",
        ]
        .iter()
        .any(|k| l.contains(k))
    }) {
        progress(started, &format!("  {}", l.trim()));
    }
    progress(
        started,
        &format!(
            "{nodes}-node guest test passed ({} NUMA tests)",
            NUMA_TESTS.len()
        ),
    );
}
