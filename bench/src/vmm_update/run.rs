//! The run: the hugemem side (`hugemem launch --control-socket`, then
//! `hugemem update` N times), then the floor and the copying baseline
//! (`baselines.rs`).

use std::ffi::OsString;
use std::path::Path;
use std::time::{Duration, Instant};

use super::baselines::BaselineRun;
use super::error::io;
use super::error::VmmUpdateError;
use super::guest::{host_tsc_hz, GuestRam, HostClock};
use super::report::{Measured, UpdateResult, UpdateSeries, VmmUpdateConfig, VmmUpdateReport};
use super::series::{after_update, before_update, OneUpdate};
use super::setup::{child_of, reserve, write_spin_elf};
use super::side;
use crate::harness::serve::{ServeChild, ServeOptions};
use crate::harness::vmm::Stopping;
use crate::private_dir::PrivateDir;
use backend::client::Client;

fn balanced(stats: &backend::stats::Stats) -> bool {
    let t = &stats.totals;
    t.created_bytes - t.released_bytes == t.held_bytes
}

/// `hugemem launch --control-socket` of the spinning guest, its
/// diagnostics in `dir/launch.log`.
fn start_launch(cfg: &VmmUpdateConfig, dir: &Path, elf: &Path) -> Result<Stopping, VmmUpdateError> {
    let mut args: Vec<OsString> = vec!["launch".into(), "--socket".into()];
    args.push(dir.join("daemon.sock").into());
    for a in ["--size", &cfg.size.to_string(), "--page-size", "2M"] {
        args.push(a.into());
    }
    args.push("--control-socket".into());
    args.push(dir.join("vm.sock").into());
    args.push("--".into());
    args.extend(crate::vmm_side::of(cfg.vmm).spin_guest_args(&cfg.program, elf));
    Stopping::start(&cfg.launcher, &args, &dir.join("launch.log"))
        .map_err(io("start hugemem launch"))
}

/// Where the bench reads the launched guest's RAM.
enum LaunchedRam {
    /// Through each VMM's own descriptor, a successor's from a daemon
    /// HANDOFF (QEMU's `mem-path=/dev/fd/N`).
    PerVmm,
    /// Through the launcher's descriptor, the same for the VM's life (a
    /// cloud-hypervisor's successor gets its fds by the migration, with
    /// numbers of its own and no `file=` on its command line).
    Launcher(GuestRam),
}

impl LaunchedRam {
    /// For a VM launched by `launcher` whose first VMM is `vmm`.
    fn find(cfg: &VmmUpdateConfig, launcher: u32, vmm: u32) -> Result<Self, VmmUpdateError> {
        if cfg.vmm.adapter().successor_memory_by_handoff() {
            return Ok(Self::PerVmm);
        }
        GuestRam::of_launched_ch(launcher, vmm).map(Self::Launcher)
    }

    /// The RAM of the guest running under `vmm`.
    fn of(&self, vmm: u32) -> Result<RamRef<'_>, VmmUpdateError> {
        match self {
            Self::PerVmm => GuestRam::of(vmm).map(RamRef::Opened),
            Self::Launcher(ram) => Ok(RamRef::Held(ram)),
        }
    }
}

/// Guest RAM opened for one process, or the one the bench holds.
enum RamRef<'a> {
    Opened(GuestRam),
    Held(&'a GuestRam),
}

impl std::ops::Deref for RamRef<'_> {
    type Target = GuestRam;

    fn deref(&self) -> &GuestRam {
        match self {
            Self::Opened(ram) => ram,
            Self::Held(ram) => ram,
        }
    }
}

/// One `hugemem update` of the guest running under VMM `vmm`; the new
/// VMM's pid and whether its memory came by HANDOFF.
fn one_update(
    control: &Path,
    ram: &LaunchedRam,
    vmm: u32,
    tsc_hz: f64,
) -> Result<(OneUpdate, u32, bool), VmmUpdateError> {
    let before = before_update(&*ram.of(vmm)?)?;
    let report = hugemem::launch::request_update(control, None, Duration::from_secs(600))?;
    let clock = HostClock::now(tsc_hz);
    let (guest, switch_gap_ticks) = after_update(
        &*ram.of(report.new_pid)?,
        before,
        &clock,
        report.migrate_at_ns,
        report.resumed_at_ns,
    )?;
    let one = OneUpdate {
        guest,
        switch_gap_ticks,
        update_ms: report.update_ms,
        switch_ms: report.switch_ms,
        qemu_downtime_ms: report.qemu_downtime_ms,
        ram_transferred_bytes: report.ram_transferred_bytes,
    };
    Ok((one, report.new_pid, report.handoff))
}

/// The hugemem side, on a private daemon; returns the result and the
/// guest's TSC rate.
fn hugemem_side(
    cfg: &VmmUpdateConfig,
    dir: &Path,
    elf: &Path,
    tsc_hz: f64,
    progress: &mut dyn FnMut(&str),
) -> Result<(UpdateResult, f64), VmmUpdateError> {
    let _pages = reserve(cfg.size).map_err(VmmUpdateError::Setup)?;
    let socket = dir.join("daemon.sock");
    let daemon = ServeChild::start(
        &cfg.launcher,
        &ServeOptions {
            socket: socket.clone(),
            pool: Some((cfg.size, cfg.size)),
            log: Some(dir.join("daemon.log")),
            ..ServeOptions::default()
        },
    )?;
    let mut stats_client = Client::connect(&socket)?;
    // Stopped with SIGTERM (it forwards it to the VMM and frees the
    // memory) and reaped when dropped.
    let launched = start_launch(cfg, dir, elf)?;
    let vmm = child_of(launched.pid())?;
    let rams = LaunchedRam::find(cfg, launched.pid(), vmm)?;
    let ram = rams.of(vmm)?;
    let started = ram.counting_past(0)?;
    progress(&format!(
        "hugemem side: the guest spins (count {})",
        started.count
    ));
    let (a, ta) = (ram.spin()?, Instant::now());
    std::thread::sleep(Duration::from_millis(300));
    let (b, tb) = (ram.spin()?, Instant::now());
    let guest_hz = b.tsc.wrapping_sub(a.tsc) as f64 / (tb - ta).as_secs_f64();
    drop(ram);
    let cleared = stats_client.stats()?.scrub.bytes;
    let control = dir.join("vm.sock");
    let mut r = UpdateResult {
        series: UpdateSeries::default(),
        handoff: true,
        cleared_bytes: 0,
        balanced: true,
        released_after_exit: false,
    };
    let (mut handoffs, mut balance) = (true, true);
    let vmm = r
        .series
        .in_a_row(cfg.updates, ("update", tsc_hz), vmm, progress, |vmm, _| {
            let (one, new_pid, handoff) = one_update(&control, &rams, vmm, tsc_hz)?;
            handoffs &= handoff;
            balance &= balanced(&stats_client.stats()?);
            Ok((new_pid, one))
        })?;
    (r.handoff, r.balanced) = (handoffs, balance);
    r.cleared_bytes = stats_client.stats()?.scrub.bytes - cleared;
    r.series.finish(&*rams.of(vmm)?, cfg.size, tsc_hz)?;
    drop(rams);
    drop(launched);
    let deadline = Instant::now() + Duration::from_secs(30);
    let after = loop {
        let s = stats_client.stats()?;
        if s.allocations.active == 0 || Instant::now() > deadline {
            break s;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    r.released_after_exit = after.allocations.active == 0;
    r.balanced &= balanced(&after);
    drop(stats_client);
    daemon.stop();
    Ok((r, guest_hz))
}

/// Runs the bench.
///
/// # Errors
///
/// [`VmmUpdateError`]: no VMM, KVM or huge pages, or a step failed. A
/// baseline that cannot run (not enough huge pages for two copies of guest
/// RAM) is a note in the report, not an error.
pub fn run(
    cfg: &VmmUpdateConfig,
    progress: &mut dyn FnMut(&str),
) -> Result<VmmUpdateReport, VmmUpdateError> {
    microguest::kvm_available().map_err(VmmUpdateError::Setup)?;
    let dir = PrivateDir::create("hugemem-vmm-update").map_err(io("private directory"))?;
    let elf = dir.path().join("spin.elf");
    let tsc_hz = host_tsc_hz(Duration::from_millis(200));
    write_spin_elf(&elf, tsc_hz)?;
    progress(&format!("host TSC {:.3} GHz", tsc_hz / 1e9));
    let (update, guest_hz) = hugemem_side(cfg, dir.path(), &elf, tsc_hz, progress)?;
    let baselines = side::of(cfg.vmm);
    let run = BaselineRun {
        cfg,
        dir: dir.path(),
        elf: &elf,
        tsc_hz,
    };
    let floor = (baselines.floor)(&run, progress);
    let (floor, floor_note) = match floor {
        Ok(f) => (Some(f), None),
        Err(VmmUpdateError::Setup(why)) => (None, Some(why)),
        Err(e) => return Err(e),
    };
    let copy = if cfg.no_copy {
        Err(VmmUpdateError::Setup("--no-copy".to_owned()))
    } else {
        (baselines.copy)(&run, progress)
    };
    let (copy, copy_note) = match copy {
        Ok(c) => (Some(c), None),
        Err(VmmUpdateError::Setup(why)) => (None, Some(why)),
        Err(e) => return Err(e),
    };
    Ok(VmmUpdateReport::assemble(
        cfg,
        Measured {
            tsc_hz,
            guest_hz,
            update,
            floor,
            floor_note,
            copy,
            copy_note,
        },
    ))
}
