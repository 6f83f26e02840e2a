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
    Request, Status, UffdRange,
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

/// Valid messages: every request, the replies a client decodes, each
/// framed with its header (the decode and frames targets read the header).
fn seeds() -> Vec<Vec<u8>> {
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
    let uffd = Request::Uffd {
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
    };
    let requests = [
        Request::Handshake {
            min_version: 1,
            max_version: 1,
            features: 3,
        },
        Request::Alloc {
            req: alloc.clone(),
            wait_ms: None,
        },
        Request::Alloc {
            req: AllocRequest {
                want_paths: true,
                parts: vec![],
                ..alloc
            },
            wait_ms: Some(2500),
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
        uffd,
        Request::Reattach {
            alloc_id: 9,
            token: [0x5a; 16],
        },
        Request::Handoff {
            alloc_id: 9,
            token: [0x5b; 16],
            want_paths: true,
        },
    ];
    let mut out = Vec::new();
    for (i, r) in requests.iter().enumerate() {
        let payload = r.encode();
        let h = Header::request(r.code(), i as u32, payload.len()).expect("header");
        let mut m = h.encode().to_vec();
        m.extend_from_slice(&payload);
        // Two frames back to back, for the frame reader.
        let mut twice = m.clone();
        twice.extend_from_slice(&m);
        out.push(m);
        out.push(twice);
        // The UFFD target takes a bare payload.
        out.push(payload);
    }
    // A whole local-migration sequence, for the ch_migration target.
    {
        use hugemem_client::ch_migration::{Command, RequestHeader};
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
        out.push(m);
        // A fault connection's requests, for the ch_fault target.
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
        out.push(f);
    }
    let region = RegionInfo {
        region_id: 1,
        guest_phys: 0,
        size: 1 << 30,
        page_size: 1 << 30,
        node: 0,
        flags: 3,
    };
    let replies = [
        (
            Code::Handshake,
            Reply::ok(ReplyBody::Handshake {
                version: 1,
                features: 1,
            }),
        ),
        (
            Code::Alloc,
            Reply::ok(ReplyBody::Alloc {
                alloc_id: 5,
                regions: vec![region, region],
                paths: vec![],
                token: None,
            }),
        ),
        (
            Code::Alloc,
            Reply::ok(ReplyBody::Alloc {
                alloc_id: 5,
                regions: vec![region],
                paths: vec!["/dev/hugepages/a".into()],
                token: Some([0xa5; 16]),
            }),
        ),
        (
            Code::Handoff,
            Reply::ok(ReplyBody::Alloc {
                alloc_id: 9,
                regions: vec![region],
                paths: Vec::new(),
                token: Some([0x5b; 16]),
            }),
        ),
        (
            Code::Reattach,
            Reply::ok(ReplyBody::Reattach {
                alloc_id: 5,
                regions: vec![region, region],
            }),
        ),
        (
            Code::Stats,
            Reply::ok(ReplyBody::Stats {
                json: "{\"a\":1}".into(),
            }),
        ),
        (
            Code::Uffd,
            Reply::error(Status::Invalid, "range 0 runs past region 1"),
        ),
    ];
    for (code, rep) in replies {
        let payload = rep.encode();
        let req = Header::request(code, 1, 0).expect("header");
        let mut m = Header::reply_to(&req, payload.len())
            .expect("header")
            .encode()
            .to_vec();
        m.extend_from_slice(&payload);
        out.push(m);
    }
    out
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
        for (name, _) in TARGETS {
            let d = dir.join(name);
            std::fs::create_dir_all(&d).expect("corpus dir");
            for (i, s) in seeds().iter().enumerate() {
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
