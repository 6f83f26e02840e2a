//! The floor of an update: the same live update without hugemem. Two plain
//! QEMUs map one resident hugetlb memfd (the command line `hugemem launch`
//! builds, `mem-path=/dev/fd/N`, the fd inherited, no daemon); each update
//! starts a new QEMU on it with `-incoming defer` and migrates to it with
//! `x-ignore-shared` over a UNIX socket, then quits the old one. What
//! hugemem adds over this is its own work: the HANDOFF, the launcher's
//! requests and supervision.

use std::ffi::OsString;
use std::os::fd::BorrowedFd;
use std::path::Path;
use std::time::Instant;

use serde_json::json;

use super::error::VmmUpdateError;
use super::guest::{GuestRam, HostClock};
use super::qemu::{migrate, BenchQemu, Migrated};
use super::report::UpdateSeries;
use super::series::{after_update, before_update, OneUpdate};
use super::setup::number;
use super::side::{BaselineRun, FloorVm};

/// Moves the guest from `old` to a new QEMU (`argv` plus `-incoming
/// defer`) on the same memory; the new QEMU and the update's figures.
fn one_update(
    mut old: BenchQemu,
    argv: &[OsString],
    memory: BorrowedFd<'_>,
    dir: &Path,
    step: usize,
    tsc_hz: f64,
) -> Result<(BenchQemu, OneUpdate), VmmUpdateError> {
    let before = before_update(&GuestRam::of(old.pid())?)?;
    let mut incoming = argv.to_vec();
    incoming.extend(["-incoming", "defer"].map(OsString::from));
    let started = Instant::now();
    let mut new = BenchQemu::start(&incoming, &dir.join(format!("plain-{step}.qmp")), &[memory])?;
    let caps = json!({"capabilities": [
        {"capability": "x-ignore-shared", "state": true},
        {"capability": "events", "state": true},
    ]});
    new.execute("migrate-set-capabilities", caps.clone())?;
    old.execute("migrate-set-capabilities", caps)?;
    let uri = format!("unix:{}", dir.join(format!("plain-{step}.sock")).display());
    new.execute("migrate-incoming", json!({ "uri": uri }))?;
    let Migrated {
        migrate_at_ns,
        resumed_at_ns,
        stats,
    } = migrate(&mut old, &mut new, &uri, "the plain update's migration")?;
    let clock = HostClock::now(tsc_hz);
    old.quit();
    let update_ms = started.elapsed().as_secs_f64() * 1e3;
    let (guest, switch_gap_ticks) = after_update(
        &GuestRam::of(new.pid())?,
        before,
        &clock,
        migrate_at_ns,
        resumed_at_ns,
    )?;
    let one = OneUpdate {
        guest,
        switch_gap_ticks,
        update_ms,
        switch_ms: resumed_at_ns.saturating_sub(migrate_at_ns) as f64 / 1e6,
        qemu_downtime_ms: number(&stats, "/downtime"),
        ram_transferred_bytes: number(&stats, "/ram/transferred"),
    };
    Ok((new, one))
}

/// `cfg.updates` plain updates in a row of the spinning guest.
///
/// # Errors
///
/// [`VmmUpdateError::Setup`] when the guest RAM in 2 MiB pages is not
/// there; QEMU and guest errors otherwise.
pub(crate) fn run(
    run: &BaselineRun<'_>,
    progress: &mut dyn FnMut(&str),
) -> Result<UpdateSeries, VmmUpdateError> {
    let BaselineRun {
        cfg, dir, tsc_hz, ..
    } = *run;
    let vm = FloorVm::new(run)?;
    let memory = vm.memory.fd();
    let qemu = BenchQemu::start(&vm.argv, &dir.join("plain-0.qmp"), &[memory])?;
    GuestRam::of(qemu.pid())?.counting_past(0)?;
    progress("floor: the guest spins under a plain QEMU");
    let mut series = UpdateSeries::default();
    let what = ("plain update", tsc_hz);
    let qemu = series.in_a_row(cfg.updates, what, qemu, progress, |qemu, step| {
        one_update(qemu, &vm.argv, memory, dir, step, tsc_hz)
    })?;
    series.finish(&GuestRam::of(qemu.pid())?, cfg.size, tsc_hz)?;
    qemu.quit();
    Ok(series)
}
