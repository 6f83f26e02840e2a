use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;

use super::peer::{receive_snapshot, send_snapshot};
use super::*;

fn memfd() -> OwnedFd {
    nix::sys::memfd::memfd_create(c"ch-migration-test", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
        .expect("memfd")
}

fn header(command: u16, length: u64) -> [u8; HEADER_SIZE] {
    let mut out = [0; HEADER_SIZE];
    out[..2].copy_from_slice(&command.to_le_bytes());
    out[8..].copy_from_slice(&length.to_le_bytes());
    out
}

/// Sends raw `bytes` (with `fds` on the first) and runs the receiver on the
/// other end; returns its result and the responses it sent.
fn receive_raw(
    chunks: &[(&[u8], Vec<OwnedFd>)],
    limits: Limits,
) -> (Result<peer::Snapshot, ChMigrationError>, Vec<bool>) {
    let (ours, theirs) = UnixStream::pair().expect("pair");
    for (bytes, fds) in chunks {
        let fds: Vec<_> = fds.iter().map(AsFd::as_fd).collect();
        crate::sys::send_all(ours.as_fd(), bytes, &fds).expect("send");
    }
    // The sender is done: the receiver sees the end after these bytes.
    ours.shutdown(std::net::Shutdown::Write).expect("shutdown");
    let result = receive_snapshot(&theirs, limits);
    drop(theirs);
    let mut answers = Vec::new();
    let mut buf = [0u8; HEADER_SIZE];
    while std::io::Read::read_exact(&mut &ours, &mut buf).is_ok() {
        answers.push(Response::decode(&buf).expect("a response").ok);
    }
    (result, answers)
}

#[test]
fn headers_round_trip() {
    for c in 1..=9 {
        let h = RequestHeader::new(Command::from_u16(c).expect("known"), 1234);
        assert_eq!(RequestHeader::decode(&h.encode()).expect("decode"), h);
    }
    assert!(matches!(
        RequestHeader::decode(&header(0, 0)),
        Err(ChMigrationError::UnknownCommand(0))
    ));
    assert!(matches!(
        RequestHeader::decode(&header(10, 0)),
        Err(ChMigrationError::UnknownCommand(10))
    ));
    for ok in [true, false] {
        assert_eq!(
            Response::decode(&Response { ok }.encode())
                .expect("decode")
                .ok,
            ok
        );
    }
}

#[test]
fn a_snapshot_goes_from_sender_to_receiver_with_its_fds() {
    let (a, b) = UnixStream::pair().expect("pair");
    let (m0, m1) = (memfd(), memfd());
    nix::unistd::ftruncate(&m1, 8192).expect("size");
    let sender = std::thread::spawn(move || {
        let memory = [(0, m0.as_fd()), (3, m1.as_fd())];
        send_snapshot(&a, &memory, b"{\"cpus\":1}", &[7u8; 1000], true)
    });
    let got = receive_snapshot(&b, Limits::default()).expect("receive");
    sender.join().expect("join").expect("send");
    assert_eq!(got.memory.len(), 2);
    assert_eq!(got.memory[0].0, 0);
    assert_eq!(got.memory[1].0, 3);
    let size = nix::sys::stat::fstat(&got.memory[1].1)
        .expect("fstat")
        .st_size;
    assert_eq!(size, 8192, "the fd is the sender's file");
    assert_eq!(got.config, b"{\"cpus\":1}");
    assert_eq!(got.state, vec![7u8; 1000]);
    assert!(got.paused);
}

#[test]
fn a_sequence_out_of_order_is_refused() {
    let (r, answers) = receive_raw(&[(&header(2, 2), Vec::new())], Limits::default());
    assert!(
        matches!(
            r,
            Err(ChMigrationError::OutOfOrder {
                command: Command::Config,
                expected: "Start"
            })
        ),
        "{r:?}"
    );
    assert_eq!(answers, [false]);
    let start = header(1, 0);
    let (r, answers) = receive_raw(
        &[(&start, Vec::new()), (&header(3, 0), Vec::new())],
        Limits::default(),
    );
    assert!(
        matches!(r, Err(ChMigrationError::OutOfOrder { .. })),
        "{r:?}"
    );
    assert_eq!(answers, [true, false]);
}

#[test]
fn ram_contents_and_page_faults_are_not_part_of_a_snapshot() {
    let start = header(1, 0);
    for command in [4, 9] {
        let (r, _) = receive_raw(
            &[(&start, Vec::new()), (&header(command, 16), Vec::new())],
            Limits::default(),
        );
        assert!(matches!(r, Err(ChMigrationError::Unsupported(_))), "{r:?}");
    }
}

#[test]
fn an_oversized_part_is_refused_before_it_is_read() {
    let start = header(1, 0);
    let limits = Limits {
        max_config: 100,
        ..Limits::default()
    };
    // The announced length alone: no payload follows, none is waited for.
    let (r, answers) = receive_raw(
        &[(&start, Vec::new()), (&header(2, u64::MAX), Vec::new())],
        limits,
    );
    assert!(
        matches!(
            r,
            Err(ChMigrationError::TooLarge {
                what: "a configuration",
                ..
            })
        ),
        "{r:?}"
    );
    assert_eq!(answers, [true, false]);
}

#[test]
fn memory_fds_are_checked() {
    let start = header(1, 0);
    let fd_request = header(7, 4);
    let slot = 0u32.to_le_bytes();
    // No fd with the slot.
    let (r, _) = receive_raw(
        &[
            (&start, Vec::new()),
            (&fd_request, Vec::new()),
            (&slot, Vec::new()),
        ],
        Limits::default(),
    );
    assert!(matches!(r, Err(ChMigrationError::FdCount(0))), "{r:?}");
    // A slot payload that is not a u32.
    let (r, _) = receive_raw(
        &[(&start, Vec::new()), (&header(7, 8), Vec::new())],
        Limits::default(),
    );
    assert!(matches!(r, Err(ChMigrationError::TooLarge { .. })), "{r:?}");
    // The same slot twice.
    let (r, _) = receive_raw(
        &[
            (&start, Vec::new()),
            (&fd_request, Vec::new()),
            (&slot, vec![memfd()]),
            (&fd_request, Vec::new()),
            (&slot, vec![memfd()]),
        ],
        Limits::default(),
    );
    assert!(
        matches!(r, Err(ChMigrationError::DuplicateSlot(0))),
        "{r:?}"
    );
    // More slots than the limit.
    let limits = Limits {
        max_memory_fds: 1,
        ..Limits::default()
    };
    let one = 1u32.to_le_bytes();
    let (r, _) = receive_raw(
        &[
            (&start, Vec::new()),
            (&fd_request, Vec::new()),
            (&slot, vec![memfd()]),
            (&fd_request, Vec::new()),
            (&one, vec![memfd()]),
        ],
        limits,
    );
    assert!(matches!(r, Err(ChMigrationError::TooManyFds(1))), "{r:?}");
    // An fd where none belongs (on a header).
    let (r, _) = receive_raw(&[(&start, vec![memfd()])], Limits::default());
    assert!(matches!(r, Err(ChMigrationError::FdCount(1))), "{r:?}");
}

#[test]
fn a_sender_that_stops_mid_sequence_or_speaks_another_version_is_refused() {
    let start = header(1, 0);
    let (r, _) = receive_raw(
        &[
            (&start, Vec::new()),
            (&header(2, 10), Vec::new()),
            (b"{\"a\"", Vec::new()),
        ],
        Limits::default(),
    );
    assert!(matches!(r, Err(ChMigrationError::Closed(_))), "{r:?}");
    let mut v1 = header(1, 0);
    v1[2] = 1;
    let (r, _) = receive_raw(&[(&v1, Vec::new())], Limits::default());
    assert!(matches!(r, Err(ChMigrationError::Version(1))), "{r:?}");
    let (r, _) = receive_raw(
        &[(&start, Vec::new()), (&header(6, 0), Vec::new())],
        Limits::default(),
    );
    assert!(
        matches!(r, Err(ChMigrationError::Closed("with Abandon"))),
        "{r:?}"
    );
}
