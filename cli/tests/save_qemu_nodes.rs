//! A QEMU VM of two memory regions (issue 46), through the real `hugemem`
//! binary and QEMU: the counting micro-guest (`microguest::spin`) launched
//! with `hugemem launch --nodes 0:128M,0:128M` under `-M pc`, which gives
//! QEMU two `memory-backend-file` objects, one guest NUMA node each. The
//! guest writes every 2 MiB page of both; its counter lives in the first.
//!
//! * Parked and restored directly, and cloned in both modes (shared and
//!   copy): each counts on, and the parked regions keep every byte (a
//!   digest of each).
//! * Saved (`hugemem save`, `hugemem unpark --save`): one memory file per
//!   region, each holding that region's bytes (the same digest). A damaged
//!   second file (a changed byte, a file cut short) is refused, naming it,
//!   and nothing is parked; loaded on demand, its restore is refused,
//!   naming it, and it stays parked.
//! * Loaded back, eagerly and on demand (`park --from-dir [--on-demand]`):
//!   each region on a pool region of its own, from its start (QEMU maps a
//!   region's file from its start), and restored in QEMU the guest counts
//!   on from where it was parked, every page it wrote kept, the second
//!   region byte for byte. The pool's books balance throughout.
//! * Loaded on demand, it survives a daemon takeover (its files, and the
//!   region each fills, in the state document) and restores as above.
//!
//! Skipped (through the skip helper) without `qemu-system-x86_64`, a
//! usable `/dev/kvm` or 384 free 2 MiB pages. Deadlines only: `timeout`
//! around every command, `wait_until` around every wait.

mod common;

use std::ffi::{OsStr, OsString};
use std::hash::Hasher;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

use hugemem_client::saved_vm::manifest::{Manifest, VMM_QEMU};
use hugemem_client::stats::Stats;
use microguest::{pattern, SpinState, IMAGE_END_GPA, SPIN_BLOCK_GPA, SPIN_BLOCK_LEN};
use test_support::prelude::{wait_until, TestDaemon};
use test_support::process::ServeProcess;

use common::park::{run_ok, run_ok_both, stop};
use common::qemu::{
    copy_save, entries, load, load_refused, park, qemu_args_on, qemu_of, set_up, MARKER, RAM,
    START_GPA, STRIDE,
};
use common::{assert_balanced, child_of, counting_past, spin_state, StopLauncher};

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");
const SETTLE: Duration = Duration::from_secs(60);
/// Each region: half the guest's RAM.
const HALF: u64 = RAM / 2;
/// Two regions on host node 0: two guest NUMA nodes.
const NODES: [&str; 4] = ["--nodes", "0:128M,0:128M", "--page-size", "2M"];

/// The STATS of the daemon on `socket`.
fn stats(socket: &Path) -> Stats {
    let mut c = hugemem_client::client::Client::connect(socket).expect("connect");
    c.set_timeout(Some(SETTLE)).expect("timeout");
    c.stats().expect("STATS")
}

/// Waits until the daemon on `socket` reports what `cond` wants; its STATS.
fn wait_stats(socket: &Path, what: &str, cond: impl Fn(&Stats) -> bool) -> Stats {
    let mut last = None;
    wait_until(what, SETTLE, || {
        let s = stats(socket);
        let done = cond(&s);
        last = Some(s);
        done
    });
    last.expect("stats")
}

/// `hugemem serve` on `socket` with `config` (with `takeover`: a
/// successor), a process of its own; once it answers when `takeover` is
/// false.
fn serve(socket: &Path, config: &Path, takeover: bool) -> ServeProcess {
    let mut cmd = Command::new(HUGEMEM);
    cmd.args(["serve", "--config"])
        .arg(config)
        .arg("--socket")
        .arg(socket);
    if takeover {
        cmd.arg("--takeover");
    }
    let d = ServeProcess(cmd.spawn().expect("spawn hugemem serve"));
    if !takeover {
        wait_until("the daemon answers", SETTLE, || {
            hugemem_client::client::Client::connect(socket).is_ok()
        });
    }
    d
}

/// `hugemem launch` on the daemon at `socket`, with the control socket `control`, `how` (`NODES`,
/// `--restore NAME`, `--clone-of NAME …`), and QEMU's `args`.
fn launch(socket: &Path, control: &Path, how: &[&str], args: &[OsString]) -> Child {
    Command::new("timeout")
        .args(["600", HUGEMEM, "launch", "--socket"])
        .arg(socket)
        .arg("--control-socket")
        .arg(control)
        .args(how)
        .arg("--")
        .arg("qemu-system-x86_64")
        .args(args)
        .spawn()
        .expect("spawn hugemem launch")
}

/// QEMU `pid`'s memory files (`mem-path=/dev/fd/N`), in its command line's
/// order, as it holds them: each region's, reopened.
fn region_files(pid: u32) -> Vec<std::fs::File> {
    let mut fds: Vec<String> = Vec::new();
    wait_until("QEMU's command line", Duration::from_secs(30), || {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        fds = String::from_utf8_lossy(&cmdline)
            .split('\0')
            .filter_map(|a| {
                a.split(',')
                    .find_map(|kv| kv.strip_prefix("mem-path=/dev/fd/"))
                    .map(str::to_owned)
            })
            .collect();
        !fds.is_empty()
    });
    let files: Vec<std::fs::File> = fds
        .iter()
        .map(|fd| std::fs::File::open(format!("/proc/{pid}/fd/{fd}")).expect("open a memory fd"))
        .collect();
    assert_eq!(files.len(), 2, "two memory regions: {fds:?}");
    let inodes: Vec<u64> = files
        .iter()
        .map(|f| f.metadata().expect("stat").ino())
        .collect();
    assert_ne!(inodes[0], inodes[1], "two regions, not one file twice");
    for f in &files {
        assert!(
            f.metadata().expect("stat").len() >= HALF,
            "a region of {HALF}"
        );
    }
    files
}

/// A digest of `ram`'s bytes from `from` to `HALF`.
fn digest_from(ram: &std::fs::File, from: u64) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let mut buf = vec![0u8; STRIDE as usize];
    let mut off = from;
    while off < HALF {
        ram.read_exact_at(&mut buf, off).expect("read a region");
        h.write(&buf);
        off += STRIDE;
    }
    h.finish()
}

/// What must not change in a parked VM's regions while it runs again: the
/// first region past the guest's own image (its counter, stack and page
/// tables), and every byte of the second.
fn digests(rams: &[std::fs::File]) -> (u64, u64) {
    (
        digest_from(&rams[0], IMAGE_END_GPA.next_multiple_of(STRIDE)),
        digest_from(&rams[1], 0),
    )
}

/// Every page the guest wrote, in both regions, holds its pattern (the
/// second region holds guest addresses from `HALF`).
fn assert_regions_kept(rams: &[std::fs::File], when: &str) {
    let mut word = [0u8; 8];
    let mut gpa = START_GPA.next_multiple_of(STRIDE);
    while gpa + 8 <= RAM {
        let (ram, at) = if gpa < HALF {
            (&rams[0], gpa)
        } else {
            (&rams[1], gpa - HALF)
        };
        ram.read_exact_at(&mut word, at).expect("read guest RAM");
        assert_eq!(
            u64::from_le_bytes(word),
            pattern(MARKER, gpa),
            "{when}: page {gpa:#x} lost the guest's write"
        );
        gpa += STRIDE;
    }
}

/// The counting guest's state as QEMU `pid` sees it, through
/// `/proc/PID/mem` (a shared clone's private pages are nowhere else): its
/// mapping of its first memory file.
fn spin_state_in(pid: u32) -> Option<SpinState> {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let fd = String::from_utf8_lossy(&cmdline)
        .split('\0')
        .find_map(|a| {
            a.split(',')
                .find_map(|kv| kv.strip_prefix("mem-path=/dev/fd/"))
                .map(str::to_owned)
        })?;
    let ino = std::fs::metadata(format!("/proc/{pid}/fd/{fd}"))
        .ok()?
        .ino();
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    let base = maps.lines().find_map(|l| {
        let w: Vec<&str> = l.split_whitespace().collect();
        let (start, end) = w.first()?.split_once('-')?;
        let (start, end) = (
            u64::from_str_radix(start, 16).ok()?,
            u64::from_str_radix(end, 16).ok()?,
        );
        (w.get(4)?.parse::<u64>().ok()? == ino && end - start >= HALF).then_some(start)
    })?;
    let mem = std::fs::File::open(format!("/proc/{pid}/mem")).ok()?;
    let mut block = vec![0u8; SPIN_BLOCK_LEN];
    mem.read_exact_at(&mut block, base + SPIN_BLOCK_GPA).ok()?;
    SpinState::parse(&block)
}

/// The launch `child` runs a VM that counts on past `past`, seen through
/// its QEMU's own mapping, no page changed.
fn counts_on_in_its_qemu(child: &Child, past: u64, what: &str) {
    let qemu = qemu_of(child_of(child.id()));
    let mut last = None;
    wait_until(what, Duration::from_secs(60), || {
        last = spin_state_in(qemu);
        last.as_ref()
            .is_some_and(|s| s.spinning && s.count > past + 10)
    });
    let s = last.expect("a state");
    assert_eq!(s.bad, 0, "{what}: a page changed at {:#x}", s.bad_gpa);
    eprintln!("{what}: counts on ({} from {past})", s.count);
}

/// A fresh two-region VM launched, counting, and parked as `name`; its
/// regions (the parked memory) and the count it was parked with.
fn launched_and_parked(
    socket: &Path,
    dir: &Path,
    elf: &Path,
    name: &str,
) -> (Vec<std::fs::File>, u64) {
    let control = dir.join(format!("{name}.sock"));
    let mut launched = launch(socket, &control, &NODES, &qemu_args_on("pc", elf));
    let launcher = child_of(launched.id());
    let stop = StopLauncher(launcher);
    let rams = region_files(qemu_of(launcher));
    counting_past(&rams[0], 0, "the two-node guest to spin");
    let said = park(name, &control);
    assert!(said.contains("in 2 slot(s)"), "{said}");
    assert!(launched.wait().expect("launcher").success(), "{said}");
    std::mem::forget(stop);
    let parked = spin_state(&rams[0]).count;
    assert_regions_kept(&rams, "parked");
    let s = stats(socket);
    let p = s.parked.iter().find(|p| p.name == name);
    assert_eq!(p.map(|p| (p.bytes, p.slots)), Some((RAM, 2)), "{s}");
    (rams, parked)
}

/// Restores `name` in QEMU (the parked command line reused) from the
/// daemon at `socket` and checks that the guest counts on from `from`,
/// every page kept and the regions as `expected` ([`digests`]); then ends
/// it and waits for its memory back in the pool, clean, the books
/// balanced.
fn restores_counting_on(socket: &Path, dir: &Path, name: &str, from: u64, expected: (u64, u64)) {
    let control = dir.join(format!("{name}-restored.sock"));
    let mut launched = launch(socket, &control, &["--restore", name], &[]);
    let launcher = child_of(launched.id());
    let stop_it = StopLauncher(launcher);
    let rams = region_files(qemu_of(launcher));
    let now = spin_state(&rams[0]);
    assert!(
        now.count >= from,
        "{name}: the counter went back from {from} to {}",
        now.count
    );
    let state = counting_past(&rams[0], now.count, "the restored guest to count on");
    assert_eq!(
        state.bad, 0,
        "{name}: a page changed at {:#x}",
        state.bad_gpa
    );
    assert_regions_kept(&rams, name);
    assert_eq!(digests(&rams), expected, "{name}: its regions' bytes");
    drop(rams);
    wait_stats(socket, "the restore done", |s| {
        !s.parked.iter().any(|p| p.name == name)
    });
    std::mem::forget(stop_it);
    stop(launcher, &mut launched);
    let s = wait_stats(socket, "the memory back in the pool, clean", |s| {
        s.allocations.active == 0 && s.pool_sum(|p| p.clean_bytes) >= RAM
    });
    assert_balanced(&s, &format!("{name} restored and ended"));
}

#[test]
fn a_two_region_qemu_vm_parks_restores_and_clones() {
    let Some(setup) = set_up(3 * RAM / STRIDE) else {
        return;
    };
    let dir = setup.dir.path();
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let socket = daemon.socket();
    let (rams, parked) = launched_and_parked(&socket, dir, &setup.elf, "nodes");
    let before = digests(&rams);

    let active = daemon.stats().allocations.active;
    for mode in ["shared", "copy"] {
        let how = ["--clone-of", "nodes", "--clone-mode", mode];
        let control = dir.join(format!("{mode}.sock"));
        let mut child = launch(&socket, &control, &how, &[]);
        let launcher = child_of(child.id());
        let _stop = StopLauncher(launcher);
        counts_on_in_its_qemu(&child, parked, &format!("a {mode} clone"));
        stop(launcher, &mut child);
        daemon.wait_stats(SETTLE, "the clone ended", |s| {
            s.allocations.active == active && s.parked.first().is_some_and(|p| p.shared_clones == 0)
        });
        assert_eq!(
            digests(&rams),
            before,
            "the template changed under its {mode} clone"
        );
        assert_eq!(spin_state(&rams[0]).count, parked);
    }
    drop(rams);
    restores_counting_on(&socket, dir, "nodes", parked, before);
    let s = daemon.wait_stats(SETTLE, "everything released", |s| {
        s.allocations.active == 0 && s.parked.is_empty()
    });
    assert_eq!(s.counters.clones, 2, "{s}");
    assert_balanced(&s, "at the end");
    daemon.shutdown();
}

/// The save in `dir` holds the two-region VM `name`, each region's bytes
/// in its own file (`parked`: [`digests`] of the parked regions).
fn assert_two_region_save(dir: &Path, name: &str, parked: (u64, u64)) -> Manifest {
    assert_eq!(
        entries(dir),
        [
            "hugemem-manifest.json",
            "memory-0",
            "memory-1",
            "migration_config.json",
            "state.json"
        ],
        "{}",
        dir.display()
    );
    let m = Manifest::read(dir, RAM, 2, 64)
        .expect("the manifest reads")
        .expect("a manifest");
    assert_eq!((m.vmm.as_str(), m.source.name.as_str()), (VMM_QEMU, name));
    let files: Vec<(u32, u64)> = m.memory.iter().map(|f| (f.slot, f.size)).collect();
    assert_eq!(files, [(0, HALF), (1, HALF)], "one memory file per region");
    let saved: Vec<std::fs::File> = ["memory-0", "memory-1"]
        .iter()
        .map(|f| std::fs::File::open(dir.join(f)).expect("a memory file"))
        .collect();
    assert_eq!(
        digests(&saved),
        parked,
        "the regions' bytes, each in its file"
    );
    assert_regions_kept(&saved, "saved");
    let verified = run_ok(&["verify".as_ref(), dir.as_os_str()]);
    assert!(verified.contains("whole"), "{verified}");
    m
}

/// Damaged copies of the save `saved` (made in `dir`), the second region's
/// file changed, are refused, naming it, and nothing is parked; loaded on
/// demand, the restore is refused, naming it, and the VM stays parked.
fn a_damaged_second_region_is_refused(daemon: &TestDaemon, saved: &Path, dir: &Path) {
    let flipped = dir.join("flipped");
    copy_save(saved, &flipped);
    std::fs::OpenOptions::new()
        .write(true)
        .open(flipped.join("memory-1"))
        .and_then(|f| f.write_all_at(&[0x5a; 8], HALF / 2 + 4096))
        .expect("change a byte of memory-1");
    let said = load_refused(daemon, &flipped);
    assert!(
        said.contains("memory-1 does not match its manifest"),
        "{said}"
    );
    let short = dir.join("short");
    copy_save(saved, &short);
    std::fs::OpenOptions::new()
        .write(true)
        .open(short.join("memory-1"))
        .and_then(|f| f.set_len(HALF - STRIDE))
        .expect("cut memory-1 short");
    let said = load_refused(daemon, &short);
    assert!(
        said.contains("memory-1") && said.contains("bytes"),
        "{said}"
    );
    // On demand the pieces are checked as a restore reads them: the
    // restore is refused, naming the second region's file, and the VM
    // stays parked until it is dropped.
    load(daemon, "damaged", &flipped, true);
    let out = Command::new("timeout")
        .args(["300", HUGEMEM, "launch", "--socket"])
        .arg(daemon.socket())
        .args(["--restore", "damaged", "--", "qemu-system-x86_64"])
        .output()
        .expect("run hugemem launch --restore");
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(
        said.contains("memory-1 does not match its manifest"),
        "{said}"
    );
    eprintln!("restore refused: {said}");
    let s = daemon.stats();
    assert!(
        s.parked.iter().any(|p| p.name == "damaged"),
        "still parked: {s}"
    );
    let socket = daemon.socket();
    run_ok(&[
        "unpark".as_ref(),
        "damaged".as_ref(),
        "--socket".as_ref(),
        socket.as_os_str(),
    ]);
    let s = daemon.wait_stats(SETTLE, "the damaged VM dropped", |s| {
        s.parked.is_empty() && s.allocations.active == 0
    });
    assert_balanced(&s, "after the damaged VM");
}

#[test]
fn a_two_region_qemu_vm_saves_and_loads_back_region_by_region() {
    let Some(setup) = set_up(3 * RAM / STRIDE) else {
        return;
    };
    let dir = setup.dir.path();
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let socket = daemon.socket();
    let (rams, parked) = launched_and_parked(&socket, dir, &setup.elf, "vm");
    let before = digests(&rams);
    drop(rams);

    let kept = dir.join("kept");
    let save: [&OsStr; 5] = [
        "save".as_ref(),
        "vm".as_ref(),
        kept.as_os_str(),
        "--socket".as_ref(),
        socket.as_os_str(),
    ];
    let said = run_ok(&save);
    assert!(said.contains("it stays parked"), "{said}");
    let m_kept = assert_two_region_save(&kept, "vm", before);
    let saved = dir.join("saved");
    let unpark: [&OsStr; 6] = [
        "unpark".as_ref(),
        "vm".as_ref(),
        "--save".as_ref(),
        saved.as_os_str(),
        "--socket".as_ref(),
        socket.as_os_str(),
    ];
    let (said, progress) = run_ok_both(&unpark);
    assert!(said.contains("unparked"), "{said}{progress}");
    let s = daemon.wait_stats(SETTLE, "the saved VM dropped", |s| {
        s.parked.is_empty() && s.allocations.active == 0
    });
    assert_balanced(&s, "saved and dropped");
    let m_saved = assert_two_region_save(&saved, "vm", before);
    assert_eq!(m_saved.memory, m_kept.memory, "two saves, the same bytes");

    a_damaged_second_region_is_refused(&daemon, &saved, dir);

    let said = load(&daemon, "back", &saved, false);
    assert!(said.contains("2 slot(s)"), "{said}");
    let s = daemon.stats();
    let back = s.parked.iter().find(|p| p.name == "back");
    assert_eq!(back.map(|p| (p.bytes, p.slots)), Some((RAM, 2)), "{s}");
    restores_counting_on(&socket, dir, "back", parked, before);
    load(&daemon, "lazy", &kept, true);
    restores_counting_on(&socket, dir, "lazy", parked, before);
    let s = daemon.wait_stats(SETTLE, "everything released", |s| {
        s.allocations.active == 0 && s.parked.is_empty()
    });
    assert_balanced(&s, "at the end");
    daemon.shutdown();
}

#[test]
fn a_two_region_qemu_vm_loaded_on_demand_survives_a_takeover() {
    let Some(setup) = set_up(3 * RAM / STRIDE) else {
        return;
    };
    let dir = setup.dir.path();
    let socket = dir.join("hugemem.sock");
    let config = dir.join("hugemem.toml");
    std::fs::write(&config, "[pool]\nrecheck_ms = 20\n").expect("config");
    let mut old = serve(&socket, &config, false);
    let (rams, parked) = launched_and_parked(&socket, dir, &setup.elf, "vm");
    let before = digests(&rams);
    drop(rams);
    let saved = dir.join("saved");
    let unpark: [&OsStr; 6] = [
        "unpark".as_ref(),
        "vm".as_ref(),
        "--save".as_ref(),
        saved.as_os_str(),
        "--socket".as_ref(),
        socket.as_os_str(),
    ];
    run_ok(&unpark);
    let load: [&OsStr; 7] = [
        "park".as_ref(),
        "lazy".as_ref(),
        "--from-dir".as_ref(),
        saved.as_os_str(),
        "--on-demand".as_ref(),
        "--socket".as_ref(),
        socket.as_os_str(),
    ];
    let said = run_ok(&load);
    assert!(said.contains("2 slot(s)"), "{said}");

    // The successor takes the VM parked on demand, its files and which
    // region each fills, from the state document.
    let mut new = serve(&socket, &config, true);
    assert!(old.wait("the old daemon").success(), "the takeover");
    let s = wait_stats(&socket, "the successor serving", |s| s.pid == new.0.id());
    let lazy = s.parked.iter().find(|p| p.name == "lazy");
    assert_eq!(lazy.map(|p| (p.bytes, p.slots)), Some((RAM, 2)), "{s}");
    restores_counting_on(&socket, dir, "lazy", parked, before);
    new.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(new.wait("the successor").success());
}
