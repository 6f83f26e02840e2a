//! A fake cloud-hypervisor *receiver* for the restore tests: it takes a
//! RESTORE's local migration (and, for a postcopy restore, its fault
//! connection) step by step as a script says, and can die at any step, as
//! a cloud-hypervisor killed there would: the other end of two
//! `UnixStream::pair()`s, so nothing but the script decides the timing.

// Each test binary that includes this uses a part of it.
#![allow(dead_code)]

use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt as _;
use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::thread::JoinHandle;

use ch_migration::fault::MEMORY_RANGE_SIZE;
use ch_migration::{Command, RequestHeader, Response, HEADER_SIZE};

/// Where the receiver dies (closes both connections).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// Before reading anything: killed before `Start`.
    AtOnce,
    /// Once it answered `command` OK (the first of its kind).
    After(Command),
    /// Having read `command`'s request, without answering it.
    Unanswered(Command),
    /// Never: it takes the VM (and, postcopy, every page) and closes.
    Never,
}

/// What the receiver does.
pub struct Script {
    /// Where it dies.
    pub stop: Stop,
    /// A postcopy receiver: the fault connection is its second socket.
    pub postcopy: bool,
    /// Postcopy: the page size it asks for.
    pub page: u64,
    /// The VM's memory, in bytes (one slot at guest address 0).
    pub size: u64,
    /// Postcopy: pages it asks for (in this order) once `Complete` came,
    /// before it answers it or dies there.
    pub early_faults: Vec<u64>,
    /// Writes `0xEE` over the first early page once it has it, as the
    /// guest it resumed would.
    pub scribble: bool,
    /// Postcopy: after answering `Complete`, says so here (`.0`) and waits
    /// for a message (`.1`) before it asks for the remaining pages and
    /// closes.
    pub hold: Option<(mpsc::Sender<()>, mpsc::Receiver<()>)>,
    /// Postcopy: a page it asks for once the state came, before it answers
    /// the state, reading the answer only once `Complete` came, as
    /// cloud-hypervisor's prefault asks for the guest's first page.
    pub state_fault: Option<u64>,
}

impl Script {
    /// A receiver of a `size`-byte VM that dies at `stop`.
    pub fn new(stop: Stop, postcopy: bool, size: u64) -> Self {
        Self {
            stop,
            postcopy,
            page: 2 << 20,
            size,
            early_faults: Vec::new(),
            scribble: false,
            hold: None,
            state_fault: None,
        }
    }
}

/// What the receiver saw.
#[derive(Debug, Default)]
pub struct Seen {
    /// The requests it read, in order.
    pub commands: Vec<Command>,
    /// The memory fd of slot 0.
    pub memory: Option<OwnedFd>,
    /// Page faults answered OK, and refused.
    pub faults_ok: usize,
    /// See `faults_ok`.
    pub faults_refused: usize,
    /// The bytes of every page it had, as read from the memory fd when
    /// each was answered (offset, bytes).
    pub pages: Vec<(u64, Vec<u8>)>,
    /// With `state_fault`: whether its answer was there, unread, when
    /// `Complete` came (the guest would resume on that page).
    pub answered_before_complete: Option<bool>,
}

fn read_exact(sock: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> bool {
    let mut got = 0;
    while got < buf.len() {
        match hugemem_client::sys::recv_with_fds(sock.as_fd(), &mut buf[got..], fds, 4, false) {
            Ok(r) if r.bytes > 0 => got += r.bytes,
            _ => return false,
        }
    }
    true
}

/// The next request on `sock` (its payload read and dropped; its fds on
/// `fds`), or `None` once the sender is gone.
fn next_request(sock: &UnixStream, fds: &mut Vec<OwnedFd>) -> Option<Command> {
    let mut head = [0u8; HEADER_SIZE];
    if !read_exact(sock, &mut head, fds) {
        return None;
    }
    let h = RequestHeader::decode(&head).ok()?;
    let mut payload = vec![0u8; usize::try_from(h.length).ok()?];
    if !read_exact(sock, &mut payload, fds) {
        return None;
    }
    Some(h.command)
}

fn respond(mut sock: &UnixStream, ok: bool) -> bool {
    sock.write_all(&Response { ok }.encode()).is_ok()
}

/// One page fault on the fault connection: true when answered OK.
fn fault(sock: &UnixStream, gpa: u64, length: u64) -> Option<bool> {
    ask(sock, gpa, length)?;
    answer(sock)
}

/// Sends one `PageFault` request.
fn ask(mut sock: &UnixStream, gpa: u64, length: u64) -> Option<()> {
    let h = RequestHeader::new(Command::PageFault, MEMORY_RANGE_SIZE as u64);
    let mut range = [0u8; MEMORY_RANGE_SIZE];
    range[..8].copy_from_slice(&gpa.to_le_bytes());
    range[8..].copy_from_slice(&length.to_le_bytes());
    sock.write_all(&h.encode()).ok()?;
    sock.write_all(&range).ok()
}

/// True when an answer waits unread on `sock` now.
fn answer_waiting(sock: &UnixStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut pfd = libc::pollfd {
        fd: sock.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the call; a zero timeout only looks.
    unsafe { libc::poll(&mut pfd, 1, 0) == 1 && pfd.revents & libc::POLLIN != 0 }
}

/// Reads one answer: true when OK.
fn answer(mut sock: &UnixStream) -> Option<bool> {
    let mut answer = [0u8; HEADER_SIZE];
    std::io::Read::read_exact(&mut sock, &mut answer).ok()?;
    Response::decode(&answer).ok().map(|r| r.ok)
}

impl Seen {
    fn take_page(&mut self, fault_sock: &UnixStream, at: u64, page: u64) -> bool {
        let answered = fault(fault_sock, at, page);
        self.keep_page(answered, at, page)
    }

    /// Counts an answer to the request for the page at `at`, and keeps
    /// the page's bytes when it was OK.
    fn keep_page(&mut self, answered: Option<bool>, at: u64, page: u64) -> bool {
        match answered {
            Some(true) => {
                self.faults_ok += 1;
                if let Some(m) = &self.memory {
                    let f = std::fs::File::from(m.try_clone().expect("dup"));
                    let mut buf = vec![0u8; usize::try_from(page).expect("page")];
                    // A page of another slot is past slot 0's memory: not kept.
                    if f.read_exact_at(&mut buf, at).is_ok() {
                        self.pages.push((at, buf));
                    }
                }
                true
            }
            Some(false) => {
                self.faults_refused += 1;
                false
            }
            None => false,
        }
    }

    /// Writes `0xEE` over the page at `at` through a shared mapping, as a
    /// guest would (hugetlbfs files take no `write`).
    fn scribble(&self, at: u64, page: u64) {
        use std::os::fd::AsRawFd;
        let Some(m) = &self.memory else { return };
        let len = at + page;
        let p = test_support::prelude::map_raw(m.as_raw_fd(), len);
        assert!(!p.is_null(), "mmap of the VM's memory");
        let at = usize::try_from(at).expect("at");
        // SAFETY: `p` is this receiver's live shared mapping of `len`
        // bytes (`at + page`): the page at `at` is inside it.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(p, at + usize::try_from(page).expect("page")) };
        bytes[at..].fill(0xEE);
        test_support::prelude::unmap_raw(p, len);
    }
}

/// Runs `script` on the receiver's ends: `main` (the migration
/// connection) and, for a postcopy receiver, `fault`.
pub fn run(script: Script, main: UnixStream, fault: Option<UnixStream>) -> Seen {
    let mut seen = Seen::default();
    if script.stop == Stop::AtOnce {
        return seen;
    }
    let mut fds = Vec::new();
    let mut fault_sock = None;
    loop {
        let Some(cmd) = next_request(&main, &mut fds) else {
            return seen;
        };
        seen.commands.push(cmd);
        if cmd == Command::MemoryFd && seen.memory.is_none() {
            seen.memory = fds.pop();
        }
        if cmd == Command::State && script.postcopy {
            // As cloud-hypervisor: the fault connection's role is read
            // once the state is due.
            let sock = fault.as_ref().expect("a fault connection");
            let mut role = [0u8; 2];
            std::io::Read::read_exact(&mut &*sock, &mut role).expect("the role");
            assert_eq!(
                u16::from_le_bytes(role),
                2,
                "announced as the fault connection"
            );
            fault_sock = Some(sock);
            if let Some(at) = script.state_fault {
                ask(sock, at, script.page);
            }
        }
        let last = matches!(cmd, Command::Complete | Command::CompletePaused);
        if last {
            if let (Some(f), Some(at)) = (fault_sock, script.state_fault) {
                seen.answered_before_complete = Some(answer_waiting(f));
                let answered = answer(f);
                seen.keep_page(answered, at, script.page);
            }
            if let Some(f) = fault_sock {
                for &at in &script.early_faults {
                    seen.take_page(f, at, script.page);
                }
                if script.scribble {
                    if let Some(&at) = script.early_faults.first() {
                        seen.scribble(at, script.page);
                    }
                }
            }
        }
        if script.stop == Stop::Unanswered(cmd) {
            return seen;
        }
        if !respond(&main, true) || script.stop == Stop::After(cmd) {
            return seen;
        }
        if last {
            break;
        }
    }
    if let Some((reached, go)) = &script.hold {
        let _ = reached.send(());
        let _ = go.recv();
    }
    if let Some(f) = fault_sock {
        let mut at = 0;
        while at < script.size {
            let had = script.early_faults.contains(&at) || script.state_fault == Some(at);
            if !had && !seen.take_page(f, at, script.page) {
                break;
            }
            at += script.page;
        }
    }
    seen
}

/// A receiver running `script` on a thread: the daemon's ends (migration,
/// and fault connection when postcopy) and the thread.
pub fn spawn(script: Script) -> (UnixStream, Option<UnixStream>, JoinHandle<Seen>) {
    let (daemon_main, main) = UnixStream::pair().expect("socketpair");
    let (daemon_fault, fault) = if script.postcopy {
        let (d, f) = UnixStream::pair().expect("socketpair");
        (Some(d), Some(f))
    } else {
        (None, None)
    };
    let thread = std::thread::spawn(move || run(script, main, fault));
    (daemon_main, daemon_fault, thread)
}
