//! A fake cloud-hypervisor for the park tests: the other end of a
//! `UnixStream::pair()` that sends a local migration's requests exactly as
//! a test scripts them (raw headers, payloads, fds, hang-ups, actions
//! between two requests), and the checks every refusal must pass (the
//! daemon serves on, holds no allocation or parked VM it should not, and
//! closed every fd it received).

// Each test binary that includes this uses a part of it.
#![allow(dead_code)]

pub mod clones;

use std::ffi::CString;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::thread::JoinHandle;
use std::time::Duration;

use backend::client::{Client, ClientError};
use backend::proto::Status;
use backend::stats::Stats;
use ch_migration::{Command, RequestHeader, HEADER_SIZE, PROTOCOL_VERSION};
use hugemem_client::park::Parked;
use test_support::prelude::TestDaemon;
use test_support::tenant::{say, NOBODY};

/// One request as the fake sender puts it on the wire: the 16 header
/// bytes, the payload, and fds (on the payload's first byte, or on the
/// header when there is no payload).
pub struct Req {
    /// The header's bytes.
    pub head: [u8; HEADER_SIZE],
    /// The payload.
    pub payload: Vec<u8>,
    /// The fds sent with it.
    pub fds: Vec<OwnedFd>,
}

/// A request of `command` with `payload` (its length announced truly).
pub fn req(command: Command, payload: &[u8]) -> Req {
    Req {
        head: RequestHeader::new(command, payload.len() as u64).encode(),
        payload: payload.to_vec(),
        fds: Vec::new(),
    }
}

/// A request with any command number, header bytes and announced length,
/// and no payload.
pub fn raw(command: u16, version: u16, length: u64) -> Req {
    let mut head = [0u8; HEADER_SIZE];
    head[..2].copy_from_slice(&command.to_le_bytes());
    head[2..4].copy_from_slice(&version.to_le_bytes());
    head[8..].copy_from_slice(&length.to_le_bytes());
    Req {
        head,
        payload: Vec::new(),
        fds: Vec::new(),
    }
}

/// `Start` of this protocol version.
pub fn start() -> Req {
    raw(Command::Start as u16, PROTOCOL_VERSION, 0)
}

/// `MemoryFd` of `slot` with a duplicate of each of `fds`.
pub fn memory_fd(slot: u32, fds: &[&OwnedFd]) -> Req {
    let mut r = req(Command::MemoryFd, &slot.to_le_bytes());
    r.fds = fds
        .iter()
        .map(|f| f.try_clone().expect("dup a memory fd"))
        .collect();
    r
}

/// `Config` carrying `json`.
pub fn config(json: &str) -> Req {
    req(Command::Config, json.as_bytes())
}

/// `State` carrying `bytes`.
pub fn state(bytes: &[u8]) -> Req {
    req(Command::State, bytes)
}

/// `CompletePaused`.
pub fn complete_paused() -> Req {
    req(Command::CompletePaused, &[])
}

/// A configuration whose guest RAM mappings are `(slot, gpa, size,
/// file_offset)`, the rest as cloud-hypervisor writes it.
pub fn config_json(mappings: &[(u32, u64, u64, u64)]) -> String {
    let list: Vec<serde_json::Value> = mappings
        .iter()
        .map(|&(slot, gpa, size, file_offset)| {
            serde_json::json!({
                "slot": slot, "gpa": gpa, "size": size, "file_offset": file_offset,
                "zone_id": "mem0", "virtio_mem": false
            })
        })
        .collect();
    serde_json::json!({
        "cpus": {"boot_vcpus": 1},
        "memory_manager_data": {"guest_ram_mappings": list}
    })
    .to_string()
}

/// The VM state a fake sender sends: bytes a test recognises.
pub const STATE: &[u8] = b"{\"vcpus\":[\"fake vcpu state\"],\"devices\":[]}";

/// The whole sequence for one memory fd (slot 0) mapped `size` bytes from 0.
pub fn whole(fd: &OwnedFd, size: u64) -> Vec<Step> {
    vec![
        Step::Send(start()),
        Step::Send(memory_fd(0, &[fd])),
        Step::Send(config(&config_json(&[(0, 0, size, 0)]))),
        Step::Send(state(STATE)),
        Step::Send(complete_paused()),
    ]
}

/// One step of the fake sender.
pub enum Step {
    /// Send the request and read its answer; an error answer or a closed
    /// socket ends the script.
    Send(Req),
    /// Send the header and the first `n` payload bytes (without a
    /// payload: the first `n` header bytes), then hang up.
    HangUpInside(Req, usize),
    /// Run an action (truncate a file, ...) before the next step.
    Run(Box<dyn FnOnce() + Send>),
    /// Close the socket.
    HangUp,
}

/// How the daemon answered one request of the fake sender.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// OK.
    Ok,
    /// An error response.
    Refused,
    /// No answer: the daemon closed the socket (or the send failed).
    Gone,
}

fn send(sock: &UnixStream, bytes: &[u8], fds: &[OwnedFd]) -> bool {
    let fds: Vec<BorrowedFd<'_>> = fds.iter().map(AsFd::as_fd).collect();
    hugemem_client::proto::socket::send_all(sock.as_fd(), bytes, &fds).is_ok()
}

fn put(sock: &UnixStream, r: &Req) -> bool {
    if r.payload.is_empty() {
        send(sock, &r.head, &r.fds)
    } else {
        send(sock, &r.head, &[]) && send(sock, &r.payload, &r.fds)
    }
}

fn answer(sock: &UnixStream) -> Answer {
    let mut buf = [0u8; HEADER_SIZE];
    let mut fds = Vec::new();
    let mut got = 0;
    while got < HEADER_SIZE {
        match hugemem_client::sys::recv_with_fds(sock.as_fd(), &mut buf[got..], &mut fds, 1, false)
        {
            Ok(r) if r.bytes > 0 => got += r.bytes,
            _ => return Answer::Gone,
        }
    }
    match u16::from_le_bytes([buf[0], buf[1]]) {
        1 => Answer::Ok,
        _ => Answer::Refused,
    }
}

/// Writes `reqs` on `sock` without reading an answer (they wait in the
/// socket for the daemon): for a forked child, which runs no thread.
pub fn write_script(sock: &UnixStream, reqs: &[Req]) -> bool {
    reqs.iter().all(|r| put(sock, r))
}

/// A fake cloud-hypervisor running `steps` on a thread: the stream to
/// hand the daemon, and the thread (its answers).
pub fn fake_sender(steps: Vec<Step>) -> (UnixStream, JoinHandle<Vec<Answer>>) {
    let (daemon_end, ch_end) = UnixStream::pair().expect("socketpair");
    ch_end
        .set_read_timeout(Some(Duration::from_secs(90)))
        .expect("timeout");
    let peer = std::thread::spawn(move || {
        let mut answers = Vec::new();
        for step in steps {
            match step {
                Step::Send(r) => {
                    // A daemon that refuses on the header answers and
                    // closes while the payload is still being sent: its
                    // answer is there to read all the same.
                    let _ = put(&ch_end, &r);
                    let a = answer(&ch_end);
                    answers.push(a);
                    if a != Answer::Ok {
                        break;
                    }
                }
                Step::HangUpInside(r, n) if r.payload.is_empty() => {
                    let _ = send(&ch_end, &r.head[..n], &r.fds);
                    break;
                }
                Step::HangUpInside(r, n) => {
                    let _ = send(&ch_end, &r.head, &[]) && send(&ch_end, &r.payload[..n], &r.fds);
                    break;
                }
                Step::Run(action) => action(),
                Step::HangUp => break,
            }
        }
        answers
    });
    (daemon_end, peer)
}

/// What a PARK through a fake sender gave.
pub struct ParkRun {
    /// The daemon's reply.
    pub result: Result<Parked, ClientError>,
    /// The fake sender's answers, request by request.
    pub answers: Vec<Answer>,
}

/// PARK `name` on `client` while a fake sender runs `steps`; checks that
/// the daemon kept no copy of the migration socket once it replied.
pub fn park_via(client: &mut Client, name: &str, steps: Vec<Step>) -> ParkRun {
    let (daemon_end, peer) = fake_sender(steps);
    let result = client.park(name, &daemon_end);
    assert_eq!(
        open_count(identity(&daemon_end)),
        1,
        "the daemon still holds the migration socket after its reply to PARK {name}"
    );
    drop(daemon_end);
    let answers = peer.join().expect("the fake sender");
    ParkRun { result, answers }
}

/// A file's identity (device, inode).
pub fn identity(fd: &impl AsFd) -> (u64, u64) {
    let st = nix::sys::stat::fstat(fd.as_fd()).expect("fstat");
    (st.st_dev, st.st_ino)
}

/// How many fds of this process (the test and the in-process daemon) name
/// the file whose identity is `id`.
pub fn open_count(id: (u64, u64)) -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .filter_map(Result::ok)
        .filter(|e| std::fs::metadata(e.path()).is_ok_and(|m| (m.dev(), m.ino()) == id))
        .count()
}

/// A memfd (4 KiB pages) of `size` bytes whose byte i is `pattern(i)`.
pub fn memfd(name: &str, size: u64, sealing: bool) -> OwnedFd {
    let cname = CString::new(name).expect("name");
    let flags = libc::MFD_CLOEXEC | if sealing { libc::MFD_ALLOW_SEALING } else { 0 };
    // SAFETY: memfd_create with a valid C string; returns a new fd or -1.
    let raw = unsafe { libc::memfd_create(cname.as_ptr(), flags) };
    assert!(
        raw >= 0,
        "memfd_create: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: `raw` was just returned by memfd_create; nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let f = std::fs::File::from(fd.try_clone().expect("dup"));
    f.set_len(size).expect("ftruncate");
    fill(&fd, 0, size);
    fd
}

/// Byte `i` of what the fake VMs' memory holds.
pub fn pattern(i: u64) -> u8 {
    (i.wrapping_mul(131) % 251) as u8 + 1
}

/// Writes `pattern` into `[from, to)` of `fd`, 1 MiB at a time.
pub fn fill(fd: &OwnedFd, from: u64, to: u64) {
    let mut at = from;
    while at < to {
        let bytes: Vec<u8> = (at..to.min(at + (1 << 20))).map(pattern).collect();
        let w = nix::sys::uio::pwrite(fd, &bytes, at as i64).expect("pwrite");
        at += w as u64;
    }
}

/// `len` bytes of `fd` from `offset` (pread: memfds and hugetlbfs alike).
pub fn read_at(fd: &impl AsFd, offset: u64, len: u64) -> Vec<u8> {
    let mut buf = vec![0u8; len as usize];
    let mut got = 0;
    while got < buf.len() {
        let n = nix::sys::uio::pread(fd.as_fd(), &mut buf[got..], (offset + got as u64) as i64)
            .expect("pread");
        assert!(n > 0, "the file ended at {}", offset + got as u64);
        got += n;
    }
    buf
}

/// True when `fd`'s `[offset, offset + len)` holds `pattern` of the same
/// offsets shifted by `shift` (the source's offset minus this one's).
pub fn holds_pattern(fd: &impl AsFd, offset: u64, len: u64, source_offset: u64) -> bool {
    read_at(fd, offset, len)
        .iter()
        .enumerate()
        .all(|(i, &b)| b == pattern(source_offset + i as u64))
}

/// The daemon's STATS through a new connection (it still serves), with
/// its books balanced: `active` allocations, `parked` parked VMs,
/// allocations made − released == active, regions created − released ==
/// held.
pub fn assert_serves_balanced(d: &TestDaemon, active: u64, parked: usize, case: &str) -> Stats {
    let s = d.client().stats().expect("the daemon still answers STATS");
    assert_eq!(s.allocations.active, active, "{case}: allocations: {s}");
    assert_eq!(s.parked.len(), parked, "{case}: parked VMs: {:?}", s.parked);
    assert_eq!(
        s.counters.allocs_ok - s.counters.allocs_released,
        active,
        "{case}: allocations made − released: {s}"
    );
    assert_eq!(
        s.totals.created_bytes - s.totals.released_bytes,
        s.totals.held_bytes,
        "{case}: region totals: {s}"
    );
    s
}

/// A refusal with `status` whose message holds `needle`.
pub fn assert_refused(r: &Result<Parked, ClientError>, status: Status, needle: &str, case: &str) {
    match r {
        Err(ClientError::Refused { status: s, message }) => {
            assert_eq!(*s, status, "{case}: {message}");
            assert!(
                message.contains(needle),
                "{case}: the refusal {message:?} does not say {needle:?}"
            );
        }
        other => panic!("{case}: expected a refusal saying {needle:?}, got {other:?}"),
    }
}

/// Writes `pattern` over the first `size` bytes of a hugemem region `fd`
/// through a shared mapping (hugetlbfs files take no `write`).
pub fn fill_mapped(fd: &impl AsFd, size: u64) {
    use std::os::fd::AsRawFd;
    let p = test_support::prelude::map_raw(fd.as_fd().as_raw_fd(), size);
    assert!(!p.is_null(), "mmap of a region");
    let bytes: Vec<u8> = (0..size).map(pattern).collect();
    // SAFETY: `p` is this test's live shared mapping of `size` bytes and
    // `bytes` holds exactly `size` bytes; they do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, bytes.len()) };
    test_support::prelude::unmap_raw(p, size);
}

/// RESTORE `name` on `client` to a fake cloud-hypervisor receiver
/// (`receive_snapshot` on the other end): the daemon's reply and what the
/// receiver got (`None`: it was refused or cut off).
pub fn restore_via(
    client: &mut Client,
    name: &str,
) -> (
    Result<hugemem_client::client::Allocation, ClientError>,
    Option<ch_migration::peer::Snapshot>,
) {
    let (daemon_end, ch_end) = UnixStream::pair().expect("socketpair");
    let receiver = std::thread::spawn(move || {
        let limits = ch_migration::Limits::default();
        ch_migration::peer::receive_snapshot(&ch_end, limits).ok()
    });
    let result = client.restore(name, &daemon_end, true);
    drop(daemon_end);
    (result, receiver.join().expect("the fake receiver"))
}

/// [`whole`] with `action` run after State, before CompletePaused.
pub fn whole_then(fd: &OwnedFd, size: u64, action: impl FnOnce() + Send + 'static) -> Vec<Step> {
    let mut steps = whole(fd, size);
    let last = steps.pop();
    steps.push(Step::Run(Box::new(action)));
    steps.extend(last);
    steps
}

/// The path by which a step reopens `fd` (`/proc/self/fd/N`), so that no
/// duplicate of it waits in the step and the count of its fds stays the
/// test's.
pub fn reopen_path(fd: &OwnedFd) -> String {
    use std::os::fd::AsRawFd;
    format!("/proc/self/fd/{}", fd.as_raw_fd())
}

/// A daemon that serves root and uid 65534, its socket open to both.
pub fn daemon_for_two_uids() -> TestDaemon {
    let d = TestDaemon::start(|c| c.allowed_uids = vec![0, NOBODY]);
    for (path, mode) in [(d.dir(), 0o755), (d.socket().as_path(), 0o777)] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }
    d
}

/// How many of the fds that `steps` send name the file `id`.
pub fn carried(steps: &[Step], id: (u64, u64)) -> usize {
    steps
        .iter()
        .map(|s| match s {
            Step::Send(r) | Step::HangUpInside(r, _) => {
                r.fds.iter().filter(|f| identity(*f) == id).count()
            }
            _ => 0,
        })
        .sum()
}

/// One refusal case: what the fake sender does and what the refusal says.
pub struct Case {
    /// What the case is.
    pub name: &'static str,
    /// What the fake sender does.
    pub steps: Vec<Step>,
    /// What the refusal says.
    pub needle: &'static str,
}

pub fn case(name: &'static str, steps: Vec<Step>, needle: &'static str) -> Case {
    Case {
        name,
        steps,
        needle,
    }
}

/// Runs each case as a PARK by `client` and checks the refusal (see the
/// module docs); `watched` are the files whose fds the sender sends, and
/// `active` the allocations that exist throughout.
pub fn refuse_each(d: &TestDaemon, client: &mut Client, watched: &[(u64, u64)], cases: Vec<Case>) {
    let active = d.stats().allocations.active;
    for c in cases {
        // The fds the steps carry are dropped with them: not counted.
        let before: Vec<usize> = watched
            .iter()
            .map(|id| open_count(*id) - carried(&c.steps, *id))
            .collect();
        let hangs_up = c
            .steps
            .iter()
            .any(|s| matches!(s, Step::HangUp | Step::HangUpInside(..)));
        let run = park_via(client, "refused", c.steps);
        assert_refused(&run.result, Status::Invalid, c.needle, c.name);
        let (last, rest) = run.answers.split_last().unwrap_or((&Answer::Ok, &[]));
        assert!(
            rest.iter().all(|a| *a == Answer::Ok),
            "{}: answers {:?}",
            c.name,
            run.answers
        );
        if !hangs_up {
            assert_eq!(
                *last,
                Answer::Refused,
                "{}: the sender was not told (answers {:?})",
                c.name,
                run.answers
            );
        }
        assert_serves_balanced(d, active, 0, c.name);
        let after: Vec<usize> = watched.iter().map(|id| open_count(*id)).collect();
        assert_eq!(before, after, "{}: fds of the sent files left open", c.name);
    }
}

/// Expects a refusal with `status` whose text holds `needle`, in a forked
/// child: 0 when so, 20 (and the reason on stderr) otherwise.
pub fn child_expects<T: std::fmt::Debug>(
    r: Result<T, ClientError>,
    status: Status,
    needle: &str,
) -> i32 {
    match r {
        Err(ClientError::Refused { status: s, message })
            if s == status && message.contains(needle) =>
        {
            0
        }
        other => {
            say(&format!(
                "expected {status:?} saying {needle:?}, got {other:?}"
            ));
            20
        }
    }
}
