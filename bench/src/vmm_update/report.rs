//! What `bench vmm-update` is asked to do and what it reports.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::path::PathBuf;

use guest_mem::size::format_size;
use serde::Serialize;

/// The run's settings.
#[derive(Debug, Clone)]
pub struct VmmUpdateConfig {
    /// Guest RAM, bytes.
    pub size: u64,
    /// Live updates in a row on the hugemem side (the copying migration runs once).
    pub updates: usize,
    /// The QEMU binary (both sides; also the update's new binary).
    pub qemu: OsString,
    /// The `hugemem` binary (`serve`, `launch`).
    pub launcher: PathBuf,
    /// Skip the copying baseline (it needs twice the RAM in huge pages).
    pub no_copy: bool,
}

/// A run of live updates in a row on the same pages (`x-ignore-shared`):
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
    /// The new QEMU's start (hugemem: the request) to the old QEMU gone,
    /// each update, ms.
    pub update_ms: Vec<f64>,
    /// Median of `update_ms`.
    pub update_median_ms: f64,
    /// `migrate` to the new QEMU's RESUME, each update, ms.
    pub switch_ms: Vec<f64>,
    /// QEMU's own downtime figure, each update, ms.
    pub qemu_downtime_ms: Vec<u64>,
    /// Most RAM bytes one update sent.
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
    /// Every update's memory came by daemon HANDOFF.
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
    /// `migrate` to the destination's RESUME and the source's exit, ms.
    pub update_ms: f64,
    /// QEMU's `total-time`, ms.
    pub qemu_total_ms: u64,
    /// QEMU's own downtime figure, ms.
    pub qemu_downtime_ms: u64,
    /// RAM bytes sent.
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
    /// `qemu`.
    pub vmm: String,
    /// Guest RAM, bytes.
    pub size: u64,
    /// Page size of guest RAM, both sides.
    pub page_size: String,
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

impl VmmUpdateReport {
    /// A text table, each figure beside its floor and the copying baseline.
    pub fn to_table(&self) -> String {
        let u = &self.update.series;
        let mut t = String::new();
        let _ = writeln!(
            t,
            "vmm-update: {} on {} pages (QEMU, guest pages every {}), TSC {:.3} GHz (guest {:.3})",
            format_size(self.size),
            self.page_size,
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
        let _ = writeln!(
            t,
            "over the floor: update time {} ms, pause at the switch {} ms",
            col(self.update_over_floor_ms.map(|v| format!("{v:+.1}"))),
            col(self.switch_gap_over_floor_ms.map(|v| format!("{v:+.2}")))
        );
        let _ = writeln!(
            t,
            "transferred {:.4}% of RAM (limit < 1%); pause at the switch copy/hugemem {}, largest gap copy/hugemem {} (limit >= 5x at 8 GiB); update time copy/hugemem {}",
            u.ram_transferred_max_pct,
            col(self.switch_gap_ratio.map(|r| format!("{r:.1}x"))),
            col(self.downtime_ratio.map(|r| format!("{r:.1}x"))),
            col(self.update_time_ratio.map(|r| format!("{r:.1}x")))
        );
        if let Some(note) = &self.floor_note {
            let _ = writeln!(t, "floor not run: {note}");
        }
        if let Some(note) = &self.copy_note {
            let _ = writeln!(t, "copying baseline not run: {note}");
        }
        t
    }
}
