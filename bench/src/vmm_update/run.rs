//! The run: the hugemem side (`hugemem launch --control-socket`, then
//! `hugemem update` N times), then the copying baseline (`copy.rs`).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use backend::client::Client;
use hugemem::launch::UpdateReport;
use microguest::{pvh_elf, PvhConfig, SpinState};

use super::copy;
use super::error::io;
use super::guest::{gap_within, host_tsc_hz, GuestRam, HostClock};
use super::qemu::guest_args;
use super::report::{median, UpdateResult, VmmUpdateConfig, VmmUpdateReport};
use super::setup::{child_of, idle_gap, reserve, HOST_CHECK_END, MARKER, START_GPA, STRIDE};
use super::VmmUpdateError;
use crate::private_dir::PrivateDir;
use crate::serve_child::{ServeChild, ServeOptions};

fn balanced(stats: &backend::stats::Stats) -> bool {
    let t = &stats.totals;
    t.created_bytes - t.released_bytes == t.held_bytes
}

fn start_launch(cfg: &VmmUpdateConfig, dir: &Path, elf: &Path) -> Result<Child, VmmUpdateError> {
    let log = std::fs::File::create(dir.join("launch.log")).map_err(io("launch log"))?;
    Command::new(&cfg.launcher)
        .arg("launch")
        .arg("--socket")
        .arg(dir.join("daemon.sock"))
        .args(["--size", &cfg.size.to_string(), "--page-size", "2M"])
        .arg("--control-socket")
        .arg(dir.join("vm.sock"))
        .arg("--")
        .args(guest_args(&cfg.qemu, elf))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(io("start hugemem launch"))
}

/// One `hugemem update` of the guest running under QEMU `qemu`: the
/// report, the guest's state once it counts on under the new QEMU, and its
/// recorded gap overlapping the switch (TSC ticks), if any.
fn one_update(
    control: &Path,
    qemu: u32,
    tsc_hz: f64,
) -> Result<(UpdateReport, SpinState, Option<u64>), VmmUpdateError> {
    let old = GuestRam::of(qemu)?;
    old.reset_max_gap()?;
    let before = old.spin()?.count;
    drop(old);
    let report = hugemem::launch::request_update(control, None, Duration::from_secs(600))?;
    let clock = HostClock::now(tsc_hz);
    let new_ram = GuestRam::of(report.new_pid)?;
    let now = new_ram.counting_past(before)?;
    let offset = new_ram.tsc_offset()?;
    let switch = gap_within(
        &now,
        clock.tsc_at(report.migrate_at_ns) - offset,
        clock.tsc_at(report.resumed_at_ns) - offset,
    );
    Ok((report, now, switch))
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
    let mut launch = start_launch(cfg, dir, elf)?;
    let launched = Guarded(&mut launch);
    let mut qemu = child_of(launched.0.id())?;
    let ram = GuestRam::of(qemu)?;
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
        updates: 0,
        downtime_ms: Vec::new(),
        downtime_median_ms: 0.0,
        idle_gap_ms: 0.0,
        switch_gap_ms: Vec::new(),
        switch_gap_median_ms: None,
        update_ms: Vec::new(),
        update_median_ms: 0.0,
        switch_ms: Vec::new(),
        qemu_downtime_ms: Vec::new(),
        ram_transferred_max_bytes: 0,
        ram_transferred_max_pct: 0.0,
        handoff: true,
        stale_guest: 0,
        stale_host: 0,
        cleared_bytes: 0,
        balanced: true,
        released_after_exit: false,
    };
    for i in 1..=cfg.updates {
        let (report, now, switch) = one_update(&control, qemu, tsc_hz)?;
        qemu = report.new_pid;
        r.switch_gap_ms
            .push(switch.map(|t| t as f64 / tsc_hz * 1e3));
        let downtime = now.max_gap as f64 / tsc_hz * 1e3;
        progress(&format!(
            "update {i}: {:.1} ms, guest paused {downtime:.2} ms, {} RAM bytes sent",
            report.update_ms, report.ram_transferred_bytes
        ));
        r.downtime_ms.push(downtime);
        r.update_ms.push(report.update_ms);
        r.switch_ms.push(report.switch_ms);
        r.qemu_downtime_ms.push(report.qemu_downtime_ms);
        r.ram_transferred_max_bytes = r
            .ram_transferred_max_bytes
            .max(report.ram_transferred_bytes);
        r.handoff &= report.handoff;
        r.stale_guest = now.bad;
        r.balanced &= balanced(&stats_client.stats()?);
        r.updates = i;
    }
    r.downtime_median_ms = median(&r.downtime_ms);
    r.update_median_ms = median(&r.update_ms);
    let found: Vec<f64> = r.switch_gap_ms.iter().flatten().copied().collect();
    r.switch_gap_median_ms = (!found.is_empty()).then(|| median(&found));
    r.ram_transferred_max_pct = r.ram_transferred_max_bytes as f64 * 100.0 / cfg.size as f64;
    r.cleared_bytes = stats_client.stats()?.scrub.bytes - cleared;
    let ram = GuestRam::of(qemu)?;
    let window = Duration::from_secs_f64(r.update_median_ms / 1e3);
    r.idle_gap_ms = idle_gap(&ram, window, tsc_hz)? * 1e3;
    r.stale_host = ram.stale_pages(
        START_GPA.max(microguest::IMAGE_END_GPA),
        cfg.size.min(HOST_CHECK_END),
        STRIDE,
        MARKER,
    )?;
    r.stale_guest = ram.spin()?.bad;
    drop(ram);
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

/// The launcher, stopped with SIGTERM (it forwards it to QEMU and frees the
/// memory) and reaped when dropped.
struct Guarded<'a>(&'a mut Child);

impl Drop for Guarded<'_> {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.0.id()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        let _ = self.0.wait();
    }
}

/// Runs the bench.
///
/// # Errors
///
/// [`VmmUpdateError`]: no QEMU/KVM or huge pages, or a step failed. A
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
    let image = pvh_elf(&PvhConfig {
        stride: STRIDE,
        marker: MARKER,
        start_gpa: START_GPA,
        spin: true,
        // Gaps of 0.2 ms and more go to the guest's ring (its ticks are
        // ~50 µs apart here).
        gap_min_ticks: (tsc_hz * 2e-4) as u64,
        ..Default::default()
    })
    .map_err(|e| VmmUpdateError::Setup(e.to_string()))?;
    std::fs::write(&elf, image).map_err(io("write the guest image"))?;
    progress(&format!("host TSC {:.3} GHz", tsc_hz / 1e9));
    let (update, guest_hz) = hugemem_side(cfg, dir.path(), &elf, tsc_hz, progress)?;
    let (copy, copy_note) = if cfg.no_copy {
        (None, Some("--no-copy".to_owned()))
    } else {
        match copy::run(cfg, dir.path(), &elf, tsc_hz, progress) {
            Ok(c) => (Some(c), None),
            Err(VmmUpdateError::Setup(why)) => (None, Some(why)),
            Err(e) => return Err(e),
        }
    };
    let ratio = |a: f64, b: f64| (b > 0.0).then(|| a / b);
    Ok(VmmUpdateReport {
        vmm: "qemu".into(),
        size: cfg.size,
        page_size: "2M".into(),
        guest_stride: STRIDE,
        tsc_ghz: tsc_hz / 1e9,
        guest_tsc_ghz: guest_hz / 1e9,
        downtime_ratio: copy
            .as_ref()
            .and_then(|c| ratio(c.downtime_ms, update.downtime_median_ms)),
        update_time_ratio: copy
            .as_ref()
            .and_then(|c| ratio(c.update_ms, update.update_median_ms)),
        switch_gap_ratio: copy
            .as_ref()
            .and_then(|c| c.switch_gap_ms.zip(update.switch_gap_median_ms))
            .and_then(|(c, u)| ratio(c, u)),
        update,
        copy,
        copy_note,
    })
}
