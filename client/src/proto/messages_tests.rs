//! Tests of `messages`: round trips and checked decoding.
use super::*;
use crate::proto::{Code, ProtoError, MAX_MESSAGE, MAX_PATH, MAX_REGIONS, TOKEN_SIZE};

const TOKEN: [u8; TOKEN_SIZE] = [
    0x10, 0x21, 0x32, 0x43, 0x54, 0x65, 0x76, 0x87, 0x98, 0xa9, 0xba, 0xcb, 0xdc, 0xed, 0xfe, 0x0f,
];

fn alloc() -> AllocRequest {
    AllocRequest {
        total_size: 4 << 30,
        page_policy: PagePolicy::Best,
        clear_mode: ClearMode::Eager,
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
    }
}

fn alloc_req(req: AllocRequest) -> Request {
    Request::Alloc { req, wait_ms: None }
}

#[test]
fn requests_round_trip() {
    let all = [
        Request::Handshake {
            min_version: 1,
            max_version: 1,
            features: 3,
        },
        Request::Alloc {
            req: alloc(),
            wait_ms: None,
        },
        Request::Alloc {
            req: AllocRequest {
                want_paths: true,
                ..alloc()
            },
            wait_ms: Some(250),
        },
        Request::Alloc {
            req: alloc(),
            wait_ms: Some(0),
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
            alloc_id: 7,
            token: TOKEN,
        },
        Request::Handoff {
            alloc_id: 7,
            token: TOKEN,
            want_paths: true,
        },
        Request::Handoff {
            alloc_id: 8,
            token: TOKEN,
            want_paths: false,
        },
    ];
    for req in all {
        let bytes = req.encode();
        assert_eq!(Request::decode(req.code(), &bytes).expect("decode"), req);
    }
}

#[test]
fn replies_round_trip() {
    let region = RegionInfo {
        region_id: 1,
        guest_phys: 0,
        size: 1 << 30,
        page_size: 1 << 30,
        node: 0,
        flags: RegionInfo::FLAG_CLEAN,
    };
    let all = [
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
                paths: vec![],
                token: Some(TOKEN),
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
            Code::Handoff,
            Reply::ok(ReplyBody::Alloc {
                alloc_id: 5,
                regions: vec![region],
                paths: vec!["/dev/hugepages/r5".into()],
                token: Some(TOKEN),
            }),
        ),
        (
            Code::Reattach,
            Reply::error(
                Status::NotFound,
                "allocation 5 does not exist or does not belong to this connection",
            ),
        ),
        (
            Code::Alloc,
            Reply::ok(ReplyBody::Alloc {
                alloc_id: 5,
                regions: vec![region, region],
                paths: vec![
                    "/dev/hugepages-1G/vm.1.0".into(),
                    "/dev/hugepages-1G/vm.1.1".into(),
                ],
                token: Some(TOKEN),
            }),
        ),
        (Code::Free, Reply::ok(ReplyBody::Empty)),
        (
            Code::Lock,
            Reply::ok(ReplyBody::Lock {
                bytes: 10,
                micros: 20,
            }),
        ),
        (
            Code::Rebalance,
            Reply::ok(ReplyBody::Rebalance {
                pages_moved: 3,
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
            Reply::error(Status::Invalid, "range 1 runs past region 12"),
        ),
        (
            Code::Alloc,
            Reply::error(Status::NoMemory, "node 0 has 1 free 1G page, 4 needed"),
        ),
    ];
    for (code, reply) in all {
        assert_eq!(Reply::decode(code, &reply.encode()).expect("decode"), reply);
    }
}

#[test]
fn malformed_alloc_is_refused_before_allocation() {
    let good = alloc_req(alloc()).encode();
    // Truncated anywhere: an error, never a panic.
    for cut in 0..good.len() {
        assert!(
            Request::decode(Code::Alloc, &good[..cut]).is_err(),
            "cut at {cut}"
        );
    }
    // Trailing bytes.
    let mut long = good.clone();
    long.push(0);
    assert!(matches!(
        Request::decode(Code::Alloc, &long),
        Err(ProtoError::TrailingBytes(1))
    ));
    // A huge part count is refused from the count alone.
    let mut huge = good.clone();
    huge[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        Request::decode(Code::Alloc, &huge),
        Err(ProtoError::OutOfBounds(_))
    ));
    // Parts that do not add up.
    let mut a = alloc();
    a.total_size += 1;
    assert!(Request::decode(Code::Alloc, &alloc_req(a).encode()).is_err());
    // A node in two parts is fine (two regions on one node).
    let mut a = alloc();
    a.parts[1].node = a.parts[0].node;
    let same = alloc_req(a.clone());
    assert_eq!(
        Request::decode(Code::Alloc, &same.encode()).expect("one node twice"),
        same
    );
    // Zero sizes, bad enums.
    let mut bytes = good.clone();
    bytes[8] = 9;
    assert!(Request::decode(Code::Alloc, &bytes).is_err());
    let mut bytes = good;
    bytes[10] = 2;
    assert!(Request::decode(Code::Alloc, &bytes).is_err());
}

#[test]
fn alloc_flags_are_checked() {
    let mut bytes = alloc_req(alloc()).encode();
    bytes[11] = ALLOC_FLAG_PATHS;
    assert!(
        matches!(Request::decode(Code::Alloc, &bytes), Ok(Request::Alloc { req, .. }) if req.want_paths)
    );
    bytes[11] = 4;
    assert!(matches!(
        Request::decode(Code::Alloc, &bytes),
        Err(ProtoError::OutOfBounds(_))
    ));
    // The old layout (no WAIT flag, no trailer) still decodes: the
    // daemon's default wait applies.
    bytes[11] = 0;
    assert!(matches!(
        Request::decode(Code::Alloc, &bytes),
        Ok(Request::Alloc { wait_ms: None, .. })
    ));
    // WAIT without its trailer, or with a non-zero reserved word: refused.
    bytes[11] = ALLOC_FLAG_WAIT;
    assert!(Request::decode(Code::Alloc, &bytes).is_err());
    bytes.extend_from_slice(&1500u32.to_le_bytes());
    bytes.extend_from_slice(&0u32.to_le_bytes());
    assert!(matches!(
        Request::decode(Code::Alloc, &bytes),
        Ok(Request::Alloc {
            wait_ms: Some(1500),
            ..
        })
    ));
    let n = bytes.len();
    bytes[n - 4] = 1;
    assert!(Request::decode(Code::Alloc, &bytes).is_err());
}

fn paths_reply(paths: Vec<String>) -> Vec<u8> {
    let region = RegionInfo {
        region_id: 1,
        guest_phys: 0,
        size: 1 << 30,
        page_size: 1 << 30,
        node: 0,
        flags: 1,
    };
    Reply::ok(ReplyBody::Alloc {
        alloc_id: 1,
        regions: vec![region],
        paths,
        token: None,
    })
    .encode()
}

#[test]
fn alloc_reply_paths_are_checked() {
    let good = paths_reply(vec!["/dev/hugepages-1G/a".into()]);
    assert!(Reply::decode(Code::Alloc, &good).is_ok());
    // Truncated anywhere in the path records: an error, never a panic.
    for cut in 0..good.len() {
        assert!(
            Reply::decode(Code::Alloc, &good[..cut]).is_err(),
            "cut at {cut}"
        );
    }
    let mut long = good.clone();
    long.push(b'x');
    assert!(matches!(
        Reply::decode(Code::Alloc, &long),
        Err(ProtoError::TrailingBytes(1))
    ));
    // Undefined reply flag bits.
    let mut bytes = good.clone();
    bytes[8 + 12] = 4;
    assert!(Reply::decode(Code::Alloc, &bytes).is_err());
    // Relative, NUL, too long, empty, not UTF-8.
    for bad_path in [
        "dev/x".to_string(),
        "/a\0b".to_string(),
        format!("/{}", "a".repeat(MAX_PATH)),
        String::new(),
    ] {
        assert!(
            Reply::decode(Code::Alloc, &paths_reply(vec![bad_path.clone()])).is_err(),
            "{bad_path:?}"
        );
    }
    let mut bytes = good;
    let last = bytes.len() - 1;
    bytes[last] = 0xff;
    assert!(Reply::decode(Code::Alloc, &bytes).is_err());
    // A huge path length is refused from the length alone.
    let mut bytes = paths_reply(vec!["/x".into()]);
    let at = bytes.len() - 2 - 4;
    bytes[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        Reply::decode(Code::Alloc, &bytes),
        Err(ProtoError::OutOfBounds(_))
    ));
}

#[test]
fn long_error_messages_are_cut_on_a_char_boundary() {
    let r = Reply::error(Status::Internal, "é".repeat(MAX_MESSAGE));
    assert!(r.message.len() <= MAX_MESSAGE);
    assert_eq!(
        Reply::decode(Code::Free, &r.encode())
            .expect("decode")
            .message,
        r.message
    );
}

fn uffd_request() -> Request {
    Request::Uffd {
        alloc_id: 7,
        ranges: vec![
            UffdRange {
                region_id: 11,
                offset: 0,
                vmm_addr: 0x7f00_0000_0000,
                len: 3 << 30,
            },
            UffdRange {
                region_id: 11,
                offset: 3 << 30,
                vmm_addr: 0x7f01_0000_0000,
                len: 1 << 30,
            },
            UffdRange {
                region_id: 12,
                offset: 0,
                vmm_addr: 0x7e00_0000_0000,
                len: 2 << 20,
            },
        ],
    }
}

#[test]
fn uffd_request_layout_and_fd_count() {
    let req = uffd_request();
    let bytes = req.encode();
    assert_eq!(bytes.len(), 16 + 3 * 32);
    assert_eq!(&bytes[0..8], &7u64.to_le_bytes());
    assert_eq!(&bytes[8..12], &3u32.to_le_bytes());
    assert_eq!(&bytes[16..24], &11u64.to_le_bytes());
    assert_eq!(&bytes[32..40], &0x7f00_0000_0000u64.to_le_bytes());
    assert_eq!(req.code(), Code::Uffd);
    assert_eq!(req.expected_fds(), 1);
    assert_eq!(Request::Stats.expected_fds(), 0);
    assert_eq!(Request::Free { alloc_id: 1 }.expected_fds(), 0);
}

#[test]
fn malformed_uffd_is_refused() {
    let good = uffd_request().encode();
    for cut in 0..good.len() {
        assert!(
            Request::decode(Code::Uffd, &good[..cut]).is_err(),
            "cut at {cut}"
        );
    }
    let mut long = good.clone();
    long.push(0);
    assert!(matches!(
        Request::decode(Code::Uffd, &long),
        Err(ProtoError::TrailingBytes(1))
    ));
    // A huge count is refused from the count alone, before allocating.
    let mut huge = good.clone();
    huge[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        Request::decode(Code::Uffd, &huge),
        Err(ProtoError::OutOfBounds(_))
    ));
    let mut over = good.clone();
    over[8..12].copy_from_slice(&(MAX_REGIONS as u32 + 1).to_le_bytes());
    assert!(matches!(
        Request::decode(Code::Uffd, &over),
        Err(ProtoError::OutOfBounds(_))
    ));
    // No ranges, reserved bits, zero length, wrapping, overlap.
    let none = Request::Uffd {
        alloc_id: 1,
        ranges: vec![],
    }
    .encode();
    assert!(Request::decode(Code::Uffd, &none).is_err());
    let mut reserved = good.clone();
    reserved[12] = 1;
    assert!(Request::decode(Code::Uffd, &reserved).is_err());
    let with = |f: &dyn Fn(&mut UffdRange)| {
        let Request::Uffd {
            alloc_id,
            mut ranges,
        } = uffd_request()
        else {
            unreachable!()
        };
        f(&mut ranges[1]);
        Request::decode(Code::Uffd, &Request::Uffd { alloc_id, ranges }.encode())
    };
    assert!(with(&|r| r.len = 0).is_err());
    assert!(with(&|r| r.vmm_addr = u64::MAX - 4096).is_err());
    assert!(with(&|r| r.offset = u64::MAX).is_err());
    assert!(
        with(&|r| r.vmm_addr = 0x7f00_0000_0000 + (1 << 30)).is_err(),
        "overlaps range 0"
    );
    assert!(
        with(&|r| r.vmm_addr = 0x7f00_0000_0000 + (3 << 30)).is_ok(),
        "adjacent is fine"
    );
}

fn region(id: u64) -> RegionInfo {
    RegionInfo {
        region_id: id,
        guest_phys: (id - 1) << 21,
        size: 2 << 20,
        page_size: 2 << 20,
        node: 0,
        flags: RegionInfo::FLAG_CLEAN | RegionInfo::FLAG_LOCKED,
    }
}

#[test]
fn alloc_reply_without_a_token_is_the_old_bytes() {
    // A client that did not negotiate FEATURE_REATTACH sees exactly the
    // layout it knew: flags word 0, nothing after the table.
    let bytes = Reply::ok(ReplyBody::Alloc {
        alloc_id: 7,
        regions: vec![region(1)],
        paths: vec![],
        token: None,
    })
    .encode();
    assert_eq!(bytes.len(), 8 + 16 + 40);
    assert_eq!(&bytes[8 + 12..8 + 16], &0u32.to_le_bytes());
}

#[test]
fn alloc_reply_token_layout() {
    // Token after the table and after the paths; flag bit 1.
    let bytes = Reply::ok(ReplyBody::Alloc {
        alloc_id: 7,
        regions: vec![region(1)],
        paths: vec!["/dev/hugepages/a".into()],
        token: Some(TOKEN),
    })
    .encode();
    let flags = ALLOC_REPLY_FLAG_PATHS | ALLOC_REPLY_FLAG_TOKEN;
    assert_eq!(&bytes[8 + 12..8 + 16], &flags.to_le_bytes());
    assert_eq!(bytes.len(), 8 + 16 + 40 + 4 + 16 + TOKEN_SIZE);
    assert_eq!(&bytes[bytes.len() - TOKEN_SIZE..], &TOKEN);
    // The token flag alone: the token follows the table directly.
    let bytes = Reply::ok(ReplyBody::Alloc {
        alloc_id: 7,
        regions: vec![region(1)],
        paths: vec![],
        token: Some(TOKEN),
    })
    .encode();
    assert_eq!(
        &bytes[8 + 12..8 + 16],
        &ALLOC_REPLY_FLAG_TOKEN.to_le_bytes()
    );
    assert_eq!(&bytes[8 + 16 + 40..], &TOKEN);
    // Truncated anywhere (the token included): an error, never a panic.
    for cut in 0..bytes.len() {
        assert!(
            Reply::decode(Code::Alloc, &bytes[..cut]).is_err(),
            "cut at {cut}"
        );
    }
    let mut long = bytes.clone();
    long.push(0);
    assert!(matches!(
        Reply::decode(Code::Alloc, &long),
        Err(ProtoError::TrailingBytes(1))
    ));
    // The flag without the token bytes is truncation; token bytes without
    // the flag are trailing bytes.
    let mut no_flag = bytes;
    no_flag[8 + 12] = 0;
    assert!(matches!(
        Reply::decode(Code::Alloc, &no_flag),
        Err(ProtoError::TrailingBytes(TOKEN_SIZE))
    ));
}

#[test]
fn reattach_request_layout_and_checks() {
    let req = Request::Reattach {
        alloc_id: 0x0102_0304_0506_0708,
        token: TOKEN,
    };
    let bytes = req.encode();
    assert_eq!(bytes.len(), 8 + TOKEN_SIZE);
    assert_eq!(&bytes[0..8], &0x0102_0304_0506_0708u64.to_le_bytes());
    assert_eq!(&bytes[8..], &TOKEN);
    assert_eq!(req.code(), Code::Reattach);
    assert_eq!(req.expected_fds(), 0);
    assert_eq!(Code::from_u32(9), Some(Code::Reattach));
    for cut in 0..bytes.len() {
        assert!(
            matches!(
                Request::decode(Code::Reattach, &bytes[..cut]),
                Err(ProtoError::Truncated { .. })
            ),
            "cut at {cut}"
        );
    }
    let mut long = bytes;
    long.push(0);
    assert!(matches!(
        Request::decode(Code::Reattach, &long),
        Err(ProtoError::TrailingBytes(1))
    ));
}

#[test]
fn reattach_reply_layout_and_checks() {
    let reply = Reply::ok(ReplyBody::Reattach {
        alloc_id: 7,
        regions: vec![region(1), region(2)],
    });
    let bytes = reply.encode();
    assert_eq!(bytes.len(), 8 + 16 + 2 * 40);
    assert_eq!(&bytes[8..16], &7u64.to_le_bytes());
    assert_eq!(&bytes[16..20], &2u32.to_le_bytes());
    assert_eq!(&bytes[20..24], &0u32.to_le_bytes());
    assert_eq!(&bytes[24..32], &1u64.to_le_bytes());
    for cut in 0..bytes.len() {
        assert!(
            Reply::decode(Code::Reattach, &bytes[..cut]).is_err(),
            "cut at {cut}"
        );
    }
    let mut long = bytes.clone();
    long.push(0);
    assert!(matches!(
        Reply::decode(Code::Reattach, &long),
        Err(ProtoError::TrailingBytes(1))
    ));
    // The reserved word, and a count beyond the limit (refused from the
    // count alone).
    let mut reserved = bytes.clone();
    reserved[20] = 1;
    assert!(Reply::decode(Code::Reattach, &reserved).is_err());
    let mut huge = bytes;
    huge[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        Reply::decode(Code::Reattach, &huge),
        Err(ProtoError::OutOfBounds(_))
    ));
}

#[test]
fn handoff_request_layout_and_checks() {
    let req = Request::Handoff {
        alloc_id: 0x0102_0304_0506_0708,
        token: TOKEN,
        want_paths: true,
    };
    let bytes = req.encode();
    assert_eq!(bytes.len(), 8 + TOKEN_SIZE + 8);
    assert_eq!(&bytes[0..8], &0x0102_0304_0506_0708u64.to_le_bytes());
    assert_eq!(&bytes[8..24], &TOKEN);
    assert_eq!(&bytes[24..28], &HANDOFF_FLAG_PATHS.to_le_bytes());
    assert_eq!(&bytes[28..32], &0u32.to_le_bytes());
    assert_eq!(req.code(), Code::Handoff);
    assert_eq!(req.expected_fds(), 0);
    assert_eq!(Code::from_u32(10), Some(Code::Handoff));
    for cut in 0..bytes.len() {
        assert!(
            matches!(
                Request::decode(Code::Handoff, &bytes[..cut]),
                Err(ProtoError::Truncated { .. })
            ),
            "cut at {cut}"
        );
    }
    let mut long = bytes.clone();
    long.push(0);
    assert!(matches!(
        Request::decode(Code::Handoff, &long),
        Err(ProtoError::TrailingBytes(1))
    ));
    // An undefined flag bit and a non-zero reserved word are refused.
    let mut flags = bytes.clone();
    flags[24] |= 2;
    assert!(matches!(
        Request::decode(Code::Handoff, &flags),
        Err(ProtoError::OutOfBounds(m)) if m.contains("undefined HANDOFF flag")
    ));
    let mut reserved = bytes;
    reserved[31] = 1;
    assert!(matches!(
        Request::decode(Code::Handoff, &reserved),
        Err(ProtoError::OutOfBounds(_))
    ));
}

#[test]
fn handoff_reply_is_an_alloc_reply() {
    let body = ReplyBody::Alloc {
        alloc_id: 9,
        regions: vec![region(3)],
        paths: Vec::new(),
        token: Some(TOKEN),
    };
    let bytes = Reply::ok(body.clone()).encode();
    assert_eq!(
        Reply::decode(Code::Handoff, &bytes).expect("decode").body,
        Reply::decode(Code::Alloc, &bytes).expect("decode").body
    );
    for cut in 0..bytes.len() {
        assert!(
            Reply::decode(Code::Handoff, &bytes[..cut]).is_err(),
            "cut at {cut}"
        );
    }
}
