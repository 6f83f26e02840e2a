//! The run: every repetition runs hugemem's variants (from the park, from
//! disk), then cloud-hypervisor's `file://`, then the offload daemon. A
//! baseline that fails is a note in the report, and stops running; a
//! failure of hugemem's is the run's.

use std::time::Duration;

use super::ch_side::{ch_file_rep, offload_daemon_rep};
use super::dense::LOW_RAM_END;
use super::error::OffloadError;
use super::hugemem_side::{one_rep, HugememResults};
use super::qemu_report::QemuResult;
use super::qemu_side::qemu_rep;
use super::report::{
    ChFileResult, FromDiskResult, FromParkResult, Measured, OffloadConfig, OffloadDaemonResult,
    OffloadReport, OnDemandResult,
};
use super::save_vs_disk;
use crate::harness::rounds;
use crate::private_dir::PrivateDir;
use crate::vmm_update::error::io;
use crate::vmm_update::guest::host_tsc_hz;
use crate::vmm_update::setup::{reserve_pages, write_spin_elf};

/// A baseline's results so far, or why it stopped.
struct Baseline<T> {
    result: T,
    stopped: Option<String>,
}

impl<T: Default> Baseline<T> {
    fn new(stopped: Option<String>) -> Self {
        Self {
            result: T::default(),
            stopped,
        }
    }

    /// Runs one repetition of it unless it stopped; a failure stops it.
    fn step(
        &mut self,
        rep: usize,
        progress: &mut dyn FnMut(&str),
        f: impl FnOnce(&mut T) -> Result<(), OffloadError>,
    ) {
        if self.stopped.is_some() {
            return;
        }
        if let Err(e) = f(&mut self.result) {
            progress(&format!("a baseline failed in repetition {rep}: {e}"));
            self.stopped = Some(format!("failed in repetition {rep}: {e}"));
        }
    }

    /// The result when it ran at least once, and the note.
    fn finish(self, ran: impl Fn(&T) -> bool) -> (Option<T>, Option<String>) {
        let ran = ran(&self.result);
        (ran.then_some(self.result), self.stopped)
    }
}

/// Runs the bench.
///
/// # Errors
///
/// [`OffloadError`]: no KVM or huge pages, or a step of hugemem's failed.
pub fn run(
    cfg: &OffloadConfig,
    progress: &mut dyn FnMut(&str),
) -> Result<OffloadReport, OffloadError> {
    let page = cfg.page_size;
    if !page.is_huge() || cfg.size == 0 || cfg.reps == 0 || !cfg.size.is_multiple_of(page.bytes()) {
        return Err(OffloadError::Setup(format!(
            "--page-size must be 2M or 1G, --size a non-zero multiple of it and --reps at least 1 (got {page}, {} bytes, {})",
            cfg.size, cfg.reps
        )));
    }
    microguest::kvm_available().map_err(OffloadError::Setup)?;
    // One guest at a time holds its RAM in 2 MiB pages: the daemon's pool
    // is stopped before the baselines' cloud-hypervisors take theirs.
    let _pages = reserve_pages(cfg.size, page).map_err(OffloadError::Setup)?;
    let dir = PrivateDir::create_in(&cfg.dir, "hugemem-bench-offload")
        .map_err(io(format!("a directory under {}", cfg.dir.display())))?;
    save_vs_disk::room_for_rounds(dir.path(), cfg.size.min(LOW_RAM_END))?;
    let elf = dir.path().join("spin.elf");
    let tsc_hz = host_tsc_hz(Duration::from_millis(200));
    write_spin_elf(&elf, tsc_hz)?;
    let mut from_park = FromParkResult::default();
    let mut from_disk = FromDiskResult::default();
    let mut on_demand = OnDemandResult::default();
    let mut ch_file = Baseline::<ChFileResult>::new(None);
    let mut offload =
        Baseline::<OffloadDaemonResult>::new(cfg.offload_daemon.is_none().then(|| {
            "no offload_daemon binary given (--offload-daemon or CH_OFFLOAD_DAEMON)".into()
        }));
    let mut qemu = Baseline::<QemuResult>::new(match (&cfg.qemu, cfg.dense) {
        (None, _) => Some("QEMU's rows did not run (no --qemu)".into()),
        (Some(_), true) => Some("QEMU's rows do not run with --dense".into()),
        (Some(_), false) => None,
    });
    rounds::each(cfg.reps, |round| {
        let rep = round.index() + 1;
        one_rep(
            cfg,
            dir.path(),
            &elf,
            rep,
            tsc_hz,
            HugememResults {
                park: &mut from_park,
                disk: &mut from_disk,
                on_demand: &mut on_demand,
            },
        )?;
        ch_file.step(rep, progress, |out| {
            ch_file_rep(cfg, dir.path(), &elf, rep, out)
        });
        if let Some(program) = &cfg.offload_daemon {
            let program = std::path::Path::new(program);
            offload.step(rep, progress, |out| {
                offload_daemon_rep(cfg, program, dir.path(), &elf, rep, out)
            });
        }
        if let Some(program) = &cfg.qemu {
            qemu.step(rep, progress, |out| {
                qemu_rep(cfg, program, (dir.path(), &elf), rep, tsc_hz, out)
            });
        }
        let last = |v: &[f64]| v.last().map_or_else(|| "-".into(), |x| format!("{x:.1}"));
        progress(&format!(
            "repetition {round}: QEMU park {} ms, restore {} ms (floor {} / {} ms, its own file {} / {} ms); park {} ms, restore from the park {} ms; save {} ms ({} GB/s over the disk's direct write {}x), load {} ms ({} GB/s, disk {} GB/s), restore {} ms; on demand: park {} ms, running after {} ms, all filled after {} ms; file:// restore {} ms; offload_daemon restore {} ms",
            last(&qemu.result.park_ms.samples),
            last(&qemu.result.restore_ms.samples),
            last(&qemu.result.floor_save_ms.samples),
            last(&qemu.result.floor_restore_ms.samples),
            last(&qemu.result.file_save_ms.samples),
            last(&qemu.result.file_restore_ms.samples),
            last(&from_park.park_ms.samples),
            last(&from_park.restore_ms.samples),
            last(&from_disk.save_ms.samples),
            from_disk.save_gbps.samples.last().map_or_else(|| "-".into(), |x| format!("{x:.2}")),
            from_disk.disk_write.save_over_single.samples.last().map_or_else(|| "-".into(), |x| format!("{x:.2}")),
            last(&from_disk.load_ms.samples),
            from_disk.load_gbps.samples.last().map_or_else(|| "-".into(), |x| format!("{x:.2}")),
            from_disk.disk_read_gbps.samples.last().map_or_else(|| "-".into(), |x| format!("{x:.2}")),
            last(&from_disk.restore_ms.samples),
            last(&on_demand.park_ms.samples),
            last(&on_demand.restore_ms.samples),
            last(&on_demand.all_filled_ms.samples),
            last(&ch_file.result.restore_ms.samples),
            last(&offload.result.restore_ms.samples),
        ));
        Ok::<_, OffloadError>(())
    })?;
    let (ch_file, ch_file_note) = ch_file.finish(|r| !r.restore_ms.samples.is_empty());
    let (offload_daemon, offload_daemon_note) =
        offload.finish(|r| !r.restore_ms.samples.is_empty());
    let (qemu, qemu_note) = qemu.finish(|r| !r.file_restore_ms.samples.is_empty());
    Ok(OffloadReport::assemble(
        cfg,
        Measured {
            tsc_hz,
            from_park,
            from_disk,
            on_demand,
            ch_file,
            ch_file_note,
            offload_daemon,
            offload_daemon_note,
            qemu,
            qemu_note,
        },
    ))
}
