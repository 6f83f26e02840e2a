//! The baselines an update is measured against, written once for both
//! VMMs over [`BaselineVmm`] (QEMU: `qemu.rs`, cloud-hypervisor: `ch.rs`).
//!
//! * **Floor**: the same updates without hugemem. Plain VMMs on one
//!   resident hugetlb memfd (the command line `hugemem launch` builds, the
//!   fd inherited, no daemon: [`FloorVm`]); each update starts a new VMM
//!   without a VM and moves the guest to it by a migration that leaves the
//!   memory where it is (QEMU: `x-ignore-shared`, the new QEMU mapping the
//!   same memfd; cloud-hypervisor: `local=on`, the memory's fds going over
//!   the socket), then ends the old one, as `hugemem update` does. What
//!   hugemem adds over this is its own work: the HANDOFF or the request to
//!   the launcher, its supervision.
//! * **Copy**: the guest under a VMM with its own memory (a hugetlb memfd
//!   of its own, `BenchVmm::shared_memory_args`), migrated once, RAM
//!   copied, to a second VMM that receives it into memory of its own: how a
//!   host is drained today. QEMU's bandwidth limit is lifted (its default
//!   is 128 MiB/s), its downtime limit left at the default (300 ms).
//!
//! RAM bytes sent: QEMU's `query-migrate` RAM bytes (`ram_bytes_sent`:
//! its phases' bytes, the same on QEMU 7.2 and 10.0); for
//! cloud-hypervisor what the source process wrote during the migration
//! (`/proc/PID/io` `wchar`), the measure `hugemem update` reports.

use std::ffi::OsString;
use std::fs::File;
use std::os::fd::BorrowedFd;
use std::path::Path;
use std::time::{Duration, Instant};

use guest_mem::{PageSize, Reservation};

use super::error::{io, VmmUpdateError};
use super::guest::{GuestRam, HostClock};
use super::report::{CopyResult, UpdateSeries, VmmUpdateConfig};
use super::series::{after_update, before_update, settled, OneUpdate, Settled};
use super::setup::reserve;
use crate::floor::{vmm_argv, FloorMemory};

/// What a baseline is run with.
pub(crate) struct BaselineRun<'a> {
    /// The run's configuration.
    pub(crate) cfg: &'a VmmUpdateConfig,
    /// The run's private directory (sockets, logs).
    pub(crate) dir: &'a Path,
    /// The spinning guest's kernel.
    pub(crate) elf: &'a Path,
    /// The host's TSC rate, ticks per second.
    pub(crate) tsc_hz: f64,
}

/// A floor's VM before it starts: a resident memfd of the guest's size on
/// 2 MiB pages, and the command line `hugemem launch` builds for the
/// spinning guest on it (`/dev/fd/N`, the fd to be inherited), no daemon.
pub(crate) struct FloorVm {
    /// The guest's RAM.
    pub(crate) memory: FloorMemory,
    /// Its whole command line, program first.
    pub(crate) argv: Vec<OsString>,
    /// The memfd's pages, held until after it is gone.
    _pages: Reservation,
}

impl FloorVm {
    /// Makes the memory and the command line for `run`'s VMM.
    ///
    /// # Errors
    ///
    /// [`VmmUpdateError::Setup`] when the guest RAM in 2 MiB pages is not
    /// there, or the VMM's command line cannot carry it.
    pub(crate) fn new(run: &BaselineRun<'_>) -> Result<Self, VmmUpdateError> {
        let cfg = run.cfg;
        let pages = reserve(cfg.size).map_err(VmmUpdateError::Setup)?;
        let (memory, _) = FloorMemory::populated(cfg.size, PageSize::Huge2M)
            .map_err(|e| VmmUpdateError::Setup(format!("the floor's memory: {e}")))?;
        let mut user = crate::vmm_side::of(cfg.vmm).spin_guest_args(&cfg.program, run.elf);
        let program = user.remove(0);
        let argv =
            vmm_argv(cfg.vmm, program, &user, &[memory.region()], &[memory.fd()]).map_err(|e| {
                let vmm = cfg.vmm.adapter().name();
                VmmUpdateError::Setup(format!("the plain {vmm}'s command line: {e}"))
            })?;
        Ok(Self {
            memory,
            argv,
            _pages: pages,
        })
    }
}

/// One migration, as [`BaselineVmm::migrate`] saw it.
pub(crate) struct Migration {
    /// `CLOCK_MONOTONIC` just before the migration was asked for, ns.
    pub(crate) migrate_at_ns: u64,
    /// `CLOCK_MONOTONIC` once the destination ran the guest, ns.
    pub(crate) resumed_at_ns: u64,
    /// RAM bytes the migration sent.
    pub(crate) sent_bytes: u64,
    /// QEMU's own downtime figure, ms.
    pub(crate) qemu_downtime_ms: Option<u64>,
    /// QEMU's own total time, ms.
    pub(crate) qemu_total_ms: Option<u64>,
}

/// A VMM process a baseline starts and moves the guest between.
pub(crate) trait BaselineVmm: Sized {
    /// What a progress line calls the RAM bytes a migration sent.
    const SENT: &'static str;

    /// Starts `argv` (program first) running the guest, named `name` in
    /// `dir` (its sockets, its log), `inherit` open in it under their
    /// numbers.
    fn start(
        argv: &[OsString],
        dir: &Path,
        name: &str,
        inherit: &[BorrowedFd<'_>],
    ) -> Result<Self, VmmUpdateError>;

    /// Starts a VMM without a VM for the guest of `argv` to move into,
    /// named `name`; `memory`: the floor's memfd, where the guest's RAM
    /// stays (a VMM that gets it by the migration leaves it closed).
    fn receiver(
        argv: &[OsString],
        dir: &Path,
        name: &str,
        memory: Option<BorrowedFd<'_>>,
    ) -> Result<Self, VmmUpdateError>;

    /// The guest's RAM in this VMM's own memory, once its VM runs.
    fn own_ram(&self) -> Result<GuestRam, VmmUpdateError>;

    /// Gets `src` and `dst` ready for a migration over `channel` (a UNIX
    /// socket path); `local`: the guest's memory stays where it is.
    fn prepare(
        src: &mut Self,
        dst: &mut Self,
        channel: &Path,
        local: bool,
    ) -> Result<(), VmmUpdateError>;

    /// Migrates the guest from `src` to `dst`, as prepared; returns once
    /// `dst` runs it.
    fn migrate(
        src: &mut Self,
        dst: &mut Self,
        channel: &Path,
        local: bool,
    ) -> Result<Migration, VmmUpdateError>;

    /// Ends it, asking it to, and reaps it.
    fn end(self);
}

impl Migration {
    /// From the request to the destination running the guest, ms.
    fn switch_ms(&self) -> f64 {
        self.resumed_at_ns.saturating_sub(self.migrate_at_ns) as f64 / 1e6
    }
}

/// `cfg.updates` plain updates in a row of the spinning guest: the floor.
///
/// # Errors
///
/// [`VmmUpdateError::Setup`] when the guest RAM in 2 MiB pages is not
/// there; VMM and guest errors otherwise.
pub(crate) fn floor<V: BaselineVmm>(
    run: &BaselineRun<'_>,
    progress: &mut dyn FnMut(&str),
) -> Result<UpdateSeries, VmmUpdateError> {
    let BaselineRun {
        cfg, dir, tsc_hz, ..
    } = *run;
    let vm = FloorVm::new(run)?;
    let memory = vm.memory.fd();
    let dup = memory
        .try_clone_to_owned()
        .map_err(io("dup the floor's memory"))?;
    let ram = GuestRam::from_file(File::from(dup))?;
    let first = V::start(&vm.argv, dir, "floor-0", &[memory])?;
    ram.counting_past(0)?;
    let vmm = cfg.vmm.adapter().name();
    progress(&format!("floor: the guest spins under a plain {vmm}"));
    let mut series = UpdateSeries::default();
    let what = ("plain update", tsc_hz);
    let last = series.in_a_row(cfg.updates, what, first, progress, |mut old, step| {
        let before = before_update(&ram)?;
        let started = Instant::now();
        let name = format!("floor-{step}");
        let mut new = V::receiver(&vm.argv, dir, &name, Some(memory))?;
        let channel = dir.join(format!("{name}.migration"));
        V::prepare(&mut old, &mut new, &channel, true)?;
        let m = V::migrate(&mut old, &mut new, &channel, true)?;
        let clock = HostClock::now(tsc_hz);
        old.end();
        let update_ms = started.elapsed().as_secs_f64() * 1e3;
        let (guest, switch_gap_ticks) =
            after_update(&ram, before, &clock, m.migrate_at_ns, m.resumed_at_ns)?;
        let one = OneUpdate {
            guest,
            switch_gap_ticks,
            update_ms,
            switch_ms: m.switch_ms(),
            qemu_downtime_ms: m.qemu_downtime_ms.unwrap_or(0),
            ram_transferred_bytes: m.sent_bytes,
        };
        Ok((new, one))
    })?;
    series.finish(&ram, cfg.size, tsc_hz)?;
    last.end();
    Ok(series)
}

/// One copying migration of the spinning guest.
///
/// # Errors
///
/// [`VmmUpdateError::Setup`] when twice the guest RAM in 2 MiB pages is not
/// there; VMM and guest errors otherwise.
pub(crate) fn copy<V: BaselineVmm>(
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
    let side = crate::vmm_side::of(cfg.vmm);
    let mut argv = side.spin_guest_args(&cfg.program, elf);
    argv.extend(side.shared_memory_args(cfg.size, "2M"));
    let mut src = V::start(&argv, dir, "copy-src", &[])?;
    let src_ram = src.own_ram()?;
    src_ram.counting_past(0)?;
    progress("copying side: the guest spins");
    let mut dst = V::receiver(&argv, dir, "copy-dst", None)?;
    let channel = dir.join("copy.migration");
    V::prepare(&mut src, &mut dst, &channel, false)?;
    let before = before_update(&src_ram)?;
    let started = Instant::now();
    let m = V::migrate(&mut src, &mut dst, &channel, false)?;
    let clock = HostClock::now(tsc_hz);
    drop(src_ram);
    src.end();
    let update_ms = started.elapsed().as_secs_f64() * 1e3;
    let dst_ram = dst.own_ram()?;
    let (now, switch_gap) =
        after_update(&dst_ram, before, &clock, m.migrate_at_ns, m.resumed_at_ns)?;
    let downtime_ms = now.max_gap as f64 / tsc_hz * 1e3;
    let window = Duration::from_secs_f64(update_ms / 1e3);
    let Settled {
        idle_gap_ms,
        stale_host,
        stale_guest,
    } = settled(&dst_ram, cfg.size, window, tsc_hz)?;
    drop(dst_ram);
    dst.end();
    let sent = m.sent_bytes;
    progress(&format!(
        "copying migration: {update_ms:.1} ms, guest paused {downtime_ms:.2} ms, {sent} {}",
        V::SENT
    ));
    Ok(CopyResult {
        downtime_ms,
        idle_gap_ms,
        switch_gap_ms: switch_gap.map(|t| t as f64 / tsc_hz * 1e3),
        update_ms,
        switch_ms: m.switch_ms(),
        qemu_total_ms: m.qemu_total_ms,
        qemu_downtime_ms: m.qemu_downtime_ms,
        ram_transferred_bytes: sent,
        copy_gb_per_s: sent as f64 / (update_ms / 1e3) / 1e9,
        stale_guest,
        stale_host,
    })
}
