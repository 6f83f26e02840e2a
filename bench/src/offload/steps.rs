//! What the variants share: running the `hugemem` commands, what a
//! process wrote while it ran, and the snapshot directories' page cache.

use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::error::OffloadError;
use crate::harness::vmm::written_bytes;
pub(super) use crate::harness::vmm::Stopping;
use crate::vmm_update::error::io;

/// Runs `hugemem ARGS` to its end; its wall time (ms) and stdout.
pub(super) fn hugemem(launcher: &Path, args: &[OsString]) -> Result<(f64, String), OffloadError> {
    let started = Instant::now();
    let out = Command::new(launcher)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(io(format!("run {}", launcher.display())))?;
    let ms = started.elapsed().as_secs_f64() * 1e3;
    if !out.status.success() {
        return Err(OffloadError::Guest(format!(
            "hugemem {} failed ({}): {}",
            args.iter()
                .map(|a| a.to_string_lossy())
                .collect::<Vec<_>>()
                .join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok((ms, String::from_utf8_lossy(&out.stdout).into_owned()))
}

/// CPU time (user + system) of this process's children that ended and
/// were waited for, ms: the difference around [`hugemem`] is that
/// command's (no other child is waited for meanwhile).
pub(super) fn children_cpu_ms() -> f64 {
    use nix::sys::resource::{getrusage, UsageWho};
    getrusage(UsageWho::RUSAGE_CHILDREN).map_or(0.0, |u| {
        let ms = |t: nix::sys::time::TimeVal| {
            t.tv_sec() as f64 * 1e3 + f64::from(u32::try_from(t.tv_usec()).unwrap_or(0)) / 1e3
        };
        ms(u.user_time()) + ms(u.system_time())
    })
}

/// Starts `program ARGS`, its stderr in `log`.
pub(super) fn spawn(
    program: &Path,
    args: &[OsString],
    log: &Path,
) -> Result<Stopping, OffloadError> {
    Stopping::start(program, args, log).map_err(io(format!("start {}", program.display())))
}

/// What a process writes from now until it exits (`/proc/PID/io`
/// `wchar`), read every millisecond by a thread: the last read before
/// the exit, so a lower bound of what it wrote.
pub(super) struct WriteWatch {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Option<u64>>,
}

impl WriteWatch {
    /// Starts watching process `pid`.
    pub(super) fn start(pid: u32) -> Self {
        let first = written_bytes(pid);
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut last = first;
            while !stopped.load(Ordering::Relaxed) {
                match written_bytes(pid) {
                    Some(now) => last = Some(now),
                    None => break,
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            first.zip(last).map(|(a, b)| b.saturating_sub(a))
        });
        Self { stop, thread }
    }

    /// The bytes written while watched (0 when the process could not be read).
    pub(super) fn finish(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().ok().flatten().unwrap_or(0)
    }
}

/// The regular files under `dir`, its subdirectories included.
fn files_under(dir: &Path) -> Result<Vec<PathBuf>, OffloadError> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).map_err(io(format!("list {}", d.display())))? {
            let entry = entry.map_err(io(format!("list {}", d.display())))?;
            let kind = entry.file_type().map_err(io("file type"))?;
            if kind.is_dir() {
                todo.push(entry.path());
            } else if kind.is_file() {
                out.push(entry.path());
            }
        }
    }
    Ok(out)
}

/// Drops every file under `dir` from the page cache (fsync, then
/// `POSIX_FADV_DONTNEED`: only these files, never the host's whole cache).
pub(super) fn drop_dir_cache(dir: &Path) -> Result<(), OffloadError> {
    for path in files_under(dir)? {
        let file = File::open(&path).map_err(io(format!("open {}", path.display())))?;
        crate::fill::drop_cache(&file)
            .map_err(|e| OffloadError::Guest(format!("{}: {e}", path.display())))?;
    }
    Ok(())
}

/// Bytes the disk holds for `path` (its allocated blocks: a sparse
/// file's holes are not read from the disk).
fn allocated(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).map_or(0, |m| m.blocks() * 512)
}

/// Bytes the disk holds for the files under `dir`.
pub(super) fn allocated_under(dir: &Path) -> Result<u64, OffloadError> {
    Ok(files_under(dir)?.iter().map(|p| allocated(p)).sum())
}

/// The file under `dir` with the most bytes on disk (a snapshot's guest
/// memory; a slot the guest never wrote is a hole).
pub(super) fn densest_file(dir: &Path) -> Result<PathBuf, OffloadError> {
    files_under(dir)?
        .into_iter()
        .max_by_key(|p| allocated(p))
        .ok_or_else(|| OffloadError::Guest(format!("{} holds no file", dir.display())))
}

/// The disk's sequential read rate on `file`, cold (`bench fill`'s
/// measurement), GB/s.
pub(super) fn disk_read_gbps(file: &Path) -> Result<f64, OffloadError> {
    let opened = File::open(file).map_err(io(format!("open {}", file.display())))?;
    let bytes = opened.metadata().map_err(io("stat")).map(|m| m.len())?;
    let fail = |e: crate::fill::FillBenchError| OffloadError::Guest(format!("disk read: {e}"));
    crate::fill::drop_cache(&opened).map_err(fail)?;
    let seconds = crate::fill::sequential_read(file, false).map_err(fail)?;
    crate::fill::drop_cache(&opened).map_err(fail)?;
    Ok(crate::fill::gbps(bytes, seconds))
}

/// The seconds of the daemon's last "PARK: memory from elsewhere copied"
/// in its log `log` (its fill engine's time for a load), ms.
pub(super) fn daemon_copy_ms(log: &Path) -> Option<f64> {
    logged_number(log, "PARK: memory from elsewhere copied", "secs=").map(|secs| secs * 1e3)
}

/// The launcher's "restored: …" line in its log `log`, once it is there:
/// its `ms` field (the restore's start to the daemon's answer; on demand,
/// that answer comes when every page is filled). Waits up to `wait`,
/// reading the log every millisecond as `counting_past` reads the guest.
pub(super) fn wait_restored_ms(log: &Path, wait: Duration) -> Result<f64, OffloadError> {
    let deadline = Instant::now() + wait;
    loop {
        if let Some(ms) = logged_number(log, "restored: ", "ms=") {
            return Ok(ms);
        }
        if Instant::now() > deadline {
            return Err(OffloadError::Guest(format!(
                "no \"restored:\" line in {} within {wait:?}",
                log.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The number after `field` on the last line of `log` holding `needle`.
fn logged_number(log: &Path, needle: &str, field: &str) -> Option<f64> {
    let text = std::fs::read_to_string(log).ok()?;
    let line = text.lines().rev().find(|l| l.contains(needle))?;
    // The log may colour its fields: drop the escape sequences first.
    let mut plain = String::with_capacity(line.len());
    let mut in_escape = false;
    for c in line.chars() {
        match (in_escape, c) {
            (false, '\u{1b}') => in_escape = true,
            (true, 'm') => in_escape = false,
            (true, _) => {}
            (false, c) => plain.push(c),
        }
    }
    let (_, after) = plain.split_once(field)?;
    after.split_whitespace().next()?.parse().ok()
}

/// Waits until the daemon's pools hold no dirty or quarantined memory
/// (its scrubber is done with what was returned), deadline 300 s; how long
/// that took, ms.
pub(super) fn daemon_settled(client: &mut backend::client::Client) -> Result<f64, OffloadError> {
    let started = Instant::now();
    loop {
        let stats = client.stats()?;
        let busy: u64 = stats
            .pools
            .iter()
            .map(|p| p.dirty_bytes + p.quarantined_bytes)
            .sum();
        if busy == 0 {
            return Ok(started.elapsed().as_secs_f64() * 1e3);
        }
        if started.elapsed() > Duration::from_secs(300) {
            return Err(OffloadError::Guest(format!(
                "the daemon still holds {busy} bytes to scrub after 300 s"
            )));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A command line's arguments, as `OsString`s.
pub(super) fn args<const N: usize>(parts: [&dyn AsRef<std::ffi::OsStr>; N]) -> Vec<OsString> {
    parts.iter().map(|p| p.as_ref().to_owned()).collect()
}
