use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::os::unix::net::{UnixListener, UnixStream};

use super::fault::*;
use super::postcopy::{open_fault_connection, restore_postcopy, PostcopySnapshot};
use super::slots::{check_slots, SlotRange};
use super::*;

const SLOTS: [SlotRange; 2] = [
    SlotRange {
        slot: 0,
        gpa: 0,
        size: 0x20_0000,
        file_offset: 0,
    },
    SlotRange {
        slot: 3,
        gpa: 0x1_0000_0000,
        size: 0x40_0000,
        file_offset: 0x20_0000,
    },
];

fn range(gpa: u64, length: u64) -> [u8; MEMORY_RANGE_SIZE] {
    let mut out = [0; MEMORY_RANGE_SIZE];
    out[..8].copy_from_slice(&gpa.to_le_bytes());
    out[8..].copy_from_slice(&length.to_le_bytes());
    out
}

fn fault(gpa: u64, length: u64) -> Result<FaultRequest, ChMigrationError> {
    let mut d = FaultDecoder::new(&SLOTS).expect("slots");
    let h = RequestHeader::new(Command::PageFault, MEMORY_RANGE_SIZE as u64);
    assert_eq!(d.take_header(&h).expect("header"), FaultStep::Range);
    d.take_range(&range(gpa, length))
}

#[test]
fn a_fault_maps_onto_its_slot_and_file_offset() {
    let f = fault(0x1_0020_0000, 0x20_0000).expect("inside slot 3");
    assert_eq!(
        f,
        FaultRequest {
            slot: 3,
            gpa: 0x1_0020_0000,
            length: 0x20_0000,
            offset_in_slot: 0x20_0000,
            file_offset: 0x40_0000,
        }
    );
    assert_eq!(fault(0x1000, 0x1000).expect("slot 0").file_offset, 0x1000);
}

#[test]
fn hostile_ranges_are_refused() {
    let cases = [
        (0, 0, "empty"),
        (0x800, 0x1000, "unaligned gpa"),
        (0, 0x800, "unaligned length"),
        (0, (1 << 30) + 4096, "over 1 GiB"),
        (0x8000_0000, 0x1000, "beyond every slot"),
        (u64::MAX - 0xfff, 0x1000, "gpa + length overflows"),
        (0x1F_F000, 0x2000, "spans slot 0's end"),
        (0x1_0040_0000, 0x1000, "just past slot 3"),
    ];
    for (gpa, length, what) in cases {
        match fault(gpa, length) {
            Err(ChMigrationError::BadFault { .. }) => {}
            other => panic!("{what}: {other:?}"),
        }
    }
}

#[test]
fn only_page_faults_and_abandon_come_on_the_fault_connection() {
    let mut d = FaultDecoder::new(&SLOTS).expect("slots");
    for c in [
        Command::Start,
        Command::Config,
        Command::State,
        Command::Memory,
    ] {
        assert!(matches!(
            d.take_header(&RequestHeader::new(c, 0)),
            Err(ChMigrationError::OutOfOrder { .. })
        ));
    }
    for bad_len in [0, 15, 17, u64::MAX] {
        assert!(matches!(
            d.take_header(&RequestHeader::new(Command::PageFault, bad_len)),
            Err(ChMigrationError::TooLarge { .. })
        ));
    }
    assert!(
        d.take_range(&range(0, 4096)).is_err(),
        "a range when none is due"
    );
    assert!(d
        .take_header(&RequestHeader::new(Command::Abandon, 1))
        .is_err());
    assert_eq!(
        d.take_header(&RequestHeader::new(Command::Abandon, 0))
            .expect("abandon"),
        FaultStep::Abandon
    );
    assert!(d.ended());
    assert!(d
        .take_header(&RequestHeader::new(Command::PageFault, 16))
        .is_err());
}

#[test]
fn slot_tables_are_checked() {
    let s = |slot, gpa, size, file_offset| SlotRange {
        slot,
        gpa,
        size,
        file_offset,
    };
    assert!(check_slots(&SLOTS, 64).is_ok());
    for (table, what) in [
        (vec![s(0, 0, 0, 0)], "empty"),
        (vec![s(0, 0x800, 0x1000, 0)], "unaligned"),
        (vec![s(0, u64::MAX - 0xfff, 0x2000, 0)], "gpa overflow"),
        (vec![s(0, 0, 0x2000, u64::MAX - 0xfff)], "file overflow"),
        (
            vec![s(0, 0, 0x2000, 0), s(0, 0x2000, 0x1000, 0)],
            "same slot",
        ),
        (vec![s(0, 0, 0x2000, 0), s(1, 0x1000, 0x1000, 0)], "overlap"),
    ] {
        assert!(
            matches!(
                check_slots(&table, 64),
                Err(ChMigrationError::BadSlot { .. })
            ),
            "{what}"
        );
    }
    assert!(matches!(
        check_slots(&SLOTS, 1),
        Err(ChMigrationError::TooManyFds(1))
    ));
}

fn page_fault(sock: &UnixStream, gpa: u64, length: u64) -> Response {
    let h = RequestHeader::new(Command::PageFault, MEMORY_RANGE_SIZE as u64);
    let mut w = sock;
    std::io::Write::write_all(&mut w, &h.encode()).expect("header");
    std::io::Write::write_all(&mut w, &range(gpa, length)).expect("range");
    let mut answer = [0u8; HEADER_SIZE];
    std::io::Read::read_exact(&mut w, &mut answer).expect("answer");
    assert_eq!(&answer[8..], &[0; 8], "no payload with shared memory");
    Response::decode(&answer).expect("response")
}

#[test]
fn the_serve_loop_fills_each_fault_and_ends_on_close_or_abandon() {
    for abandon in [false, true] {
        let (ch, ours) = UnixStream::pair().expect("pair");
        let server = std::thread::spawn(move || {
            let mut seen = Vec::new();
            let stats = serve_page_faults(&ours, &SLOTS, |f| {
                seen.push(f);
                Ok::<_, std::io::Error>(())
            })
            .expect("serve");
            (stats, seen)
        });
        assert!(page_fault(&ch, 0x1_0000_0000, 0x20_0000).ok);
        assert!(page_fault(&ch, 0x1000, 0x1000).ok);
        if abandon {
            let mut w = &ch;
            std::io::Write::write_all(&mut w, &RequestHeader::new(Command::Abandon, 0).encode())
                .expect("abandon");
            let mut answer = [0u8; HEADER_SIZE];
            std::io::Read::read_exact(&mut w, &mut answer).expect("answer");
            assert!(Response::decode(&answer).expect("response").ok);
        } else {
            drop(ch);
        }
        let (stats, seen) = server.join().expect("join");
        assert_eq!(stats.faults, 2);
        assert_eq!(stats.bytes, 0x20_1000);
        assert_eq!((stats.min_length, stats.max_length), (0x1000, 0x20_0000));
        assert_eq!(stats.abandoned, abandon);
        assert_eq!(seen[0].slot, 3);
        assert_eq!(seen[1].file_offset, 0x1000);
    }
}

#[test]
fn a_bad_fault_or_a_failed_fill_is_answered_with_an_error() {
    let (ch, ours) = UnixStream::pair().expect("pair");
    let server = std::thread::spawn(move || {
        serve_page_faults(&ours, &SLOTS, |_| Ok::<_, std::io::Error>(()))
    });
    assert!(!page_fault(&ch, 0x8000_0000, 0x1000).ok);
    assert!(matches!(
        server.join().expect("join"),
        Err(FaultServeError::Protocol(ChMigrationError::BadFault { .. }))
    ));

    let (ch, ours) = UnixStream::pair().expect("pair");
    let server = std::thread::spawn(move || {
        serve_page_faults(&ours, &SLOTS, |_| {
            Err(std::io::Error::other("the disk is gone"))
        })
    });
    assert!(!page_fault(&ch, 0, 0x1000).ok);
    assert!(matches!(
        server.join().expect("join"),
        Err(FaultServeError::Fill { gpa: 0, .. })
    ));
}

#[test]
fn an_fd_on_the_fault_connection_is_refused() {
    let (ch, ours) = UnixStream::pair().expect("pair");
    let memfd =
        nix::sys::memfd::memfd_create(c"x", nix::sys::memfd::MFdFlags::MFD_CLOEXEC).expect("memfd");
    let h = RequestHeader::new(Command::PageFault, MEMORY_RANGE_SIZE as u64);
    crate::sys::send_all(ch.as_fd(), &h.encode(), &[memfd.as_fd()]).expect("send");
    assert!(matches!(
        serve_page_faults(&ours, &SLOTS, |_| Ok::<_, std::io::Error>(())),
        Err(FaultServeError::Protocol(ChMigrationError::FdCount(1)))
    ));
}

/// The sender's next request on `main`: its header (the payload is read
/// and dropped; fds it carried go on `fds`).
fn next_request(main: &UnixStream, fds: &mut Vec<std::os::fd::OwnedFd>) -> RequestHeader {
    let mut head = [0u8; HEADER_SIZE];
    wire::read_exact(main, &mut head, fds, "header").expect("header");
    let h = RequestHeader::decode(&head).expect("decode");
    let mut payload = vec![0u8; h.length as usize];
    wire::read_exact(main, &mut payload, fds, "payload").expect("payload");
    h
}

/// The fault connection the sender opens on `listener`, and the role it
/// announced on it.
fn accept_fault_connection(listener: &UnixListener) -> (UnixStream, u16) {
    let (fault, _) = listener.accept().expect("fault connection");
    let mut role = [0u8; 2];
    std::io::Read::read_exact(&mut &fault, &mut role).expect("role");
    (fault, u16::from_le_bytes(role))
}

/// A receiver as cloud-hypervisor's postcopy one behaves: it takes the
/// snapshot on the main connection and, when the state is due, the
/// announced fault connection, asks for every page of its one slot and
/// finds each filled, then closes the fault connection.
fn fake_postcopy_receiver(listener: UnixListener, page: u64, size: u64) -> u64 {
    let (main, _) = listener.accept().expect("main");
    let mut fds = Vec::new();
    let mut memfd = None;
    loop {
        let h = next_request(&main, &mut fds);
        if h.command == Command::MemoryFd {
            memfd = fds.pop();
        }
        if h.command == Command::State {
            let (fault, role) = accept_fault_connection(&listener);
            assert_eq!(role, FAULT_CONNECTION_ROLE);
            let file = std::fs::File::from(memfd.take().expect("a memory fd"));
            let mut buf = vec![0u8; page as usize];
            for at in (0..size).step_by(page as usize) {
                assert!(page_fault(&fault, 0x10_0000 + at, page).ok);
                file.read_exact_at(&mut buf, 0x1000 + at).expect("read");
                assert!(buf.iter().all(|b| *b == (at / page) as u8 + 1));
            }
            drop(fault);
        }
        wire::respond(&main, true).expect("answer");
        if h.command == Command::Complete {
            return size / page;
        }
    }
}

#[test]
fn a_postcopy_restore_serves_faults_from_before_the_state_until_the_close() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("ch.sock");
    let listener = UnixListener::bind(&path).expect("bind");
    let (page, size) = (0x1000u64, 0x8000u64);
    let receiver = std::thread::spawn(move || fake_postcopy_receiver(listener, page, size));
    let memfd =
        nix::sys::memfd::memfd_create(c"x", nix::sys::memfd::MFdFlags::MFD_CLOEXEC).expect("memfd");
    let file = std::fs::File::from(memfd);
    file.set_len(0x1000 + size).expect("size");
    let slots = [SlotRange {
        slot: 0,
        gpa: 0x10_0000,
        size,
        file_offset: 0x1000,
    }];
    let sock = UnixStream::connect(&path).expect("connect");
    let memory = [(0u32, file.as_fd())];
    let report = restore_postcopy(
        &sock,
        || open_fault_connection(&path),
        PostcopySnapshot {
            memory: &memory,
            config: b"{}",
            state: b"{}",
            paused: false,
            slots: &slots,
        },
        |f: FaultRequest| {
            let fill = vec![(f.offset_in_slot / page) as u8 + 1; f.length as usize];
            file.write_all_at(&fill, f.file_offset)
        },
    )
    .expect("restore");
    assert_eq!(receiver.join().expect("join"), size / page);
    assert_eq!(report.faults.faults, size / page);
    assert!(!report.faults.abandoned);
}

#[test]
fn a_refused_fault_is_what_a_failed_postcopy_restore_reports() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("ch.sock");
    let listener = UnixListener::bind(&path).expect("bind");
    // A receiver that asks for a page outside every slot when the state
    // is due, then gives up on the main connection, as cloud-hypervisor
    // does when its fault handler fails.
    let receiver = std::thread::spawn(move || {
        let (main, _) = listener.accept().expect("main");
        let mut fds = Vec::new();
        loop {
            let h = next_request(&main, &mut fds);
            if h.command == Command::State {
                let (fault, _role) = accept_fault_connection(&listener);
                assert!(!page_fault(&fault, 0x4000_0000, 0x1000).ok);
                return;
            }
            wire::respond(&main, true).expect("answer");
        }
    });
    let sock = UnixStream::connect(&path).expect("connect");
    let result = restore_postcopy(
        &sock,
        || open_fault_connection(&path),
        PostcopySnapshot {
            memory: &[],
            config: b"{}",
            state: b"{}",
            paused: true,
            slots: &SLOTS,
        },
        |_| Ok::<_, std::io::Error>(()),
    );
    receiver.join().expect("join");
    assert!(
        matches!(
            result,
            Err(super::postcopy::PostcopyError::Serve(
                FaultServeError::Protocol(ChMigrationError::BadFault { .. })
            ))
        ),
        "{result:?}"
    );
}
