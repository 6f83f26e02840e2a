//! The fill engine on real huge pages: sparse files on disk and memfds with
//! holes into dirty, clean and unpopulated regions, files too short or
//! truncated, fds that are not files, overlapping sources, one unit filled
//! once however many threads ask, and several workers used.
//!
//! Each test reserves its 2 MiB pages on node 0 through
//! `test_support::hugepages` and skips (said out loud) when it cannot.

#![allow(clippy::undocumented_unsafe_blocks)]

use std::fs::File;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::{Mutex, MutexGuard, PoisonError};

use clearing::RunOptions;
use guest_mem::{
    fill_region, fill_region_planned, fill_unit, mark_for_fill, Checksums, FillError, FillOptions,
    FillPlan, FillSource, PagePolicy, PageSize, PageState, Region, RegionSpec, UnitFill,
};
use numa::Topology;

const MIB: u64 = 1 << 20;
const STALE: u8 = 0xAA;

static HUGE: Mutex<()> = Mutex::new(());

fn huge_lock() -> MutexGuard<'static, ()> {
    HUGE.lock().unwrap_or_else(PoisonError::into_inner)
}

fn topology() -> Topology {
    Topology::detect().expect("detect topology")
}

/// A 2 MiB-page region of `units` pages on node 0, created but not
/// populated; `None` after a skip.
fn unpopulated(topo: &Topology, units: u64, test: &str) -> Option<Region> {
    if !test_support::hugepages::reserve(PageSize::Huge2M, units, Some(0), test) {
        return None;
    }
    let spec = RegionSpec::new("gm-fill-test", units * 2 * MIB, Some(0))
        .with_policy(PagePolicy::Strict(PageSize::Huge2M));
    match Region::create(topo, &spec) {
        Ok(region) => Some(region),
        Err(e) => {
            test_support::skip!("{test}: pages reserved for the test were taken: {e}");
            None
        }
    }
}

/// As [`unpopulated`], then populated, filled with stale bytes and marked dirty,
/// as a region another tenant used.
fn dirty(topo: &Topology, units: u64, test: &str) -> Option<Region> {
    let region = unpopulated(topo, units, test)?;
    region
        .prepare_eager(topo, &RunOptions::default())
        .expect("populate");
    unsafe { region.as_mut_slice() }.fill(STALE);
    region.mark_all_dirty();
    Some(region)
}

/// A file byte: odd, so never zero and never `STALE`.
fn pattern(offset: u64) -> u8 {
    ((offset % 251) as u8) | 1
}

/// Writes `pattern` over `range` of `file`.
fn island(file: &File, start: u64, len: u64) {
    let bytes: Vec<u8> = (start..start + len).map(pattern).collect();
    file.write_all_at(&bytes, start).expect("write island");
}

/// A sparse file on real disk (/var/tmp) of `len` bytes with data at
/// `islands` (start, len) and holes elsewhere.
fn sparse_file(len: u64, islands: &[(u64, u64)]) -> File {
    let file = tempfile::tempfile_in("/var/tmp").expect("temp file on /var/tmp");
    file.set_len(len).expect("size the file");
    for &(start, n) in islands {
        island(&file, start, n);
    }
    file.sync_all().expect("fsync");
    file
}

/// A 4 KiB shmem memfd of `len` bytes with data at `islands`, holes elsewhere.
fn memfd(len: u64, islands: &[(u64, u64)]) -> File {
    let fd = unsafe { libc::memfd_create(c"gm-fill-src".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    file.set_len(len).expect("size the memfd");
    for &(start, n) in islands {
        island(&file, start, n);
    }
    file
}

/// What the region must hold: each source's file bytes (holes read as
/// zero), zero everywhere else.
fn expected(region_len: u64, files: &[&File], sources: &[FillSource<'_>]) -> Vec<u8> {
    let mut want = vec![0u8; region_len as usize];
    for (file, s) in files.iter().zip(sources) {
        let dest = &mut want[s.dest_offset as usize..(s.dest_offset + s.len) as usize];
        file.read_exact_at(dest, s.file_offset).expect("read back");
    }
    want
}

/// The first offset where the region differs from `want`, with both bytes.
fn first_difference(region: &Region, want: &[u8]) -> Option<(usize, u8, u8)> {
    let got = unsafe { region.as_slice() };
    got.iter()
        .zip(want)
        .position(|(a, b)| a != b)
        .map(|i| (i, got[i], want[i]))
}

fn all_clean(region: &Region) -> bool {
    region.states().counts().clean == region.states().len()
}

#[test]
fn sparse_file_into_a_dirty_region_on_several_workers() {
    let _g = huge_lock();
    let test = "fill sparse file";
    let topo = topology();
    let Some(region) = dirty(&topo, 8, test) else {
        return;
    };
    // Islands at odd offsets, holes between them and at both ends.
    let file = sparse_file(
        12 * MIB,
        &[
            (100_000, 5000),
            (3 * MIB + 17, MIB),
            (6 * MIB, 2 * MIB + 3),
            (11 * MIB, 4096),
        ],
    );
    let other = sparse_file(MIB, &[(0, 300_000)]);
    let sources = [
        // Unaligned in the file, aligned in the region.
        FillSource {
            file: file.as_fd(),
            file_offset: 4096 + 5,
            dest_offset: 0,
            len: 9 * MIB,
        },
        // A gap of 1 MiB + 7 bytes, then a second file.
        FillSource {
            file: other.as_fd(),
            file_offset: 0,
            dest_offset: 10 * MIB + 7,
            len: MIB,
        },
        // A gap, then the tail of the first file up to the region's end.
        FillSource {
            file: file.as_fd(),
            file_offset: 10 * MIB,
            dest_offset: 14 * MIB,
            len: 2 * MIB,
        },
    ];
    let want = expected(region.len(), &[&file, &other, &file], &sources);
    let units_done = std::sync::Mutex::new(Vec::new());
    let record = |unit: usize| units_done.lock().expect("lock").push(unit);
    let opts = FillOptions {
        chunk: 2 * MIB,
        unit_done: Some(&record),
        ..FillOptions::default()
    };
    let report = fill_region(&topo, &region, &sources, &opts).expect("fill");
    println!("{test}: {report:?}");
    assert_eq!(first_difference(&region, &want), None);
    assert!(all_clean(&region));
    assert_eq!(report.units_filled, 8);
    let mut units_done = units_done.lock().expect("lock").clone();
    units_done.sort_unstable();
    assert_eq!(
        units_done,
        (0..8).collect::<Vec<_>>(),
        "each unit said once"
    );
    let sourced: u64 = sources.iter().map(|s| s.len).sum();
    assert_eq!(report.counts.bytes_read + report.counts.hole_bytes, sourced);
    assert!(report.counts.hole_bytes > 0, "the holes were found");
    // Everything not read was zeroed over the stale bytes.
    assert_eq!(
        report.counts.bytes_read + report.counts.bytes_zeroed,
        region.len()
    );
    let cpus = topo
        .nodes()
        .iter()
        .find(|n| n.id == 0)
        .map_or(1, |n| n.cpus.len());
    assert_eq!(report.threads, cpus.min(opts.max_threads_per_node).min(8));
    if cpus > 1 {
        assert!(report.threads > 1, "one worker for {cpus} CPUs");
    }
}

#[test]
fn memfd_with_holes_into_a_clean_region_zeroes_nothing() {
    let _g = huge_lock();
    let test = "fill memfd";
    let topo = topology();
    let Some(region) = unpopulated(&topo, 4, test) else {
        return;
    };
    region
        .prepare_eager(&topo, &RunOptions::default())
        .expect("populate");
    let src = memfd(
        8 * MIB,
        &[(0, 4096), (MIB + 123, 70_000), (5 * MIB, 3 * MIB)],
    );
    let sources = [FillSource {
        file: src.as_fd(),
        file_offset: 0,
        dest_offset: 0,
        len: 8 * MIB,
    }];
    let want = expected(region.len(), &[&src], &sources);
    let dest_is_zero = mark_for_fill(&region);
    assert!(dest_is_zero, "a clean region is zero");
    assert_eq!(region.states().counts().dirty, 4);
    let opts = FillOptions {
        dest_is_zero,
        chunk: 2 * MIB,
        ..FillOptions::default()
    };
    let report = fill_region(&topo, &region, &sources, &opts).expect("fill");
    println!("{test}: {report:?}");
    assert_eq!(first_difference(&region, &want), None);
    assert!(all_clean(&region));
    assert_eq!(report.counts.bytes_zeroed, 0);
    // shmem reports its unwritten pages as holes.
    assert!(report.counts.hole_bytes >= 4 * MIB, "{:?}", report.counts);
}

#[test]
fn unpopulated_region_is_populated_and_filled_without_zeroing() {
    let _g = huge_lock();
    let test = "fill unpopulated";
    let topo = topology();
    let Some(region) = unpopulated(&topo, 3, test) else {
        return;
    };
    let file = sparse_file(4 * MIB, &[(MIB, MIB), (3 * MIB + 1, 10)]);
    let sources = [FillSource {
        file: file.as_fd(),
        file_offset: MIB,
        dest_offset: 0,
        len: 3 * MIB,
    }];
    let want = expected(region.len(), &[&file], &sources);
    let report = fill_region(&topo, &region, &sources, &FillOptions::default()).expect("fill");
    assert_eq!(first_difference(&region, &want), None);
    assert!(all_clean(&region));
    assert_eq!(report.counts.bytes_zeroed, 0);
    assert!(region
        .verify_placement()
        .expect("placement")
        .misplaced
        .is_empty());
}

#[test]
fn too_short_and_truncated_sources_fail_and_leave_no_stale_byte() {
    let _g = huge_lock();
    let test = "fill short";
    let topo = topology();
    let Some(region) = dirty(&topo, 2, test) else {
        return;
    };
    let file = sparse_file(3 * MIB, &[(0, 3 * MIB)]);
    // Claims more than the file has: refused before anything is written.
    let sources = [FillSource {
        file: file.as_fd(),
        file_offset: MIB + 1,
        dest_offset: 0,
        len: 2 * MIB,
    }];
    match fill_region(&topo, &region, &sources, &FillOptions::default()) {
        Err(FillError::TooShort {
            index: 0,
            size,
            claimed_end,
        }) => {
            assert_eq!((size, claimed_end), (3 * MIB, 3 * MIB + 1));
        }
        other => panic!("expected TooShort, got {other:?}"),
    }
    assert_eq!(region.states().counts().dirty, 2, "nothing was claimed");

    // Long enough when checked, truncated before it is read (as a peer
    // shrinking its memfd mid-fill would): the unit fails, is zeroed from
    // where the data stopped, and stays dirty.
    let sources = [FillSource {
        file: file.as_fd(),
        file_offset: 0,
        dest_offset: 0,
        len: 3 * MIB,
    }];
    let plan = FillPlan::new(&region, &sources).expect("plan");
    file.set_len(2 * MIB + 4096).expect("truncate");
    let opts = FillOptions::default();
    assert!(matches!(
        fill_unit(&region, &plan, 0, &opts),
        Ok(UnitFill::Filled(_))
    ));
    match fill_unit(&region, &plan, 1, &opts) {
        Err(
            e @ FillError::ShortRead {
                index: 0,
                file_offset,
                dest_offset,
            },
        ) => {
            println!("{test}: {e}");
            assert_eq!((file_offset, dest_offset), (2 * MIB + 4096, 2 * MIB + 4096));
        }
        other => panic!("expected ShortRead, got {other:?}"),
    }
    assert_eq!(region.states().get(0), Ok(PageState::Clean));
    assert_eq!(region.states().get(1), Ok(PageState::Dirty));
    let bytes = unsafe { region.as_slice() };
    assert!(
        !bytes.contains(&STALE),
        "a stale byte survived the failed fill"
    );
    let supplied = 2 * MIB + 4096;
    let want = expected(
        supplied,
        &[&file],
        &[FillSource {
            len: supplied,
            ..sources[0]
        }],
    );
    assert_eq!(first_difference(&region, &want), None);
    let rest = &bytes[want.len()..];
    assert_eq!(
        rest.iter().position(|&b| b != 0),
        None,
        "not zero after the file's end"
    );
}

#[test]
fn pipes_overlaps_and_ranges_past_the_region_are_refused() {
    let _g = huge_lock();
    let test = "fill refusals";
    let topo = topology();
    let Some(region) = dirty(&topo, 2, test) else {
        return;
    };
    let (reader, _writer) = std::io::pipe().expect("pipe");
    let file = sparse_file(4 * MIB, &[(0, 4096)]);
    let source = |file_offset, dest_offset, len| FillSource {
        file: file.as_fd(),
        file_offset,
        dest_offset,
        len,
    };
    let pipe = [
        source(0, 0, MIB),
        FillSource {
            file: reader.as_fd(),
            file_offset: 0,
            dest_offset: MIB,
            len: 4096,
        },
    ];
    assert!(
        matches!(
            FillPlan::new(&region, &pipe),
            Err(FillError::NotRegular {
                index: 1,
                kind: "a pipe"
            })
        ),
        "{:?}",
        FillPlan::new(&region, &pipe)
    );
    let overlap = [source(0, 2 * MIB, MIB), source(0, 0, 2 * MIB + 1)];
    match FillPlan::new(&region, &overlap) {
        Err(FillError::Overlap {
            first: 1,
            second: 0,
            at,
        }) => assert_eq!(at, 2 * MIB),
        other => panic!("expected Overlap, got {other:?}"),
    }
    let past = [source(0, 3 * MIB, MIB + 1)];
    assert!(matches!(
        FillPlan::new(&region, &past),
        Err(FillError::OutOfRegion { index: 0, .. })
    ));
    let wraps = [source(0, u64::MAX - 1, 4)];
    assert!(matches!(
        FillPlan::new(&region, &wraps),
        Err(FillError::OutOfRegion { .. })
    ));
    let huge_offset = [source(u64::MAX - 1, 0, 4)];
    assert!(matches!(
        FillPlan::new(&region, &huge_offset),
        Err(FillError::FileRange { .. })
    ));
    assert_eq!(region.states().counts().dirty, 2, "nothing was claimed");
    let bytes = unsafe { region.as_slice() };
    assert!(bytes.iter().all(|&b| b == STALE), "a refused fill wrote");
}

#[test]
fn a_unit_is_filled_once_however_many_threads_ask() {
    let _g = huge_lock();
    let test = "fill unit once";
    let topo = topology();
    let Some(region) = dirty(&topo, 4, test) else {
        return;
    };
    let file = sparse_file(8 * MIB, &[(0, 8 * MIB)]);
    let sources = [FillSource {
        file: file.as_fd(),
        file_offset: 0,
        dest_offset: 0,
        len: 8 * MIB,
    }];
    let plan = FillPlan::new(&region, &sources).expect("plan");
    let opts = FillOptions::default();
    let first = fill_unit(&region, &plan, 2, &opts).expect("fill unit 2");
    assert!(
        matches!(first, UnitFill::Filled(c) if c.bytes_read == 2 * MIB),
        "{first:?}"
    );
    let again = fill_unit(&region, &plan, 2, &opts).expect("fill unit 2 again");
    assert_eq!(again, UnitFill::Done(PageState::Clean));
    assert!(matches!(
        fill_unit(&region, &plan, 4, &opts),
        Err(FillError::NoSuchUnit { unit: 4, units: 4 })
    ));

    // Four threads race for each remaining unit: one fills it, the others
    // find it busy or done.
    for unit in [0, 1, 3] {
        let outcomes: Vec<UnitFill> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| s.spawn(|| fill_unit(&region, &plan, unit, &opts).expect("fill")))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("join"))
                .collect()
        });
        let filled = outcomes
            .iter()
            .filter(|o| matches!(o, UnitFill::Filled(_)))
            .count();
        assert_eq!(filled, 1, "unit {unit}: {outcomes:?}");
    }
    let want = expected(region.len(), &[&file], &sources);
    assert_eq!(first_difference(&region, &want), None);
    assert!(all_clean(&region));
    // A whole-region fill now has nothing left to do.
    let report = fill_region(&topo, &region, &sources, &opts).expect("fill");
    assert_eq!((report.units_filled, report.units_skipped), (0, 4));
}

/// Drops `file`'s pages from the page cache (written back first).
fn drop_cache(file: &File) {
    use std::os::fd::AsRawFd;
    file.sync_all().expect("fsync");
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(rc, 0, "POSIX_FADV_DONTNEED");
}

/// True when `file`'s file system takes `O_DIRECT` reads (`statx`
/// `STATX_DIOALIGN`).
fn takes_direct_io(file: &File) -> bool {
    use std::os::fd::AsRawFd;
    let mut st = std::mem::MaybeUninit::<libc::statx>::zeroed();
    let rc = unsafe {
        libc::statx(
            file.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            st.as_mut_ptr(),
        )
    };
    let st = unsafe { st.assume_init() };
    rc == 0 && st.stx_mask & libc::STATX_DIOALIGN != 0 && st.stx_dio_offset_align > 0
}

/// A file on disk that is not in the page cache is read with `O_DIRECT`
/// where the reads are aligned (an unaligned source goes through the page
/// cache), and the same file in the page cache is copied from it; both
/// fills hold exactly the file's bytes, zeros in its hole.
#[test]
fn a_cold_file_on_disk_is_read_direct_and_a_warm_one_through_the_cache() {
    let _g = huge_lock();
    let test = "fill direct";
    let topo = topology();
    let file = sparse_file(8 * MIB, &[(0, 3 * MIB), (4 * MIB, 4 * MIB)]);
    if !takes_direct_io(&file) {
        test_support::skip!("{test}: /var/tmp takes no O_DIRECT reads");
        return;
    }
    let sources = [
        // Aligned: read direct, but for the hole.
        FillSource {
            file: file.as_fd(),
            file_offset: 0,
            dest_offset: 0,
            len: 6 * MIB,
        },
        // Unaligned in the file and the region: through the page cache.
        FillSource {
            file: file.as_fd(),
            file_offset: 6 * MIB + 5,
            dest_offset: 6 * MIB + 5,
            len: MIB,
        },
    ];
    let want = expected(8 * MIB, &[&file, &file], &sources);
    for warm in [false, true] {
        let Some(region) = dirty(&topo, 4, test) else {
            return;
        };
        if warm {
            let mut sink = vec![0u8; (8 * MIB) as usize];
            file.read_exact_at(&mut sink, 0)
                .expect("read into the cache");
        } else {
            drop_cache(&file);
        }
        let report = fill_region(&topo, &region, &sources, &FillOptions::default())
            .unwrap_or_else(|e| panic!("{test}: fill (warm {warm}): {e}"));
        println!("{test}: warm {warm}: {report:?}");
        assert_eq!(first_difference(&region, &want), None, "warm {warm}");
        assert_eq!(report.counts.bytes_read, 6 * MIB, "warm {warm}");
        assert_eq!(report.counts.hole_bytes, MIB, "warm {warm}");
        if warm {
            assert_eq!(report.counts.bytes_read_direct, 0, "a warm file is copied");
        } else {
            // The first source's data; none of the unaligned source's.
            assert_eq!(report.counts.bytes_read_direct, 5 * MIB);
        }
    }
}

/// A source fd that is not open for reading (`O_PATH`, write-only) is
/// refused as before: the second open for `O_DIRECT` reads, made with the
/// daemon's rights, is never made for it.
#[test]
fn a_source_not_open_for_reading_gains_no_read_access() {
    let _g = huge_lock();
    let test = "fill no read access";
    let topo = topology();
    let file = sparse_file(2 * MIB, &[(0, 2 * MIB)]);
    drop_cache(&file);
    let path = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&file));
    let o_path = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH)
        .open(&path)
        .expect("an O_PATH fd");
    let write_only = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("a write-only fd");
    for (what, fd) in [("O_PATH", &o_path), ("write-only", &write_only)] {
        let Some(region) = dirty(&topo, 1, test) else {
            return;
        };
        let source = FillSource {
            file: fd.as_fd(),
            file_offset: 0,
            dest_offset: 0,
            len: 2 * MIB,
        };
        match fill_region(&topo, &region, &[source], &FillOptions::default()) {
            Err(FillError::Read { .. } | FillError::Seek { .. }) => {}
            other => panic!("{test}: {what}: expected a read error, got {other:?}"),
        }
        let got = unsafe { region.as_slice() };
        assert!(
            got.iter().all(|&b| b == 0),
            "{what}: nothing of the file, and no stale byte"
        );
    }
}

/// The CRC-32C of each 2 MiB piece of `file` (holes read as zero).
fn piece_checksums(file: &File, len: u64) -> Vec<u32> {
    let mut buf = vec![0u8; (2 * MIB) as usize];
    (0..len.div_ceil(2 * MIB))
        .map(|k| {
            let n = (2 * MIB).min(len - k * 2 * MIB) as usize;
            file.read_exact_at(&mut buf[..n], k * 2 * MIB)
                .expect("read");
            crc32c::crc32c(&buf[..n])
        })
        .collect()
}

#[test]
fn a_checked_source_fills_what_matches_and_refuses_a_damaged_piece() {
    let _g = huge_lock();
    let test = "fill checked";
    let topo = topology();
    let Some(region) = dirty(&topo, 4, test) else {
        return;
    };
    let len = 8 * MIB;
    let file = sparse_file(len, &[(0, 3 * MIB), (5 * MIB, MIB)]);
    let crcs = piece_checksums(&file, len);
    let expected_sums = Checksums {
        piece: 2 * MIB,
        file_len: len,
        crc32c: &crcs,
    };
    let sources = [FillSource {
        file: file.as_fd(),
        file_offset: 0,
        dest_offset: 0,
        len,
    }];
    let unit = region.state_unit();
    let plan = FillPlan::new(&region, &sources)
        .and_then(|p| p.with_checksums(0, expected_sums, unit))
        .expect("a plan with checksums");
    let report = fill_region_planned(&topo, &region, &plan, &FillOptions::default())
        .expect("a whole file fills");
    assert_eq!(report.counts.bytes_verified, len, "every piece checked");
    assert_eq!(
        first_difference(&region, &expected(len, &[&file], &sources)),
        None
    );

    // One byte changed after the checksums were taken: its piece's unit
    // fails, names the piece, and is left dirty; the others fill.
    file.write_all_at(&[0], 5 * MIB + 7)
        .expect("damage one byte");
    region.mark_all_dirty();
    let plan = FillPlan::new(&region, &sources)
        .and_then(|p| p.with_checksums(0, expected_sums, unit))
        .expect("plan");
    let opts = FillOptions::default();
    for u in [0, 1, 3] {
        assert!(matches!(
            fill_unit(&region, &plan, u, &opts),
            Ok(UnitFill::Filled(_))
        ));
    }
    match fill_unit(&region, &plan, 2, &opts) {
        Err(
            e @ FillError::Checksum {
                index: 0,
                file_offset,
                len,
                expected,
                found,
            },
        ) => {
            println!("{test}: {e}");
            assert_eq!((file_offset, len), (4 * MIB, 2 * MIB));
            assert_eq!(expected, crcs[2]);
            assert_ne!(found, expected);
        }
        other => panic!("expected a checksum error, got {other:?}"),
    }
    assert_eq!(region.states().get(2), Ok(PageState::Dirty));

    // Checksums that cannot be checked on a source are refused up front.
    let short = Checksums {
        crc32c: &crcs[..3],
        ..expected_sums
    };
    let unaligned = [FillSource {
        file_offset: 4096,
        len: len - 4096,
        ..sources[0]
    }];
    for (sources, sums) in [(&sources, short), (&unaligned, expected_sums)] {
        let refused = FillPlan::new(&region, sources).and_then(|p| p.with_checksums(0, sums, unit));
        assert!(
            matches!(refused, Err(FillError::Checksums { index: 0, .. })),
            "{refused:?}"
        );
    }
}
