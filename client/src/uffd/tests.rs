//! Tests of the userfaultfd wrapper on real userfaultfds.

use super::*;

#[test]
fn uffd_create_flags_default_is_not_user_mode_only() {
    let bits = CreateFlags::default().bits();
    assert_eq!(bits, libc::O_CLOEXEC | libc::O_NONBLOCK);
    assert_eq!(bits & abi::UFFD_USER_MODE_ONLY, 0);
    assert_eq!(
        CreateFlags::new().user_mode_only().bits() & abi::UFFD_USER_MODE_ONLY,
        abi::UFFD_USER_MODE_ONLY
    );
    assert_eq!(CreateFlags::new().blocking().bits(), libc::O_CLOEXEC);
}

#[test]
fn uffd_features_display_names_bits() {
    let f = Features(abi::UFFD_FEATURE_MINOR_HUGETLBFS | abi::UFFD_FEATURE_THREAD_ID | (1 << 40));
    assert_eq!(f.to_string(), "THREAD_ID|MINOR_HUGETLBFS|0x10000000000");
    assert_eq!(Features(0).to_string(), "none");
    assert!(Features(0x1fff).contains(abi::UFFD_FEATURE_MINOR_HUGETLBFS));
}

#[test]
fn uffd_parse_pagefault_and_kinds() {
    let m = UffdMsg::pagefault(abi::UFFD_PAGEFAULT_FLAG_MINOR, 0x20_1000, 99);
    let Parsed::PageFault(pf) = parse_msg(&m) else {
        panic!("not a page fault")
    };
    assert_eq!(
        pf,
        PageFault {
            address: 0x20_1000,
            flags: abi::UFFD_PAGEFAULT_FLAG_MINOR,
            thread_id: 99
        }
    );
    assert_eq!(pf.kind(), FaultKind::Minor);
    assert!(!pf.is_write());
    assert_eq!(pf.page_start(2 << 20), 0x20_0000);

    let missing = PageFault {
        address: 0,
        flags: abi::UFFD_PAGEFAULT_FLAG_WRITE,
        thread_id: 0,
    };
    assert_eq!(missing.kind(), FaultKind::Missing);
    assert!(missing.is_write());
    let wp = PageFault {
        address: 0,
        flags: abi::UFFD_PAGEFAULT_FLAG_WP | 1,
        thread_id: 0,
    };
    assert_eq!(wp.kind(), FaultKind::WriteProtect);
}

#[test]
fn uffd_parse_non_cooperative_events() {
    assert_eq!(
        parse_msg(&UffdMsg::range_event(
            abi::UFFD_EVENT_REMOVE,
            0x1000,
            0x3000
        )),
        Parsed::Remove {
            start: 0x1000,
            end: 0x3000
        }
    );
    assert_eq!(
        parse_msg(&UffdMsg::range_event(abi::UFFD_EVENT_UNMAP, 0x4000, 0x5000)),
        Parsed::Unmap {
            start: 0x4000,
            end: 0x5000
        }
    );
    assert_eq!(
        parse_msg(&UffdMsg::remap(1, 2, 3)),
        Parsed::Remap {
            from: 1,
            to: 2,
            len: 3
        }
    );
    assert_eq!(parse_msg(&UffdMsg::fork(12)), Parsed::Fork(12));
    let odd = UffdMsg {
        event: 0x42,
        ..UffdMsg::default()
    };
    assert_eq!(parse_msg(&odd), Parsed::Unknown(0x42));
}

#[test]
fn uffd_fill_classification() {
    assert_eq!(Fill::classify(None, 0), Some(Fill::Done));
    assert_eq!(
        Fill::classify(Some(libc::EEXIST), -i64::from(libc::EEXIST)),
        Some(Fill::AlreadyMapped)
    );
    assert_eq!(
        Fill::classify(Some(libc::EAGAIN), 4096),
        Some(Fill::Retry { done: 4096 })
    );
    assert_eq!(
        Fill::classify(Some(libc::EAGAIN), -i64::from(libc::EAGAIN)),
        Some(Fill::Retry { done: 0 })
    );
    assert_eq!(
        Fill::classify(Some(libc::EFAULT), -i64::from(libc::EFAULT)),
        None
    );
    assert!(Fill::AlreadyMapped.is_served());
    assert!(!Fill::Retry { done: 0 }.is_served());
}

#[test]
fn uffd_parse_fdinfo_text() {
    let text = "pos:\t0\nflags:\t02004002\nmnt_id:\t15\nino:\t1057\npending:\t1\ntotal:\t2\nAPI:\taa:80000300:1fc00000000003\n";
    let info = parse_fdinfo(text).expect("parses");
    assert_eq!(info.pending, 1);
    assert_eq!(info.total, 2);
    assert_eq!(info.features, Features(0x300));
    assert_eq!(parse_fdinfo("pos:\t0\n"), None);
}

#[test]
fn uffd_from_owned_fd_rejects_other_fds() {
    let file = std::fs::File::open("/proc/self/stat").expect("open");
    match Uffd::from_owned_fd(OwnedFd::from(file)) {
        Err(UffdError::NotUserfaultfd(target)) => assert!(target.contains("stat"), "{target}"),
        other => panic!("expected NotUserfaultfd, got {other:?}"),
    }
}
