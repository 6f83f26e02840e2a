//! The benches' VMM processes, in two shapes:
//!
//! * one run to its end, timed from outside ([`run_to_end`]): when the
//!   guest's port-0x3f0 marks came on its stdout, when it exited, what it
//!   printed;
//! * one that lives while the bench drives it through its monitor or API
//!   ([`VmmProcess`]: a baseline's QEMU or cloud-hypervisor), ended on
//!   request or killed, and reaped either way.
//!
//! Not `hugemem::launch`'s process: that one forwards signals and, in a
//! process with other threads (a bench may hold an in-process daemon),
//! sees the child's exit only at its next poll; here the end is seen at
//! once, through EOF on stdout and a blocking wait.

use std::ffi::OsString;
use std::io::Read;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The guest's first instruction (`{` on port 0x3f0).
pub(crate) const READY_BYTE: u8 = b'{';
/// The guest has touched every page of its RAM (`|`, after [`READY_BYTE`]).
pub(crate) const TOUCHED_BYTE: u8 = b'|';

/// A finished VMM process.
#[derive(Debug)]
pub(crate) struct VmmRun {
    /// How it ended.
    pub(crate) status: ExitStatus,
    /// From the start to its exit.
    pub(crate) elapsed: Duration,
    /// What it printed.
    pub(crate) stdout: String,
    /// Its diagnostics.
    pub(crate) stderr: String,
    /// When the guest's [`READY_BYTE`] came.
    pub(crate) ready: Option<Duration>,
    /// When the guest's [`TOUCHED_BYTE`] came after it.
    pub(crate) touched: Option<Duration>,
}

/// When a run is stopped.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stop {
    /// After this long it gets SIGTERM, or SIGKILL without a grace.
    pub(crate) after: Duration,
    /// After SIGTERM, this long more before SIGKILL; `None`: SIGKILL at once.
    pub(crate) grace: Option<Duration>,
}

/// Why a run gave no result.
#[derive(Debug, thiserror::Error)]
pub(crate) enum VmmRunError {
    /// It could not be started.
    #[error("cannot start {}: {source}", program.to_string_lossy())]
    Spawn {
        /// The program.
        program: OsString,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Reading its output or waiting for it failed.
    #[error("{0}")]
    Io(String),
    /// It ran past its limit and was stopped.
    #[error("ran longer than {after:?} and was stopped; {run}")]
    Stopped {
        /// The limit.
        after: Duration,
        /// What it did meanwhile.
        run: String,
    },
}

/// The guest's marks in `chunk`, read `at` since the start: sets `ready`
/// at the first [`READY_BYTE`] and `touched` at the first [`TOUCHED_BYTE`]
/// after it.
fn stamp_marks(
    chunk: &[u8],
    at: Duration,
    ready: &mut Option<Duration>,
    touched: &mut Option<Duration>,
) {
    for &b in chunk {
        match b {
            READY_BYTE if ready.is_none() => *ready = Some(at),
            TOUCHED_BYTE if ready.is_some() && touched.is_none() => *touched = Some(at),
            _ => {}
        }
    }
}

impl VmmRun {
    /// The guest's report line (`HUGEMEM-GUEST …`).
    pub(crate) fn guest_line(&self) -> Option<&str> {
        self.stdout
            .lines()
            .find_map(|l| l.find("HUGEMEM-GUEST ").map(|i| l[i..].trim()))
    }

    /// Its status and the tails of its output, for an error.
    pub(crate) fn describe(&self) -> String {
        let tail = |s: &str| -> String {
            let t = s.trim();
            let start = t.len().saturating_sub(1500);
            let start = (start..t.len())
                .find(|&i| t.is_char_boundary(i))
                .unwrap_or(t.len());
            t[start..].to_string()
        };
        format!(
            "{}; stdout {:?}; stderr tail:\n{}",
            self.status,
            tail(&self.stdout),
            tail(&self.stderr)
        )
    }
}

/// Runs `argv` to its end with stdout and stderr captured, `inherit` open
/// in it under their numbers, times (from `t0`) taken as its output
/// arrives; stopped as `stop` says.
pub(crate) fn run_to_end(
    argv: &[OsString],
    inherit: &[BorrowedFd<'_>],
    t0: Instant,
    stop: Stop,
) -> Result<VmmRun, VmmRunError> {
    let Some((program, args)) = argv.split_first() else {
        return Err(VmmRunError::Spawn {
            program: OsString::new(),
            source: std::io::Error::other("empty command"),
        });
    };
    let mut cmd = Command::new(program);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    inherit_fds(&mut cmd, inherit);
    let mut child = cmd.spawn().map_err(|source| VmmRunError::Spawn {
        program: program.clone(),
        source,
    })?;
    let (Some(mut stdout), Some(mut stderr)) = (child.stdout.take(), child.stderr.take()) else {
        let _ = child.kill();
        let _ = child.wait();
        return Err(VmmRunError::Io("the child's pipes are missing".into()));
    };
    let pid = i32::try_from(child.id())
        .map(nix::unistd::Pid::from_raw)
        .map_err(|_| VmmRunError::Io("child pid out of range".into()))?;
    // The watchdog signals by pid, which is safe only while the child is not
    // reaped: it is joined before the wait below.
    let (stop_tx, stopped) = mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        use nix::sys::signal::{kill, Signal};
        if stopped.recv_timeout(stop.after) != Err(mpsc::RecvTimeoutError::Timeout) {
            return false;
        }
        let Some(grace) = stop.grace else {
            let _ = kill(pid, Signal::SIGKILL);
            return true;
        };
        let _ = kill(pid, Signal::SIGTERM);
        if stopped.recv_timeout(grace) == Err(mpsc::RecvTimeoutError::Timeout) {
            let _ = kill(pid, Signal::SIGKILL);
        }
        true
    });
    let err_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = stderr.read_to_end(&mut v);
        v
    });
    // Read as it comes, to time the guest's marks.
    let mut out = Vec::new();
    let (mut ready, mut touched) = (None, None);
    let mut buf = [0u8; 4096];
    let read = loop {
        match stdout.read(&mut buf) {
            Ok(0) => break Ok(()),
            Ok(n) => {
                stamp_marks(&buf[..n], t0.elapsed(), &mut ready, &mut touched);
                out.extend_from_slice(&buf[..n]);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => break Err(e),
        }
    };
    if read.is_err() {
        let _ = child.kill();
    }
    // A send error means the watchdog has finished already.
    let _ = stop_tx.send(());
    let killed = watchdog.join().unwrap_or(false);
    let status = child
        .wait()
        .map_err(|e| VmmRunError::Io(format!("wait: {e}")))?;
    let elapsed = t0.elapsed();
    let stderr = err_reader.join().unwrap_or_default();
    let run = VmmRun {
        status,
        elapsed,
        stdout: String::from_utf8_lossy(&out).into_owned(),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
        ready,
        touched,
    };
    if let Err(e) = read {
        return Err(VmmRunError::Io(format!(
            "reading its output: {e}; {}",
            run.describe()
        )));
    }
    if killed {
        return Err(VmmRunError::Stopped {
            after: stop.after,
            run: run.describe(),
        });
    }
    Ok(run)
}

/// Makes `cmd`'s child inherit `fds` across exec under their current
/// numbers (their close-on-exec flag cleared in the child only). The
/// caller keeps them open until the spawn returns.
pub(crate) fn inherit_fds(cmd: &mut Command, fds: &[BorrowedFd<'_>]) {
    if fds.is_empty() {
        return;
    }
    let fds: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let hook = move || -> std::io::Result<()> {
        for &fd in &fds {
            // SAFETY: fcntl(F_GETFD/F_SETFD) only reads and writes the
            // descriptor flags of `fd`, which the parent holds open (its
            // BorrowedFd outlives the spawn), so it is open in the child.
            let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
            if flags < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // SAFETY: as above.
            if unsafe { libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) } < 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(())
    };
    // SAFETY: the hook runs in the child between fork and exec, where only
    // async-signal-safe calls are allowed: it calls fcntl (async-signal-
    // safe) on fd numbers captured before the fork, iterates a Vec without
    // allocating, and takes no lock.
    unsafe { cmd.pre_exec(hook) };
}

/// A VMM process the bench drives while it runs: started with its stdin
/// closed and the memory fds it names inherited, ended by [`VmmProcess::end`]
/// or, dropped while it still runs, killed; reaped either way.
#[derive(Debug)]
pub(crate) struct VmmProcess {
    child: Child,
}

impl VmmProcess {
    /// Starts `command` with `inherit` open in it under their numbers.
    pub(crate) fn spawn(mut command: Command, inherit: &[BorrowedFd<'_>]) -> std::io::Result<Self> {
        command.stdin(Stdio::null());
        inherit_fds(&mut command, inherit);
        command.spawn().map(|child| Self { child })
    }

    /// Its pid.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether it has not exited yet.
    pub(crate) fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Ends it: `ask` (a request over its monitor or API to end) when it
    /// still runs, then waits for its exit.
    pub(crate) fn end(mut self, ask: impl FnOnce()) -> Option<ExitStatus> {
        if self.running() {
            ask();
        }
        self.child.wait().ok()
    }

    /// Kills it now; its exit status.
    pub(crate) fn kill(mut self) -> Option<ExitStatus> {
        let _ = self.child.kill();
        self.child.wait().ok()
    }
}

impl Drop for VmmProcess {
    fn drop(&mut self) {
        if self.running() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A process of the bench's that ends on SIGTERM (a `hugemem launch`
/// forwards it to its VMM and frees the memory; an offload daemon): sent
/// SIGTERM and reaped when dropped, unless it ended first.
#[derive(Debug)]
pub(crate) struct Stopping(pub(crate) Child);

impl Stopping {
    /// Starts `program ARGS`, its stdin and stdout closed, its stderr in
    /// a new file `log`.
    pub(crate) fn start(
        program: &std::path::Path,
        args: &[OsString],
        log: &std::path::Path,
    ) -> std::io::Result<Self> {
        let log = std::fs::File::create(log)?;
        Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map(Self)
    }

    /// Its pid.
    pub(crate) fn pid(&self) -> u32 {
        self.0.id()
    }

    /// Waits for its exit, up to `deadline` (looking every millisecond);
    /// true when it exited with status 0.
    ///
    /// # Errors
    ///
    /// The wait's; [`std::io::ErrorKind::TimedOut`] when it still runs at
    /// the deadline.
    pub(crate) fn exited_ok(&mut self, deadline: Duration) -> std::io::Result<bool> {
        let until = Instant::now() + deadline;
        loop {
            match self.0.try_wait()? {
                Some(status) => return Ok(status.success()),
                None if Instant::now() > until => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("process {} did not exit within {deadline:?}", self.pid()),
                    ))
                }
                None => std::thread::sleep(Duration::from_millis(1)),
            }
        }
    }
}

impl Drop for Stopping {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            if let Ok(pid) = i32::try_from(self.0.id()) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGTERM,
                );
            }
        }
        let _ = self.0.wait();
    }
}

/// The bytes process `pid` has written (`/proc/PID/io` `wchar`): a
/// migration's stream goes out with `write`, so its growth over a switch
/// bounds what the stream carried; `None` once the process is reaped.
pub(crate) fn written_bytes(pid: u32) -> Option<u64> {
    let io = std::fs::read_to_string(format!("/proc/{pid}/io")).ok()?;
    io.lines()
        .find_map(|l| l.strip_prefix("wchar:"))
        .and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_are_stamped_in_order() {
        let (mut ready, mut touched) = (None, None);
        let ms = Duration::from_millis;
        stamp_marks(b"|noise", ms(1), &mut ready, &mut touched);
        assert_eq!(
            (ready, touched),
            (None, None),
            "124 before 123 is not a mark"
        );
        stamp_marks(b"{", ms(2), &mut ready, &mut touched);
        stamp_marks(b"{HUGEMEM-GUEST|", ms(3), &mut ready, &mut touched);
        stamp_marks(b"|", ms(4), &mut ready, &mut touched);
        assert_eq!((ready, touched), (Some(ms(2)), Some(ms(3))));
    }

    fn run(argv: &[&str], after: Duration) -> Result<VmmRun, VmmRunError> {
        let argv: Vec<OsString> = argv.iter().map(OsString::from).collect();
        let stop = Stop {
            after,
            grace: Some(Duration::from_secs(5)),
        };
        run_to_end(&argv, &[], Instant::now(), stop)
    }

    #[test]
    fn processes_end_or_are_stopped() {
        let done = run(
            &["sh", "-c", "echo out; echo err >&2; exit 3"],
            Duration::from_secs(30),
        )
        .expect("run");
        assert_eq!(done.status.code(), Some(3));
        assert_eq!(
            (done.stdout.as_str(), done.stderr.as_str()),
            ("out\n", "err\n")
        );
        let err = run(&["sleep", "30"], Duration::from_millis(100)).expect_err("stopped");
        assert!(matches!(err, VmmRunError::Stopped { .. }), "{err}");
        assert!(run(&["/nonexistent/vmm"], Duration::from_secs(1)).is_err());
    }

    #[test]
    fn long_lived_processes_end_on_request_or_are_killed() {
        use std::os::unix::process::ExitStatusExt;
        let sleep = || {
            let mut c = Command::new("sleep");
            c.arg("30");
            VmmProcess::spawn(c, &[]).expect("spawn sleep")
        };
        let mut asked = sleep();
        assert!(asked.running());
        assert!(written_bytes(asked.pid()).is_some());
        let pid = nix::unistd::Pid::from_raw(i32::try_from(asked.pid()).expect("pid"));
        let status = asked.end(|| {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        });
        assert_eq!(status.and_then(|s| s.signal()), Some(libc::SIGTERM));
        let killed = sleep().kill();
        assert_eq!(killed.and_then(|s| s.signal()), Some(libc::SIGKILL));
    }
}
