//! One repetition of the baselines: cloud-hypervisor's own `file://`
//! snapshot and restore, and its reference offload daemon, each on a
//! cloud-hypervisor with its own memory (a hugetlb memfd of 2 MiB pages).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::dense;
use super::error::OffloadError;
use super::report::{ChFileResult, OffloadConfig, OffloadDaemonResult};
use super::steps::{allocated_under, args, drop_dir_cache, spawn, Stopping};
use crate::vmm_side::{BenchVmm, CloudHypervisor};
use crate::vmm_update::ch::{BenchCh, CH_DEADLINE};
use crate::vmm_update::error::io;
use crate::vmm_update::guest::GuestRam;

/// How long a guest may take to spin in its memory (a restored one: to
/// have its memory).
const RESTORE_WAIT: Duration = Duration::from_secs(300);

fn api_err(
    what: &'static str,
) -> impl FnOnce(hugemem::launch::vmm::cloud_hypervisor::api::ChApiError) -> OffloadError {
    move |e| OffloadError::Ch(format!("{what}: {e}"))
}

/// The spinning guest under a cloud-hypervisor of its own (`--memory
/// size=S,shared=on,hugepages=on,hugepage_size=2M`), counting; with
/// `--dense`, its RAM filled (`dense.rs`: the memfd from guest address 0,
/// which holds all the RAM the guest touches).
fn own_guest(
    cfg: &OffloadConfig,
    dir: &Path,
    elf: &Path,
    name: &str,
) -> Result<(BenchCh, GuestRam), OffloadError> {
    let mut argv = CloudHypervisor.spin_guest_args(&cfg.cloud_hypervisor, elf);
    argv.extend(CloudHypervisor.shared_memory_args(cfg.size, &cfg.page_size.to_string()));
    let mut ch = BenchCh::start(&argv, dir, name, &[])?;
    ch.drain_events();
    ch.wait_running()?;
    let ram = GuestRam::wait_memfd(ch.pid(), RESTORE_WAIT)?;
    ram.counting_past(0)?;
    if cfg.dense {
        dense::fill(ram.file(), cfg.page_size)?;
    }
    Ok((ch, ram))
}

/// A fresh directory for a snapshot.
fn snapshot_dir(dir: &Path, name: &str) -> Result<PathBuf, OffloadError> {
    let path = dir.join(name);
    std::fs::create_dir(&path).map_err(io(format!("create {}", path.display())))?;
    Ok(path)
}

/// One `file://` snapshot and restore; adds to `out`.
pub(super) fn ch_file_rep(
    cfg: &OffloadConfig,
    dir: &Path,
    elf: &Path,
    rep: usize,
    out: &mut ChFileResult,
) -> Result<(), OffloadError> {
    let (src, ram) = own_guest(cfg, dir, elf, &format!("chfile{rep}-src"))?;
    let snap = snapshot_dir(dir, &format!("chfile{rep}-snapshot"))?;
    let url = format!("file://{}", snap.display());
    let started = Instant::now();
    src.api()
        .put("vm.pause", None, CH_DEADLINE)
        .map_err(api_err("vm.pause"))?;
    src.api()
        .put(
            "vm.snapshot",
            Some(&serde_json::json!({ "destination_url": url })),
            CH_DEADLINE,
        )
        .map_err(api_err("vm.snapshot"))?;
    let snapshot_ms = started.elapsed().as_secs_f64() * 1e3;
    let parked_at = ram.spin()?.count;
    drop(ram);
    src.retire();
    drop_dir_cache(&snap)?;
    out.snapshot_bytes_on_disk = out.snapshot_bytes_on_disk.max(allocated_under(&snap)?);
    let restore: [OsString; 3] = [
        cfg.cloud_hypervisor.clone(),
        "--restore".into(),
        format!("source_url={url},resume=true").into(),
    ];
    let started = Instant::now();
    let mut dst = BenchCh::start(&restore, dir, &format!("chfile{rep}-dst"), &[])?;
    dst.drain_events();
    let ram = GuestRam::wait_memfd(dst.pid(), RESTORE_WAIT)?;
    let now = ram.counting_past(parked_at)?;
    out.restore_ms.push(started.elapsed().as_secs_f64() * 1e3);
    out.snapshot_ms.push(snapshot_ms);
    out.stale_guest = out.stale_guest.max(now.bad);
    drop(ram);
    dst.retire();
    std::fs::remove_dir_all(&snap).map_err(io(format!("remove {}", snap.display())))
}

/// Waits until `path` exists (a socket its process binds).
fn bound(path: &Path, process: &mut Stopping) -> Result<(), OffloadError> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !path.exists() {
        if Instant::now() > deadline || matches!(process.0.try_wait(), Ok(Some(_))) {
            return Err(OffloadError::Ch(format!(
                "offload_daemon did not bind {}",
                path.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

/// Waits for `process` (an offload daemon) to end well.
fn done(process: &mut Stopping, what: &str) -> Result<(), OffloadError> {
    if process
        .exited_ok(CH_DEADLINE)
        .map_err(io("wait for offload_daemon"))?
    {
        Ok(())
    } else {
        Err(OffloadError::Ch(format!("offload_daemon {what} failed")))
    }
}

/// One park to the offload daemon and restore from it; adds to `out`.
pub(super) fn offload_daemon_rep(
    cfg: &OffloadConfig,
    program: &Path,
    dir: &Path,
    elf: &Path,
    rep: usize,
    out: &mut OffloadDaemonResult,
) -> Result<(), OffloadError> {
    let (src, ram) = own_guest(cfg, dir, elf, &format!("od{rep}-src"))?;
    let snap = dir.join(format!("od{rep}-snapshot"));
    let socket = dir.join(format!("od{rep}-snapshot.sock"));
    let snapshot_args = args([&"snapshot", &"--socket", &socket, &"--output-dir", &snap]);
    let started = Instant::now();
    let mut daemon = spawn(
        program,
        &snapshot_args,
        &dir.join(format!("od{rep}-snapshot.log")),
    )?;
    bound(&socket, &mut daemon)?;
    src.api()
        .send_migration(&socket, true, CH_DEADLINE)
        .map_err(api_err("send-migration"))?;
    done(&mut daemon, "snapshot")?;
    let park_ms = started.elapsed().as_secs_f64() * 1e3;
    let parked_at = ram.spin()?.count;
    drop(ram);
    src.retire();
    drop_dir_cache(&snap)?;
    out.snapshot_bytes_on_disk = out.snapshot_bytes_on_disk.max(allocated_under(&snap)?);
    let channel = dir.join(format!("od{rep}-restore.sock"));
    let restore_args = args([
        &"restore",
        &"--socket",
        &channel,
        &"--input-dir",
        &snap,
        &"--resume",
    ]);
    let started = Instant::now();
    let mut dst = BenchCh::start(
        std::slice::from_ref(&cfg.cloud_hypervisor),
        dir,
        &format!("od{rep}-dst"),
        &[],
    )?;
    let receiving = dst.listen_for_migration(&channel)?;
    let log = dir.join(format!("od{rep}-restore.log"));
    let mut daemon = spawn(program, &restore_args, &log)?;
    receiving.wait()?;
    let ram = GuestRam::wait_memfd(dst.pid(), RESTORE_WAIT)?;
    let now = ram.counting_past(parked_at)?;
    out.restore_ms.push(started.elapsed().as_secs_f64() * 1e3);
    out.park_ms.push(park_ms);
    out.stale_guest = out.stale_guest.max(now.bad);
    done(&mut daemon, "restore")?;
    drop(ram);
    dst.retire();
    std::fs::remove_dir_all(&snap).map_err(io(format!("remove {}", snap.display())))
}
