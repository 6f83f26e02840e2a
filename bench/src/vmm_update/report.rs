//! What `bench vmm-update` is asked to do and what it reports.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::path::PathBuf;

use guest_mem::size::format_size;
use hugemem::launch::Vmm;

use super::setup::{one_gib_pages, STRIDE};
use crate::stats;
use crate::vmm_side::PerVmm;
use serde::Serialize;

/// The run's settings.
#[derive(Debug, Clone)]
pub struct VmmUpdateConfig {
    /// The VMM updated.
    pub vmm: Vmm,
    /// Guest RAM, bytes.
    pub size: u64,
    /// Live updates in a row on the hugemem side and the floor (the
    /// copying migration runs once).
    pub updates: usize,
    /// The VMM's binary (every side; also the update's new binary).
    pub program: OsString,
    /// The `hugemem` binary (`serve`, `launch`).
    pub launcher: PathBuf,
    /// Skip the copying baseline (it needs twice the RAM in huge pages).
    pub no_copy: bool,
}

/// A run of live updates in a row on the same pages (QEMU:
/// `x-ignore-shared`; cloud-hypervisor: local migration):
/// what each update cost the guest, and what the guest and host found after.
#[derive(Debug, Clone, Default, Serialize)]
pub struct UpdateSeries {
    /// Updates done.
    pub updates: usize,
    /// Guest-visible pause of each update, ms (largest TSC gap).
    pub downtime_ms: Vec<f64>,
    /// Median of `downtime_ms`.
    pub downtime_median_ms: f64,
    /// Largest gap over an idle window as long as an update, ms: the noise floor.
    pub idle_gap_ms: f64,
    /// The guest's gap overlapping the switch (`migrate` to RESUME, placed
    /// on the guest's clock), each update, ms; `None` when none of the
    /// recorded gaps (at least 0.2 ms) overlaps it.
    pub switch_gap_ms: Vec<Option<f64>>,
    /// Median of the `switch_gap_ms` found.
    pub switch_gap_median_ms: Option<f64>,
    /// The new VMM's start (hugemem: the request) to the old VMM gone,
    /// each update, ms.
    pub update_ms: Vec<f64>,
    /// Median of `update_ms`.
    pub update_median_ms: f64,
    /// `migrate` to the new QEMU's RESUME (cloud-hypervisor:
    /// `send-migration` to the new process's `receive-migration` answer),
    /// each update, ms.
    pub switch_ms: Vec<f64>,
    /// QEMU's own downtime figure, each update, ms (0 for cloud-hypervisor).
    pub qemu_downtime_ms: Vec<u64>,
    /// Most RAM bytes one update sent (QEMU: `ram.transferred`;
    /// cloud-hypervisor: what the old process wrote during the switch,
    /// `/proc/PID/io` `wchar`).
    pub ram_transferred_max_bytes: u64,
    /// That, in percent of guest RAM.
    pub ram_transferred_max_pct: f64,
    /// Pages the guest found changed (its own check).
    pub stale_guest: u64,
    /// Pages the host found without the guest's value after the updates.
    pub stale_host: u64,
}

/// The hugemem side: `hugemem update`, `updates` times.
#[derive(Debug, Clone, Serialize)]
pub struct UpdateResult {
    /// The updates.
    #[serde(flatten)]
    pub series: UpdateSeries,
    /// Every update's memory came by daemon HANDOFF (QEMU; a
    /// cloud-hypervisor's successor gets the fds from its predecessor, so
    /// false there).
    pub handoff: bool,
    /// Bytes the daemon cleared during the updates.
    pub cleared_bytes: u64,
    /// `created − released == held` after every update and after the VM exited.
    pub balanced: bool,
    /// No allocation left once the VM exited.
    pub released_after_exit: bool,
}

/// The baseline: one plain QEMU migration copying RAM into the
/// destination's own memory.
#[derive(Debug, Clone, Serialize)]
pub struct CopyResult {
    /// Guest-visible pause, ms.
    pub downtime_ms: f64,
    /// Largest gap over an idle window as long, after, ms.
    pub idle_gap_ms: f64,
    /// The guest's gap overlapping `migrate` to RESUME, ms (see
    /// [`UpdateSeries::switch_gap_ms`]).
    pub switch_gap_ms: Option<f64>,
    /// `migrate` (cloud-hypervisor: `send-migration`) to the destination
    /// running the guest and the source's exit, ms.
    pub update_ms: f64,
    /// `migrate` to the destination running the guest, ms.
    pub switch_ms: f64,
    /// QEMU's `total-time`, ms (QEMU only).
    pub qemu_total_ms: Option<u64>,
    /// QEMU's own downtime figure, ms (QEMU only).
    pub qemu_downtime_ms: Option<u64>,
    /// RAM bytes sent (QEMU: `ram.transferred`; cloud-hypervisor: what
    /// the source wrote during the migration, `/proc/PID/io` `wchar`).
    pub ram_transferred_bytes: u64,
    /// Rate of the copy, GB/s: RAM bytes sent / `update_ms` (QEMU's own
    /// `total-time` reads 0 in some runs of QEMU 7.2 here).
    pub copy_gb_per_s: f64,
    /// Pages the guest found changed.
    pub stale_guest: u64,
    /// Pages the host found without the guest's value on the destination.
    pub stale_host: u64,
}

/// The report of one run.
#[derive(Debug, Clone, Serialize)]
pub struct VmmUpdateReport {
    /// `qemu` or `cloud-hypervisor`.
    pub vmm: String,
    /// Guest RAM, bytes.
    pub size: u64,
    /// Page size of guest RAM, every side.
    pub page_size: String,
    /// Why the run is not on 1 GiB pages: the host's 1 GiB pages.
    pub page_size_note: String,
    /// Stride of the guest's pages (each holds data the copy must send).
    pub guest_stride: u64,
    /// Host TSC rate, GHz (against CLOCK_MONOTONIC).
    pub tsc_ghz: f64,
    /// The guest's TSC rate over its idle window, GHz (same clock expected).
    pub guest_tsc_ghz: f64,
    /// The hugemem side.
    pub update: UpdateResult,
    /// The floor: the same updates by plain QEMUs on one resident memfd,
    /// no daemon, when it ran.
    pub floor: Option<UpdateSeries>,
    /// Why the floor did not run.
    pub floor_note: Option<String>,
    /// hugemem's median update time less the floor's, ms.
    pub update_over_floor_ms: Option<f64>,
    /// hugemem's median pause at the switch less the floor's, ms.
    pub switch_gap_over_floor_ms: Option<f64>,
    /// The median of the paired differences hugemem − floor of the update
    /// time (update `i` against update `i`), ms.
    pub update_over_floor_paired_ms: Option<f64>,
    /// Its 95 % interval (sign test, as `bench compare`), ms; 6 updates
    /// and more.
    pub update_over_floor_ci95_ms: Option<[f64; 2]>,
    /// The median of the paired differences hugemem − floor of the pause at
    /// the switch, over the updates where both found one, ms.
    pub switch_gap_over_floor_paired_ms: Option<f64>,
    /// Its 95 % interval, ms.
    pub switch_gap_over_floor_ci95_ms: Option<[f64; 2]>,
    /// The baseline, when it ran.
    pub copy: Option<CopyResult>,
    /// Why the baseline did not run.
    pub copy_note: Option<String>,
    /// Baseline downtime / hugemem median downtime.
    pub downtime_ratio: Option<f64>,
    /// Baseline update time / hugemem median update time.
    pub update_time_ratio: Option<f64>,
    /// Baseline switch gap / hugemem median switch gap.
    pub switch_gap_ratio: Option<f64>,
}

/// The median of `v` (0 when empty).
pub(crate) fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(s.len() / 2).copied().unwrap_or(0.0)
}

/// What a run measured, before it is compared.
pub(crate) struct Measured {
    pub(crate) tsc_hz: f64,
    pub(crate) guest_hz: f64,
    pub(crate) update: UpdateResult,
    pub(crate) floor: Option<UpdateSeries>,
    pub(crate) floor_note: Option<String>,
    pub(crate) copy: Option<CopyResult>,
    pub(crate) copy_note: Option<String>,
}

/// The pauses at the switch of `a` and `b` paired by update, where both
/// found one.
fn paired_gaps(a: &UpdateSeries, b: &UpdateSeries) -> (Vec<f64>, Vec<f64>) {
    a.switch_gap_ms
        .iter()
        .zip(&b.switch_gap_ms)
        .filter_map(|(x, y)| x.zip(*y))
        .unzip()
}

/// Why the run is on 2 MiB pages: what the host has in 1 GiB pages
/// against what a run of `size` on them needs at once (the copy's source
/// and destination).
fn page_size_note(size: u64) -> String {
    let (total, free) = one_gib_pages();
    format!(
        "run on 2 MiB pages; the host has {} huge pages of 1 GiB ({} free), a run on them needs {} at once",
        total,
        free,
        2 * size.div_ceil(1 << 30)
    )
}

impl VmmUpdateReport {
    /// The report of `m`: each side beside the floor and the copy.
    pub(crate) fn assemble(cfg: &VmmUpdateConfig, m: Measured) -> Self {
        let u = &m.update.series;
        let ratio = |a: f64, b: f64| (b > 0.0).then(|| a / b);
        let floor = m.floor.as_ref();
        let copy = m.copy.as_ref();
        let gaps = floor.map(|f| paired_gaps(u, f));
        Self {
            vmm: cfg.vmm.adapter().id().into(),
            size: cfg.size,
            page_size: "2M".into(),
            page_size_note: page_size_note(cfg.size),
            guest_stride: STRIDE,
            tsc_ghz: m.tsc_hz / 1e9,
            guest_tsc_ghz: m.guest_hz / 1e9,
            downtime_ratio: copy.and_then(|c| ratio(c.downtime_ms, u.downtime_median_ms)),
            update_time_ratio: copy.and_then(|c| ratio(c.update_ms, u.update_median_ms)),
            switch_gap_ratio: copy
                .and_then(|c| c.switch_gap_ms.zip(u.switch_gap_median_ms))
                .and_then(|(c, u)| ratio(c, u)),
            update_over_floor_ms: floor.map(|f| u.update_median_ms - f.update_median_ms),
            switch_gap_over_floor_ms: floor
                .and_then(|f| u.switch_gap_median_ms.zip(f.switch_gap_median_ms))
                .map(|(u, f)| u - f),
            update_over_floor_paired_ms: floor
                .and_then(|f| stats::paired_median(&u.update_ms, &f.update_ms)),
            update_over_floor_ci95_ms: floor
                .and_then(|f| stats::paired_median_ci95(&u.update_ms, &f.update_ms)),
            switch_gap_over_floor_paired_ms: gaps
                .as_ref()
                .and_then(|(a, b)| stats::paired_median(a, b)),
            switch_gap_over_floor_ci95_ms: gaps
                .as_ref()
                .and_then(|(a, b)| stats::paired_median_ci95(a, b)),
            update: m.update,
            floor: m.floor,
            floor_note: m.floor_note,
            copy: m.copy,
            copy_note: m.copy_note,
        }
    }

    /// A text table, each figure beside its floor and the copying baseline.
    pub fn to_table(&self) -> String {
        let u = &self.update.series;
        let mut t = String::new();
        let _ = writeln!(
            t,
            "vmm-update: {} on {} pages ({}, guest pages every {}), TSC {:.3} GHz (guest {:.3})",
            format_size(self.size),
            self.page_size,
            self.vmm,
            format_size(self.guest_stride),
            self.tsc_ghz,
            self.guest_tsc_ghz
        );
        // One line per figure: the label, hugemem's figure, the floor's and
        // the copy's ("-" where one did not run).
        let col = |v: Option<String>| v.unwrap_or_else(|| "-".into());
        let row = |t: &mut String,
                   label: &str,
                   ours: String,
                   floor: Option<String>,
                   copying: Option<String>| {
            let _ = writeln!(
                t,
                "{label:<34} {ours:>14} {:>14} {:>14}",
                col(floor),
                col(copying)
            );
        };
        row(
            &mut t,
            "",
            "hugemem update".into(),
            Some("floor (plain)".into()),
            Some("copying".into()),
        );
        let floor = self.floor.as_ref();
        let copy = self.copy.as_ref();
        row(
            &mut t,
            "largest gap in the window, ms",
            format!("{:.2}", u.downtime_median_ms),
            floor.map(|f| format!("{:.2}", f.downtime_median_ms)),
            copy.map(|c| format!("{:.2}", c.downtime_ms)),
        );
        row(
            &mut t,
            "pause at the switch, ms",
            col(u.switch_gap_median_ms.map(|v| format!("{v:.2}"))),
            floor
                .and_then(|f| f.switch_gap_median_ms)
                .map(|v| format!("{v:.2}")),
            copy.and_then(|c| c.switch_gap_ms)
                .map(|v| format!("{v:.2}")),
        );
        row(
            &mut t,
            "idle-window gap (noise), ms",
            format!("{:.2}", u.idle_gap_ms),
            floor.map(|f| format!("{:.2}", f.idle_gap_ms)),
            copy.map(|c| format!("{:.2}", c.idle_gap_ms)),
        );
        row(
            &mut t,
            "update time, ms",
            format!("{:.1}", u.update_median_ms),
            floor.map(|f| format!("{:.1}", f.update_median_ms)),
            copy.map(|c| format!("{:.1}", c.update_ms)),
        );
        row(
            &mut t,
            "RAM bytes transferred",
            u.ram_transferred_max_bytes.to_string(),
            floor.map(|f| f.ram_transferred_max_bytes.to_string()),
            copy.map(|c| c.ram_transferred_bytes.to_string()),
        );
        row(
            &mut t,
            "stale pages (guest + host)",
            (u.stale_guest + u.stale_host).to_string(),
            floor.map(|f| (f.stale_guest + f.stale_host).to_string()),
            copy.map(|c| (c.stale_guest + c.stale_host).to_string()),
        );
        let h = &self.update;
        let _ = writeln!(
            t,
            "updates {}, memory by HANDOFF {}, bytes cleared meanwhile {}, created - released == held {}, released after exit {}",
            u.updates, h.handoff, h.cleared_bytes, h.balanced, h.released_after_exit
        );
        let interval = |v: Option<[f64; 2]>| {
            col(v.map(|[lo, hi]| format!("95 % interval {lo:+.2} .. {hi:+.2}")))
        };
        let _ = writeln!(
            t,
            "over the floor: update time {} ms (paired {} ms, {}), pause at the switch {} ms (paired {} ms, {})",
            col(self.update_over_floor_ms.map(|v| format!("{v:+.1}"))),
            col(self.update_over_floor_paired_ms.map(|v| format!("{v:+.1}"))),
            interval(self.update_over_floor_ci95_ms),
            col(self.switch_gap_over_floor_ms.map(|v| format!("{v:+.2}"))),
            col(self.switch_gap_over_floor_paired_ms.map(|v| format!("{v:+.2}"))),
            interval(self.switch_gap_over_floor_ci95_ms),
        );
        let _ = writeln!(
            t,
            "transferred {:.4}% of RAM (limit < 1%); pause at the switch copy/hugemem {}, largest gap copy/hugemem {}{}; update time copy/hugemem {}{}",
            u.ram_transferred_max_pct,
            col(self.switch_gap_ratio.map(|r| format!("{r:.1}x"))),
            col(self.downtime_ratio.map(|r| format!("{r:.1}x"))),
            ratio_limits(&self.vmm).0,
            col(self.update_time_ratio.map(|r| format!("{r:.1}x"))),
            ratio_limits(&self.vmm).1,
        );
        let _ = writeln!(t, "{}", self.page_size_note);
        if let Some(note) = &self.floor_note {
            let _ = writeln!(t, "floor not run: {note}");
        }
        if let Some(note) = &self.copy_note {
            let _ = writeln!(t, "copying baseline not run: {note}");
        }
        t
    }
}

/// The limits a VMM's ratios are held to, as the table notes them: the
/// pause against QEMU's copy, the update time against cloud-hypervisor's.
fn ratio_limits(vmm: &str) -> (&'static str, &'static str) {
    let limits = PerVmm {
        qemu: (" (limit >= 5x at 8 GiB)", ""),
        cloud_hypervisor: ("", " (limit >= 20x at 8 GiB)"),
    };
    Vmm::parse(vmm).map_or(limits.cloud_hypervisor, |k| *limits.get(k))
}
