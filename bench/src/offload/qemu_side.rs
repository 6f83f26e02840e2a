//! QEMU's rows (issue 46): one repetition parks and restores a QEMU VM
//! through hugemem, then saves and restores the same kind of VM with
//! QEMU's own migration to a file, then runs QEMU's floor, each on the
//! spinning guest under `-M microvm`, one guest at a time:
//!
//! 1. **hugemem**: a private daemon, `hugemem launch --control-socket …
//!    -- qemu-system-x86_64 …`, `hugemem park NAME --control-socket …`
//!    (its wall time) and `hugemem launch --restore NAME --
//!    qemu-system-x86_64` (the parked command line reused): its start to
//!    the guest counting again, read in the same memory.
//! 2. **QEMU's own save to a file**: QEMU on its own memory (a hugetlb
//!    memfd, `memory-backend-memfd`), `migrate` to an fd on a file (`fd:`,
//!    passed with `getfd`; its bandwidth limit lifted) until `completed`,
//!    QEMU quit, the file dropped from the page cache, then a new QEMU
//!    with `-incoming defer` fed the file (`migrate-incoming fd:`): its
//!    start to the guest counting.
//! 3. **The floor**: the same save and restore with `x-ignore-shared` on a
//!    resident hugetlb memfd the bench holds (the command line `hugemem
//!    launch` builds, no daemon): QEMU writing only its device state and a
//!    new QEMU mapping the same pages. hugemem's park and restore do this
//!    and talk to the daemon; what they add over it is hugemem's.

use std::ffi::OsString;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use backend::client::Client;
use guest_mem::PageSize;
use hugemem::launch::vmm::qemu::qmp::{is_event, ram_bytes_sent};
use hugemem::launch::Vmm;
use serde_json::json;

use super::error::OffloadError;
use super::qemu_report::QemuResult;
use super::report::OffloadConfig;
use super::steps::{args, hugemem, spawn, wait_restored_ms};
use crate::floor::{vmm_argv, FloorMemory};
use crate::harness::serve::{ServeChild, ServeOptions};
use crate::vmm_side::{BenchVmm, Qemu};
use crate::vmm_update::error::io;
use crate::vmm_update::guest::GuestRam;
use crate::vmm_update::qemu::BenchQemu;
use crate::vmm_update::series::before_update;
use crate::vmm_update::setup::child_of;

/// How long a launcher may take to end once its VM is parked, and a
/// restored guest to count.
const WAIT: Duration = Duration::from_secs(120);

/// One repetition of QEMU's rows; adds to `out`.
pub(super) fn qemu_rep(
    cfg: &OffloadConfig,
    qemu: &OsString,
    (dir, elf): (&Path, &Path),
    rep: usize,
    tsc_hz: f64,
    out: &mut QemuResult,
) -> Result<(), OffloadError> {
    through_hugemem(cfg, qemu, (dir, elf), rep, tsc_hz, out)?;
    let floor = floor_save_restore((cfg.size, cfg.page_size), qemu, (dir, elf), rep)?;
    out.floor_save_ms.push(floor.save_ms);
    out.floor_restore_ms.push(floor.restore_ms);
    out.floor_file_bytes = out.floor_file_bytes.max(floor.file_bytes);
    out.floor_ram_transferred_bytes = out.floor_ram_transferred_bytes.max(floor.ram_bytes);
    out.stale_guest = out.stale_guest.max(floor.stale);
    let own = own_save_restore((cfg.size, cfg.page_size), qemu, (dir, elf), rep)?;
    out.file_save_ms.push(own.save_ms);
    out.file_restore_ms.push(own.restore_ms);
    out.file_bytes = out.file_bytes.max(own.file_bytes);
    out.file_ram_transferred_bytes = out.file_ram_transferred_bytes.max(own.ram_bytes);
    out.stale_guest = out.stale_guest.max(own.stale);
    Ok(())
}

/// The numbers after `"stream: "` in `hugemem park`'s line: the device
/// state's bytes and the RAM bytes QEMU's stream carried.
fn stream_bytes(said: &str) -> Option<(u64, u64)> {
    let (_, after) = said.split_once("stream: ")?;
    let mut numbers = after
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .map(str::parse::<u64>);
    Some((numbers.next()?.ok()?, numbers.next()?.ok()?))
}

/// The launcher's own figure in `hugemem park`'s line (its "; X ms, the
/// QEMU exits": the park's request to the daemon's answer), ms.
fn launcher_park_ms(said: &str) -> Option<f64> {
    let (before, _) = said.rsplit_once(" ms, the ")?;
    before.rsplit(' ').next()?.parse().ok()
}

/// hugemem's park and restore of a launched QEMU on a private daemon.
fn through_hugemem(
    cfg: &OffloadConfig,
    qemu: &OsString,
    (dir, elf): (&Path, &Path),
    rep: usize,
    tsc_hz: f64,
    out: &mut QemuResult,
) -> Result<(), OffloadError> {
    let path = |what: &str| dir.join(format!("q{rep}-{what}"));
    let socket = path("daemon.sock");
    let daemon = ServeChild::start(
        &cfg.launcher,
        &ServeOptions {
            socket: socket.clone(),
            pool: Some((cfg.size, cfg.size)),
            log: Some(path("daemon.log")),
            ..ServeOptions::default()
        },
    )?;
    let mut client = Client::connect(&socket)?;
    let control = path("vm.sock");
    let mut launch_args = args([
        &"launch",
        &"--socket",
        &socket,
        &"--control-socket",
        &control,
        &"--size",
        &cfg.size.to_string(),
        &"--page-size",
        &cfg.page_size.to_string(),
        &"--",
    ]);
    launch_args.extend(Qemu.spin_guest_args(qemu, elf));
    let mut launch = spawn(&cfg.launcher, &launch_args, &path("launch.log"))?;
    let vmm = child_of(launch.pid())?;
    // The launched QEMU's memory, opened anew: the same pages the restored
    // QEMU runs on.
    let ram = GuestRam::of(vmm)?;
    ram.counting_past(0)?;
    let name = format!("offload-bench-qemu-{rep}");
    before_update(&ram)?;
    out.park_command_ms
        .push(command_start_ms(&cfg.launcher, &name, &path("none.sock"))?);
    let park_args = args([&"park", &name, &"--control-socket", &control]);
    let (park_ms, said) = hugemem(&cfg.launcher, &park_args)?;
    if !launch
        .exited_ok(WAIT)
        .map_err(io("wait for the launcher"))?
    {
        return Err(OffloadError::Guest(
            "the QEMU launcher failed once its VM was parked".into(),
        ));
    }
    let stats = client.stats()?;
    let copied = stats
        .parked
        .iter()
        .find(|p| p.name == name)
        .map(|p| p.copied_bytes)
        .ok_or_else(|| OffloadError::Guest(format!("{name} is not parked: {stats}")))?;
    let (state, ram_sent) = stream_bytes(&said)
        .ok_or_else(|| OffloadError::Guest(format!("no stream figures in {said:?}")))?;
    if let Some(ms) = launcher_park_ms(&said) {
        out.park_launcher_ms.push(ms);
    }
    let parked_at = ram.spin()?.count;
    let restore_args = args([
        &"launch",
        &"--socket",
        &socket,
        &"--restore",
        &name,
        &"--",
        qemu,
    ]);
    let started = Instant::now();
    let restored = spawn(&cfg.launcher, &restore_args, &path("restored.log"))?;
    let now = ram.counting_past(parked_at)?;
    out.restore_ms.push(started.elapsed().as_secs_f64() * 1e3);
    out.park_ms.push(park_ms);
    out.pause_ms.push(now.max_gap as f64 / tsc_hz * 1e3);
    out.restore_launcher_ms
        .push(wait_restored_ms(&path("restored.log"), WAIT)?);
    out.park_copied_bytes = out.park_copied_bytes.max(copied);
    out.park_state_bytes = out.park_state_bytes.max(state);
    out.park_ram_transferred_bytes = out.park_ram_transferred_bytes.max(ram_sent);
    out.stale_guest = out.stale_guest.max(now.bad);
    drop(ram);
    drop(restored);
    drop(client);
    daemon.stop();
    Ok(())
}

/// The wall time of `hugemem park NAME --control-socket NONE` where no
/// socket is: the command's start, a refused connect and its end, ms (the
/// part of the park's wall time that any command pays).
fn command_start_ms(launcher: &Path, name: &str, none: &Path) -> Result<f64, OffloadError> {
    let started = Instant::now();
    let out = std::process::Command::new(launcher)
        .args(args([&"park", &name, &"--control-socket", &none]))
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(io(format!("run {}", launcher.display())))?;
    let ms = started.elapsed().as_secs_f64() * 1e3;
    if out.status.success() {
        return Err(OffloadError::Guest(format!(
            "hugemem park on {} (no socket) succeeded",
            none.display()
        )));
    }
    Ok(ms)
}

/// One save to a file and restore from it, as QEMU alone does them
/// (`bench clone --vmm qemu` runs them too).
pub(crate) struct SaveRestore {
    /// `migrate` to the file until `completed`, ms.
    pub(crate) save_ms: f64,
    /// The new QEMU's start to the guest counting, ms.
    pub(crate) restore_ms: f64,
    /// The file's size, bytes.
    pub(crate) file_bytes: u64,
    /// `query-migrate`'s `ram.transferred`, bytes.
    pub(crate) ram_bytes: u64,
    /// The guest's own count of bad pages.
    pub(crate) stale: u64,
}

/// Runs `migrate` on `src` into `file` (`fd:`), until QEMU's `completed`
/// (QEMU is paused then); its time, ms, and `query-migrate`'s
/// `ram.transferred`.
fn save_to(src: &mut BenchQemu, file: &File, local: bool) -> Result<(f64, u64), OffloadError> {
    let mut caps = vec![json!({"capability": "events", "state": true})];
    if local {
        caps.push(json!({"capability": "x-ignore-shared", "state": true}));
    }
    src.execute("migrate-set-capabilities", json!({ "capabilities": caps }))?;
    // QEMU's default limit (128 MiB/s) is no disk's.
    src.execute(
        "migrate-set-parameters",
        json!({"max-bandwidth": 1u64 << 40}),
    )?;
    src.qmp
        .execute_with_fd("getfd", json!({"fdname": "hm-save"}), file.as_fd())
        .map_err(|e| OffloadError::Qemu(format!("getfd: {e}")))?;
    let started = Instant::now();
    src.execute("migrate", json!({"uri": "fd:hm-save"}))?;
    let end = src
        .qmp
        .wait_event(|e| is_event(e, "MIGRATION", &["completed", "failed", "cancelled"]))
        .map_err(|e| OffloadError::Qemu(format!("waiting for the save: {e}")))?;
    let ms = started.elapsed().as_secs_f64() * 1e3;
    let stats = src.execute("query-migrate", json!({}))?;
    if !is_event(&end, "MIGRATION", &["completed"]) {
        return Err(OffloadError::Qemu(format!("the save ended: {stats}")));
    }
    Ok((ms, ram_bytes_sent(&stats)))
}

/// Starts `argv` with `-incoming defer` and `inherit`, feeds it `file`
/// (`migrate-incoming fd:`).
fn restore_from(
    argv: &[OsString],
    monitor: &Path,
    inherit: &[BorrowedFd<'_>],
    file: &File,
    local: bool,
) -> Result<BenchQemu, OffloadError> {
    let mut incoming = argv.to_vec();
    incoming.extend(["-incoming", "defer"].map(OsString::from));
    let mut dst = BenchQemu::start(&incoming, monitor, inherit)?;
    if local {
        let caps = json!({"capabilities": [{"capability": "x-ignore-shared", "state": true}]});
        dst.execute("migrate-set-capabilities", caps)?;
    }
    dst.qmp
        .execute_with_fd("getfd", json!({"fdname": "hm-load"}), file.as_fd())
        .map_err(|e| OffloadError::Qemu(format!("getfd: {e}")))?;
    dst.execute("migrate-incoming", json!({"uri": "fd:hm-load"}))?;
    Ok(dst)
}

/// A new file for a save at `path`, and the same opened for reading.
fn save_file(path: &Path) -> Result<(File, File), OffloadError> {
    let write = File::create(path).map_err(io(format!("create {}", path.display())))?;
    let read = File::open(path).map_err(io(format!("open {}", path.display())))?;
    Ok((write, read))
}

/// QEMU's floor: `x-ignore-shared` to a file and back on a resident memfd.
pub(crate) fn floor_save_restore(
    (size, page): (u64, PageSize),
    qemu: &OsString,
    (dir, elf): (&Path, &Path),
    rep: usize,
) -> Result<SaveRestore, OffloadError> {
    let (memory, _) = FloorMemory::populated(size, page)
        .map_err(|e| OffloadError::Setup(format!("the floor's memory: {e}")))?;
    let mut user = Qemu.spin_guest_args(qemu, elf);
    let program = user.remove(0);
    let argv = vmm_argv(
        Vmm::Qemu,
        program,
        &user,
        &[memory.region()],
        &[memory.fd()],
    )
    .map_err(|e| OffloadError::Setup(format!("the floor QEMU's command line: {e}")))?;
    let mut src = BenchQemu::start(&argv, &dir.join(format!("qf{rep}-src.qmp")), &[memory.fd()])?;
    let ram = GuestRam::open(Path::new(&format!(
        "/proc/self/fd/{}",
        memory.fd().as_raw_fd()
    )))?;
    ram.counting_past(0)?;
    let path = dir.join(format!("qf{rep}-state"));
    let (write, read) = save_file(&path)?;
    let (save_ms, ram_bytes) = save_to(&mut src, &write, true)?;
    drop(write);
    let parked_at = ram.spin()?.count;
    src.quit();
    let file_bytes = read.metadata().map_err(io("stat the floor's file"))?.len();
    drop_file_cache(&read)?;
    let started = Instant::now();
    let monitor = dir.join(format!("qf{rep}-dst.qmp"));
    let dst = restore_from(&argv, &monitor, &[memory.fd()], &read, true)?;
    let now = ram.counting_past(parked_at)?;
    let restore_ms = started.elapsed().as_secs_f64() * 1e3;
    dst.quit();
    std::fs::remove_file(&path).map_err(io(format!("remove {}", path.display())))?;
    Ok(SaveRestore {
        save_ms,
        restore_ms,
        file_bytes,
        ram_bytes,
        stale: now.bad,
    })
}

/// QEMU's own save of its RAM to a file and restore from it.
pub(crate) fn own_save_restore(
    (size, page): (u64, PageSize),
    qemu: &OsString,
    (dir, elf): (&Path, &Path),
    rep: usize,
) -> Result<SaveRestore, OffloadError> {
    let mut argv = Qemu.spin_guest_args(qemu, elf);
    let mib = format!("{}M", size >> 20);
    argv.extend(Qemu.own_memory_args(&mib, &page.to_string(), None));
    let mut src = BenchQemu::start(&argv, &dir.join(format!("qo{rep}-src.qmp")), &[])?;
    let ram = GuestRam::of(src.pid())?;
    ram.counting_past(0)?;
    let path = dir.join(format!("qo{rep}-state"));
    let (write, read) = save_file(&path)?;
    let (save_ms, ram_bytes) = save_to(&mut src, &write, false)?;
    write.sync_all().map_err(io("fsync the saved file"))?;
    drop(write);
    let parked_at = ram.spin()?.count;
    drop(ram);
    src.quit();
    let file_bytes = read.metadata().map_err(io("stat the saved file"))?.len();
    drop_file_cache(&read)?;
    let started = Instant::now();
    let monitor = dir.join(format!("qo{rep}-dst.qmp"));
    let dst = restore_from(&argv, &monitor, &[], &read, false)?;
    let ram = GuestRam::wait_memfd(dst.pid(), WAIT)?;
    let now = ram.counting_past(parked_at)?;
    let restore_ms = started.elapsed().as_secs_f64() * 1e3;
    drop(ram);
    dst.quit();
    std::fs::remove_file(&path).map_err(io(format!("remove {}", path.display())))?;
    Ok(SaveRestore {
        save_ms,
        restore_ms,
        file_bytes,
        ram_bytes,
        stale: now.bad,
    })
}

/// Drops `file` from the page cache (fsync, `POSIX_FADV_DONTNEED`).
fn drop_file_cache(file: &File) -> Result<(), OffloadError> {
    crate::fill::drop_cache(file).map_err(|e| OffloadError::Guest(format!("drop the cache: {e}")))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_park_line_gives_its_figures() {
        let said = "parked as vm: QEMU 256M in 1 slot(s), its memory moved (0 bytes copied by the daemon; QEMU's stream: 51102 bytes of device state, 33009 bytes of RAM); 39.4 ms, the QEMU exits";
        assert_eq!(super::stream_bytes(said), Some((51102, 33009)));
        assert_eq!(super::launcher_park_ms(said), Some(39.4));
    }
}
