//! The fuzz targets' bodies, shared by the cargo-fuzz binaries
//! (`fuzz_targets/*.rs`) and the stable driver (`src/bin/stable.rs`).
//!
//! Each body must never panic on any input: a panic is a finding.

use hugemem_client::proto::{Code, FrameReader, Header, Reply, Request, HEADER_SIZE, MAX_FDS};

/// `Header::decode` on the first 16 bytes, then `Request::decode` and
/// `Reply::decode` of the rest under the header's code (or, when the header
/// is refused, under a code picked from the first byte among
/// [`Code::ALL`], every code the protocol has). Whatever decodes must
/// encode and decode back to itself; a request must re-encode to the very
/// bytes it came from, and expect the fds the protocol's table gives its
/// code and flags.
pub fn decode(data: &[u8]) {
    let Some((head, payload)) = data.split_first_chunk::<HEADER_SIZE>() else {
        return;
    };
    let code = match Header::decode(head) {
        Ok(h) => {
            // Encoding a decoded header gives the same bytes.
            assert_eq!(&h.encode(), head);
            h.code
        }
        Err(_) => Code::ALL[usize::from(head[0]) % Code::ALL.len()],
    };
    if let Ok(req) = Request::decode(code, payload) {
        assert_eq!(req.code(), code);
        let bytes = req.encode();
        // So the flags below are the ones on the wire.
        assert_eq!(bytes, payload, "a decoded request re-encodes to its bytes");
        let again = Request::decode(code, &bytes).expect("a decoded request re-decodes");
        assert_eq!(again, req);
        check_fds(&req);
    }
    if let Ok(rep) = Reply::decode(code, payload) {
        let again = Reply::decode(code, &rep.encode()).expect("a decoded reply re-decodes");
        assert_eq!(again, rep);
    }
}

/// The fds a decoded request expects are what the protocol's table says
/// for its code and flags ([`Code::request_fds`]), and fit in one message
/// (the frame readers refuse more than [`MAX_FDS`]).
fn check_fds(req: &Request) {
    let rule = req.code().request_fds();
    let fds = req.expected_fds();
    assert_eq!(
        fds,
        rule.count(req.flags()),
        "{:?} with flags {:#x}: {rule:?}",
        req.code(),
        req.flags()
    );
    assert!(fds <= MAX_FDS, "{fds} fds in one message");
}

/// What a reader made of a byte stream: the frames (header, payload) in
/// order, and the error that ended it (EOF included), as text.
type Reading = (Vec<(Header, Vec<u8>)>, String);

/// Reads `data` as a peer's byte stream through [`FrameReader`], the
/// decoder the daemon's tokio reader and the blocking reader run: each read
/// fills at most `piece(room)` bytes of what the reader asks for (at least
/// one), then EOF.
fn read_stream(data: &[u8], mut piece: impl FnMut(usize) -> usize) -> Reading {
    let mut reader = FrameReader::new();
    let mut frames = Vec::new();
    let mut at = 0usize;
    loop {
        let room = reader.next_read().0.len();
        assert!(room > 0, "the reader asks for at least one byte");
        let n = piece(room).clamp(1, room).min(data.len() - at);
        let (used, result) = reader.feed(&data[at..at + n]);
        assert_eq!(used, n);
        at += n;
        match result {
            Ok(Some(frame)) => {
                assert!(frame.fds.is_empty());
                frames.push((frame.header, frame.payload));
            }
            Ok(None) => {}
            Err(e) => return (frames, e.to_string()),
        }
    }
}

/// The daemon's frame decoder ([`FrameReader`], which
/// `backend::proto::async_io::read_frame` and the blocking reader drive)
/// over the input as a byte stream, then EOF, frame after frame: once with
/// reads as large as the reader asks for, once with reads of sizes picked
/// from the input's length. Both must give the same frames and the same
/// final error; each frame must be a checked header (that re-decodes from
/// the bytes where it started) with exactly its payload, and the frames
/// must account for no more bytes than were sent. Each payload then goes
/// through `Request::decode`, what the daemon does next, and a request
/// that decodes must expect the fds the protocol's table gives it.
pub fn frames(data: &[u8]) {
    let whole = read_stream(data, |room| room);
    let mut x = (data.len() as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let split = read_stream(data, |room| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        1 + (x % room as u64) as usize
    });
    assert_eq!(
        whole, split,
        "the frames depend on how the reads split the bytes"
    );
    let mut at = 0usize;
    for (header, payload) in &whole.0 {
        assert_eq!(payload.len(), header.size as usize);
        let head: &[u8; HEADER_SIZE] = data[at..at + HEADER_SIZE].try_into().expect("16 bytes");
        assert_eq!(&Header::decode(head).expect("re-decodes"), header);
        at += HEADER_SIZE + payload.len();
        assert!(at <= data.len());
        if let Ok(req) = Request::decode(header.code, payload) {
            check_fds(&req);
        }
    }
}

/// The UFFD request path the daemon runs before touching a uffd: decode the
/// payload, then check the ranges against a fixed region table
/// (`hugemem_client::proto::check_uffd_ranges`, which the daemon's lazy-mode
/// handler calls). Accepted ranges must really fit.
pub fn uffd_request(data: &[u8]) {
    use hugemem_client::proto::RegionInfo;
    const M2: u64 = 2 << 20;
    const G1: u64 = 1 << 30;
    let regions = [
        RegionInfo {
            region_id: 1,
            guest_phys: 0,
            size: 64 * M2,
            page_size: M2,
            node: 0,
            flags: RegionInfo::FLAG_LAZY,
        },
        RegionInfo {
            region_id: 2,
            guest_phys: 64 * M2,
            size: 2 * G1,
            page_size: G1,
            node: 1,
            flags: RegionInfo::FLAG_LAZY,
        },
        RegionInfo {
            region_id: 3,
            guest_phys: 0,
            size: 8 * M2,
            page_size: M2,
            node: 0,
            flags: RegionInfo::FLAG_CLEAN,
        },
    ];
    let Ok(Request::Uffd { ranges, .. }) = Request::decode(Code::Uffd, data) else {
        return;
    };
    if hugemem_client::proto::check_uffd_ranges(&ranges, &regions).is_ok() {
        for r in &ranges {
            let g = regions
                .iter()
                .find(|g| g.region_id == r.region_id)
                .expect("known region");
            assert!(g.flags & RegionInfo::FLAG_LAZY != 0);
            assert!(r.len > 0 && r.offset + r.len <= g.size);
            assert_eq!((r.offset | r.len | r.vmm_addr) % g.page_size, 0);
        }
    }
}

/// A target body.
pub type Target = fn(&[u8]);

/// cloud-hypervisor's local-migration receiver (what a daemon runs on a
/// cloud-hypervisor's `send-migration` stream: `ch_migration::
/// SnapshotReader`): the input as a sequence of 16-byte request headers,
/// each followed by the payload the reader asked for. Accepted steps keep
/// the sequence's order and the limits; a refusal ends the sequence, as
/// it ends the connection.
pub fn ch_migration(data: &[u8]) {
    use ch_migration::{Limits, Next, RequestHeader, SnapshotReader, HEADER_SIZE};
    let limits = Limits {
        max_config: 4096,
        max_state: 4096,
        max_memory_fds: 4,
    };
    let mut reader = SnapshotReader::new(limits);
    let mut at = 0;
    let (mut fds, mut configs, mut states) = (0usize, 0, 0);
    while at + HEADER_SIZE <= data.len() {
        let head: &[u8; HEADER_SIZE] = data[at..at + HEADER_SIZE].try_into().expect("16 bytes");
        at += HEADER_SIZE;
        let Ok(header) = RequestHeader::decode(head) else {
            return;
        };
        assert_eq!(
            &header.encode(),
            head,
            "a decoded header re-encodes to its bytes"
        );
        let finished_before = reader.finished();
        let Ok(next) = reader.take(&header) else {
            return;
        };
        assert!(!finished_before, "nothing is taken after Complete");
        let payload = match next {
            Next::Nothing | Next::Done { .. } => 0,
            Next::MemoryFd => {
                fds += 1;
                4
            }
            Next::Config(n) => {
                configs += 1;
                assert!(n as u64 <= limits.max_config);
                n
            }
            Next::State(n) => {
                states += 1;
                assert!(n as u64 <= limits.max_state);
                assert_eq!(configs, 1, "the state comes after the configuration");
                n
            }
        };
        assert!(fds <= limits.max_memory_fds);
        assert!(configs <= 1 && states <= 1);
        at = at.saturating_add(payload).min(data.len());
    }
}

/// cloud-hypervisor's postcopy fault connection (what
/// `ch_migration::fault::serve_page_faults` runs on the `PageFault`s of a
/// receiving cloud-hypervisor: `ch_migration::fault::FaultDecoder`) over a
/// fixed slot table: the input as request headers, each `PageFault`
/// followed by its 16-byte `MemoryRange`. Every accepted fault lies inside
/// one slot, page aligned, at most the largest page, its file offset
/// where the slot puts it; nothing is taken after `Abandon`.
pub fn ch_fault(data: &[u8]) {
    use ch_migration::fault::{
        FaultDecoder, FaultStep, MAX_FAULT_LENGTH, MEMORY_RANGE_SIZE,
    };
    use ch_migration::slots::SlotRange;
    use ch_migration::{RequestHeader, HEADER_SIZE};
    let slots = [
        SlotRange {
            slot: 0,
            gpa: 0,
            size: 0x20_0000,
            file_offset: 0,
        },
        SlotRange {
            slot: 7,
            gpa: 0x1_0000_0000,
            size: 0x4000_0000,
            file_offset: 0x20_0000,
        },
    ];
    let mut decoder = FaultDecoder::new(&slots).expect("a valid table");
    let mut at = 0;
    while at + HEADER_SIZE <= data.len() {
        let head: &[u8; HEADER_SIZE] = data[at..at + HEADER_SIZE].try_into().expect("16 bytes");
        at += HEADER_SIZE;
        let Ok(header) = RequestHeader::decode(head) else {
            return;
        };
        let ended_before = decoder.ended();
        let Ok(step) = decoder.take_header(&header) else {
            return;
        };
        assert!(!ended_before, "nothing is taken after Abandon");
        if step == FaultStep::Abandon {
            continue;
        }
        let Some(range) = data.get(at..at + MEMORY_RANGE_SIZE) else {
            return;
        };
        at += MEMORY_RANGE_SIZE;
        let Ok(fault) = decoder.take_range(range.try_into().expect("16 bytes")) else {
            continue;
        };
        let slot = slots
            .iter()
            .find(|s| s.slot == fault.slot)
            .expect("a known slot");
        assert!(fault.length > 0 && fault.length <= MAX_FAULT_LENGTH);
        assert_eq!((fault.gpa | fault.length) % 4096, 0);
        assert!(fault.gpa >= slot.gpa && fault.gpa + fault.length <= slot.gpa + slot.size);
        assert_eq!(fault.offset_in_slot, fault.gpa - slot.gpa);
        assert_eq!(fault.file_offset, slot.file_offset + fault.offset_in_slot);
    }
}

/// Targets by name, for the stable driver.
pub const TARGETS: [(&str, Target); 5] = [
    ("decode", decode),
    ("frames", frames),
    ("uffd_request", uffd_request),
    ("ch_migration", ch_migration),
    ("ch_fault", ch_fault),
];
