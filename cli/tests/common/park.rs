//! What the park tests share: the counting guest launched, parked and
//! restored through the real `hugemem` binary and cloud-hypervisor, the
//! set-up every test starts from, and the end of a launched VM.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use guest_mem::PageSize;
use test_support::hugepages::hold;
use test_support::prelude::{serial, wait_until, TestDaemon};

use super::{
    assert_balanced, child_of, cloud_hypervisor, counting_past, launched_guest_ram, spin_elf,
    spin_state,
};

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");
/// The counting guest's RAM.
pub const RAM: u64 = 256 << 20;
/// Its marker.
pub const MARKER: u64 = 0x5041_524b_0000_0000;
/// Where it starts writing.
pub const START_GPA: u64 = 1 << 20;
/// Its stride (one write per 2 MiB page).
pub const STRIDE: u64 = 2 << 20;

/// `hugemem park NAME --api-socket API`; its stdout.
pub fn park(daemon: &TestDaemon, name: &str, api: &Path) -> String {
    park_on(&daemon.socket(), name, api)
}

/// [`park`] on the daemon at `socket`.
pub fn park_on(socket: &Path, name: &str, api: &Path) -> String {
    let out = Command::new("timeout")
        .args(["120", HUGEMEM, "park", name, "--socket"])
        .arg(socket)
        .arg("--api-socket")
        .arg(api)
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

/// `hugemem launch` of the counting guest (256 MiB on 2 MiB pages) under
/// cloud-hypervisor `ch`, its API at `api`.
pub fn launch_counting(daemon: &TestDaemon, ch: &str, api: &Path, elf: &Path) -> Child {
    launch_counting_on(&daemon.socket(), ch, api, elf)
}

/// [`launch_counting`] on the daemon at `socket`.
pub fn launch_counting_on(socket: &Path, ch: &str, api: &Path, elf: &Path) -> Child {
    Command::new("timeout")
        .args(["600", HUGEMEM, "launch", "--socket"])
        .arg(socket)
        .args([
            "--size",
            "256M",
            "--page-size",
            "2M",
            "--",
            ch,
            "--api-socket",
        ])
        .arg(api)
        .arg("--kernel")
        .arg(elf)
        .args(["--cpus", "boot=1", "--serial", "null", "--console", "off"])
        .spawn()
        .expect("spawn hugemem launch")
}

/// The counting guest launched under cloud-hypervisor `ch` (API at `api`),
/// seen counting, parked as `name` and its launcher ended: the parked
/// memory (opened anew) and the guest's state when it was parked.
pub fn launch_and_park(
    daemon: &TestDaemon,
    (ch, elf): (&str, &Path),
    api: &Path,
    name: &str,
) -> (std::fs::File, microguest::SpinState) {
    launch_and_park_on(&daemon.socket(), (ch, elf), api, name)
}

/// [`launch_and_park`] on the daemon at `socket`.
pub fn launch_and_park_on(
    socket: &Path,
    (ch, elf): (&str, &Path),
    api: &Path,
    name: &str,
) -> (std::fs::File, microguest::SpinState) {
    let mut launch = launch_counting_on(socket, ch, api, elf);
    let launcher = child_of(launch.id());
    let ram = launched_guest_ram(launcher, child_of(launcher));
    counting_past(&ram, 0, "the guest to spin");
    let said = park_on(socket, name, api);
    assert!(said.contains(&format!("parked as {name}")), "{said}");
    assert!(launch.wait().expect("the launcher ends").success());
    let parked = spin_state(&ram);
    (ram, parked)
}

/// `hugemem launch --restore NAME` under cloud-hypervisor `ch`.
pub fn restore(daemon: &TestDaemon, ch: &str, name: &str, api: &Path) -> Child {
    Command::new("timeout")
        .args(["600", HUGEMEM, "launch", "--socket"])
        .arg(daemon.socket())
        .args(["--restore", name, "--", ch, "--api-socket"])
        .arg(api)
        .spawn()
        .expect("spawn hugemem launch --restore")
}

/// The largest memfd process `pid` holds (its guest memory), opened anew.
pub fn memfd_of(pid: u32) -> std::fs::File {
    let mut best: Option<(u64, std::fs::File)> = None;
    wait_until("the process's guest memfd", Duration::from_secs(60), || {
        let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            return false;
        };
        for e in dir.flatten() {
            let target = std::fs::read_link(e.path()).unwrap_or_default();
            if !target.to_string_lossy().starts_with("/memfd:") {
                continue;
            }
            if let Ok(f) = std::fs::File::open(e.path()) {
                let len = f.metadata().map(|m| m.len()).unwrap_or(0);
                if best.as_ref().is_none_or(|(l, _)| len > *l) {
                    best = Some((len, f));
                }
            }
        }
        best.as_ref().is_some_and(|(l, _)| *l >= RAM)
    });
    best.expect("a memfd").1
}

/// The first child of `parent` that runs its own program, if any yet.
pub fn child_now(parent: u32) -> Option<u32> {
    let exe = |pid: u32| std::fs::read_link(format!("/proc/{pid}/exe")).ok();
    let children =
        std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children")).ok()?;
    let pid = children.split_whitespace().next()?.parse::<u32>().ok()?;
    (exe(pid).is_some() && exe(pid) != exe(parent)).then_some(pid)
}

/// A memfd of at least `RAM` bytes that process `pid` holds, opened anew.
pub fn guest_memfd_now(pid: u32) -> Option<std::fs::File> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .ok()?
        .flatten()
        .filter(|e| {
            std::fs::read_link(e.path()).is_ok_and(|t| t.to_string_lossy().starts_with("/memfd:"))
        })
        .filter_map(|e| std::fs::File::open(e.path()).ok())
        .find(|f| f.metadata().is_ok_and(|m| m.len() >= RAM))
}

/// A digest of every byte of a guest's `RAM` bytes of memory.
pub fn digest(ram: &std::fs::File) -> u64 {
    digest_of(ram, RAM)
}

/// A digest of the first `len` bytes of `file`.
pub fn digest_of(file: &std::fs::File, len: u64) -> u64 {
    use std::hash::Hasher;
    use std::os::unix::fs::FileExt;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let mut buf = vec![0u8; 8 << 20];
    let mut off = 0;
    while off < len {
        file.read_exact_at(&mut buf, off)
            .expect("read the template");
        h.write(&buf);
        off += buf.len() as u64;
    }
    h.finish()
}

/// SIGTERM to the launcher, and its end.
pub fn stop(launcher: u32, launch: &mut Child) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(launcher).expect("pid")),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM to the launcher");
    let status = launch.wait().expect("wait for the launcher");
    assert_ne!(
        status.code(),
        Some(124),
        "the launcher did not finish in time"
    );
}

/// What every test here starts from; the fields drop in this order, the
/// machine's lock last.
pub struct Setup {
    pub ch: String,
    pub dir: tempfile::TempDir,
    /// The counting guest (`microguest::spin`) in `dir`.
    pub elf: PathBuf,
    _pages: guest_mem::Reservation,
    _serial: std::sync::MutexGuard<'static, ()>,
}

/// The machine's lock, cloud-hypervisor, 2 MiB pages for `guests` guests
/// held, a private directory with the counting guest; `None` after a skip.
pub fn set_up(guests: u64) -> Option<Setup> {
    let serial = serial();
    let ch = cloud_hypervisor()?;
    let pages = match hold(PageSize::Huge2M, guests * RAM / STRIDE) {
        Ok(r) => r,
        Err(why) => {
            test_support::skip!("{why}");
            return None;
        }
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let elf = spin_elf(dir.path(), STRIDE, START_GPA, MARKER);
    Some(Setup {
        ch,
        dir,
        elf,
        _pages: pages,
        _serial: serial,
    })
}

/// Ends a launched VM and waits for its allocation to be released, the
/// daemon's totals balanced; the daemon's STATS then.
pub fn stop_and_settle(
    daemon: &TestDaemon,
    launcher: u32,
    launch: &mut Child,
) -> backend::stats::Stats {
    stop(launcher, launch);
    let stats = daemon.wait_stats(Duration::from_secs(30), "the allocation released", |s| {
        s.allocations.active == 0
    });
    assert_balanced(&stats, "after the VM exited");
    stats
}

/// `hugemem ARGS` that must succeed; its stdout.
pub fn run_ok(args: &[&std::ffi::OsStr]) -> String {
    run_ok_both(args).0
}

/// `hugemem ARGS` that must succeed; its stdout and its stderr.
pub fn run_ok_both(args: &[&std::ffi::OsStr]) -> (String, String) {
    let out = Command::new("timeout")
        .arg("300")
        .arg(HUGEMEM)
        .args(args)
        .output()
        .expect("run hugemem");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "hugemem {args:?} failed: {stdout}{stderr}"
    );
    (stdout, stderr)
}

/// Where process `pid` maps guest RAM: the start of its mapping of a
/// memfd of `RAM` bytes from offset 0, and the mapping's permissions.
pub fn guest_ram_mapping(pid: u32) -> Option<(u64, String)> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    maps.lines().find_map(|l| {
        let mut w = l.split_whitespace();
        let (range, perms, offset) = (w.next()?, w.next()?, w.next()?);
        let path = w.nth(2).unwrap_or_default();
        let (start, end) = range.split_once('-')?;
        let (start, end) = (
            u64::from_str_radix(start, 16).ok()?,
            u64::from_str_radix(end, 16).ok()?,
        );
        (path.starts_with("/memfd:")
            && end - start == RAM
            && offset.trim_start_matches('0').is_empty())
        .then(|| (start, perms.to_string()))
    })
}

/// The counting guest's state as a clone sees it: read through
/// `/proc/PID/mem` (its private pages are nowhere else).
pub fn clone_spin_state(pid: u32) -> Option<microguest::SpinState> {
    let (base, _) = guest_ram_mapping(pid)?;
    let mem = std::fs::File::open(format!("/proc/{pid}/mem")).ok()?;
    let mut block = vec![0u8; microguest::SPIN_BLOCK_LEN];
    std::os::unix::fs::FileExt::read_exact_at(&mem, &mut block, base + microguest::SPIN_BLOCK_GPA)
        .ok()?;
    microguest::SpinState::parse(&block)
}

/// The huge pages process `pid` wrote privately (smaps `Private_Hugetlb`), bytes.
pub fn private_hugetlb(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.strip_prefix("Private_Hugetlb:"))
        .filter_map(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .sum::<u64>()
        * 1024
}
