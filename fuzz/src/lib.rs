//! The fuzz targets' bodies, shared by the cargo-fuzz binaries
//! (`fuzz_targets/*.rs`) and the stable driver (`src/bin/stable.rs`).
//!
//! Each body must never panic on any input: a panic is a finding.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::OnceLock;

use backend::proto::{Code, Header, ProtoError, Reply, Request, HEADER_SIZE};

/// Every request code, for targets that pick one from the input.
const CODES: [Code; 8] = [
    Code::Handshake,
    Code::Alloc,
    Code::Free,
    Code::Lock,
    Code::Unlock,
    Code::Rebalance,
    Code::Stats,
    Code::Uffd,
];

/// `Header::decode` on the first 16 bytes, then `Request::decode` and
/// `Reply::decode` of the rest under the header's code (or, when the header
/// is refused, under a code picked from the first byte). Whatever decodes
/// must encode and decode back to itself.
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
        Err(_) => CODES[usize::from(head[0]) % CODES.len()],
    };
    if let Ok(req) = Request::decode(code, payload) {
        assert_eq!(req.code(), code);
        let again = Request::decode(code, &req.encode()).expect("a decoded request re-decodes");
        assert_eq!(again, req);
        assert!(req.expected_fds() <= 1);
    }
    if let Ok(rep) = Reply::decode(code, payload) {
        let again = Reply::decode(code, &rep.encode()).expect("a decoded reply re-decodes");
        assert_eq!(again, rep);
    }
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .expect("runtime")
    })
}

/// The daemon's frame reader (`proto::async_io::read_frame`) over a
/// socketpair carrying the input bytes, then EOF: frames are read until an
/// error; each must be a checked header with exactly its payload, and the
/// reader must end with EOF or a decoding error, never hang or panic.
pub fn frames(data: &[u8]) {
    let (mut tx, rx) = UnixStream::pair().expect("socketpair");
    // The socket buffer (>= 200 KiB) holds any input libFuzzer makes here
    // (-max_len is set well below it); a larger one is cut, not blocked on.
    tx.set_nonblocking(true).expect("nonblocking");
    let n = tx.write(data).unwrap_or(0);
    drop(tx);
    rx.set_nonblocking(true).expect("nonblocking");
    let written = &data[..n];
    runtime().block_on(async move {
        let rx = tokio::net::UnixStream::from_std(rx).expect("register");
        let mut consumed = 0usize;
        loop {
            match backend::proto::async_io::read_frame(&rx).await {
                Ok(frame) => {
                    assert_eq!(frame.payload.len(), frame.header.size as usize);
                    assert!(frame.fds.is_empty());
                    consumed += HEADER_SIZE + frame.payload.len();
                    assert!(consumed <= written.len());
                    let at = consumed - HEADER_SIZE - frame.payload.len();
                    let head: &[u8; HEADER_SIZE] =
                        written[at..at + HEADER_SIZE].try_into().expect("16 bytes");
                    assert_eq!(Header::decode(head).expect("re-decodes"), frame.header);
                    // What the daemon does next with it.
                    let _ = Request::decode(frame.header.code, &frame.payload);
                }
                Err(ProtoError::Closed | ProtoError::UnexpectedEof) => break,
                Err(_) => break,
            }
        }
    });
}

/// The UFFD request path the daemon runs before touching a uffd: decode the
/// payload, then check the ranges against a fixed region table
/// (`backend::fault::check_uffd_ranges`). Accepted ranges must really fit.
pub fn uffd_request(data: &[u8]) {
    use backend::proto::RegionInfo;
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
    if backend::fault::check_uffd_ranges(&ranges, &regions).is_ok() {
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

/// Targets by name, for the stable driver.
pub const TARGETS: [(&str, Target); 3] = [
    ("decode", decode),
    ("frames", frames),
    ("uffd_request", uffd_request),
];
