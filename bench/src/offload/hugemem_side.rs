//! One repetition of hugemem's variants on a private daemon: a VM launched
//! by `hugemem launch`, parked and restored from the park, then parked
//! again, saved to disk, loaded from it and restored.

use std::ffi::OsString;
use std::path::Path;
use std::time::{Duration, Instant};

use backend::client::Client;

use super::dense;
use super::error::OffloadError;
use super::report::{FromDiskResult, FromParkResult, OffloadConfig, OnDemandResult};
use super::save_vs_disk::{self, SaveDone};
use super::steps::{
    allocated_under, args, children_cpu_ms, daemon_copy_ms, daemon_settled, densest_file,
    disk_read_gbps, drop_dir_cache, hugemem, spawn, wait_restored_ms, Stopping, WriteWatch,
};
use crate::harness::serve::{ServeChild, ServeOptions};
use crate::vmm_side::{BenchVmm, CloudHypervisor};
use crate::vmm_update::error::io;
use crate::vmm_update::guest::GuestRam;
use crate::vmm_update::series::before_update;
use crate::vmm_update::setup::{child_of, HOST_CHECK_END, MARKER, START_GPA, STRIDE};

/// How long a launcher may take to end once its VM is parked.
const EXIT_WAIT: Duration = Duration::from_secs(60);

/// The repetition's daemon, names and paths.
struct Rep<'a> {
    cfg: &'a OffloadConfig,
    dir: &'a Path,
    socket: std::path::PathBuf,
    daemon_log: std::path::PathBuf,
    rep: usize,
}

impl Rep<'_> {
    fn path(&self, what: &str) -> std::path::PathBuf {
        self.dir.join(format!("hm{}-{what}", self.rep))
    }

    /// `hugemem launch --restore NAME -- cloud-hypervisor --api-socket …`.
    fn restore(&self, name: &str, what: &str) -> Result<Stopping, OffloadError> {
        self.restore_with(name, what, false)
    }

    /// [`Rep::restore`], with `--on-demand` when `on_demand`.
    fn restore_with(
        &self,
        name: &str,
        what: &str,
        on_demand: bool,
    ) -> Result<Stopping, OffloadError> {
        let mut restore_args = args([&"launch", &"--socket", &self.socket, &"--restore", &name]);
        if on_demand {
            restore_args.push("--on-demand".into());
        }
        restore_args.extend(args([
            &"--",
            &self.cfg.cloud_hypervisor,
            &"--api-socket",
            &self.path(&format!("{what}.api")),
        ]));
        let log = self.path(&format!("{what}.log"));
        spawn(&self.cfg.launcher, &restore_args, &log)
    }

    /// `hugemem park NAME --from-dir DIR` (with `--on-demand` when
    /// `on_demand`); its wall time, ms.
    fn park_from_dir(&self, name: &str, dir: &Path, on_demand: bool) -> Result<f64, OffloadError> {
        let mut park_args = args([
            &"park",
            &name,
            &"--socket",
            &self.socket,
            &"--from-dir",
            &dir,
        ]);
        if on_demand {
            park_args.push("--on-demand".into());
        }
        hugemem(&self.cfg.launcher, &park_args).map(|(ms, _)| ms)
    }

    /// `hugemem park NAME --api-socket API`; its wall time, ms.
    fn park(&self, name: &str, api: &Path) -> Result<f64, OffloadError> {
        let park_args = args([
            &"park",
            &name,
            &"--socket",
            &self.socket,
            &"--api-socket",
            &api,
        ]);
        hugemem(&self.cfg.launcher, &park_args).map(|(ms, _)| ms)
    }
}

/// Waits until `launcher` ends after its VM was parked.
fn parked(launcher: &mut Stopping) -> Result<(), OffloadError> {
    if launcher
        .exited_ok(EXIT_WAIT)
        .map_err(io("wait for the launcher"))?
    {
        Ok(())
    } else {
        Err(OffloadError::Guest(
            "the launcher failed once its VM was parked".into(),
        ))
    }
}

/// What one repetition of hugemem's variants adds to.
pub(super) struct HugememResults<'a> {
    pub(super) park: &'a mut FromParkResult,
    pub(super) disk: &'a mut FromDiskResult,
    pub(super) on_demand: &'a mut OnDemandResult,
}

/// Runs one repetition: adds to `out`.
pub(super) fn one_rep(
    cfg: &OffloadConfig,
    dir: &Path,
    elf: &Path,
    rep: usize,
    tsc_hz: f64,
    out: HugememResults<'_>,
) -> Result<(), OffloadError> {
    let HugememResults {
        park,
        disk,
        on_demand,
    } = out;
    let socket = dir.join(format!("hm{rep}-daemon.sock"));
    let daemon_log = dir.join(format!("hm{rep}-daemon.log"));
    let daemon = ServeChild::start(
        &cfg.launcher,
        &ServeOptions {
            socket: socket.clone(),
            pool: Some((cfg.size, cfg.size)),
            log: Some(daemon_log.clone()),
            ..ServeOptions::default()
        },
    )?;
    let r = Rep {
        cfg,
        dir,
        socket,
        daemon_log,
        rep,
    };
    let mut client = Client::connect(&r.socket)?;
    let api = r.path("launch.api");
    let mut launch_args: Vec<OsString> = args([
        &"launch",
        &"--socket",
        &r.socket,
        &"--size",
        &cfg.size.to_string(),
        &"--page-size",
        &cfg.page_size.to_string(),
        &"--",
    ]);
    launch_args.extend(CloudHypervisor.spin_guest_args(&cfg.cloud_hypervisor, elf));
    launch_args.extend(args([&"--api-socket", &api]));
    let mut launch = spawn(&cfg.launcher, &launch_args, &r.path("launch.log"))?;
    let vmm = child_of(launch.pid())?;
    let ram = GuestRam::of_launched_ch(launch.pid(), vmm)?;
    ram.counting_past(0)?;
    if cfg.dense {
        dense::fill(ram.file(), cfg.page_size)?;
    }

    // From the park.
    let name = format!("offload-bench-{rep}");
    before_update(&ram)?;
    let watch = WriteWatch::start(vmm);
    let park_ms = r.park(&name, &api)?;
    park.park_written_bytes = park.park_written_bytes.max(watch.finish());
    parked(&mut launch)?;
    let stats = client.stats()?;
    let copied = stats
        .parked
        .iter()
        .find(|p| p.name == name)
        .map(|p| p.copied_bytes)
        .ok_or_else(|| OffloadError::Guest(format!("{name} is not parked: {stats}")))?;
    park.park_copied_bytes = park.park_copied_bytes.max(copied);
    let parked_at = ram.spin()?.count;
    let started = Instant::now();
    let mut restored = r.restore(&name, "restored")?;
    let now = ram.counting_past(parked_at)?;
    park.park_ms.push(park_ms);
    park.restore_ms.push(started.elapsed().as_secs_f64() * 1e3);
    park.pause_ms.push(now.max_gap as f64 / tsc_hz * 1e3);
    park.stale_guest = park.stale_guest.max(now.bad);

    // The guest runs as soon as cloud-hypervisor resumes it, a moment
    // before the daemon has its answer and drops the parked record: the
    // name is free again once the launcher says it is restored.
    let restored_ms = wait_restored_ms(&r.path("restored.log"), EXIT_WAIT)?;
    park.restore_launcher_ms.push(restored_ms);

    // To disk and back: parked again, saved, loaded, restored.
    r.park(&name, &r.path("restored.api"))?;
    parked(&mut restored)?;
    let parked_at = ram.spin()?.count;
    // The memory returns to the pool with the save: the bench lets go of it.
    drop(ram);
    from_disk(&r, &mut client, &name, parked_at, disk)?;
    from_disk_on_demand(&r, &mut client, &name, parked_at, on_demand)?;
    std::fs::remove_dir_all(r.path("saved"))
        .map_err(io(format!("remove {}", r.path("saved").display())))?;
    drop(client);
    daemon.stop();
    Ok(())
}

/// Saves the VM parked as `name` to disk (`saved`), loads it back (cold
/// cache) as another name and restores it; the guest counted `parked_at`
/// when parked. The VM ends after; `saved` stays.
fn from_disk(
    r: &Rep<'_>,
    client: &mut Client,
    name: &str,
    parked_at: u64,
    disk: &mut FromDiskResult,
) -> Result<(), OffloadError> {
    let saved = r.path("saved");
    let on_disk = save(r, client, name, &saved, disk)?;
    drop_dir_cache(&saved)?;
    let disk_gbps = disk_read_gbps(&densest_file(&saved)?)?;
    drop_dir_cache(&saved)?;
    let loaded = format!("{name}-loaded");
    let load_ms = r.park_from_dir(&loaded, &saved, false)?;
    if let Some(ms) = daemon_copy_ms(&r.daemon_log) {
        disk.load_daemon_copy_ms.push(ms);
    }
    let started = Instant::now();
    let launcher = r.restore(&loaded, "loaded")?;
    let vmm = child_of(launcher.pid())?;
    let ram = GuestRam::wait_memfd(vmm, Duration::from_secs(120))?;
    let now = ram.counting_past(parked_at)?;
    let restore_ms = started.elapsed().as_secs_f64() * 1e3;
    let load_gbps = on_disk as f64 / 1e9 / (load_ms / 1e3);
    if r.cfg.dense {
        let end = r.cfg.size.min(HOST_CHECK_END);
        disk.stale_dense = disk.stale_dense.max(dense::stale_pages(ram.file(), end)?);
    }
    disk.saved_bytes_on_disk = disk.saved_bytes_on_disk.max(on_disk);
    disk.load_ms.push(load_ms);
    disk.load_gbps.push(load_gbps);
    disk.disk_read_gbps.push(disk_gbps);
    disk.load_vs_disk.push(load_gbps / disk_gbps);
    disk.restore_ms.push(restore_ms);
    disk.disk_to_running_ms.push(load_ms + restore_ms);
    disk.stale_guest = disk.stale_guest.max(now.bad);
    drop(ram);
    drop(launcher);
    Ok(())
}

/// `hugemem unpark NAME --save SAVED` (the daemon then let finish
/// scrubbing the memory the save returned), in a round of the disk's own
/// write rates around it (`save_vs_disk.rs`) on the same file system. The
/// writes before it write what it is about to write: as much as the save
/// before, or in the first round the guest RAM below the 32-bit hole (all
/// the guest writes). Adds the save's figures to `disk`; the bytes it
/// wrote (its files' bytes on disk).
fn save(
    r: &Rep<'_>,
    client: &mut Client,
    name: &str,
    saved: &Path,
    disk: &mut FromDiskResult,
) -> Result<u64, OffloadError> {
    let bytes_before = disk
        .save_written_bytes
        .samples
        .last()
        .map_or(r.cfg.size.min(dense::LOW_RAM_END), |&b| b as u64);
    let mut figures = None;
    save_vs_disk::round(r.dir, bytes_before, &mut disk.disk_write, || {
        let save_args = args([&"unpark", &name, &"--socket", &r.socket, &"--save", &saved]);
        let cpu_before = children_cpu_ms();
        let (save_ms, stdout) = hugemem(&r.cfg.launcher, &save_args)?;
        let cpu_ms = children_cpu_ms() - cpu_before;
        let written = allocated_under(saved)?;
        // The saved VM's memory went back to the pool, to be scrubbed: a
        // restore from disk comes long after its save, on a daemon done
        // with it, and the disk's rates after the save meet no scrub.
        let scrub_ms = daemon_settled(client)?;
        let gbps = written as f64 / 1e9 / (save_ms / 1e3);
        figures = Some((save_ms, cpu_ms, stdout, written, scrub_ms, gbps));
        Ok(SaveDone { written, gbps })
    })?;
    let Some((save_ms, cpu_ms, stdout, written, scrub_ms, gbps)) = figures else {
        return Err(OffloadError::Guest("the save's round ran no save".into()));
    };
    let prefix = format!("saved {name} to {} in ", saved.display());
    let line = stdout.lines().find(|l| l.starts_with(&prefix));
    let own_s = line
        .and_then(|l| l.strip_prefix(&prefix))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|s| s.parse::<f64>().ok());
    if let Some(s) = own_s {
        disk.save_own_ms.push(s * 1e3);
    }
    disk.save_line = line.unwrap_or_default().to_string();
    disk.save_ms.push(save_ms);
    disk.save_cpu_ms.push(cpu_ms);
    disk.save_written_bytes.push(written as f64);
    disk.save_gbps.push(gbps);
    disk.scrub_wait_ms.push(scrub_ms);
    Ok(written)
}

/// Restores the VM saved in `saved` on demand: its files parked with
/// `--on-demand` (cold cache, on pool memory the daemon has scrubbed, as
/// for the load), then `hugemem launch --restore --on-demand`, timed to the
/// guest counting past `parked_at`; then, once the launcher says every page
/// is filled, the host checks every 4 KiB page below 2 GiB.
fn from_disk_on_demand(
    r: &Rep<'_>,
    client: &mut Client,
    name: &str,
    parked_at: u64,
    od: &mut OnDemandResult,
) -> Result<(), OffloadError> {
    let saved = r.path("saved");
    // The loaded VM's memory went back to the pool with its end.
    daemon_settled(client)?;
    drop_dir_cache(&saved)?;
    let pending = format!("{name}-on-demand");
    let park_ms = r.park_from_dir(&pending, &saved, true)?;
    let started = Instant::now();
    let launcher = r.restore_with(&pending, "on-demand", true)?;
    let vmm = child_of(launcher.pid())?;
    let ram = GuestRam::wait_memfd(vmm, Duration::from_secs(120))?;
    let now = ram.counting_past(parked_at)?;
    let restore_ms = started.elapsed().as_secs_f64() * 1e3;
    let all_filled_ms = wait_restored_ms(&r.path("on-demand.log"), Duration::from_secs(300))?;
    let stale_host = ram.stale_pages(
        START_GPA.max(microguest::IMAGE_END_GPA),
        r.cfg.size.min(HOST_CHECK_END),
        STRIDE,
        MARKER,
    )?;
    if r.cfg.dense {
        let end = r.cfg.size.min(HOST_CHECK_END);
        od.stale_dense = od.stale_dense.max(dense::stale_pages(ram.file(), end)?);
    }
    od.park_ms.push(park_ms);
    od.restore_ms.push(restore_ms);
    od.disk_to_running_ms.push(park_ms + restore_ms);
    od.all_filled_ms.push(all_filled_ms);
    od.stale_host = od.stale_host.max(stale_host);
    od.stale_guest = od.stale_guest.max(now.bad.max(ram.spin()?.bad));
    drop(ram);
    drop(launcher);
    Ok(())
}
