//! `hugemem bench fill`: the fill engine (`guest_mem::fill`) reading a file
//! on disk into a 2 MiB-page region, against the disk's own sequential read
//! rate, measured in the same run on the same file.
//!
//! The file (`size` bytes, a share of it holes, spread evenly in 1 MiB
//! blocks) is written to a private directory under `dir` (default
//! /var/tmp: real disk, not tmpfs), fsynced, and dropped from the page cache
//! with `POSIX_FADV_DONTNEED` before each cold measurement (only this file's
//! pages: the host-wide `drop_caches` would disturb everyone else). Every
//! figure is the file's size over the time it took, holes included, so the
//! figures compare directly:
//!
//! * `seq_read`: `read(2)` of the whole file in 8 MiB reads into one buffer,
//!   cold: the disk through the page cache, the baseline;
//! * `seq_read_direct`: the same with `O_DIRECT` (no page cache): the device;
//! * `fill_region` into a fresh, populated 2 MiB-page region, cold: `direct`
//!   (the engine's default: `O_DIRECT` reads of a file mostly not in the
//!   page cache), then through the page cache once per read-ahead hint
//!   (`Readahead`: `willneed`, `none`, `sequential`);
//! * `warm`: the engine's default with the file in the page cache (which it
//!   then reads through the page cache): a copy from the page cache into
//!   huge pages, bound by memory bandwidth.
//!
//! Each region is allocated (and populated) before its clock starts, so the
//! figures are the fill alone.

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Instant;

use clearing::RunOptions;
use guest_mem::{
    fill_region, mark_for_fill, FillOptions, FillSource, PagePolicy, PageSize, Readahead, Region,
    RegionSpec, Reservation,
};
use numa::Topology;
use serde::Serialize;

use crate::harness::rounds;
use crate::private_dir::PrivateDir;
use crate::stats::{median, ratio};

/// Block in which the file's data and holes alternate.
const BLOCK: u64 = 1 << 20;
/// Bytes per `read` of the sequential baseline.
const READ_SIZE: usize = 8 << 20;

/// What to measure.
#[derive(Debug, Clone)]
pub struct FillBenchConfig {
    /// Bytes of the file and the region.
    pub size: u64,
    /// Percent of the file that is holes (0..=100).
    pub holes_percent: u64,
    /// Directory the file is written under (a private directory in it).
    pub dir: PathBuf,
    /// Most fill workers (default: the node's CPUs).
    pub threads: Option<usize>,
    /// Repetitions, each measuring everything once in turn (the median is
    /// reported: the cold figures of a virtual disk swing with its host's cache).
    pub reps: usize,
}

/// One fill measurement.
#[derive(Debug, Clone, Serialize)]
pub struct FillPoint {
    /// "direct", a read-ahead hint (through the page cache), or "warm".
    pub mode: String,
    /// File bytes per second, GB/s (10^9 bytes).
    pub gbps: f64,
    /// Over the cold buffered sequential read (`seq_read_gbps`).
    pub vs_seq_read: f64,
    /// Workers that ran.
    pub threads: usize,
    /// Bytes read from the file (the holes were not).
    pub bytes_read: u64,
    /// Of those, bytes read with `O_DIRECT`.
    pub bytes_read_direct: u64,
    /// Bytes of holes skipped.
    pub hole_bytes: u64,
    /// Every repetition's GB/s, in order.
    pub samples: Vec<f64>,
    /// What bounds the figure.
    pub limit: String,
}

/// The report; `--json` prints it as one object.
#[derive(Debug, Clone, Serialize)]
pub struct FillBenchReport {
    /// File and region bytes.
    pub size_bytes: u64,
    /// Percent of the file that is holes.
    pub holes_percent: u64,
    /// Where the file was.
    pub dir: String,
    /// Repetitions (medians are reported).
    pub reps: usize,
    /// Cold `read(2)` of the whole file, GB/s: the disk through the page
    /// cache (limit: the disk).
    pub seq_read_gbps: f64,
    /// Every repetition's `seq_read_gbps`.
    pub seq_read_samples: Vec<f64>,
    /// The same with `O_DIRECT`, GB/s: the device alone (`null` when the file
    /// system refuses `O_DIRECT`).
    pub seq_read_direct_gbps: Option<f64>,
    /// `fill_region`, cold per read-ahead hint, then warm.
    pub fills: Vec<FillPoint>,
}

/// Why the bench failed.
#[derive(Debug, thiserror::Error)]
pub enum FillBenchError {
    /// Zero size or repetitions, holes over 100 %, or a size that is not whole 2 MiB pages.
    #[error("size must be a non-zero multiple of 2 MiB and holes at most 100 %")]
    Config,
    /// File work failed.
    #[error("{what}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        error: std::io::Error,
    },
    /// No 2 MiB pages for the region.
    #[error("cannot reserve {pages} 2 MiB pages: {why}")]
    NoPages {
        /// Pages asked for.
        pages: u64,
        /// Why not.
        why: String,
    },
    /// Topology.
    #[error("cannot read the NUMA topology")]
    Topology(#[from] numa::TopologyError),
    /// The region.
    #[error("cannot allocate the region")]
    Region(#[from] guest_mem::RegionError),
    /// The fill.
    #[error("the fill failed")]
    Fill(#[from] guest_mem::FillError),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> FillBenchError {
    let what = what.into();
    move |error| FillBenchError::Io { what, error }
}

/// Runs the benchmark. `progress` gets one line per step.
pub fn run(
    cfg: &FillBenchConfig,
    progress: &mut dyn FnMut(&str),
) -> Result<FillBenchReport, FillBenchError> {
    let page = PageSize::Huge2M.bytes();
    if cfg.size == 0 || cfg.reps == 0 || !cfg.size.is_multiple_of(page) || cfg.holes_percent > 100 {
        return Err(FillBenchError::Config);
    }
    let topology = Topology::detect()?;
    let pages = cfg.size / page;
    let _pages = match Reservation::for_run(PageSize::Huge2M, pages) {
        Ok(r) if r.report().met => r,
        Ok(r) => {
            let why = format!("{} free", r.report().free);
            return Err(FillBenchError::NoPages { pages, why });
        }
        Err(e) => {
            let why = e.to_string();
            return Err(FillBenchError::NoPages { pages, why });
        }
    };
    let dir = PrivateDir::create_in(&cfg.dir, "hugemem-bench-fill").map_err(io(format!(
        "cannot create a directory under {}",
        cfg.dir.display()
    )))?;
    let path = dir.path().join("fill-source");
    progress(&format!(
        "writing {} with {} % holes to {}",
        guest_mem::size::format_size(cfg.size),
        cfg.holes_percent,
        path.display()
    ));
    let file = write_file(&path, cfg.size, cfg.holes_percent)?;

    let mut seq = Vec::new();
    let mut direct = Vec::new();
    let mut fills: Vec<FillPoint> = Vec::new();
    rounds::each(cfg.reps, |round| {
        drop_cache(&file)?;
        seq.push(gbps(cfg.size, sequential_read(&path, false)?));
        drop_cache(&file)?;
        match sequential_read(&path, true) {
            Ok(seconds) => direct.push(gbps(cfg.size, seconds)),
            Err(e) => progress(&format!("O_DIRECT read refused: {e}")),
        }
        for (i, mode) in MODES.into_iter().enumerate() {
            let point = fill_once(&topology, cfg, &file, &path, mode)?;
            match fills.get_mut(i) {
                Some(p) => p.samples.extend(point.samples),
                None => fills.push(point),
            }
        }
        progress(&format!("repetition {round} done"));
        Ok::<_, FillBenchError>(())
    })?;
    let seq_read_gbps = median(&seq);
    for p in &mut fills {
        p.gbps = median(&p.samples);
        p.vs_seq_read = ratio(p.gbps, seq_read_gbps);
    }
    let seq_read_direct_gbps = (!direct.is_empty()).then(|| median(&direct));
    Ok(FillBenchReport {
        size_bytes: cfg.size,
        holes_percent: cfg.holes_percent,
        dir: cfg.dir.display().to_string(),
        reps: cfg.reps,
        seq_read_gbps,
        seq_read_samples: seq,
        seq_read_direct_gbps,
        fills,
    })
}

/// One fill measured.
#[derive(Debug, Clone, Copy)]
struct Mode {
    name: &'static str,
    readahead: Readahead,
    /// `FillOptions::direct_io`.
    direct_io: bool,
    /// The page cache is dropped first.
    cold: bool,
}

/// The fills measured, in the order each repetition runs them.
const MODES: [Mode; 5] = [
    Mode {
        name: "direct",
        readahead: Readahead::WillNeed,
        direct_io: true,
        cold: true,
    },
    Mode {
        name: "willneed",
        readahead: Readahead::WillNeed,
        direct_io: false,
        cold: true,
    },
    Mode {
        name: "none",
        readahead: Readahead::None,
        direct_io: false,
        cold: true,
    },
    Mode {
        name: "sequential",
        readahead: Readahead::Sequential,
        direct_io: false,
        cold: true,
    },
    Mode {
        name: "warm",
        readahead: Readahead::WillNeed,
        direct_io: true,
        cold: false,
    },
];

/// One `fill_region` of the whole file into a fresh region.
fn fill_once(
    topology: &Topology,
    cfg: &FillBenchConfig,
    file: &File,
    path: &Path,
    mode: Mode,
) -> Result<FillPoint, FillBenchError> {
    let region = fresh_region(topology, cfg.size)?;
    if mode.cold {
        drop_cache(file)?;
    } else {
        // Into the page cache.
        sequential_read(path, false)?;
    }
    let opts = FillOptions {
        dest_is_zero: mark_for_fill(&region),
        readahead: mode.readahead,
        direct_io: mode.direct_io,
        max_threads_per_node: cfg
            .threads
            .unwrap_or(FillOptions::default().max_threads_per_node),
        ..FillOptions::default()
    };
    let source = FillSource {
        file: file.as_fd(),
        file_offset: 0,
        dest_offset: 0,
        len: cfg.size,
    };
    let report = fill_region(topology, &region, &[source], &opts)?;
    let gbps = gbps(cfg.size, report.elapsed.as_secs_f64());
    Ok(FillPoint {
        mode: mode.name.to_string(),
        gbps,
        vs_seq_read: 0.0,
        threads: report.threads,
        bytes_read: report.counts.bytes_read,
        bytes_read_direct: report.counts.bytes_read_direct,
        hole_bytes: report.counts.hole_bytes,
        samples: vec![gbps],
        limit: if mode.direct_io && mode.cold {
            "the device (O_DIRECT)"
        } else if mode.cold {
            "disk (cold page cache)"
        } else {
            "memory bandwidth (page cache to huge pages)"
        }
        .to_string(),
    })
}

impl FillBenchReport {
    /// The report as a text table.
    pub fn to_table(&self) -> String {
        let mut out = format!(
            "fill: {} file, {} % holes, under {}; medians of {} repetitions\n",
            guest_mem::size::format_size(self.size_bytes),
            self.holes_percent,
            self.dir,
            self.reps
        );
        out.push_str(&format!(
            "  {:<28} {:>8.2} GB/s  (limit: disk, cold page cache)\n",
            "sequential read(2)", self.seq_read_gbps
        ));
        if let Some(direct) = self.seq_read_direct_gbps {
            out.push_str(&format!(
                "  {:<28} {:>8.2} GB/s  (limit: the device, no page cache)\n",
                "sequential O_DIRECT read", direct
            ));
        }
        for p in &self.fills {
            let direct = if p.bytes_read > 0 {
                100.0 * p.bytes_read_direct as f64 / p.bytes_read as f64
            } else {
                0.0
            };
            out.push_str(&format!(
                "  {:<28} {:>8.2} GB/s  {:>5.2}x seq read, {} workers, {:.0} % read with O_DIRECT  (limit: {})\n",
                format!("fill_region, {}", p.mode),
                p.gbps,
                p.vs_seq_read,
                p.threads,
                direct,
                p.limit
            ));
        }
        out
    }
}

/// A fresh region on 2 MiB pages on the first node with CPUs, populated
/// (outside every clock).
fn fresh_region(topology: &Topology, size: u64) -> Result<Region, FillBenchError> {
    let node = topology
        .nodes()
        .iter()
        .find(|n| !n.cpus.is_empty())
        .map(|n| n.id);
    let spec =
        RegionSpec::new("bench-fill", size, node).with_policy(PagePolicy::Strict(PageSize::Huge2M));
    Ok(Region::allocate(topology, &spec, &RunOptions::default())?.0)
}

/// The file: data blocks of non-zero bytes, holes spread evenly among them.
fn write_file(path: &Path, size: u64, holes_percent: u64) -> Result<File, FillBenchError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(io(format!("cannot create {}", path.display())))?;
    let mut block = vec![0u8; BLOCK as usize];
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    for (i, offset) in (0..size).step_by(BLOCK as usize).enumerate() {
        let i = i as u64;
        // Bresenham: block i is a hole when the running share of holes steps.
        if (i + 1) * holes_percent / 100 != i * holes_percent / 100 {
            continue;
        }
        for word in block.chunks_exact_mut(8) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            word.copy_from_slice(&(state | 1).to_le_bytes());
        }
        let len = BLOCK.min(size - offset) as usize;
        file.write_all_at(&block[..len], offset)
            .map_err(io("cannot write the file"))?;
    }
    file.set_len(size).map_err(io("cannot size the file"))?;
    file.sync_all().map_err(io("cannot fsync the file"))?;
    Ok(file)
}

/// Drops the file's pages from the page cache (they are clean: fsynced).
pub(crate) fn drop_cache(file: &File) -> Result<(), FillBenchError> {
    file.sync_data().map_err(io("cannot fsync the file"))?;
    nix::fcntl::posix_fadvise(
        file.as_fd(),
        0,
        0,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
    )
    .map_err(|e| io("cannot drop the file from the page cache")(e.into()))
}

/// Seconds to read the whole file with `READ_SIZE` reads into one buffer.
pub(crate) fn sequential_read(path: &Path, direct: bool) -> Result<f64, FillBenchError> {
    let mut opts = OpenOptions::new();
    opts.read(true);
    if direct {
        opts.custom_flags(libc::O_DIRECT);
    }
    let mut file = opts
        .open(path)
        .map_err(io(format!("cannot open {}", path.display())))?;
    // O_DIRECT wants an aligned buffer: a 4 KiB-aligned window of a larger one.
    let mut buf = vec![0u8; READ_SIZE + 4096];
    let skip = buf.as_ptr().align_offset(4096);
    let window = &mut buf[skip..skip + READ_SIZE];
    let started = Instant::now();
    loop {
        let n = file.read(window).map_err(io("cannot read the file"))?;
        if n == 0 {
            break;
        }
    }
    Ok(started.elapsed().as_secs_f64())
}

pub(crate) fn gbps(bytes: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        // Precision loss above 2^53 bytes is irrelevant for a rate.
        #[allow(clippy::cast_precision_loss)]
        let b = bytes as f64;
        b / 1e9 / seconds
    } else {
        0.0
    }
}
