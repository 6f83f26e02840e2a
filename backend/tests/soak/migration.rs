//! The tenant as cloud-hypervisor: the sending end of a PARK
//! (`ch_migration::peer::send_snapshot` on a thread) and
//! the receiving end of a RESTORE (`peer::receive_snapshot`, or a receiver
//! of its own that refuses a step or runs a postcopy restore: it takes the
//! fault connection the daemon announces and asks for every page on it
//! before it answers the state, as cloud-hypervisor's `receive-migration
//! …,memory_mode=postcopy` does when its guest touches them).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use backend::client::{Allocation, Client, ClientError};
use ch_migration::fault::FAULT_CONNECTION_ROLE;
use ch_migration::layout::migration_config_slots;
use ch_migration::peer::{receive_snapshot, send_snapshot};
use ch_migration::{Command, Limits, RequestHeader, Response, HEADER_SIZE};
use hugemem_client::park::Parked;

/// How long the tenant's end of a migration waits for the daemon: past
/// the daemon's own bound (60 s per read or write) and a takeover.
const PEER_TIMEOUT: Duration = Duration::from_secs(150);

/// PARK `name` on `client` (on demand when `on_demand`) while a thread
/// sends `memory`, `config` and `state`, ending with `CompletePaused`:
/// the daemon's reply, and the sender's outcome.
pub fn park(
    client: &mut Client,
    name: &str,
    memory: &[(u32, BorrowedFd<'_>)],
    config: &[u8],
    state: &[u8],
    on_demand: bool,
) -> (Result<Parked, ClientError>, Result<(), String>) {
    let (ours, theirs) = match UnixStream::pair() {
        Ok(p) => p,
        Err(e) => return (Ok(dummy_parked()), Err(format!("socketpair: {e}"))),
    };
    let _ = ours.set_read_timeout(Some(PEER_TIMEOUT));
    std::thread::scope(|s| {
        let sender = s
            .spawn(|| send_snapshot(&ours, memory, config, state, true).map_err(|e| e.to_string()));
        let parked = client.park_with(name, &theirs, on_demand);
        // The sender learns of a refusal that came before it finished.
        drop(theirs);
        let sent = sender
            .join()
            .unwrap_or_else(|_| Err("the sender thread panicked".into()));
        (parked, sent)
    })
}

/// Stands in for a reply when the socket pair could not be made (the
/// sender's error says so).
fn dummy_parked() -> Parked {
    Parked {
        alloc_id: 0,
        bytes: 0,
        copied_bytes: 0,
        slots: 0,
    }
}

/// What a receiver got.
#[derive(Debug)]
pub struct Received {
    /// Memory slots and their fds.
    pub memory: Vec<(u32, OwnedFd)>,
    /// The configuration.
    pub config: Vec<u8>,
    /// The state.
    pub state: Vec<u8>,
    /// It ended with `CompletePaused`.
    pub paused: bool,
    /// Pages asked for on the fault connection.
    pub faults: u64,
}

/// How the receiving end behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Receiver {
    /// `peer::receive_snapshot`.
    Plain,
    /// Postcopy: asks for every page on the fault connection.
    Postcopy,
    /// Refuses the request with this index (0: `Start`).
    Refuse(usize),
    /// Hangs up before the daemon sends anything.
    HangUp,
}

/// RESTORE `name` on `client` (ending paused when `paused`) to a receiver
/// that behaves as `how` says: the daemon's reply and what the receiver
/// got.
pub fn restore(
    client: &mut Client,
    name: &str,
    paused: bool,
    how: Receiver,
) -> (Result<Allocation, ClientError>, Result<Received, String>) {
    let pairs = UnixStream::pair().and_then(|a| Ok((a, UnixStream::pair()?)));
    let ((ours, theirs), (fault_ours, fault_theirs)) = match pairs {
        Ok(p) => p,
        Err(e) => {
            return (
                Err(ClientError::Unexpected("no socket pair".into())),
                Err(format!("socketpair: {e}")),
            )
        }
    };
    let _ = ours.set_read_timeout(Some(PEER_TIMEOUT));
    let _ = fault_ours.set_read_timeout(Some(PEER_TIMEOUT));
    if how == Receiver::HangUp {
        drop(ours);
        let r = client.restore(name, &theirs, paused);
        return (r, Err("hung up".into()));
    }
    std::thread::scope(|s| {
        let receiver = s.spawn(|| match how {
            Receiver::Plain => receive_snapshot(&ours, Limits::default())
                .map(|snap| Received {
                    memory: snap.memory,
                    config: snap.config,
                    state: snap.state,
                    paused: snap.paused,
                    faults: 0,
                })
                .map_err(|e| e.to_string()),
            Receiver::Postcopy => receive(&ours, Some(&fault_ours), None),
            Receiver::Refuse(k) => receive(&ours, None, Some(k)),
            Receiver::HangUp => Err("hung up".into()),
        });
        let r = if how == Receiver::Postcopy {
            client.restore_postcopy(name, &theirs, &fault_theirs, paused)
        } else {
            client.restore(name, &theirs, paused)
        };
        // A refusal before the first request: the receiver sees the end.
        drop((theirs, fault_theirs));
        let got = receiver
            .join()
            .unwrap_or_else(|_| Err("the receiver thread panicked".into()));
        (r, got)
    })
}

/// Reads all of `buf` from `sock`, keeping any fds that come with it.
fn read_exact(sock: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> Result<(), String> {
    let mut got = 0;
    while got < buf.len() {
        let r = hugemem_client::sys::recv_with_fds(sock.as_fd(), &mut buf[got..], fds, 4, false)
            .map_err(|e| format!("recv: {e}"))?;
        if r.bytes == 0 {
            return Err(format!("the daemon closed the socket after {got} bytes"));
        }
        got += r.bytes;
    }
    Ok(())
}

fn respond(sock: &UnixStream, ok: bool) -> Result<(), String> {
    hugemem_client::proto::socket::send_all(sock.as_fd(), &Response { ok }.encode(), &[])
        .map_err(|e| format!("send a response: {e}"))
}

/// A receiver of its own: answers each request, refuses the one numbered
/// `refuse_at`, and with `fault` asks for every page when the state comes.
/// On any error it shuts its sockets, so the daemon does not wait.
fn receive(
    main: &UnixStream,
    fault: Option<&UnixStream>,
    refuse_at: Option<usize>,
) -> Result<Received, String> {
    let got = receive_steps(main, fault, refuse_at);
    if got.is_err() {
        let _ = main.shutdown(std::net::Shutdown::Both);
        if let Some(f) = fault {
            let _ = f.shutdown(std::net::Shutdown::Both);
        }
    }
    got
}

fn receive_steps(
    main: &UnixStream,
    fault: Option<&UnixStream>,
    refuse_at: Option<usize>,
) -> Result<Received, String> {
    let mut got = Received {
        memory: Vec::new(),
        config: Vec::new(),
        state: Vec::new(),
        paused: false,
        faults: 0,
    };
    for n in 0.. {
        let mut head = [0u8; HEADER_SIZE];
        let mut fds = Vec::new();
        read_exact(main, &mut head, &mut fds)?;
        let h = RequestHeader::decode(&head).map_err(|e| e.to_string())?;
        if h.length > 1 << 20 {
            return Err(format!("a {:?} of {} bytes", h.command, h.length));
        }
        let mut payload = vec![0u8; h.length as usize];
        read_exact(main, &mut payload, &mut fds)?;
        if refuse_at == Some(n) {
            respond(main, false)?;
            return Err(format!("refused {:?} as the soak asked", h.command));
        }
        match h.command {
            Command::MemoryFd => {
                let slot = payload
                    .get(..4)
                    .and_then(|b| b.try_into().ok())
                    .map(u32::from_le_bytes)
                    .ok_or("a MemoryFd without its slot")?;
                let fd = fds.pop().ok_or("a MemoryFd without its fd")?;
                got.memory.push((slot, fd));
            }
            Command::Config => got.config = payload,
            Command::State => {
                got.state = payload;
                if let Some(fault) = fault {
                    got.faults = fault_every_page(fault, &got.config)?;
                }
            }
            Command::Complete | Command::CompletePaused => {
                got.paused = h.command == Command::CompletePaused;
                respond(main, true)?;
                return Ok(got);
            }
            _ => {}
        }
        respond(main, true)?;
    }
    Err("no end".into())
}

/// On the fault connection the daemon announced: asks for every page of
/// every slot (the configuration's zones say the page size), then closes
/// it, as a receiver that has all its memory does. Returns the faults.
fn fault_every_page(fault: &UnixStream, config: &[u8]) -> Result<u64, String> {
    let mut role = [0u8; 2];
    read_exact(fault, &mut role, &mut Vec::new())?;
    if u16::from_le_bytes(role) != FAULT_CONNECTION_ROLE {
        return Err(format!("the fault connection announced role {role:?}"));
    }
    let value: serde_json::Value =
        serde_json::from_slice(config).map_err(|e| format!("the configuration: {e}"))?;
    let memory = value.pointer("/vm_config/memory");
    let hugetlb = memory
        .and_then(|m| m.get("hugepages"))
        .and_then(serde_json::Value::as_bool)
        == Some(true);
    let page = match memory.and_then(|m| m.get("hugepage_size")) {
        Some(size) if hugetlb => size.as_u64().ok_or("hugepage_size")?,
        _ => 4096,
    };
    let slots = migration_config_slots(config, 64).map_err(|e| e.to_string())?;
    let mut faults = 0;
    for s in &slots {
        let mut at = 0;
        while at < s.size {
            let len = page.min(s.size - at);
            let mut payload = [0u8; 16];
            payload[..8].copy_from_slice(&(s.gpa + at).to_le_bytes());
            payload[8..].copy_from_slice(&len.to_le_bytes());
            let head = RequestHeader::new(Command::PageFault, 16).encode();
            let sent =
                hugemem_client::proto::socket::send_all(fault.as_fd(), &head, &[]).and_then(|()| {
                    hugemem_client::proto::socket::send_all(fault.as_fd(), &payload, &[])
                });
            sent.map_err(|e| format!("send a PageFault: {e}"))?;
            let mut answer = [0u8; HEADER_SIZE];
            read_exact(fault, &mut answer, &mut Vec::new())?;
            if !Response::decode(&answer).is_ok_and(|r| r.ok) {
                return Err(format!(
                    "the fault at {:#x} (+{len:#x}) was refused",
                    s.gpa + at
                ));
            }
            faults += 1;
            at += len;
        }
    }
    let _ = fault.shutdown(std::net::Shutdown::Both);
    Ok(faults)
}
