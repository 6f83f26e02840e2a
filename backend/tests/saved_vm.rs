//! A parked VM saved to disk and parked from it again, against a live
//! daemon in this process: EXPORT holds the VM for its saver (no other
//! connection restores, exports or drops it meanwhile; the saver's end
//! frees it, its UNPARK drops it), the saver's memory fds are read-only,
//! a save proves itself (a load checks every piece against the manifest)
//! and a damaged, truncated or lying save is refused with the file and the
//! offset, nothing parked, eagerly and on demand.
//!
//! The tests are serialized (`serial`): they share the host's huge pages.

mod park_peer;

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::net::UnixStream;
use std::path::Path;

use backend::client::{Client, ClientError};
use backend::proto::Status;
use ch_migration::peer::{receive_snapshot, Snapshot};
use ch_migration::Limits;
use hugemem_client::park::Exported;
use hugemem_client::saved_vm::{park_from_dir, save_parked, DirKind, SaveOptions};
use park_peer::*;
use test_support::prelude::{reserve_2m, serial, wait_until, TestDaemon};
use test_support::tenant::alloc_2m;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 4 * MIB;
/// How long the daemon may take to settle (a session's end).
const SETTLE: std::time::Duration = std::time::Duration::from_secs(60);

/// Parks a 4 MiB allocation of `pattern` bytes under `name` (moved).
fn park_pattern(d: &TestDaemon, name: &str) {
    let mut launcher = d.client();
    let a = launcher.alloc(alloc_2m(SIZE, false)).expect("ALLOC");
    fill_mapped(&a.fds[0], SIZE);
    let run = park_via(&mut d.client(), name, whole(&a.fds[0], SIZE));
    assert_eq!(run.result.expect("PARK").copied_bytes, 0, "moved");
}

/// EXPORT `name` on `client` to a receiver in this process.
fn export_via(
    client: &mut Client,
    name: &str,
) -> (Result<Exported, ClientError>, Option<Snapshot>) {
    let (daemon_end, saver_end) = UnixStream::pair().expect("socketpair");
    let receiver = std::thread::spawn(move || receive_snapshot(&saver_end, Limits::default()).ok());
    let result = client.export(name, &daemon_end);
    drop(daemon_end);
    (result, receiver.join().expect("the receiver"))
}

fn refused_with<T: std::fmt::Debug>(r: Result<T, ClientError>, status: Status, needle: &str) {
    match r {
        Err(ClientError::Refused { status: s, message }) => {
            assert_eq!(s, status, "{message}");
            assert!(
                message.contains(needle),
                "{message:?} does not say {needle:?}"
            );
        }
        other => panic!("expected a refusal saying {needle:?}, got {other:?}"),
    }
}

fn access_mode(fd: &OwnedFd) -> i32 {
    let flags = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_GETFL).expect("F_GETFL");
    flags & libc::O_ACCMODE
}

#[test]
fn a_vm_being_saved_is_held_for_its_saver_and_stays_parked() {
    const TEST: &str = "a_vm_being_saved_is_held_for_its_saver_and_stays_parked";
    let _g = serial();
    if !reserve_2m(8, TEST) {
        return;
    }
    let d = TestDaemon::start(|_| {});
    park_pattern(&d, "g");
    let mut saver = d.client();
    let (exported, snapshot) = export_via(&mut saver, "g");
    let exported = exported.expect("EXPORT");
    let snapshot = snapshot.expect("the saver got the VM");
    assert_eq!(
        (exported.bytes, exported.page_size, exported.slots),
        (SIZE, 2 * MIB, 1)
    );
    let (_, fd) = &snapshot.memory[0];
    assert_eq!(
        access_mode(fd),
        libc::O_RDONLY,
        "the saver's memory fd is read-only"
    );
    assert!(
        holds_pattern(fd, 0, SIZE, 0),
        "the saver reads the VM's bytes"
    );
    let wrote = nix::sys::uio::pwrite(fd, &[0u8; 8], 0);
    assert_eq!(
        wrote,
        Err(nix::errno::Errno::EBADF),
        "and cannot write them"
    );

    // Held: another connection restores, exports or drops nothing.
    let mut other = d.client();
    refused_with(
        restore_via(&mut other, "g").0,
        Status::Invalid,
        "being saved",
    );
    refused_with(
        export_via(&mut other, "g").0,
        Status::Invalid,
        "being saved",
    );
    refused_with(other.unpark("g"), Status::Invalid, "being saved");
    assert_serves_balanced(&d, 1, 1, "held");
    let s = d.client().stats().expect("STATS");
    assert_eq!((s.counters.exports, s.counters.exports_refused), (1, 1));

    // The saver's UNPARK drops it.
    drop(snapshot);
    saver.unpark("g").expect("the saver drops the VM it saved");
    assert_serves_balanced(&d, 0, 0, "dropped by its saver");

    // A saver that goes away leaves the VM parked and free: it restores
    // with its bytes.
    park_pattern(&d, "h");
    let mut gone = d.client();
    let (exported, snapshot) = export_via(&mut gone, "h");
    exported.expect("EXPORT");
    let sessions = |d: &TestDaemon| d.stats().sessions.active;
    let before = sessions(&d);
    drop((snapshot, gone));
    // The daemon ends the saver's session (and its hold) when it reads EOF.
    wait_until("the saver's session ends", SETTLE, || sessions(&d) < before);
    let restored = restore_via(&mut other, "h")
        .0
        .expect("RESTORE once the saver is gone");
    assert!(holds_pattern(&restored.fds[0], 0, SIZE, 0), "its bytes");
    let id = restored.id;
    drop(restored);
    other.free(id).expect("FREE");
    assert_serves_balanced(&d, 0, 0, "restored and freed");
}

/// Flips one byte of `file` at `offset`.
fn flip(file: &Path, offset: u64) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(file)
        .expect("open");
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, offset).expect("read");
    f.write_all_at(&[b[0] ^ 0x40], offset).expect("write");
}

fn load_refused(d: &TestDaemon, name: &str, dir: &Path, on_demand: bool, needles: &[&str]) {
    match park_from_dir(&d.socket(), name, dir, on_demand) {
        Err(e) => {
            let msg = format!("{e}");
            for n in needles {
                assert!(msg.contains(n), "{msg:?} does not say {n:?}");
            }
        }
        Ok(r) => panic!("a damaged save was parked: {r:?}"),
    }
}

#[test]
fn a_save_proves_itself_and_damage_is_refused_before_anything_runs_on_it() {
    const TEST: &str = "a_save_proves_itself_and_damage_is_refused_before_anything_runs_on_it";
    let _g = serial();
    if !reserve_2m(12, TEST) {
        return;
    }
    let d = TestDaemon::start(|_| {});
    let tmp = tempfile::tempdir_in("/var/tmp").expect("tempdir on disk");
    let dir = tmp.path().join("g");
    park_pattern(&d, "g");
    let saved = save_parked(&d.socket(), "g", &dir, true, &SaveOptions::default()).expect("save");
    assert_eq!((saved.slots, saved.memory_bytes), (1, SIZE));
    assert_serves_balanced(&d, 0, 0, "saved and unparked");

    // Whole: it loads, every piece checked, and restores with its bytes.
    let loaded = park_from_dir(&d.socket(), "g2", &dir, false).expect("load");
    assert_eq!(loaded.kind, DirKind::Saved);
    assert_eq!(
        d.client()
            .stats()
            .expect("STATS")
            .counters
            .park_verified_bytes,
        SIZE
    );
    let mut c = d.client();
    let (restored, _) = restore_via(&mut c, "g2");
    let restored = restored.expect("RESTORE");
    assert!(
        holds_pattern(&restored.fds[0], 0, SIZE, 0),
        "the saved bytes"
    );
    let id = restored.id;
    drop(restored);
    c.free(id).expect("FREE");
    assert_serves_balanced(&d, 0, 0, "loaded, restored, freed");

    // One byte changed: refused at park time, naming the file and the
    // piece, nothing parked.
    let memory = dir.join("memory-0");
    flip(&memory, 2 * MIB + 5);
    load_refused(
        &d,
        "g3",
        &dir,
        false,
        &["memory-0", "does not match its manifest", "0x200000"],
    );
    assert_serves_balanced(&d, 0, 0, "a damaged save refused");

    // On demand: parked (nothing read yet), then the restore reads the
    // damaged piece and fails; the VM stays parked, and is dropped.
    park_from_dir(&d.socket(), "g4", &dir, true).expect("an on-demand park reads nothing yet");
    let (restored, _) = restore_via(&mut c, "g4");
    refused_with(
        restored,
        Status::Invalid,
        "memory-0 does not match its manifest",
    );
    assert_serves_balanced(&d, 1, 1, "the damaged VM stays parked");
    c.unpark("g4").expect("UNPARK");
    assert_serves_balanced(&d, 0, 0, "dropped");

    // Truncated, missing: refused before the daemon is asked.
    flip(&memory, 2 * MIB + 5);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&memory)
        .expect("open");
    let mut tail = vec![0u8; 4096];
    f.read_exact_at(&mut tail, SIZE - 4096)
        .expect("read the tail");
    f.set_len(SIZE - 4096).expect("truncate");
    load_refused(&d, "g5", &dir, false, &["memory-0", "4190208 bytes"]);
    // Grown back, the tail is zeros: caught by its piece's checksum.
    f.set_len(SIZE).expect("size back");
    load_refused(
        &d,
        "g5",
        &dir,
        false,
        &["memory-0", "does not match its manifest", "0x200000"],
    );
    f.write_all_at(&tail, SIZE - 4096).expect("the tail back");
    let state = dir.join("state.json");
    let kept = std::fs::read(&state).expect("state");
    std::fs::remove_file(&state).expect("rm");
    load_refused(&d, "g6", &dir, false, &["state.json"]);
    std::fs::write(&state, &kept).expect("put back");
    let again = park_from_dir(&d.socket(), "g7", &dir, false).expect("whole again");
    assert_eq!(again.kind, DirKind::Saved);
    c.unpark("g7").expect("UNPARK");
    assert_serves_balanced(&d, 0, 0, "end");
}

#[test]
fn a_manifest_that_lies_or_is_not_a_file_is_refused() {
    const TEST: &str = "a_manifest_that_lies_or_is_not_a_file_is_refused";
    let _g = serial();
    if !reserve_2m(8, TEST) {
        return;
    }
    let d = TestDaemon::start(|_| {});
    let tmp = tempfile::tempdir_in("/var/tmp").expect("tempdir on disk");
    let dir = tmp.path().join("g");
    park_pattern(&d, "g");
    save_parked(&d.socket(), "g", &dir, true, &SaveOptions::default()).expect("save");
    let memory = std::fs::File::open(dir.join("memory-0")).expect("memory-0");
    let park_with = |manifest: &dyn AsFd| {
        let steps = whole(&OwnedFd::from(memory.try_clone().expect("dup")), SIZE);
        let (daemon_end, peer) = fake_sender(steps);
        let r = d
            .client()
            .park_verified("lying", &daemon_end, manifest.as_fd(), false);
        drop(daemon_end);
        drop(peer.join());
        r
    };
    // Not a regular file; a manifest past its bound; one of another size.
    let fifo = tmp.path().join("fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).expect("mkfifo");
    let pipe = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(&fifo)
        .expect("open fifo");
    refused_with(park_with(&pipe), Status::Invalid, "not a regular file");
    let huge = tmp.path().join("huge.json");
    std::fs::write(&huge, vec![b' '; 1 << 20]).expect("write");
    refused_with(
        park_with(&std::fs::File::open(&huge).expect("open")),
        Status::Invalid,
        "bytes (at most",
    );
    let text = std::fs::read_to_string(dir.join("hugemem-manifest.json")).expect("manifest");
    let lying = tmp.path().join("lying.json");
    std::fs::write(
        &lying,
        text.replace(
            &format!("\"size\":{SIZE}"),
            &format!("\"size\":{}", 2 * SIZE),
        ),
    )
    .expect("write");
    let r = park_with(&std::fs::File::open(&lying).expect("open"));
    assert!(r.is_err(), "a manifest of another size: {r:?}");
    assert_serves_balanced(&d, 0, 0, "nothing parked");
}
