//! The baseline: a plain local QEMU migration that copies RAM. Source and
//! destination each have their own memory (`memory-backend-memfd` on 2 MiB
//! pages, as QEMU is run without hugemem), no `x-ignore-shared`, the stream
//! over a UNIX socket, QEMU's bandwidth limit lifted (its default is
//! 128 MiB/s), its downtime limit left at the default (300 ms).

use std::ffi::OsString;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::json;

use super::error::VmmUpdateError;
use super::guest::{GuestRam, HostClock};
use super::qemu::{migrate, BenchQemu, Migrated};
use super::report::CopyResult;
use super::report::VmmUpdateConfig;
use super::series::{after_update, settled, Settled};
use super::setup::{number, reserve};
use super::side::BaselineRun;
use crate::vmm_side::{BenchVmm, Qemu};

fn argv(cfg: &VmmUpdateConfig, elf: &Path, incoming: bool) -> Vec<OsString> {
    let mut argv = Qemu.spin_guest_args(&cfg.program, elf);
    argv.extend(Qemu.shared_memory_args(cfg.size, "2M"));
    if incoming {
        argv.extend(["-incoming", "defer"].map(OsString::from));
    }
    argv
}

/// One copying migration of the spinning guest.
///
/// # Errors
///
/// [`VmmUpdateError::Setup`] when twice the guest RAM in 2 MiB pages is not
/// there; QEMU and guest errors otherwise.
pub(crate) fn run(
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
    let mut src = BenchQemu::start(&argv(cfg, elf, false), &dir.join("src.qmp"), &[])?;
    let src_ram = GuestRam::of(src.pid())?;
    src_ram.counting_past(0)?;
    progress("copying side: the guest spins");
    let mut dst = BenchQemu::start(&argv(cfg, elf, true), &dir.join("dst.qmp"), &[])?;
    let caps = json!({"capabilities": [{"capability": "events", "state": true}]});
    src.execute("migrate-set-capabilities", caps.clone())?;
    dst.execute("migrate-set-capabilities", caps)?;
    src.execute(
        "migrate-set-parameters",
        json!({"max-bandwidth": 1u64 << 40}),
    )?;
    let channel = dir.join("migrate.sock");
    let uri = format!("unix:{}", channel.display());
    dst.execute("migrate-incoming", json!({ "uri": uri }))?;
    src_ram.reset_max_gap()?;
    let before = src_ram.spin()?.count;
    let started = Instant::now();
    let Migrated {
        migrate_at_ns: migrate_at,
        resumed_at_ns: resumed_at,
        stats,
    } = migrate(&mut src, &mut dst, &uri, "the copying migration")?;
    let clock = HostClock::now(tsc_hz);
    drop(src_ram);
    src.quit();
    let update_ms = started.elapsed().as_secs_f64() * 1e3;
    let dst_ram = GuestRam::of(dst.pid())?;
    let (now, switch_gap) = after_update(&dst_ram, before, &clock, migrate_at, resumed_at)?;
    let downtime_ms = now.max_gap as f64 / tsc_hz * 1e3;
    let switch_gap_ms = switch_gap.map(|t| t as f64 / tsc_hz * 1e3);
    let window = Duration::from_secs_f64(update_ms / 1e3);
    let Settled {
        idle_gap_ms,
        stale_host,
        stale_guest,
    } = settled(&dst_ram, cfg.size, window, tsc_hz)?;
    drop(dst_ram);
    dst.quit();
    let transferred = number(&stats, "/ram/transferred");
    let total_ms = number(&stats, "/total-time");
    progress(&format!(
        "copying migration: {update_ms:.1} ms, guest paused {downtime_ms:.2} ms, {transferred} RAM bytes sent"
    ));
    Ok(CopyResult {
        downtime_ms,
        idle_gap_ms,
        switch_gap_ms,
        update_ms,
        switch_ms: resumed_at.saturating_sub(migrate_at) as f64 / 1e6,
        qemu_total_ms: Some(total_ms),
        qemu_downtime_ms: Some(number(&stats, "/downtime")),
        ram_transferred_bytes: transferred,
        copy_gb_per_s: transferred as f64 / (update_ms / 1e3) / 1e9,
        stale_guest,
        stale_host,
    })
}
