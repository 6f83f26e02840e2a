//! cloud-hypervisor's floor and copying baseline.
//!
//! * **Floor**: the same updates without hugemem. Two plain
//!   cloud-hypervisors on one resident hugetlb memfd (the command line
//!   `hugemem launch` builds: `--memory size=0 --memory-zone
//!   …,file=/dev/fd/N,shared=on`, the fd inherited, no daemon); each update
//!   starts a new cloud-hypervisor without a VM and moves the guest to it by
//!   local migration (`send-migration … local=on`: the memory's fds go over
//!   the socket), then retires the old one, as `hugemem update` does. What
//!   hugemem adds over this is its own work: the request to the launcher,
//!   its supervision, the API socket's rename.
//! * **Copy**: the guest under a cloud-hypervisor with its own memory
//!   (`--memory size=S,shared=on,hugepages=on`: a hugetlb memfd of its own),
//!   migrated once without `local=on` to a second cloud-hypervisor, which
//!   receives the RAM into memory of its own: how a host is drained today.
//!
//! RAM bytes sent are what the source process wrote during the migration
//! (`/proc/PID/io` `wchar`), the measure `hugemem update` reports.

use std::ffi::OsString;
use std::fs::File;
use std::path::Path;
use std::time::{Duration, Instant};

use super::ch::{migrate, BenchCh, ChMigrated, CH_DEADLINE};
use super::error::io;
use super::error::VmmUpdateError;
use super::guest::{GuestRam, HostClock};
use super::report::{CopyResult, UpdateSeries};
use super::series::{after_update, before_update, settled, OneUpdate, Settled};
use super::setup::reserve;
use super::side::{BaselineRun, FloorVm};
use crate::vmm_side::{BenchVmm, CloudHypervisor};

/// Moves the guest in `ram` from `old` to a new cloud-hypervisor
/// (`program`) by local migration; the new process and the update's figures.
fn one_update(
    old: BenchCh,
    program: &OsString,
    ram: &GuestRam,
    dir: &Path,
    step: usize,
    tsc_hz: f64,
) -> Result<(BenchCh, OneUpdate), VmmUpdateError> {
    let before = before_update(ram)?;
    let started = Instant::now();
    let mut new = BenchCh::start(
        std::slice::from_ref(program),
        dir,
        &format!("floor-{step}"),
        &[],
    )?;
    let channel = dir.join(format!("floor-{step}.migration"));
    let ChMigrated {
        migrate_at_ns,
        resumed_at_ns,
        written_bytes,
    } = migrate(&old, &mut new, &channel, true)?;
    let clock = HostClock::now(tsc_hz);
    old.retire();
    let update_ms = started.elapsed().as_secs_f64() * 1e3;
    let (guest, switch_gap_ticks) =
        after_update(ram, before, &clock, migrate_at_ns, resumed_at_ns)?;
    let one = OneUpdate {
        guest,
        switch_gap_ticks,
        update_ms,
        switch_ms: resumed_at_ns.saturating_sub(migrate_at_ns) as f64 / 1e6,
        qemu_downtime_ms: 0,
        ram_transferred_bytes: written_bytes,
    };
    Ok((new, one))
}

/// `cfg.updates` plain local migrations in a row of the spinning guest.
///
/// # Errors
///
/// [`VmmUpdateError::Setup`] when the guest RAM in 2 MiB pages is not
/// there; cloud-hypervisor and guest errors otherwise.
pub(crate) fn floor(
    run: &BaselineRun<'_>,
    progress: &mut dyn FnMut(&str),
) -> Result<UpdateSeries, VmmUpdateError> {
    let BaselineRun {
        cfg, dir, tsc_hz, ..
    } = *run;
    let vm = FloorVm::new(run)?;
    let memory = vm.memory.fd();
    let ram = GuestRam::from_file(File::from(
        memory
            .try_clone_to_owned()
            .map_err(io("dup the floor's memory"))?,
    ))?;
    let mut ch = BenchCh::start(&vm.argv, dir, "floor-0", &[memory])?;
    ch.drain_events();
    ram.counting_past(0)?;
    progress("floor: the guest spins under a plain cloud-hypervisor");
    let mut series = UpdateSeries::default();
    let what = ("plain update", tsc_hz);
    let ch = series.in_a_row(cfg.updates, what, ch, progress, |ch, step| {
        one_update(ch, &vm.program, &ram, dir, step, tsc_hz)
    })?;
    series.finish(&ram, cfg.size, tsc_hz)?;
    ch.retire();
    Ok(series)
}

/// Waits until `ch`'s VM runs: its guest memory (a memfd) is there from
/// then on. Before the VM from the command line is made, `vm.info` fails or
/// names the state `Created` (the configuration alone).
pub(crate) fn running(ch: &BenchCh) -> Result<(), VmmUpdateError> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let state = ch.api().vm_state(CH_DEADLINE);
        match state {
            Ok(ref s) if s == "Running" => return Ok(()),
            _ if Instant::now() > deadline => {
                return Err(VmmUpdateError::Ch(format!(
                    "the VM does not run within 30 s: {state:?}"
                )))
            }
            _ => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

/// One copying migration of the spinning guest.
///
/// # Errors
///
/// [`VmmUpdateError::Setup`] when twice the guest RAM in 2 MiB pages is not
/// there; cloud-hypervisor and guest errors otherwise.
pub(crate) fn copy(
    run: &BaselineRun<'_>,
    progress: &mut dyn FnMut(&str),
) -> Result<CopyResult, VmmUpdateError> {
    let BaselineRun {
        cfg,
        dir,
        elf,
        tsc_hz,
    } = *run;
    let _pages = reserve(2 * cfg.size)
        .map_err(|why| VmmUpdateError::Setup(format!("source and destination memory: {why}")))?;
    let mut argv = CloudHypervisor.spin_guest_args(&cfg.program, elf);
    argv.extend(CloudHypervisor.shared_memory_args(cfg.size, "2M"));
    let mut src = BenchCh::start(&argv, dir, "copy-src", &[])?;
    src.drain_events();
    running(&src)?;
    let src_ram = GuestRam::of_memfd(src.pid())?;
    src_ram.counting_past(0)?;
    progress("copying side: the guest spins");
    let mut dst = BenchCh::start(&argv[..1], dir, "copy-dst", &[])?;
    let before = before_update(&src_ram)?;
    let started = Instant::now();
    let m = migrate(&src, &mut dst, &dir.join("copy.migration"), false)?;
    let clock = HostClock::now(tsc_hz);
    drop(src_ram);
    src.retire();
    let update_ms = started.elapsed().as_secs_f64() * 1e3;
    let dst_ram = GuestRam::of_memfd(dst.pid())?;
    let (now, switch_gap) =
        after_update(&dst_ram, before, &clock, m.migrate_at_ns, m.resumed_at_ns)?;
    let downtime_ms = now.max_gap as f64 / tsc_hz * 1e3;
    let switch_gap_ms = switch_gap.map(|t| t as f64 / tsc_hz * 1e3);
    let Settled {
        idle_gap_ms,
        stale_host,
        stale_guest,
    } = settled(
        &dst_ram,
        cfg.size,
        Duration::from_secs_f64(update_ms / 1e3),
        tsc_hz,
    )?;
    drop(dst_ram);
    dst.retire();
    let transferred = m.written_bytes;
    progress(&format!(
        "copying migration: {update_ms:.1} ms, guest paused {downtime_ms:.2} ms, {transferred} bytes written by the source"
    ));
    Ok(CopyResult {
        downtime_ms,
        idle_gap_ms,
        switch_gap_ms,
        update_ms,
        switch_ms: m.resumed_at_ns.saturating_sub(m.migrate_at_ns) as f64 / 1e6,
        qemu_total_ms: None,
        qemu_downtime_ms: None,
        ram_transferred_bytes: transferred,
        copy_gb_per_s: transferred as f64 / (update_ms / 1e3) / 1e9,
        stale_guest,
        stale_host,
    })
}
