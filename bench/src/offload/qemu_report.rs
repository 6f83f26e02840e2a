//! QEMU's rows of the report (`qemu_side.rs`): hugemem's park and restore
//! of a launched QEMU beside QEMU's own save to a file and restore from it
//! (the baseline) and its `x-ignore-shared` save and restore on a resident
//! memfd (the floor), with the comparisons.

use std::fmt::Write as _;

use serde::Serialize;

use super::figure::Figure;
use crate::stats::paired_median;

/// How far over QEMU's floor hugemem's park and restore may be, ms.
pub const OVER_FLOOR_MS: f64 = 5.0;

/// QEMU's rows, every repetition.
#[derive(Debug, Clone, Default, Serialize)]
pub struct QemuResult {
    /// `hugemem park NAME --control-socket …`'s wall time, ms.
    pub park_ms: Figure,
    /// The launcher's own figure for the park (its request to the
    /// daemon's answer, QEMU's `quit` sent), ms.
    pub park_launcher_ms: Figure,
    /// The same command's wall time where no control socket is (its
    /// start, a refused connect, its end): what of `park_ms` any command
    /// pays, ms.
    pub park_command_ms: Figure,
    /// `hugemem launch --restore NAME -- qemu-system-x86_64`'s start to the
    /// guest counting again, ms.
    pub restore_ms: Figure,
    /// The launcher's own figure for the restore (its "restored:" line), ms.
    pub restore_launcher_ms: Figure,
    /// The guest's largest recorded gap across park and restore, ms, as
    /// its TSC saw it: QEMU carries the guest's TSC over a migration, so
    /// this is not the time it was parked.
    pub pause_ms: Figure,
    /// Guest RAM bytes the daemon copied for the parks (STATS), most of
    /// the repetitions (0 expected).
    pub park_copied_bytes: u64,
    /// QEMU's device state the park carried (`hugemem park`'s line), most
    /// of the repetitions, bytes.
    pub park_state_bytes: u64,
    /// RAM bytes QEMU's park stream carried (`ram.transferred`), most of
    /// the repetitions (0 expected).
    pub park_ram_transferred_bytes: u64,
    /// QEMU's own `migrate` to a file: `migrate` to `completed`, ms.
    pub file_save_ms: Figure,
    /// A new QEMU's start (`-incoming defer`, fed the file, cold cache) to
    /// the guest counting, ms.
    pub file_restore_ms: Figure,
    /// The file's bytes, most of the repetitions.
    pub file_bytes: u64,
    /// RAM bytes QEMU's own save carried (`ram.transferred`), most of the
    /// repetitions.
    pub file_ram_transferred_bytes: u64,
    /// The floor: `x-ignore-shared` to a file on a resident memfd,
    /// `migrate` to `completed`, ms.
    pub floor_save_ms: Figure,
    /// The floor's restore: a new QEMU on the same memfd fed the file, its
    /// start to the guest counting, ms.
    pub floor_restore_ms: Figure,
    /// The floor's file, bytes.
    pub floor_file_bytes: u64,
    /// RAM bytes the floor's stream carried.
    pub floor_ram_transferred_bytes: u64,
    /// Pages the guest found changed, every QEMU variant, most of the
    /// repetitions.
    pub stale_guest: u64,
}

/// QEMU's comparisons.
#[derive(Debug, Clone, Default, Serialize)]
pub struct QemuComparison {
    /// QEMU's own save over hugemem's park (medians).
    pub file_save_over_park: Option<f64>,
    /// QEMU's own restore over hugemem's (medians).
    pub file_restore_over_restore: Option<f64>,
    /// hugemem's park less the floor's save, paired by repetition, ms.
    pub park_over_floor_paired_ms: Option<f64>,
    /// hugemem's restore less the floor's, paired by repetition, ms.
    pub restore_over_floor_paired_ms: Option<f64>,
    /// Both within [`OVER_FLOOR_MS`] of the floor (paired medians).
    pub within_floor: bool,
}

impl QemuComparison {
    /// The comparisons of `q`.
    pub fn of(q: &QemuResult) -> Self {
        let ratio = |a: f64, b: f64| (b > 0.0).then(|| a / b);
        let park = paired_median(&q.park_ms.samples, &q.floor_save_ms.samples);
        let restore = paired_median(&q.restore_ms.samples, &q.floor_restore_ms.samples);
        Self {
            file_save_over_park: ratio(q.file_save_ms.median, q.park_ms.median),
            file_restore_over_restore: ratio(q.file_restore_ms.median, q.restore_ms.median),
            park_over_floor_paired_ms: park,
            restore_over_floor_paired_ms: restore,
            within_floor: park
                .zip(restore)
                .is_some_and(|(p, r)| p <= OVER_FLOOR_MS && r <= OVER_FLOOR_MS),
        }
    }

    /// The report's QEMU lines for `q`.
    pub fn text(&self, q: &QemuResult) -> String {
        let mut t = String::new();
        let row = |t: &mut String, what: &str, a: &Figure, b: &Figure| {
            let _ = writeln!(t, "{what:<44} {:>14.1} {:>14.1}", a.median, b.median);
        };
        let _ = writeln!(
            t,
            "{:<44} {:>14} {:>14}",
            "QEMU, median of the repetitions", "park/save, ms", "restore, ms"
        );
        row(
            &mut t,
            "hugemem: park, restore from the park",
            &q.park_ms,
            &q.restore_ms,
        );
        row(
            &mut t,
            "QEMU migrate to a file, -incoming from it",
            &q.file_save_ms,
            &q.file_restore_ms,
        );
        row(
            &mut t,
            "floor: x-ignore-shared to a file, on a memfd",
            &q.floor_save_ms,
            &q.floor_restore_ms,
        );
        let x = |v: Option<f64>| v.map_or_else(|| "-".into(), |r| format!("{r:.2}x"));
        let over = |v: Option<f64>| v.map_or_else(|| "-".into(), |d| format!("{d:+.1} ms"));
        let _ = writeln!(
            t,
            "QEMU: park {} bytes copied (STATS), its stream {} bytes of device state and {} bytes of RAM blocks not on shared memory (the firmware's; QEMU's own save: {} bytes of RAM, a {} byte file; the floor's file {} bytes); the launcher's own park {:.1} ms; the command's start and end {:.1} ms; the guest's largest gap on its TSC (carried over by QEMU) {:.1} ms; restore's RESTORE exchange {:.1} ms",
            q.park_copied_bytes,
            q.park_state_bytes,
            q.park_ram_transferred_bytes,
            q.file_ram_transferred_bytes,
            q.file_bytes,
            q.floor_file_bytes,
            q.park_launcher_ms.median,
            q.park_command_ms.median,
            q.pause_ms.median,
            q.restore_launcher_ms.median,
        );
        let _ = writeln!(
            t,
            "QEMU: its own save / hugemem's park {}, its own restore / hugemem's {}; over the floor (paired medians): park {}, restore {} (expected each <= +{OVER_FLOOR_MS:.0} ms: {})",
            x(self.file_save_over_park),
            x(self.file_restore_over_restore),
            over(self.park_over_floor_paired_ms),
            over(self.restore_over_floor_paired_ms),
            if self.within_floor { "met" } else { "not met" },
        );
        t
    }
}
