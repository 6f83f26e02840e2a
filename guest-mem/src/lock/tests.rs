//! Tests of locking guest memory.

use std::sync::{Mutex, MutexGuard, PoisonError};

use clearing::{CancelToken, Progress};

use super::*;
use crate::hugepages::ensure_free;

/// `VmLck` is per process and tests run on threads of one process: every
/// test that locks memory holds this for its whole body.
static VMLCK: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    VMLCK.lock().unwrap_or_else(PoisonError::into_inner)
}

const MIB: usize = 1 << 20;

fn topology() -> Topology {
    Topology::detect().expect("read the NUMA topology")
}

/// `VmLck` of this process, bytes.
fn vmlck() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    let line = status
        .lines()
        .find(|l| l.starts_with("VmLck:"))
        .expect("VmLck line");
    let kb: u64 = line
        .trim_start_matches("VmLck:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .expect("VmLck value");
    kb * 1024
}

/// Sum of a `/proc/self/smaps` field (bytes) over the VMAs inside
/// `start..start+len`: residency of one mapping, unaffected by other tests.
fn smaps_field(start: usize, len: usize, field: &str) -> u64 {
    let smaps = std::fs::read_to_string("/proc/self/smaps").expect("read smaps");
    let mut inside = false;
    let mut total = 0;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = first.split_once('-') {
            if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                inside = a >= start && b <= start + len;
                continue;
            }
        }
        if inside {
            if let Some(rest) = line.strip_prefix(field).and_then(|r| r.strip_prefix(':')) {
                let kb: u64 = rest
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse()
                    .expect("smaps value");
                total += kb * 1024;
            }
        }
    }
    total
}

fn opts(chunk: usize) -> LockOptions {
    LockOptions::new().with_chunk(chunk).expect("valid chunk")
}

#[test]
fn lock_options_are_validated() {
    assert!(matches!(
        LockOptions::new().with_chunk(0),
        Err(LockError::BadChunk(0))
    ));
    assert!(matches!(
        LockOptions::new().with_chunk(4095),
        Err(LockError::BadChunk(4095))
    ));
    assert!(matches!(
        LockOptions::new().with_chunk(MIB + 1),
        Err(LockError::BadChunk(_))
    ));
    assert_eq!(opts(3 * 4096).chunk(), Some(3 * 4096));
    assert_eq!(LockOptions::default().chunk(), None);
    assert!(matches!(
        LockOptions::new().with_threads_per_node(0),
        Err(LockError::BadThreads)
    ));
    let o = LockOptions::new()
        .with_threads_per_node(2)
        .expect("2 threads")
        .with_on_fault(true);
    assert_eq!((o.threads_per_node(), o.on_fault()), (2, true));
}

#[test]
fn bad_ranges_are_refused_before_any_call() {
    let t = topology();
    let o = opts(MIB);
    let cases = [
        LockRange {
            start: 0x1000_0000,
            len: 0,
            page_size: PageSize::Base4K,
            node: None,
        },
        LockRange {
            start: 0x1000_0001,
            len: 4096,
            page_size: PageSize::Base4K,
            node: None,
        },
        LockRange {
            start: 0x1000_0000,
            len: 4096,
            page_size: PageSize::Huge2M,
            node: None,
        },
        LockRange {
            start: usize::MAX - 4095,
            len: 8192,
            page_size: PageSize::Base4K,
            node: None,
        },
    ];
    for r in cases {
        // SAFETY: validation fails before any system call, so no memory is touched.
        let res = unsafe { lock_ranges(&t, &[r], &o, &RunOptions::default()) };
        assert!(
            matches!(res, Err(LockError::BadRange { .. })),
            "{r:?}: {res:?}"
        );
    }
}

#[test]
fn chunk_rounds_up_to_the_largest_page() {
    let r = |page_size| LockRange {
        start: 1 << 30,
        len: 1 << 30,
        page_size,
        node: None,
    };
    assert_eq!(
        plan(&[r(PageSize::Base4K)], &opts(12 << 10)).expect("plan"),
        12 << 10
    );
    assert_eq!(
        plan(&[r(PageSize::Huge2M)], &opts(MIB)).expect("plan"),
        2 * MIB
    );
    assert_eq!(
        plan(&[r(PageSize::Huge2M)], &opts(3 * MIB)).expect("plan"),
        4 * MIB
    );
    assert_eq!(
        plan(&[r(PageSize::Base4K), r(PageSize::Huge1G)], &opts(8 * MIB)).expect("plan"),
        1 << 30
    );
}

#[test]
fn locking_4k_shmem_in_chunks_is_accounted_in_vmlck() {
    let _g = serial();
    let t = topology();
    let m = SharedMapping::memfd(64 * MIB, PageSize::Base4K).expect("64 MiB memfd");
    let (start, len) = (m.addr().expose_provenance(), m.len());
    let before = vmlck();
    let report = lock_mapping(&t, &m, &opts(MIB), &RunOptions::default()).expect("lock");
    assert_eq!(
        (report.op, report.bytes, report.chunks, report.chunk_bytes),
        (LockOp::Lock, 64 << 20, 64, MIB)
    );
    assert_eq!(report.nodes.iter().map(|n| n.bytes).sum::<u64>(), 64 << 20);
    assert_eq!(vmlck(), before + (64 << 20));
    // mlock populated every page of the memfd.
    assert_eq!(smaps_field(start, len, "Rss"), 64 << 20);
    assert_eq!(smaps_field(start, len, "Locked"), 64 << 20);
    let report = unlock_mapping(&t, &m, &opts(MIB), &RunOptions::default()).expect("unlock");
    assert_eq!(
        (report.op, report.bytes, report.chunks),
        (LockOp::Unlock, 64 << 20, 64)
    );
    assert_eq!(vmlck(), before);
    // Unlocking keeps the pages; they belong to the memfd.
    assert_eq!(smaps_field(start, len, "Rss"), 64 << 20);
}

#[test]
fn two_workers_lock_the_same_total() {
    let _g = serial();
    let t = topology();
    let m = SharedMapping::memfd(32 * MIB, PageSize::Base4K).expect("32 MiB memfd");
    let o = opts(MIB).with_threads_per_node(2).expect("2 threads");
    let before = vmlck();
    let report = lock_mapping(&t, &m, &o, &RunOptions::default()).expect("lock");
    assert_eq!((report.bytes, report.chunks), (32 << 20, 32));
    assert_eq!(vmlck(), before + (32 << 20));
    unlock_mapping(&t, &m, &o, &RunOptions::default()).expect("unlock");
    assert_eq!(vmlck(), before);
}

#[test]
fn on_fault_locking_counts_in_vmlck_but_populates_nothing() {
    let _g = serial();
    let t = topology();
    let m = SharedMapping::memfd(64 * MIB, PageSize::Base4K).expect("64 MiB memfd");
    let (start, len) = (m.addr().expose_provenance(), m.len());
    let before = vmlck();
    let o = opts(4 * MIB).with_on_fault(true);
    let report = lock_mapping(&t, &m, &o, &RunOptions::default()).expect("lock on fault");
    assert_eq!(
        (report.op, report.bytes, report.chunks),
        (LockOp::LockOnFault, 64 << 20, 16)
    );
    // The kernel counts the whole range in VmLck at once ...
    assert_eq!(vmlck(), before + (64 << 20));
    // ... but faults nothing in until the memory is touched.
    assert_eq!(smaps_field(start, len, "Rss"), 0);
    m.populate_write(0, 2 * 4096).expect("touch two pages");
    assert_eq!(smaps_field(start, len, "Rss"), 2 * 4096);
    unlock_mapping(&t, &m, &o, &RunOptions::default()).expect("unlock");
    assert_eq!(vmlck(), before);
}

#[test]
fn locking_2m_hugetlb_populates_without_vmlck() {
    let _g = serial();
    let _pools = crate::hugepages::tests::pool_lock();
    match ensure_free(PageSize::Huge2M, 8, None) {
        Ok(r) if r.met => {}
        Ok(r) => return test_support::skip!("only {} free 2 MiB pages", r.free),
        Err(e) => return test_support::skip!("cannot reserve 2 MiB pages: {e}"),
    }
    let m = match SharedMapping::memfd(16 * MIB, PageSize::Huge2M) {
        Ok(m) => m,
        // Another test may have taken the pages between the check and the map.
        Err(e) => return test_support::skip!("cannot map 16 MiB of 2 MiB pages: {e}"),
    };
    let t = topology();
    let (start, len) = (m.addr().expose_provenance(), m.len());
    let before = vmlck();
    // 1 MiB chunks are rounded up to one 2 MiB page per call.
    let report = lock_mapping(&t, &m, &opts(MIB), &RunOptions::default()).expect("lock");
    assert_eq!(
        (report.bytes, report.chunks, report.chunk_bytes),
        (16 << 20, 8, 2 * MIB)
    );
    // smaps counts a huge page mapped by one process as Private_Hugetlb,
    // even in a MAP_SHARED mapping.
    let hugetlb =
        smaps_field(start, len, "Shared_Hugetlb") + smaps_field(start, len, "Private_Hugetlb");
    assert_eq!(hugetlb, 16 << 20);
    // hugetlb VMAs are never marked VM_LOCKED, so VmLck does not move.
    assert_eq!(vmlck(), before);
    let report = unlock_mapping(&t, &m, &opts(MIB), &RunOptions::default()).expect("unlock");
    assert_eq!(report.bytes, 16 << 20);
    assert_eq!(vmlck(), before);
}

#[test]
fn cancelling_from_progress_reports_partial_bytes() {
    let _g = serial();
    let t = topology();
    let m = SharedMapping::memfd(64 * MIB, PageSize::Base4K).expect("64 MiB memfd");
    let before = vmlck();
    let token = CancelToken::new();
    let cancel_at_first = |p: &Progress| {
        if p.bytes_done >= MIB as u64 {
            token.cancel();
        }
    };
    let run_opts = RunOptions {
        cancel: Some(&token),
        progress: Some(&cancel_at_first),
        ..RunOptions::default()
    };
    let err = lock_mapping(&t, &m, &opts(MIB), &run_opts).expect_err("cancelled");
    let LockError::Cancelled {
        op,
        done_bytes,
        total_bytes,
    } = err
    else {
        panic!("expected Cancelled, got {err:?}");
    };
    assert_eq!(op, LockOp::Lock);
    assert_eq!(total_bytes, 64 << 20);
    assert!(
        done_bytes >= MIB as u64 && done_bytes < total_bytes,
        "{done_bytes}"
    );
    assert_eq!(done_bytes % MIB as u64, 0);
    // What was locked stays locked, and unlocking the whole range undoes it.
    assert_eq!(vmlck(), before + done_bytes);
    unlock_mapping(&t, &m, &opts(MIB), &RunOptions::default()).expect("unlock");
    assert_eq!(vmlck(), before);
}

#[test]
fn progress_is_monotone_and_ends_at_the_total() {
    let _g = serial();
    let t = topology();
    let m = SharedMapping::memfd(32 * MIB, PageSize::Base4K).expect("32 MiB memfd");
    let seen = Mutex::new(Vec::new());
    let record = |p: &Progress| seen.lock().unwrap_or_else(PoisonError::into_inner).push(*p);
    let run_opts = RunOptions {
        progress: Some(&record),
        ..RunOptions::default()
    };
    lock_mapping(&t, &m, &opts(MIB), &run_opts).expect("lock");
    unlock_mapping(&t, &m, &opts(MIB), &RunOptions::default()).expect("unlock");
    let seen = seen.into_inner().unwrap_or_else(PoisonError::into_inner);
    assert!(!seen.is_empty());
    assert!(seen.iter().all(|p| p.bytes_total == 32 << 20));
    assert!(
        seen.windows(2).all(|w| w[0].bytes_done <= w[1].bytes_done),
        "{seen:?}"
    );
    assert_eq!(seen.last().map(|p| p.bytes_done), Some(32 << 20));
}

#[test]
fn a_page_past_eof_fails_with_the_bytes_done() {
    let _g = serial();
    let t = topology();
    let m = SharedMapping::memfd(4 * MIB, PageSize::Base4K).expect("4 MiB memfd");
    // Shrink the file under the mapping: the second half cannot be faulted in.
    let file = std::fs::File::from(m.fd().try_clone_to_owned().expect("dup memfd"));
    file.set_len(2 * MIB as u64).expect("truncate");
    let before = vmlck();
    let err = lock_mapping(&t, &m, &opts(MIB), &RunOptions::default()).expect_err("past EOF");
    match &err {
        LockError::Limit {
            op: LockOp::Lock,
            len,
            done_bytes,
            source,
            ..
        } => {
            assert_eq!(*len, MIB);
            assert_eq!(*done_bytes, 2 * MIB as u64);
            assert_eq!(source.raw_os_error(), Some(libc::ENOMEM));
        }
        other => panic!("expected Limit, got {other:?}"),
    }
    assert!(err.to_string().contains("RLIMIT_MEMLOCK"), "{err}");
    unlock_mapping(&t, &m, &opts(MIB), &RunOptions::default()).expect("unlock");
    assert_eq!(vmlck(), before);
}
