//! `hugemem park` and `hugemem launch --restore` of a launched QEMU running
//! a stock Linux guest (issue 46): Debian's kernel under TCG, with a
//! program in it that checks its memory all the time, parked and restored
//! a few times.
//!
//! The guest is the one `scripts/numa-guest` prepares (Debian's 6.1 kernel
//! as a plain vmlinux, a busybox initramfs; `.ci/run` runs its `setup`);
//! here it has one node and its own `/init`, which runs `memcheck`
//! (`park_qemu_linux/memcheck.rs`, built by this test with `rustc` as a
//! static program). memcheck fills 64 MiB of its own memory with a known
//! pattern and then, pass after pass, checks every word and rewrites it
//! with the next pass's pattern, printing `MEMCHECK pass=N` to the serial
//! console after each pass, or `MEMCHECK MISMATCH …` and exiting on a wrong
//! word. The console is a file QEMU appends to (`-chardev
//! file,…,append=on`), so every QEMU of the VM, the first and each restored
//! one, writes on the same file.
//!
//! After each park: the launcher and its QEMU ended, the VM is listed
//! parked with 0 bytes copied, the daemon cleared no byte, and the console
//! stays as it was (nothing runs the guest). After each restore: memcheck
//! makes two more whole passes (so every word written before the park is
//! checked after it). Restores alternate between the parked command line
//! (none given) and the same one given again. At the end the console has
//! one boot and one fill, the passes 1, 2, 3, … each once and in order (the
//! counter never went back), no mismatch, and memcheck never ended; one
//! allocation served every QEMU and the totals balance.
//!
//! Skipped (through the skip helper) without `qemu-system-x86_64`, without
//! the guest's kernel and busybox (`scripts/numa-guest kernel` says what is
//! missing) or without 128 free 2 MiB pages. No KVM needed. Deadlines
//! only: `timeout` around every command, `wait_until` around every wait.

mod common;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use guest_mem::PageSize;
use test_support::hugepages::hold;
use test_support::prelude::{serial, wait_until, TestDaemon};

use common::park::stop_and_settle;
use common::{assert_balanced, child_of, StopLauncher};

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");
const RAM: u64 = 256 << 20;
const PAGE: u64 = 2 << 20;
/// memcheck's buffer, MiB: a quarter of the guest's RAM.
const CHECK_MIB: u64 = 64;
const CYCLES: u64 = 4;
/// Boot under TCG takes 3 to 10 s here; a pass of memcheck well under 1 s.
const BOOT_DEADLINE: Duration = Duration::from_secs(180);
const PASS_DEADLINE: Duration = Duration::from_secs(120);

/// The guest's `/init` (busybox sh).
const INIT: &str = "#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
echo \"MEMCHECK-INIT uptime $(cut -d' ' -f1 /proc/uptime) s, kernel $(uname -r)\"
/tests/memcheck @MIB@
echo \"MEMCHECK-EXIT $?\"
poweroff -f
";

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("cli/ has a parent")
        .to_path_buf()
}

/// `scripts/numa-guest ARGS`: its stdout, or why it failed.
fn numa_guest(args: &[&std::ffi::OsStr]) -> Result<String, String> {
    let out = Command::new(workspace().join("scripts/numa-guest"))
        .args(args)
        .output()
        .map_err(|e| format!("cannot run scripts/numa-guest: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "scripts/numa-guest {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// The guest's kernel, or why the test cannot run.
fn guest_kernel() -> Result<PathBuf, String> {
    match Command::new("qemu-system-x86_64").arg("--version").output() {
        Ok(o) if o.status.success() => {}
        _ => return Err("qemu-system-x86_64 not installed".into()),
    }
    numa_guest(&["kernel".as_ref()]).map(PathBuf::from)
}

/// memcheck, built static into `dir`; the initramfs with it and [`INIT`].
fn initramfs(dir: &Path) -> PathBuf {
    let memcheck = dir.join("memcheck");
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/park_qemu_linux/memcheck.rs");
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let out = Command::new(rustc)
        .args(["--edition", "2021", "-O", "-C", "strip=debuginfo"])
        .args(["-C", "target-feature=+crt-static", "--target"])
        .arg("x86_64-unknown-linux-gnu")
        .arg(&source)
        .arg("-o")
        .arg(&memcheck)
        .output()
        .expect("run rustc");
    assert!(
        out.status.success(),
        "rustc {}: {}",
        source.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let init = dir.join("init");
    std::fs::write(&init, INIT.replace("@MIB@", &CHECK_MIB.to_string())).expect("write init");
    let initrd = dir.join("initrd");
    let args: [&std::ffi::OsStr; 7] = [
        "initramfs".as_ref(),
        "--out".as_ref(),
        initrd.as_ref(),
        "--init".as_ref(),
        init.as_ref(),
        "--binary".as_ref(),
        memcheck.as_ref(),
    ];
    numa_guest(&args).unwrap_or_else(|e| panic!("{e}"));
    initrd
}

/// QEMU's arguments: q35 under TCG, the serial console appended to `console`.
fn qemu_args(kernel: &Path, initrd: &Path, console: &Path) -> Vec<OsString> {
    let mut args: Vec<OsString> = [
        "-machine",
        "q35",
        "-accel",
        "tcg",
        // Emulated ERMS `rep stosb` is 5-10x slower (scripts/numa-guest).
        "-cpu",
        "max,-erms",
        "-smp",
        "1",
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-no-reboot",
    ]
    .iter()
    .map(OsString::from)
    .collect();
    let mut chardev = OsString::from("file,id=console,append=on,path=");
    chardev.push(console);
    args.extend(["-chardev".into(), chardev]);
    args.extend(["-serial".into(), "chardev:console".into()]);
    args.extend([
        "-kernel".into(),
        kernel.into(),
        "-initrd".into(),
        initrd.into(),
    ]);
    args.extend([
        "-append".into(),
        "console=ttyS0 panic=-1 no_timer_check quiet".into(),
    ]);
    args
}

/// `hugemem launch` with a control socket, a fresh VM (`restore`: None) or
/// the parked one (with `args`, or the parked ones when empty).
fn launch(daemon: &TestDaemon, control: &Path, restore: Option<&str>, args: &[OsString]) -> Child {
    let mut c = Command::new("timeout");
    c.args(["600", HUGEMEM, "launch", "--socket"])
        .arg(daemon.socket())
        .arg("--control-socket")
        .arg(control);
    match restore {
        Some(name) => c.args(["--restore", name]),
        None => c.args(["--size", "256M", "--page-size", "2M"]),
    };
    c.arg("--")
        .arg("qemu-system-x86_64")
        .args(args)
        .spawn()
        .expect("spawn hugemem launch")
}

/// `hugemem park NAME --control-socket PATH`; its stdout.
fn park(name: &str, control: &Path) -> String {
    let out = Command::new("timeout")
        .args(["120", HUGEMEM, "park", name, "--control-socket"])
        .arg(control)
        .output()
        .expect("run hugemem park");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "hugemem park failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The guest's serial console, as QEMU wrote it to a file.
struct Console(PathBuf);

impl Console {
    fn text(&self) -> String {
        String::from_utf8_lossy(&std::fs::read(&self.0).unwrap_or_default()).into_owned()
    }

    /// Its whole lines.
    fn lines(&self) -> Vec<String> {
        self.text()
            .split_inclusive('\n')
            .filter_map(|l| l.strip_suffix('\n'))
            .map(|l| l.trim_end_matches('\r').to_owned())
            .collect()
    }

    /// The passes memcheck reported, in the order it reported them;
    /// panics at once on a mismatch or on memcheck's end.
    fn passes(&self) -> Vec<u64> {
        let lines = self.lines();
        let ended = lines
            .iter()
            .any(|l| l.contains("MEMCHECK MISMATCH") || l.starts_with("MEMCHECK-EXIT"));
        assert!(!ended, "memcheck failed; the console:\n{}", self.tail());
        lines
            .iter()
            .filter_map(|l| l.strip_prefix("MEMCHECK pass="))
            .map(|rest| {
                let n = rest.split_whitespace().next().unwrap_or_default();
                n.parse()
                    .unwrap_or_else(|_| panic!("a damaged pass line {rest:?}:\n{}", self.tail()))
            })
            .collect()
    }

    /// Waits until memcheck reports pass `pass` or later; the last pass.
    fn wait_pass(&self, pass: u64, deadline: Duration, what: &str) -> u64 {
        let mut last = 0;
        wait_until(what, deadline, || {
            last = self.passes().last().copied().unwrap_or(0);
            last >= pass
        });
        last
    }

    /// The last lines, for a failure's message.
    fn tail(&self) -> String {
        let lines = self.lines();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

/// Whether process `pid` runs a program (a zombie has no `exe`).
fn running(pid: u32) -> bool {
    std::fs::read_link(format!("/proc/{pid}/exe")).is_ok()
}

/// Parks the VM run by `qemu` and checks what the daemon says then.
fn park_and_check(
    daemon: &TestDaemon,
    control: &Path,
    launched: &mut Child,
    qemu: u32,
    cycle: u64,
) {
    let cleared = daemon.stats().scrub.bytes;
    let said = park("vm", control);
    assert!(
        said.contains("(0 bytes copied by the daemon"),
        "park {cycle}: {said}"
    );
    let status = launched.wait().expect("wait for the launcher");
    assert!(
        status.success(),
        "park {cycle}: the launcher ended with {status}"
    );
    assert!(!running(qemu), "park {cycle}: QEMU {qemu} runs on");
    let stats = daemon.stats();
    let parked = stats.parked.iter().find(|p| p.name == "vm");
    let parked = parked.unwrap_or_else(|| panic!("park {cycle}: not listed: {stats}"));
    assert_eq!(
        (parked.bytes, parked.copied_bytes),
        (RAM, 0),
        "park {cycle}"
    );
    assert_eq!(stats.scrub.bytes, cleared, "park {cycle}: memory cleared");
    assert_eq!(stats.counters.park_copied_bytes, 0, "park {cycle}");
    assert_balanced(&stats, &format!("park {cycle}"));
    eprintln!("park {cycle}: {said}");
}

#[test]
fn a_linux_guest_checking_its_memory_is_parked_and_restored_on_the_same_pages() {
    let _serial = serial();
    let kernel = match guest_kernel() {
        Ok(k) => k,
        Err(reason) => {
            test_support::skip!("{reason}");
            return;
        }
    };
    // Built before the pages are held: rustc takes a few seconds.
    let dir = tempfile::tempdir().expect("tempdir");
    let initrd = initramfs(dir.path());
    let _pages = match hold(PageSize::Huge2M, RAM / PAGE) {
        Ok(r) => r,
        Err(why) => {
            test_support::skip!("{why}");
            return;
        }
    };
    let console = Console(dir.path().join("console.log"));
    let control = dir.path().join("vm.sock");
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let args = qemu_args(&kernel, &initrd, &console.0);
    let mut launched = launch(&daemon, &control, None, &args);
    let mut stop = StopLauncher(child_of(launched.id()));
    let mut qemu = child_of(stop.0);
    // Two passes: the fill checked, and the checker running.
    let mut pass = console.wait_pass(2, BOOT_DEADLINE, "the guest to boot and check");
    let cleared = daemon.stats().scrub.bytes;
    for cycle in 1..=CYCLES {
        park_and_check(&daemon, &control, &mut launched, qemu, cycle);
        pass = console.passes().last().copied().unwrap_or(pass);
        // Every other restore reuses the parked command line.
        let given: &[OsString] = if cycle % 2 == 0 { &args } else { &[] };
        launched = launch(&daemon, &control, Some("vm"), given);
        std::mem::forget(std::mem::replace(
            &mut stop,
            StopLauncher(child_of(launched.id())),
        ));
        qemu = child_of(stop.0);
        // Pass `pass + 1` ends what the park cut short; `pass + 2` checks
        // every word written before the park, after it.
        pass = console.wait_pass(pass + 2, PASS_DEADLINE, "the restored guest to check on");
        let stats = daemon.wait_stats(Duration::from_secs(30), "the restore done", |s| {
            s.counters.restores == cycle && s.parked.is_empty()
        });
        assert_eq!(
            stats.scrub.bytes, cleared,
            "restore {cycle}: memory cleared"
        );
        eprintln!("restore {cycle}: memcheck at pass {pass}");
    }
    let passes = console.passes();
    let expected: Vec<u64> = (1..=passes.len() as u64).collect();
    assert_eq!(passes, expected, "each pass once, in order");
    let lines = console.lines();
    for once in ["MEMCHECK-INIT", "MEMCHECK filled"] {
        let n = lines.iter().filter(|l| l.starts_with(once)).count();
        assert_eq!(
            n,
            1,
            "{once}: the guest booted and filled once:\n{}",
            console.tail()
        );
    }
    let launcher = stop.0;
    std::mem::forget(stop);
    let stats = stop_and_settle(&daemon, launcher, &mut launched);
    assert_eq!(
        (stats.counters.allocs_ok, stats.counters.allocs_released),
        (1, 1),
        "one allocation for all QEMUs, released once: {stats}"
    );
    assert_eq!(
        (stats.counters.parks, stats.counters.restores),
        (CYCLES, CYCLES),
        "parks and restores counted: {stats}"
    );
    daemon.shutdown();
}
