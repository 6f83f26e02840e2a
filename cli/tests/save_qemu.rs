//! A parked QEMU VM saved to disk and loaded back (issue 46), through the
//! real `hugemem` binary and QEMU: the counting micro-guest
//! (`microguest::spin`) launched in QEMU, parked, saved with `hugemem save`
//! (it stays parked) and with `hugemem unpark --save` (it is dropped).
//!
//! Each save is checked: its files (the manifest naming a QEMU VM, one
//! memory file of the VM's size, the parked command line and QEMU's
//! stream), `hugemem verify`, and both saves of the same parked VM hold the
//! same bytes. Damaged copies (a memory file cut short, an edited state, a
//! changed byte of memory) are refused with the file named, and nothing is
//! parked. The save loads back with `park --from-dir`, eagerly and on
//! demand, and each load restores in QEMU with `hugemem launch --restore`:
//! the guest's counter never went back, it counts on, and every page holds
//! what it wrote.
//!
//! Skipped (through the skip helper) without `qemu-system-x86_64`, a
//! usable `/dev/kvm` or 128 free 2 MiB pages. Deadlines only: `timeout`
//! around every command, `wait_until` around every wait.

mod common;

use std::ffi::OsStr;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use hugemem::launch::vmm::qemu::parked::{ParkedConfig, ParkedState};
use hugemem_client::saved_vm::manifest::{Manifest, VMM_QEMU};
use test_support::prelude::TestDaemon;

use common::park::{run_ok, run_ok_both, stop_and_settle};
use common::qemu::{
    assert_pages_kept, guest_ram, launch, park, qemu_args, set_up, RAM, START_GPA, STRIDE,
};
use common::{assert_balanced, child_of, counting_past, spin_state, StopLauncher};

const HUGEMEM: &str = env!("CARGO_BIN_EXE_hugemem");
const SETTLE: Duration = Duration::from_secs(60);

/// The names in `dir`, sorted.
fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .expect("read_dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// The save in `dir` holds the parked QEMU VM `name` ran with `args`.
fn assert_qemu_save(dir: &Path, name: &str, args: &[std::ffi::OsString]) -> Manifest {
    assert_eq!(
        entries(dir),
        [
            "hugemem-manifest.json",
            "memory-0",
            "migration_config.json",
            "state.json"
        ],
        "{}",
        dir.display()
    );
    let m = Manifest::read(dir, RAM, 1, 64)
        .expect("the manifest reads")
        .expect("a manifest");
    assert_eq!((m.vmm.as_str(), m.source.name.as_str()), (VMM_QEMU, name));
    assert_eq!(m.memory.len(), 1, "one memory file");
    assert_eq!((m.memory[0].slot, m.memory[0].size), (0, RAM));
    assert_eq!(m.page_size, STRIDE, "parked on 2 MiB pages");
    let config = std::fs::read(dir.join("migration_config.json")).expect("config");
    let config = ParkedConfig::parse(&config).expect("a QEMU VM's configuration");
    assert_eq!(config.program, "qemu-system-x86_64");
    let parked_args: Vec<std::ffi::OsString> = config.args.iter().map(Into::into).collect();
    assert_eq!(parked_args, args, "the parked command line");
    let state = std::fs::read(dir.join("state.json")).expect("state");
    let stream = ParkedState::stream(&state).expect("QEMU's stream");
    assert!(stream.starts_with(b"QEVM"), "a QEMU migration stream");
    let verified = run_ok(&["verify".as_ref(), dir.as_os_str()]);
    assert!(
        verified.contains("whole")
            && verified.contains(&format!("a {VMM_QEMU} VM parked as {name}")),
        "{verified}"
    );
    m
}

/// A copy of the save `from` at `to`, holes kept.
fn copy_save(from: &Path, to: &Path) {
    let ok = Command::new("cp")
        .args(["-r", "--sparse=always"])
        .arg(from)
        .arg(to)
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "cp -r {} {}", from.display(), to.display());
}

/// `hugemem park NAME --from-dir DIR` that must fail; its stderr, once
/// the daemon holds nothing.
fn load_refused(daemon: &TestDaemon, dir: &Path) -> String {
    let out = Command::new("timeout")
        .args(["120", HUGEMEM, "park", "bad", "--from-dir"])
        .arg(dir)
        .arg("--socket")
        .arg(daemon.socket())
        .output()
        .expect("run hugemem park --from-dir");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{}: {stderr}", dir.display());
    let s = daemon.wait_stats(SETTLE, "nothing parked or held", |s| {
        s.parked.is_empty() && s.allocations.active == 0
    });
    assert_balanced(&s, &format!("after loading {}", dir.display()));
    eprintln!("refused: {stderr}");
    stderr
}

/// `hugemem park NAME --from-dir DIR [--on-demand]`; its stdout.
fn load(daemon: &TestDaemon, name: &str, dir: &Path, on_demand: bool) -> String {
    let socket = daemon.socket();
    let mut args: Vec<&OsStr> = vec![
        "park".as_ref(),
        name.as_ref(),
        "--from-dir".as_ref(),
        dir.as_os_str(),
        "--socket".as_ref(),
        socket.as_os_str(),
    ];
    if on_demand {
        args.push("--on-demand".as_ref());
    }
    let said = run_ok(&args);
    assert!(said.contains("checked against its manifest"), "{said}");
    said
}

/// Restores `name` in QEMU (the parked command line reused, its control
/// socket in `dir`) and checks that the guest counts on from `from` with
/// every page kept; then ends it.
fn restores_counting_on(daemon: &TestDaemon, dir: &Path, name: &str, from: u64) {
    let control = dir.join(format!("{name}.sock"));
    let mut launched = launch(daemon, &control, Some(name), &[]);
    let launcher = child_of(launched.id());
    let stop = StopLauncher(launcher);
    let ram = guest_ram(child_of(launcher));
    let now = spin_state(&ram);
    assert!(
        now.count >= from,
        "{name}: the counter went back from {from} to {}",
        now.count
    );
    let state = counting_past(&ram, now.count, "the restored guest to count on");
    assert_eq!(
        state.bad, 0,
        "{name}: a page changed at {:#x}",
        state.bad_gpa
    );
    assert_pages_kept(&ram, name);
    drop(ram);
    // The guest runs just before the daemon hands the allocation over.
    daemon.wait_stats(SETTLE, "the restore done", |s| {
        !s.parked.iter().any(|p| p.name == name)
    });
    std::mem::forget(stop);
    stop_and_settle(daemon, launcher, &mut launched);
    // The next load takes these pages (the test holds only one VM's).
    daemon.wait_stats(SETTLE, "the memory back in the pool, clean", |s| {
        s.pool_sum(|p| p.clean_bytes) >= RAM
    });
}

/// Damaged copies of the save `saved` (made in `dir`) are refused, naming
/// the file, and nothing is parked: a memory file cut short, an edited
/// state, a changed byte of memory.
fn damaged_copies_are_refused(daemon: &TestDaemon, saved: &Path, dir: &Path) {
    let short = dir.join("short");
    copy_save(saved, &short);
    std::fs::OpenOptions::new()
        .write(true)
        .open(short.join("memory-0"))
        .and_then(|f| f.set_len(RAM - STRIDE))
        .expect("cut memory-0 short");
    let said = load_refused(daemon, &short);
    assert!(
        said.contains("memory-0") && said.contains("bytes"),
        "{said}"
    );
    let edited = dir.join("edited");
    copy_save(saved, &edited);
    let state_path = edited.join("state.json");
    let mut state = std::fs::read(&state_path).expect("state");
    let at = state.len() / 2;
    state[at] = if state[at] == b'A' { b'B' } else { b'A' };
    std::fs::write(&state_path, &state).expect("edit the state");
    let said = load_refused(daemon, &edited);
    assert!(
        said.contains("state.json") && said.contains("the manifest says"),
        "{said}"
    );
    let flipped = dir.join("flipped");
    copy_save(saved, &flipped);
    let page = START_GPA.next_multiple_of(STRIDE) + 5 * STRIDE;
    std::fs::OpenOptions::new()
        .write(true)
        .open(flipped.join("memory-0"))
        .and_then(|f| f.write_all_at(&[0x5a; 8], page))
        .expect("change a page");
    let said = load_refused(daemon, &flipped);
    assert!(
        said.contains("memory-0 does not match its manifest"),
        "{said}"
    );
}

#[test]
fn a_parked_qemu_vm_saves_whole_and_loads_back_counting_on() {
    let Some(setup) = set_up(RAM / STRIDE) else {
        return;
    };
    let dir = setup.dir.path();
    let (elf, control) = (setup.elf.clone(), setup.control.clone());
    let daemon = TestDaemon::start(|c| c.pool.recheck_ms = 20);
    let socket = daemon.socket();
    let args = qemu_args(&elf);
    let mut launched = launch(&daemon, &control, None, &args);
    let launcher = child_of(launched.id());
    let stop = StopLauncher(launcher);
    let ram = guest_ram(child_of(launcher));
    counting_past(&ram, 0, "the guest to spin");
    let said = park("vm", &control);
    assert!(launched.wait().expect("launcher").success(), "{said}");
    std::mem::forget(stop);
    // QEMU has stopped: this is the count the VM was parked with.
    let parked = spin_state(&ram).count;
    drop(ram);

    // `save`: written whole, and the VM stays parked.
    let kept = dir.join("kept");
    let said = run_ok(&[
        "save".as_ref(),
        "vm".as_ref(),
        kept.as_os_str(),
        "--socket".as_ref(),
        socket.as_os_str(),
    ]);
    assert!(said.contains("it stays parked"), "{said}");
    let s = daemon.stats();
    assert_eq!(s.parked.len(), 1, "still parked after save: {s}");
    let m_kept = assert_qemu_save(&kept, "vm", &args);

    // `unpark --save`: written whole, then the VM is gone.
    let saved = dir.join("saved");
    let (said, progress) = run_ok_both(&[
        "unpark".as_ref(),
        "vm".as_ref(),
        "--save".as_ref(),
        saved.as_os_str(),
        "--socket".as_ref(),
        socket.as_os_str(),
    ]);
    assert!(said.contains("unparked"), "{said}{progress}");
    let s = daemon.wait_stats(SETTLE, "the saved VM dropped", |s| {
        s.parked.is_empty() && s.allocations.active == 0
    });
    assert_balanced(&s, "saved and dropped");
    let m_saved = assert_qemu_save(&saved, "vm", &args);
    assert_eq!(
        (m_saved.files, m_saved.memory),
        (m_kept.files, m_kept.memory),
        "two saves of one parked VM hold the same bytes"
    );

    damaged_copies_are_refused(&daemon, &saved, dir);

    // Loaded back, eagerly and on demand: each restores in QEMU.
    load(&daemon, "back", &saved, false);
    let s = daemon.stats();
    let back = s.parked.iter().find(|p| p.name == "back");
    assert_eq!(back.map(|p| (p.bytes, p.slots)), Some((RAM, 1)), "{s}");
    restores_counting_on(&daemon, dir, "back", parked);
    load(&daemon, "lazy", &kept, true);
    restores_counting_on(&daemon, dir, "lazy", parked);
    let s = daemon.wait_stats(SETTLE, "everything released", |s| {
        s.allocations.active == 0 && s.parked.is_empty()
    });
    assert_balanced(&s, "at the end");
    daemon.shutdown();
}
