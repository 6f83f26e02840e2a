//! What `bench offload` is asked to do and what it reports.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::path::PathBuf;

use guest_mem::size::format_size;
use serde::Serialize;

pub use super::figure::Figure;
use super::qemu_report::{QemuComparison, QemuResult};
use super::save_vs_disk::{DiskWriteResult, SaveOverDisk, Spread, SAVE_SHARE};
use crate::stats::{paired_median, paired_median_ci95};
use crate::vmm_update::setup::one_gib_pages;

/// The run's settings.
#[derive(Debug, Clone)]
pub struct OffloadConfig {
    /// Guest RAM, bytes.
    pub size: u64,
    /// Page size of guest RAM, every variant (2 MiB or 1 GiB).
    pub page_size: guest_mem::PageSize,
    /// Repetitions, each running every variant once.
    pub reps: usize,
    /// Where the snapshots are written (a private directory in it): a
    /// real disk, not tmpfs.
    pub dir: PathBuf,
    /// The cloud-hypervisor binary.
    pub cloud_hypervisor: OsString,
    /// cloud-hypervisor's reference `offload_daemon`; `None`: that
    /// variant does not run.
    pub offload_daemon: Option<OsString>,
    /// The `hugemem` binary (`serve`, `launch`, `park`, `unpark`).
    pub launcher: PathBuf,
    /// Every guest's RAM filled with incompressible bytes before its first
    /// park or snapshot, all but what the guest uses or checks (a guest
    /// that wrote all its memory; `dense.rs`); else the guest's one word
    /// per 4 KiB page and zeros.
    pub dense: bool,
    /// The QEMU binary for QEMU's rows; `None`: they do not run.
    pub qemu: Option<OsString>,
}

/// hugemem's park and restore from the park.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FromParkResult {
    /// `hugemem park`'s wall time, ms.
    pub park_ms: Figure,
    /// `hugemem launch --restore`'s start to the guest counting again, ms.
    pub restore_ms: Figure,
    /// The launcher's own figure for the restore (its "restored:" line's
    /// `ms`: the RESTORE exchange, until the daemon's answer), ms.
    pub restore_launcher_ms: Figure,
    /// The guest's largest recorded gap across park and restore, ms.
    pub pause_ms: Figure,
    /// Guest RAM bytes the daemon copied for the parks (STATS), most of
    /// the repetitions (0 expected: the memory moves).
    pub park_copied_bytes: u64,
    /// What the old cloud-hypervisor wrote during the park (`/proc/PID/io`
    /// `wchar`, last read before it exited: a lower bound), most of the
    /// repetitions, bytes.
    pub park_written_bytes: u64,
    /// Pages the guest found changed (its own check), most of the repetitions.
    pub stale_guest: u64,
}

/// hugemem's save to disk and restore from it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FromDiskResult {
    /// `hugemem unpark NAME --save DIR`'s wall time, ms.
    pub save_ms: Figure,
    /// The save's own figure (its "in X s": the first byte to the
    /// directory in place, flushes included), ms.
    pub save_own_ms: Figure,
    /// CPU time of the `hugemem unpark --save` process (user + system, all
    /// its threads: its reads of guest memory, checksums, system calls),
    /// ms: beside `save_ms`, how much of the save was work, not waiting.
    pub save_cpu_ms: Figure,
    /// Bytes the save wrote (its files' bytes on disk), each repetition.
    pub save_written_bytes: Figure,
    /// `save_written_bytes` over `save_ms`, GB/s.
    pub save_gbps: Figure,
    /// The last save's own line (`hugemem unpark --save`'s stdout): what it
    /// wrote, how much of it direct, what it left as holes.
    pub save_line: String,
    /// The disk's write rates around each save, and the save's over them
    /// (`save_vs_disk.rs`).
    pub disk_write: DiskWriteResult,
    /// How long the daemon took to scrub the memory the save returned
    /// (waited for before the load), ms.
    pub scrub_wait_ms: Figure,
    /// `hugemem park NAME --from-dir DIR`'s wall time, cold cache, ms.
    pub load_ms: Figure,
    /// The daemon's own time for the load's copy (its fill engine, from
    /// its log), ms.
    pub load_daemon_copy_ms: Figure,
    /// Bytes the saved files hold on disk (a slot the guest never wrote
    /// is a hole), most of the repetitions.
    pub saved_bytes_on_disk: u64,
    /// `saved_bytes_on_disk` over `load_ms`, GB/s.
    pub load_gbps: Figure,
    /// The disk's sequential read rate on the saved memory file with the
    /// most bytes on disk, cold (`bench fill`'s measurement), just before
    /// the load, GB/s.
    pub disk_read_gbps: Figure,
    /// The load's rate over the disk's, each repetition.
    pub load_vs_disk: Figure,
    /// `hugemem launch --restore` of the loaded VM: its start to the guest
    /// counting, ms.
    pub restore_ms: Figure,
    /// Load plus restore: files on disk (cold) to the guest counting, ms.
    pub disk_to_running_ms: Figure,
    /// Pages the guest found changed, most of the repetitions.
    pub stale_guest: u64,
    /// With `--dense`: pages below 2 GiB whose filled bytes the host found
    /// changed after the restore, most of the repetitions.
    pub stale_dense: u64,
}

/// hugemem's restore on demand from disk: the saved files parked with
/// `--on-demand` (checked, nothing read) and restored with `hugemem launch
/// --restore --on-demand` (cloud-hypervisor's postcopy: the guest runs at
/// once; the daemon reads each page as the guest faults it, and the rest in
/// the background).
#[derive(Debug, Clone, Default, Serialize)]
pub struct OnDemandResult {
    /// `hugemem park NAME --from-dir DIR --on-demand`'s wall time, cold
    /// cache, ms.
    pub park_ms: Figure,
    /// `hugemem launch --restore NAME --on-demand`: its start to the guest
    /// counting, ms.
    pub restore_ms: Figure,
    /// Park plus restore: files on disk (cold) to the guest counting, ms.
    pub disk_to_running_ms: Figure,
    /// The restore's start to every page filled (the launcher's
    /// "restored:" line: the daemon answers once the last page is in), ms.
    pub all_filled_ms: Figure,
    /// Pages the host found without the guest's value once every page was
    /// filled (every 4 KiB page below 2 GiB), most of the repetitions.
    pub stale_host: u64,
    /// With `--dense`: pages below 2 GiB whose filled bytes the host found
    /// changed once every page was filled, most of the repetitions.
    pub stale_dense: u64,
    /// Pages the guest found changed, most of the repetitions.
    pub stale_guest: u64,
}

/// cloud-hypervisor's own `file://` snapshot and restore.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChFileResult {
    /// `vm.pause` plus `vm.snapshot file://DIR`, ms.
    pub snapshot_ms: Figure,
    /// Bytes its files hold on disk, most of the repetitions.
    pub snapshot_bytes_on_disk: u64,
    /// `cloud-hypervisor --restore source_url=file://DIR,resume=true`'s
    /// start to the guest counting, cold cache, ms.
    pub restore_ms: Figure,
    /// Pages the guest found changed, most of the repetitions.
    pub stale_guest: u64,
}

/// cloud-hypervisor's reference offload daemon.
#[derive(Debug, Clone, Default, Serialize)]
pub struct OffloadDaemonResult {
    /// `offload_daemon snapshot`'s start to its exit (the VM received by
    /// local migration and written to disk), ms.
    pub park_ms: Figure,
    /// Bytes its files hold on disk, most of the repetitions.
    pub snapshot_bytes_on_disk: u64,
    /// The new cloud-hypervisor's start to the guest counting, fed by
    /// `offload_daemon restore --resume`, cold cache, ms.
    pub restore_ms: Figure,
    /// Pages the guest found changed, most of the repetitions.
    pub stale_guest: u64,
}

/// The report of one run.
#[derive(Debug, Clone, Serialize)]
pub struct OffloadReport {
    /// Guest RAM, bytes.
    pub size: u64,
    /// Page size of guest RAM, every variant.
    pub page_size: String,
    /// Why not on 1 GiB pages: what the host has of them.
    pub page_size_note: String,
    /// Repetitions.
    pub reps: usize,
    /// Every guest's RAM filled with incompressible bytes (`--dense`).
    pub dense: bool,
    /// Where the snapshots went.
    pub dir: String,
    /// Host TSC rate, GHz.
    pub tsc_ghz: f64,
    /// hugemem: park and restore from the park.
    pub from_park: FromParkResult,
    /// hugemem: save to disk and restore from it.
    pub from_disk: FromDiskResult,
    /// cloud-hypervisor's `file://`, when it ran.
    pub ch_file: Option<ChFileResult>,
    /// Why it did not run (or stopped).
    pub ch_file_note: Option<String>,
    /// The reference offload daemon, when it ran.
    pub offload_daemon: Option<OffloadDaemonResult>,
    /// Why it did not run (or stopped).
    pub offload_daemon_note: Option<String>,
    /// hugemem: restore on demand from disk.
    pub on_demand: OnDemandResult,
    /// Median load rate over the median disk read rate.
    pub load_vs_disk: f64,
    /// The save's rate over the disk's write rates beside it, over the
    /// rounds (`None` when none ran).
    pub save_over_disk: Option<SaveOverDisk>,
    /// cloud-hypervisor's `file://` restore over hugemem's disk to running
    /// (medians).
    pub ch_file_over_from_disk: Option<f64>,
    /// Paired median of cloud-hypervisor's `file://` restore less
    /// hugemem's disk to running, ms.
    pub ch_file_minus_from_disk_paired_ms: Option<f64>,
    /// Its 95 % interval (sign test; 6 repetitions and more), ms.
    pub ch_file_minus_from_disk_ci95_ms: Option<[f64; 2]>,
    /// cloud-hypervisor's `file://` restore over hugemem's on-demand disk
    /// to running (medians): how much sooner the guest runs.
    pub ch_file_over_on_demand: Option<f64>,
    /// The offload daemon's restore over hugemem's disk to running (medians).
    pub offload_daemon_over_from_disk: Option<f64>,
    /// The offload daemon's restore over hugemem's restore from the park
    /// (medians).
    pub offload_daemon_over_from_park: Option<f64>,
    /// QEMU's rows (`qemu_side.rs`), when they ran (not with `--dense`:
    /// their guests are not filled).
    pub qemu: Option<QemuResult>,
    /// Why they did not run (or stopped).
    pub qemu_note: Option<String>,
    /// Their comparisons.
    pub qemu_comparison: Option<QemuComparison>,
}

/// What the host has of 1 GiB pages, and why a run is on 2 MiB pages.
fn page_size_note(size: u64, page: guest_mem::PageSize) -> String {
    let (total, free) = one_gib_pages();
    if page == guest_mem::PageSize::Huge1G {
        return format!("run on 1 GiB pages; the host had {total} of them at the end of the run");
    }
    format!(
        "run on 2 MiB pages; the host has {} huge pages of 1 GiB ({} free), a run on them needs {}",
        total,
        free,
        size.div_ceil(1 << 30)
    )
}

/// What the run measured, before it is compared.
pub(crate) struct Measured {
    pub(crate) tsc_hz: f64,
    pub(crate) from_park: FromParkResult,
    pub(crate) from_disk: FromDiskResult,
    pub(crate) on_demand: OnDemandResult,
    pub(crate) ch_file: Option<ChFileResult>,
    pub(crate) ch_file_note: Option<String>,
    pub(crate) offload_daemon: Option<OffloadDaemonResult>,
    pub(crate) offload_daemon_note: Option<String>,
    pub(crate) qemu: Option<QemuResult>,
    pub(crate) qemu_note: Option<String>,
}

impl OffloadReport {
    /// The report of `m`, its comparisons made.
    pub(crate) fn assemble(cfg: &OffloadConfig, m: Measured) -> Self {
        let ratio = |a: f64, b: f64| (b > 0.0).then(|| a / b);
        let disk = &m.from_disk;
        let cold = &disk.disk_to_running_ms;
        let ch = m.ch_file.as_ref();
        let od = m.offload_daemon.as_ref();
        Self {
            size: cfg.size,
            page_size: cfg.page_size.to_string(),
            page_size_note: page_size_note(cfg.size, cfg.page_size),
            reps: cfg.reps,
            dense: cfg.dense,
            dir: cfg.dir.display().to_string(),
            tsc_ghz: m.tsc_hz / 1e9,
            load_vs_disk: ratio(disk.load_gbps.median, disk.disk_read_gbps.median).unwrap_or(0.0),
            save_over_disk: SaveOverDisk::of(&disk.disk_write),
            ch_file_over_from_disk: ch.and_then(|c| ratio(c.restore_ms.median, cold.median)),
            ch_file_minus_from_disk_paired_ms: ch
                .and_then(|c| paired_median(&c.restore_ms.samples, &cold.samples)),
            ch_file_minus_from_disk_ci95_ms: ch
                .and_then(|c| paired_median_ci95(&c.restore_ms.samples, &cold.samples)),
            ch_file_over_on_demand: ch
                .and_then(|c| ratio(c.restore_ms.median, m.on_demand.disk_to_running_ms.median)),
            offload_daemon_over_from_disk: od.and_then(|o| ratio(o.restore_ms.median, cold.median)),
            offload_daemon_over_from_park: od
                .and_then(|o| ratio(o.restore_ms.median, m.from_park.restore_ms.median)),
            on_demand: m.on_demand,
            from_park: m.from_park,
            from_disk: m.from_disk,
            ch_file: m.ch_file,
            ch_file_note: m.ch_file_note,
            offload_daemon: m.offload_daemon,
            offload_daemon_note: m.offload_daemon_note,
            qemu_comparison: m.qemu.as_ref().map(QemuComparison::of),
            qemu: m.qemu,
            qemu_note: m.qemu_note,
        }
    }

    /// A text table: each variant's park (or save) and restore.
    pub fn to_table(&self) -> String {
        let mut t = String::new();
        let _ = writeln!(
            t,
            "offload: {}{} on {} pages, {} repetitions, snapshots under {}, TSC {:.3} GHz",
            format_size(self.size),
            if self.dense { " dense" } else { "" },
            self.page_size,
            self.reps,
            self.dir,
            self.tsc_ghz
        );
        let ms = |f: &Figure| format!("{:.1}", f.median);
        let col = |v: Option<String>| v.unwrap_or_else(|| "-".into());
        let _ = writeln!(
            t,
            "{:<44} {:>14} {:>14} {:>16}",
            "median of the repetitions", "park/save, ms", "restore, ms", "guest pause, ms"
        );
        let p = &self.from_park;
        let _ = writeln!(
            t,
            "{:<44} {:>14} {:>14} {:>16}",
            "hugemem: park, restore from the park",
            ms(&p.park_ms),
            ms(&p.restore_ms),
            format!("{:.2}", p.pause_ms.median)
        );
        let d = &self.from_disk;
        let _ = writeln!(
            t,
            "{:<44} {:>14} {:>14} {:>16}",
            "hugemem: save, load + restore from disk",
            ms(&d.save_ms),
            ms(&d.disk_to_running_ms),
            "-"
        );
        let od = &self.on_demand;
        let _ = writeln!(
            t,
            "{:<44} {:>14} {:>14} {:>16}",
            "hugemem: park on demand, to a running guest",
            ms(&od.park_ms),
            ms(&od.disk_to_running_ms),
            "-"
        );
        let c = self.ch_file.as_ref();
        let _ = writeln!(
            t,
            "{:<44} {:>14} {:>14} {:>16}",
            "cloud-hypervisor file:// snapshot, restore",
            col(c.map(|c| ms(&c.snapshot_ms))),
            col(c.map(|c| ms(&c.restore_ms))),
            "-"
        );
        let o = self.offload_daemon.as_ref();
        let _ = writeln!(
            t,
            "{:<44} {:>14} {:>14} {:>16}",
            "offload_daemon snapshot, restore",
            col(o.map(|o| ms(&o.park_ms))),
            col(o.map(|o| ms(&o.restore_ms))),
            "-"
        );
        let _ = writeln!(
            t,
            "park: {} bytes copied (STATS), {} written by the old cloud-hypervisor; restore's RESTORE exchange {:.1} ms",
            p.park_copied_bytes, p.park_written_bytes, p.restore_launcher_ms.median
        );
        let _ = writeln!(
            t,
            "load from disk {:.2} GB/s ({} on disk in {:.1} ms), disk read {:.2} GB/s: {:.2}x the disk (expected >= 0.8x); restore after the load {:.1} ms",
            d.load_gbps.median, format_size(d.saved_bytes_on_disk), d.load_ms.median, d.disk_read_gbps.median, self.load_vs_disk, d.restore_ms.median
        );
        t += &self.save_text();
        let interval = col(self
            .ch_file_minus_from_disk_ci95_ms
            .map(|[lo, hi]| format!("95 % interval {lo:+.1} .. {hi:+.1}")));
        let _ = writeln!(
            t,
            "file:// restore / hugemem from disk {} (expected >= 2x; paired difference {} ms, {}); offload_daemon restore / hugemem from disk {}, / from the park {}",
            col(self.ch_file_over_from_disk.map(|r| format!("{r:.2}x"))),
            col(self.ch_file_minus_from_disk_paired_ms.map(|v| format!("{v:+.1}"))),
            interval,
            col(self.offload_daemon_over_from_disk.map(|r| format!("{r:.2}x"))),
            col(self.offload_daemon_over_from_park.map(|r| format!("{r:.1}x"))),
        );
        let _ = writeln!(
            t,
            "on demand: the guest counting {:.1} ms after the restore's start ({:.1} ms after the park's; expected <= 20 ms at 8 GiB), every page filled after {:.1} ms; {} pages stale on the host's check",
            od.restore_ms.median, od.disk_to_running_ms.median, od.all_filled_ms.median, od.stale_host
        );
        let stale = p.stale_guest
            + d.stale_guest
            + od.stale_guest
            + c.map_or(0, |c| c.stale_guest)
            + o.map_or(0, |o| o.stale_guest);
        let stale = stale + self.qemu.as_ref().map_or(0, |q| q.stale_guest);
        if let Some((q, c)) = self.qemu.as_ref().zip(self.qemu_comparison.as_ref()) {
            t += &c.text(q);
        }
        let _ = writeln!(t, "stale pages the guests found, all variants: {stale}");
        for note in [
            &self.ch_file_note,
            &self.offload_daemon_note,
            &self.qemu_note,
        ]
        .into_iter()
        .flatten()
        {
            let _ = writeln!(t, "note: {note}");
        }
        let _ = writeln!(t, "note: {}", self.page_size_note);
        t
    }

    /// The save's lines of [`OffloadReport::to_table`]: its rate beside
    /// the disk's, and with `--dense` the host's check of the bytes.
    fn save_text(&self) -> String {
        let mut t = String::new();
        let d = &self.from_disk;
        let _ = writeln!(
            t,
            "save {:.2} GB/s ({} written in {:.1} ms, its own figure {:.1} ms, its CPU time {:.1} ms); the disk's write of as many bytes: one direct writer {:.2} / {:.2} GB/s before / after, the saver's direct writers {:.2} / {:.2}, buffered + fsync {:.2}",
            d.save_gbps.median,
            format_size(d.save_written_bytes.median as u64),
            d.save_ms.median,
            d.save_own_ms.median,
            d.save_cpu_ms.median,
            d.disk_write.single_before_gbps.median,
            d.disk_write.single_after_gbps.median,
            d.disk_write.parallel_before_gbps.median,
            d.disk_write.parallel_after_gbps.median,
            d.disk_write.buffered_gbps.median,
        );
        if let Some(s) = &self.save_over_disk {
            let spread = |x: &Option<Spread>| {
                x.as_ref().map_or_else(
                    || "-".into(),
                    |x| {
                        let ci = x.ci95.map_or_else(String::new, |[lo, hi]| {
                            format!(", 95 % interval {lo:.2} .. {hi:.2}")
                        });
                        format!(
                            "{:.2}x ({} rounds {:.2} .. {:.2}{ci})",
                            x.median, x.rounds, x.min, x.max
                        )
                    },
                )
            };
            let _ = writeln!(
                t,
                "save over the disk's direct write (dd-like) {} (expected >= {SAVE_SHARE}x); over the saver's direct writers {}; over buffered + fsync {}; the disk's drift across a save (after over before) {}",
                spread(&s.single),
                spread(&s.parallel),
                spread(&s.buffered),
                spread(&s.single_drift),
            );
        }
        if self.dense {
            let _ = writeln!(
                t,
                "dense: pages whose filled bytes changed: after the load {}, on demand {}",
                d.stale_dense, self.on_demand.stale_dense
            );
        }
        t
    }
}
