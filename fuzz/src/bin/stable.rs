//! A stable-toolchain driver for the fuzz targets, for machines where
//! cargo-fuzz cannot run: random inputs and structure-aware mutations of
//! valid messages, each target body under `catch_unwind`; a panic is a
//! finding, saved under `artifacts/<target>/`.
//!
//! ```text
//! stable <target> <seconds> [seed]      run one target for a bounded time
//! stable --write-seeds <dir>            write the seed corpus (dir/<target>/)
//! ```
//!
//! Prints one line: `target=… execs=… crashes=… seconds=… execs_per_s=…`.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::time::{Duration, Instant};

use hugemem_client::proto::{
    AllocPart, AllocRequest, ClearMode, Code, Header, PagePolicy, RegionInfo, Reply, ReplyBody,
    Request, Status, UffdRange, MAX_PARK_NAME,
};
use hugemem_fuzz::TARGETS;

/// xorshift64*: small, seedable, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

/// Valid messages: every request and every reply a client decodes, each
/// framed with its header (the decode and frames targets read the
/// header), and cloud-hypervisor's migration and fault streams. Every code
/// of the protocol ([`Code::ALL`]) has a request and a reply among them,
/// or this panics (and `scripts/fuzz` fails): a new code gets seeds.
fn seeds() -> Vec<Vec<u8>> {
    let requests = requests();
    let replies = replies();
    for code in Code::ALL {
        assert!(
            requests.iter().any(|r| r.code() == code),
            "no request seed for {code:?}"
        );
        assert!(
            replies.iter().any(|(c, _)| *c == code),
            "no reply seed for {code:?}"
        );
    }
    let mut out = framed_requests(&requests);
    out.extend(framed_replies(&replies));
    out.extend(ch_migration_seeds());
    out
}

/// Every request: ALLOC with and without paths, parts and a wait; PARK,
/// RESTORE, UNPARK and HANDOFF with every flags word the decoder accepts
/// (found by decoding them all, so a flag added later is seeded too).
fn requests() -> Vec<Request> {
    let alloc = AllocRequest {
        total_size: 4 << 30,
        page_policy: PagePolicy::Best,
        clear_mode: ClearMode::Lazy,
        lock: true,
        parts: vec![
            AllocPart {
                node: 0,
                size: 2 << 30,
            },
            AllocPart {
                node: 1,
                size: 2 << 30,
            },
        ],
        want_paths: false,
    };
    let mut out = vec![
        Request::Handshake {
            min_version: 1,
            max_version: 1,
            features: 0x1f,
        },
        Request::Free { alloc_id: 9 },
        Request::Lock {
            alloc_id: 9,
            chunk: 8 << 20,
        },
        Request::Unlock {
            alloc_id: 9,
            chunk: 0,
        },
        Request::Rebalance {
            region_id: 2,
            offset: 0,
            len: 1 << 30,
            node: 1,
        },
        Request::Stats,
        uffd_request(),
        Request::Reattach {
            alloc_id: 9,
            token: [0x5a; 16],
        },
    ];
    for (want_paths, wait_ms) in [
        (false, None),
        (true, None),
        (false, Some(0)),
        (true, Some(2500)),
    ] {
        let parts = if want_paths {
            Vec::new()
        } else {
            alloc.parts.clone()
        };
        out.push(Request::Alloc {
            req: AllocRequest {
                want_paths,
                parts,
                ..alloc.clone()
            },
            wait_ms,
        });
    }
    let longest = "v".repeat(MAX_PARK_NAME);
    for name in ["vm-1", "Guest_7.b", longest.as_str()] {
        let mut named = u32::try_from(name.len())
            .expect("a short name")
            .to_le_bytes()
            .to_vec();
        named.extend_from_slice(name.as_bytes());
        for code in [
            Code::Park,
            Code::Restore,
            Code::Unpark,
            Code::Export,
            Code::Clone,
        ] {
            out.extend(every_flags_word(code, &named, &[]));
        }
    }
    let mut handoff = 9u64.to_le_bytes().to_vec();
    handoff.extend_from_slice(&[0x5b; 16]);
    out.extend(every_flags_word(
        Code::Handoff,
        &handoff,
        &0u32.to_le_bytes(),
    ));
    out
}

/// A UFFD request over two regions.
fn uffd_request() -> Request {
    Request::Uffd {
        alloc_id: 7,
        ranges: vec![
            UffdRange {
                region_id: 1,
                offset: 0,
                vmm_addr: 0x7f00_0000_0000,
                len: 32 << 20,
            },
            UffdRange {
                region_id: 2,
                offset: 1 << 30,
                vmm_addr: 0x7e00_0000_0000,
                len: 1 << 30,
            },
        ],
    }
}

/// Each request of `code` whose payload is `before`, a `u32` flags word,
/// then `after`, that decodes: every combination of the low 8 flag bits,
/// and each higher bit alone.
fn every_flags_word(code: Code, before: &[u8], after: &[u8]) -> Vec<Request> {
    (0..=0xffu32)
        .chain((8..32).map(|bit| 1 << bit))
        .filter_map(|flags| {
            let mut payload = before.to_vec();
            payload.extend_from_slice(&flags.to_le_bytes());
            payload.extend_from_slice(after);
            Request::decode(code, &payload).ok()
        })
        .collect()
}

/// Each request framed with its header, alone and twice back to back
/// (for the frame reader), and its bare payload (the UFFD target reads one).
fn framed_requests(requests: &[Request]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for (i, r) in requests.iter().enumerate() {
        let payload = r.encode();
        let id = u32::try_from(i).expect("a few requests");
        let h = Header::request(r.code(), id, payload.len()).expect("header");
        let mut m = h.encode().to_vec();
        m.extend_from_slice(&payload);
        let mut twice = m.clone();
        twice.extend_from_slice(&m);
        out.push(m);
        out.push(twice);
        out.push(payload);
    }
    out
}

/// Every reply a client decodes: each code's success body, the ALLOC
/// body (ALLOC, HANDOFF, RESTORE) with every combination of its flags
/// (paths, token), and errors.
fn replies() -> Vec<(Code, Reply)> {
    let region = RegionInfo {
        region_id: 1,
        guest_phys: 0,
        size: 1 << 30,
        page_size: 1 << 30,
        node: 0,
        flags: 3,
    };
    let lock = ReplyBody::Lock {
        bytes: 4 << 30,
        micros: 1500,
    };
    let mut out = vec![
        (
            Code::Handshake,
            Reply::ok(ReplyBody::Handshake {
                version: 1,
                features: 0x1f,
            }),
        ),
        (Code::Free, Reply::ok(ReplyBody::Empty)),
        (Code::Lock, Reply::ok(lock.clone())),
        (Code::Unlock, Reply::ok(lock)),
        (
            Code::Rebalance,
            Reply::ok(ReplyBody::Rebalance {
                pages_moved: 511,
                pages_failed: 1,
            }),
        ),
        (
            Code::Stats,
            Reply::ok(ReplyBody::Stats {
                json: "{\"a\":1}".into(),
            }),
        ),
        (Code::Uffd, Reply::ok(ReplyBody::Empty)),
        (
            Code::Uffd,
            Reply::error(Status::Invalid, "range 0 runs past region 1"),
        ),
        (
            Code::Reattach,
            Reply::ok(ReplyBody::Reattach {
                alloc_id: 5,
                regions: vec![region, region],
            }),
        ),
        (
            Code::Park,
            Reply::ok(ReplyBody::Parked {
                alloc_id: 6,
                bytes: 2 << 30,
                copied_bytes: 1 << 30,
                slots: 2,
            }),
        ),
        (Code::Unpark, Reply::ok(ReplyBody::Empty)),
        (
            Code::Export,
            Reply::ok(ReplyBody::Exported {
                alloc_id: 7,
                bytes: 4 << 30,
                page_size: 1 << 30,
                parked_at: 1_764_336_000,
                slots: 2,
            }),
        ),
        (
            Code::Clone,
            Reply::ok(ReplyBody::Exported {
                alloc_id: 7,
                bytes: 4 << 30,
                page_size: 1 << 30,
                parked_at: 1_764_336_000,
                slots: 2,
            }),
        ),
        (
            Code::Restore,
            Reply::error(Status::NotFound, "no parked VM vm-1"),
        ),
    ];
    for code in [Code::Alloc, Code::Handoff, Code::Restore] {
        for (with_paths, token) in [
            (false, None),
            (true, None),
            (false, Some([0xa5; 16])),
            (true, Some([0x5b; 16])),
        ] {
            let paths = if with_paths {
                vec!["/dev/hugepages/a".into(), "/dev/hugepages/b".into()]
            } else {
                Vec::new()
            };
            let body = ReplyBody::Alloc {
                alloc_id: 5,
                regions: vec![region, region],
                paths,
                token,
            };
            out.push((code, Reply::ok(body)));
        }
    }
    out
}

/// Each reply framed with its header.
fn framed_replies(replies: &[(Code, Reply)]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for (code, rep) in replies {
        let payload = rep.encode();
        let req = Header::request(*code, 1, 0).expect("header");
        let mut m = Header::reply_to(&req, payload.len())
            .expect("header")
            .encode()
            .to_vec();
        m.extend_from_slice(&payload);
        out.push(m);
    }
    out
}

/// A whole local-migration sequence (the ch_migration target) and a fault
/// connection's requests (the ch_fault target).
fn ch_migration_seeds() -> Vec<Vec<u8>> {
    use ch_migration::{Command, RequestHeader};
    let mut m = Vec::new();
    let mut push = |c: Command, payload: &[u8]| {
        m.extend_from_slice(&RequestHeader::new(c, payload.len() as u64).encode());
        m.extend_from_slice(payload);
    };
    push(Command::Start, &[]);
    push(Command::MemoryFd, &0u32.to_le_bytes());
    push(Command::MemoryFd, &1u32.to_le_bytes());
    push(Command::Config, b"{\"vm_config\":{}}");
    push(Command::State, &[0x5c; 64]);
    push(Command::Complete, &[]);
    let mut f = Vec::new();
    let mut fault = |gpa: u64, length: u64| {
        f.extend_from_slice(&RequestHeader::new(Command::PageFault, 16).encode());
        f.extend_from_slice(&gpa.to_le_bytes());
        f.extend_from_slice(&length.to_le_bytes());
    };
    fault(0, 0x20_0000);
    fault(0x1_0000_0000, 0x20_0000);
    fault(0x1_3fe0_0000, 0x20_0000);
    fault(0x1000, 0x1000);
    f.extend_from_slice(&RequestHeader::new(Command::Abandon, 0).encode());
    vec![m, f]
}

/// Interesting values to splice in as little-endian words.
const MAGIC: [u64; 10] = [0, 1, 2, 7, 8, 16, 64, 65, 0xFFFF_FFFF, u64::MAX];

fn mutate(rng: &mut Rng, seeds: &[Vec<u8>]) -> Vec<u8> {
    if rng.below(8) == 0 {
        // Pure noise.
        let n = rng.below(512);
        return (0..n).map(|_| rng.next() as u8).collect();
    }
    let mut d = seeds[rng.below(seeds.len())].clone();
    for _ in 0..=rng.below(4) {
        match rng.below(6) {
            0 if !d.is_empty() => {
                let i = rng.below(d.len());
                d[i] ^= 1 << rng.below(8);
            }
            1 if !d.is_empty() => {
                let i = rng.below(d.len());
                d[i] = rng.next() as u8;
            }
            2 => d.truncate(rng.below(d.len() + 1)),
            3 if d.len() >= 4 => {
                let i = rng.below(d.len() - 3);
                let v = MAGIC[rng.below(MAGIC.len())];
                let w = if rng.below(2) == 0 { 4 } else { 8 };
                let w = w.min(d.len() - i);
                d[i..i + w].copy_from_slice(&v.to_le_bytes()[..w]);
            }
            4 => {
                let other = &seeds[rng.below(seeds.len())];
                let at = rng.below(d.len() + 1);
                let from = rng.below(other.len() + 1);
                d.splice(at..at, other[from..].iter().copied());
            }
            _ => d.extend((0..rng.below(32)).map(|_| rng.next() as u8)),
        }
    }
    d
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--write-seeds") {
        let dir = Path::new(args.get(2).map_or("corpus", String::as_str));
        let seeds = seeds();
        for (name, _) in TARGETS {
            let d = dir.join(name);
            std::fs::create_dir_all(&d).expect("corpus dir");
            for (i, s) in seeds.iter().enumerate() {
                std::fs::write(d.join(format!("seed-{i:03}")), s).expect("write seed");
            }
        }
        return;
    }
    let name = args.get(1).map_or("decode", String::as_str);
    let secs: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(10);
    let seed: u64 = args
        .get(3)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x9E37_79B9_7F4A_7C15);
    let Some((_, target)) = TARGETS.iter().find(|(n, _)| *n == name) else {
        eprintln!("unknown target {name}; targets: {:?}", TARGETS.map(|t| t.0));
        std::process::exit(2);
    };
    std::panic::set_hook(Box::new(|_| {}));
    let seeds = seeds();
    let mut rng = Rng(seed | 1);
    let started = Instant::now();
    let deadline = started + Duration::from_secs(secs);
    let (mut execs, mut crashes) = (0u64, 0u64);
    // Every seed once, then mutations until the deadline.
    let mut pending: Vec<Vec<u8>> = seeds.clone();
    while Instant::now() < deadline {
        for _ in 0..256 {
            let input = pending.pop().unwrap_or_else(|| mutate(&mut rng, &seeds));
            execs += 1;
            if catch_unwind(AssertUnwindSafe(|| target(&input))).is_err() {
                crashes += 1;
                let dir = Path::new("artifacts").join(name);
                let _ = std::fs::create_dir_all(&dir);
                let _ = std::fs::write(dir.join(format!("crash-{execs}")), &input);
            }
        }
    }
    let s = started.elapsed().as_secs_f64();
    println!(
        "target={name} execs={execs} crashes={crashes} seconds={s:.1} execs_per_s={:.0}",
        execs as f64 / s
    );
    if crashes > 0 {
        std::process::exit(1);
    }
}
