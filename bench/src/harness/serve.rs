//! A bench's private daemon: `hugemem serve` in a process of its own, as a
//! host runs it. (In the bench's process, its scrubbers' faults and the
//! bench's own mappings would share one `mmap_lock`: a client's mmap would
//! wait for the daemon's refault of a whole 1 GiB page, which no real VMM
//! does.) `bench churn` runs one; `bench takeover` runs two at once on one
//! socket, the second with `--takeover`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use backend::client::Client;
use backend::diag::chain;
use tracing::warn;

/// How to start it.
#[derive(Debug, Clone, Default)]
pub struct ServeOptions {
    /// The socket (`--socket`).
    pub socket: PathBuf,
    /// A configuration file (`--config`); `None`: defaults.
    pub config: Option<PathBuf>,
    /// `--pool-target` and `--pool-limit`, bytes; `None`: the config's.
    pub pool: Option<(u64, u64)>,
    /// `--takeover`: take over from the daemon serving on `socket`.
    pub takeover: bool,
    /// Where its stderr goes; `None`: nowhere.
    pub log: Option<PathBuf>,
}

/// Why it did not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeChildError {
    /// The process could not be spawned (or its log created).
    #[error("cannot start {program} serve")]
    Spawn {
        /// The binary.
        program: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// It did not answer in time, or exited first.
    #[error("the private daemon did not answer within {secs} s: {why}")]
    NoAnswer {
        /// The wait.
        secs: u64,
        /// The last error, or its exit status.
        why: String,
    },
}

/// A running `hugemem serve`; dropped while running, it gets SIGTERM and
/// is waited for (an error path must not leave a daemon holding pages).
#[derive(Debug)]
pub struct ServeChild {
    child: Child,
    exited: Option<ExitStatus>,
}

impl ServeChild {
    /// Spawns `launcher serve` without waiting for it to answer.
    ///
    /// # Errors
    ///
    /// [`ServeChildError::Spawn`].
    pub fn spawn(launcher: &Path, opts: &ServeOptions) -> Result<Self, ServeChildError> {
        let spawn_err = |source| ServeChildError::Spawn {
            program: launcher.display().to_string(),
            source,
        };
        let mut cmd = Command::new(launcher);
        cmd.arg("serve").arg("--socket").arg(&opts.socket);
        if let Some(config) = &opts.config {
            cmd.arg("--config").arg(config);
        }
        if let Some((target, limit)) = opts.pool {
            cmd.args(["--pool-target", &target.to_string()])
                .args(["--pool-limit", &limit.to_string()]);
        }
        if opts.takeover {
            cmd.arg("--takeover");
        }
        let stderr = match &opts.log {
            Some(path) => Stdio::from(std::fs::File::create(path).map_err(spawn_err)?),
            None => Stdio::null(),
        };
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .map_err(spawn_err)?;
        Ok(Self {
            child,
            exited: None,
        })
    }

    /// [`ServeChild::spawn`], then waits (up to 30 s) until a connection
    /// to `opts.socket` completes its handshake.
    ///
    /// # Errors
    ///
    /// [`ServeChildError`]; the process is stopped first.
    pub fn start(launcher: &Path, opts: &ServeOptions) -> Result<Self, ServeChildError> {
        let mut me = Self::spawn(launcher, opts)?;
        let secs = 30;
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            match Client::connect(&opts.socket) {
                Ok(_) => return Ok(me),
                Err(e) => {
                    let why = match me.try_wait() {
                        Some(status) => format!("it exited with {status}"),
                        None if Instant::now() >= deadline => chain(&e),
                        None => {
                            std::thread::sleep(Duration::from_millis(10));
                            continue;
                        }
                    };
                    me.stop();
                    return Err(ServeChildError::NoAnswer { secs, why });
                }
            }
        }
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its exit status, once it exited (does not block).
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        if self.exited.is_none() {
            self.exited = self.child.try_wait().ok().flatten();
        }
        self.exited
    }

    /// Waits for it to exit until `deadline`; `None` if it has not by then.
    /// Sleeps on a pidfd of it, which turns readable at its exit (see
    /// `wait_child_until`).
    pub fn wait_until(&mut self, deadline: Instant) -> Option<ExitStatus> {
        if self.exited.is_none() {
            self.exited = wait_child_until(&mut self.child, deadline);
        }
        self.exited
    }

    /// Sends SIGTERM (it gives its pages back and exits).
    pub fn terminate(&self) {
        if self.exited.is_some() {
            return;
        }
        if let Ok(pid) = i32::try_from(self.child.id()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
    }

    /// Waits for it to exit; `None` when waiting failed.
    pub fn wait(&mut self) -> Option<ExitStatus> {
        if self.exited.is_none() {
            match self.child.wait() {
                Ok(s) => self.exited = Some(s),
                Err(e) => warn!(error = %e, "waiting for the private daemon failed"),
            }
        }
        self.exited
    }

    /// SIGTERM, and waits for it to exit.
    pub fn stop(mut self) {
        self.terminate();
        self.wait();
    }
}

/// Waits for `child` to exit until `deadline`; `None` if it has not by
/// then. Sleeps on a pidfd of it, which turns readable at its exit, so the
/// exit is seen at once (a kernel without `pidfd_open`, before 5.3, gets a
/// look every millisecond). `child` must not have been reaped yet.
pub(crate) fn wait_child_until(child: &mut Child, deadline: Instant) -> Option<ExitStatus> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::os::fd::AsFd;
    // Not reaped yet, so its pid is still its own.
    let exit_event = match child.try_wait() {
        Ok(Some(status)) => return Some(status),
        _ => pidfd(child.id()),
    };
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        match &exit_event {
            Some(fd) => {
                // Rounded up, so the last wait does not end just short.
                let millis = u16::try_from(left.as_millis() + 1).unwrap_or(u16::MAX);
                let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
                let _ = poll(&mut fds, PollTimeout::from(millis));
            }
            None => std::thread::sleep(left.min(Duration::from_millis(1))),
        }
    }
}

/// A pidfd of process `pid` (readable once it has exited), or `None` where
/// the kernel has no `pidfd_open`. `pid` must be an unreaped child of ours,
/// so that its number cannot have been reused.
fn pidfd(pid: u32) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::{FromRawFd, OwnedFd, RawFd};
    let pid = libc::pid_t::try_from(pid).ok()?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1;
    // it touches no memory of ours.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    let fd = RawFd::try_from(fd).ok().filter(|fd| *fd >= 0)?;
    // SAFETY: `fd` was just returned by pidfd_open, is open, and nothing
    // else owns it (pidfds are close-on-exec).
    Some(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl Drop for ServeChild {
    fn drop(&mut self) {
        if self.try_wait().is_none() {
            self.terminate();
            self.wait();
        }
    }
}
