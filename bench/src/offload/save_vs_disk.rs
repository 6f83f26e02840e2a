//! The save beside the disk's own write rate, round by round (one round
//! per repetition): right before the save, the disk writes as many bytes
//! with one direct writer (`dd`-like), then with direct writers as the
//! saver's ([`disk_write`]); the save; then the same two in the reverse
//! order (so that both stand as far from the save on average), and the
//! same bytes through the page cache with `fsync`. Every file of the
//! round stays until the round ends, as the save's files stay (the file
//! system discards a removed file's blocks: a removal between two writes
//! would give the disk work that the save does not meet). The save's rate is
//! compared with the mean of each direct writer's rates before and after
//! it: the disk of this host drifts (a virtual disk on a shared host), and
//! what it did on both sides of the save is the nearest measure of what it
//! could do during it. The drift itself (after over before) is kept.

use std::path::{Path, PathBuf};

use serde::Serialize;

use super::disk_write::{write_gbps, Writer};
use super::error::OffloadError;
use super::figure::Figure;
use crate::stats::median_ci95;

/// The disk's write rates around each save, and the save's over them.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DiskWriteResult {
    /// One direct writer (`dd bs=1M oflag=direct conv=fsync`) right before
    /// the save, GB/s.
    pub single_before_gbps: Figure,
    /// The same right after the save (and the daemon's scrub of what it
    /// returned), GB/s.
    pub single_after_gbps: Figure,
    /// Direct writers as the saver's (its threads, 8 MiB `pwrite`s to a
    /// file sized first) right before the save, GB/s.
    pub parallel_before_gbps: Figure,
    /// The same right after the save, GB/s.
    pub parallel_after_gbps: Figure,
    /// One writer through the page cache, then `fsync` (`dd bs=1M
    /// conv=fsync`), after the direct ones, GB/s.
    pub buffered_gbps: Figure,
    /// The save's rate over the mean of `single_before_gbps` and
    /// `single_after_gbps`, round by round.
    pub save_over_single: Figure,
    /// The save's rate over the mean of the parallel rates before and
    /// after, round by round.
    pub save_over_parallel: Figure,
    /// The save's rate over `buffered_gbps`, round by round.
    pub save_over_buffered: Figure,
    /// `single_after_gbps` over `single_before_gbps`: how far the disk
    /// drifted across the save.
    pub single_after_over_before: Figure,
    /// `parallel_after_gbps` over `parallel_before_gbps`.
    pub parallel_after_over_before: Figure,
    /// The host's 1-minute load average as each save started.
    pub host_load: Figure,
}

/// A ratio's rounds: median, least, most and the median's 95 % interval
/// (sign test, 6 rounds and more).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Spread {
    /// Rounds.
    pub rounds: usize,
    /// Median.
    pub median: f64,
    /// Least.
    pub min: f64,
    /// Most.
    pub max: f64,
    /// The median's 95 % interval (`None` under 6 rounds).
    pub ci95: Option<[f64; 2]>,
}

impl Spread {
    /// The spread of `f`'s samples; `None` when it has none.
    pub(crate) fn of(f: &Figure) -> Option<Self> {
        let s = &f.samples;
        (!s.is_empty()).then(|| Self {
            rounds: s.len(),
            median: f.median,
            min: s.iter().copied().fold(f64::INFINITY, f64::min),
            max: s.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            ci95: median_ci95(s),
        })
    }
}

/// The save over the disk's write rates, summed up over the rounds.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SaveOverDisk {
    /// The save's rate over one direct writer's (`dd`-like): the
    /// expectation's ratio (at least [`SAVE_SHARE`]).
    pub single: Option<Spread>,
    /// Over direct writers as the saver's.
    pub parallel: Option<Spread>,
    /// Over one writer through the page cache with `fsync`.
    pub buffered: Option<Spread>,
    /// The disk's drift across a save, one direct writer (after over
    /// before).
    pub single_drift: Option<Spread>,
    /// The same, direct writers as the saver's.
    pub parallel_drift: Option<Spread>,
}

/// Least save rate over the disk's direct write rate (issue 43).
pub const SAVE_SHARE: f64 = 0.8;

impl SaveOverDisk {
    /// The summary of `d`; `None` when no round ran.
    pub(crate) fn of(d: &DiskWriteResult) -> Option<Self> {
        (!d.save_over_single.samples.is_empty()
            || !d.save_over_parallel.samples.is_empty()
            || !d.save_over_buffered.samples.is_empty())
        .then(|| Self {
            single: Spread::of(&d.save_over_single),
            parallel: Spread::of(&d.save_over_parallel),
            buffered: Spread::of(&d.save_over_buffered),
            single_drift: Spread::of(&d.single_after_over_before),
            parallel_drift: Spread::of(&d.parallel_after_over_before),
        })
    }
}

/// What a save did, for its round.
pub(super) struct SaveDone {
    /// Bytes it wrote (its files' bytes on disk).
    pub(super) written: u64,
    /// Its rate, GB/s.
    pub(super) gbps: f64,
}

/// One round in `dir`: the direct writers before (`bytes_before` bytes:
/// what the save is about to write), `save`, then the direct writers in
/// the reverse order and the buffered one, as many bytes as the save
/// wrote. Adds to `out`.
pub(super) fn round(
    dir: &Path,
    bytes_before: u64,
    out: &mut DiskWriteResult,
    save: impl FnOnce() -> Result<SaveDone, OffloadError>,
) -> Result<(), OffloadError> {
    let files = RoundFiles(dir.to_path_buf());
    let write = |name: &str, bytes: u64, writer: Writer| {
        write_gbps(&files.0.join(format!("disk-write-{name}")), bytes, writer)
    };
    let single_before = write("single-before", bytes_before, Writer::Single)?;
    let parallel_before = write("parallel-before", bytes_before, Writer::Parallel)?;
    out.host_load.push(load_average());
    let done = save()?;
    let parallel_after = write("parallel-after", done.written, Writer::Parallel)?;
    let single_after = write("single-after", done.written, Writer::Single)?;
    let buffered = write("buffered", done.written, Writer::Buffered)?;
    drop(files);
    let pair = |before: Option<f64>, after: Option<f64>, [b, a, over, drift]: [&mut Figure; 4]| {
        if let (Some(before), Some(after)) = (before, after) {
            b.push(before);
            a.push(after);
            over.push(done.gbps / ((before + after) / 2.0));
            drift.push(after / before);
        }
    };
    pair(
        single_before,
        single_after,
        [
            &mut out.single_before_gbps,
            &mut out.single_after_gbps,
            &mut out.save_over_single,
            &mut out.single_after_over_before,
        ],
    );
    pair(
        parallel_before,
        parallel_after,
        [
            &mut out.parallel_before_gbps,
            &mut out.parallel_after_gbps,
            &mut out.save_over_parallel,
            &mut out.parallel_after_over_before,
        ],
    );
    if let Some(buffered) = buffered {
        out.buffered_gbps.push(buffered);
        out.save_over_buffered.push(done.gbps / buffered);
    }
    Ok(())
}

/// Checks that `dir`'s file system has room for a round of saves of
/// `bytes`: the save's files and its writers' kept until the round ends.
pub(super) fn room_for_rounds(dir: &Path, bytes: u64) -> Result<(), OffloadError> {
    let fs = nix::sys::statvfs::statvfs(dir)
        .map_err(|e| OffloadError::Setup(format!("statvfs {}: {e}", dir.display())))?;
    let free = fs.blocks_available() * fs.fragment_size();
    let needed = (ROUND_FILES.len() as u64 + 1) * bytes;
    if free < needed {
        return Err(OffloadError::Setup(format!(
            "{} has {} free; a save and the disk's writes beside it need {}",
            dir.display(),
            guest_mem::size::format_size(free),
            guest_mem::size::format_size(needed)
        )));
    }
    Ok(())
}

/// The files of a round's writers in a directory, removed when dropped.
struct RoundFiles(PathBuf);

impl Drop for RoundFiles {
    fn drop(&mut self) {
        for name in ROUND_FILES {
            let _ = std::fs::remove_file(self.0.join(format!("disk-write-{name}")));
        }
    }
}

/// The names of a round's files (after `disk-write-`).
const ROUND_FILES: [&str; 5] = [
    "single-before",
    "parallel-before",
    "parallel-after",
    "single-after",
    "buffered",
];

/// The host's load average over the last minute (`/proc/loadavg`), 0 when
/// unreadable.
fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_compares_the_save_with_the_disk_on_both_sides() {
        let tmp = tempfile::tempdir_in("/var/tmp").expect("tempdir");
        let mut out = DiskWriteResult::default();
        round(tmp.path(), 1, &mut out, || {
            Ok(SaveDone {
                written: 1,
                gbps: 0.5,
            })
        })
        .expect("round");
        assert_eq!(out.buffered_gbps.samples.len(), 1);
        assert_eq!(out.save_over_buffered.samples.len(), 1);
        // Direct where the file system takes it.
        let direct = out.single_before_gbps.samples.len();
        assert_eq!(out.save_over_single.samples.len(), direct);
        assert_eq!(out.save_over_parallel.samples.len(), direct);
        if direct == 1 {
            let mean = (out.single_before_gbps.median + out.single_after_gbps.median) / 2.0;
            assert!((out.save_over_single.median - 0.5 / mean).abs() < 1e-12);
        }
        let left: Vec<_> = std::fs::read_dir(tmp.path()).expect("list").collect();
        assert!(left.is_empty(), "the round removes its files: {left:?}");
        let summary = SaveOverDisk::of(&out).expect("one round");
        assert_eq!(summary.buffered.expect("buffered").rounds, 1);
        assert!(SaveOverDisk::of(&DiskWriteResult::default()).is_none());
    }

    #[test]
    fn a_spread_has_its_ends_and_an_interval_from_six_rounds() {
        let mut f = Figure::default();
        for x in [0.9, 0.7, 1.1, 0.8, 1.0] {
            f.push(x);
        }
        let s = Spread::of(&f).expect("samples");
        assert_eq!((s.rounds, s.median, s.min, s.max), (5, 0.9, 0.7, 1.1));
        assert!(s.ci95.is_none(), "under 6 rounds");
        f.push(0.95);
        assert!(Spread::of(&f).expect("samples").ci95.is_some());
        assert!(Spread::of(&Figure::default()).is_none());
    }
}
