//! Running the VMM: inherited region fds, signal forwarding, waiting.
//!
//! # Which fds the VMM gets, and under which numbers
//!
//! Every fd this process holds is close-on-exec (std opens files and sockets
//! with `O_CLOEXEC`/`SOCK_CLOEXEC`, and region fds arrive with
//! `MSG_CMSG_CLOEXEC`), so the VMM inherits nothing by default. For exactly
//! the region fds, a `pre_exec` hook clears `FD_CLOEXEC` in the child after
//! `fork`, so they keep the numbers that were written into the command line
//! (`/dev/fd/N`) and the parent's copies stay close-on-exec.
//!
//! The alternative, `dup2` onto fixed numbers (3, 4, …), would make the
//! command line independent of the parent's fd table, but `dup2` silently
//! closes whatever the child had at the target number: among others the
//! pipe std uses to report an `exec` failure back to the parent. Clearing the
//! flag in place touches no other fd.
//!
//! # Signals
//!
//! SIGTERM, SIGINT and SIGHUP are blocked in this thread before the VMM is
//! spawned and read from a `signalfd`, polled together with a pidfd of the
//! VMM (readable when it exits: no SIGCHLD involved, so no wait in slices
//! for a SIGCHLD that another thread of a test harness may have taken; a
//! kernel without `pidfd_open`, before 5.3, gets 50 ms polls); a SIGTERM to
//! `hugemem launch` is sent on to the VMM, which shuts down, and then launch
//! frees the memory. One exception: a signal the terminal driver sent to the
//! whole foreground process group (Ctrl-C; `si_code == SI_KERNEL`) has
//! reached the VMM already and is not sent twice. The VMM stays in our
//! process group so that it can read the terminal (`-serial stdio`).
//! The child's signal mask is restored in `pre_exec` (std keeps the parent's).
//! Because blocking is per thread, this must run on the main thread before
//! other threads exist, or another thread could take the signal instead.
//!
//! # A watcher beside the VMM
//!
//! [`run_vmm_watching`] runs one more function on its own thread while the
//! VMM runs (`hugemem launch` watches its daemon connection there, to
//! re-attach after a daemon restart). The thread is started after the
//! signals are blocked, so it inherits the mask and never takes them; when
//! the VMM has exited it is woken by an event (`exit_event.rs`, an eventfd
//! in its `poll` set), and joined.

use std::ffi::OsString;
use std::fmt;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{SigSet, SigmaskHow, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::unistd::Pid;
use tracing::{debug, info, warn};

use super::error::LaunchError;
use super::exit_event::ExitEvent;

/// How the VMM ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmmExit {
    /// It exited with this status.
    Code(i32),
    /// A signal killed it.
    Signal(i32),
}

impl VmmExit {
    /// The status a shell would report: the code, or 128 + the signal.
    pub fn shell_code(self) -> i32 {
        match self {
            Self::Code(c) => c,
            Self::Signal(s) => 128 + s,
        }
    }

    fn from_status(status: ExitStatus) -> Self {
        match (status.code(), status.signal()) {
            (Some(c), _) => Self::Code(c),
            (None, Some(s)) => Self::Signal(s),
            // Neither: stopped/continued, which wait() does not report.
            (None, None) => Self::Code(-1),
        }
    }
}

impl fmt::Display for VmmExit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Code(c) => write!(f, "exit status {c}"),
            Self::Signal(s) => write!(f, "killed by signal {s}"),
        }
    }
}

fn forwarded_signals() -> SigSet {
    let mut set = SigSet::empty();
    for s in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP] {
        set.add(s);
    }
    set
}

/// Starts `f` on a thread of its own that never takes the signals the
/// launcher forwards to its VMM (SIGTERM, SIGINT, SIGHUP): they are
/// blocked in it from its first instruction (a thread inherits its
/// creator's mask). A thread started before [`run_vmm_watching`] blocks
/// them would otherwise be the one the kernel hands a SIGTERM to, whose
/// default action ends the launcher and leaves its VMM running, orphaned.
///
/// # Errors
///
/// The mask's or the spawn's.
pub(crate) fn spawn_unsignalled<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> io::Result<std::thread::JoinHandle<T>> {
    let old = forwarded_signals()
        .thread_swap_mask(SigmaskHow::SIG_BLOCK)
        .map_err(io::Error::from)?;
    let _restore = MaskGuard(old);
    std::thread::Builder::new().spawn(f)
}

/// Restores the thread's signal mask when dropped.
struct MaskGuard(SigSet);

impl Drop for MaskGuard {
    fn drop(&mut self) {
        if let Err(e) = self.0.thread_set_mask() {
            tracing::error!(error = %e, "cannot restore the signal mask");
        }
    }
}

/// Runs `argv` with `inherit` open in the child under their current numbers,
/// forwards SIGTERM/SIGINT/SIGHUP to it, and waits for it. Returns how it
/// ended and how long it ran.
///
/// Call from the main thread before other threads exist (see the module docs).
///
/// # Errors
///
/// [`LaunchError::Spawn`] when the program cannot be started,
/// [`LaunchError::Wait`] when waiting or signal handling fails (the child is
/// killed then).
pub fn run_vmm(
    argv: &[OsString],
    inherit: &[BorrowedFd<'_>],
) -> Result<(VmmExit, Duration), LaunchError> {
    run_vmm_watching(argv, inherit, Vec::new(), None::<fn(&ExitEvent)>, None).0
}

/// Something the waiting thread serves while the VMM runs: `hugemem
/// launch`'s control socket (`control.rs`, served by `update/`). Its fd is
/// polled beside the signals and the VMM's exit; when it is readable,
/// [`Supervisor::serve`] runs on the waiting thread (signals stay pending
/// meanwhile and are forwarded after).
pub(crate) trait Supervisor {
    /// Readable when there is something to serve.
    fn fd(&self) -> BorrowedFd<'_>;
    /// Serves it. May replace `vmm` by a successor it started with
    /// `spawner` (and then reaps the one it replaced).
    fn serve(&mut self, vmm: &mut Child, spawner: &Spawner);
}

/// Starts VMM processes the way the launch does (inherited fds under their
/// numbers, the launcher's signal mask undone in the child).
#[derive(Clone, Copy)]
pub(crate) struct Spawner {
    child_mask: libc::sigset_t,
}

impl Spawner {
    /// Starts `argv` with `inherit` open in the child under their numbers.
    ///
    /// # Errors
    ///
    /// [`LaunchError::Spawn`].
    pub(crate) fn spawn(
        &self,
        argv: &[OsString],
        inherit: &[BorrowedFd<'_>],
    ) -> Result<Child, LaunchError> {
        spawn(argv, inherit, self.child_mask)
    }
}

/// [`run_vmm`], with `watch` running on a thread of its own while the VMM
/// runs (see the module docs): it gets an event that fires once the VMM
/// has exited and should return soon after. Returns what [`run_vmm`] does
/// and, when the thread ran and did not panic, what `watch` returned.
///
/// `handed_over` are inherited too (after `inherit`) and closed here once
/// the VMM started: the VMM's own ends of its channels (cloud-hypervisor's
/// API listener, QEMU's end of its monitor). A copy kept here would outlive
/// the VMM: connections to a gone cloud-hypervisor's API would be queued
/// and never answered instead of refused, and QEMU's monitor would never
/// read end-of-file.
pub(crate) fn run_vmm_watching<R: Send>(
    argv: &[OsString],
    inherit: &[BorrowedFd<'_>],
    handed_over: Vec<OwnedFd>,
    watch: Option<impl FnOnce(&ExitEvent) -> R + Send>,
    control: Option<&mut dyn Supervisor>,
) -> (Result<(VmmExit, Duration), LaunchError>, Option<R>) {
    let set = forwarded_signals();
    let old = match set.thread_swap_mask(SigmaskHow::SIG_BLOCK) {
        Ok(old) => old,
        Err(e) => return (Err(LaunchError::Wait(e.into())), None),
    };
    let _restore = MaskGuard(old);
    // Without the event there is no way to stop the watcher: run without it
    // (as when its thread cannot start; the daemon then releases the
    // allocation when the connection the watcher would have held closes).
    let exit = ExitEvent::new()
        .inspect_err(|e| warn!(error = %e, "cannot create the VMM-exit eventfd"))
        .ok();
    std::thread::scope(|scope| {
        // Started with the signals blocked: it inherits the mask.
        let watcher = watch.zip(exit.as_ref()).and_then(|(w, exit)| {
            std::thread::Builder::new()
                .name("hm-launch-watch".into())
                .spawn_scoped(scope, move || w(exit))
                .inspect_err(|e| warn!(error = %e, "cannot start the daemon watcher thread"))
                .ok()
        });
        let outcome = spawn_and_wait(argv, inherit, handed_over, &set, old, control);
        if let Some(exit) = &exit {
            exit.fire();
        }
        let watched = watcher.and_then(|h| h.join().ok());
        (outcome, watched)
    })
}

/// Spawns the VMM (with `inherit` and `handed_over`, closing the latter
/// once it started) and waits for it, forwarding the signals of `set`
/// (which the caller blocked; `old` is the mask to restore in the child)
/// and serving `control`.
fn spawn_and_wait(
    argv: &[OsString],
    inherit: &[BorrowedFd<'_>],
    handed_over: Vec<OwnedFd>,
    set: &SigSet,
    old: SigSet,
    control: Option<&mut dyn Supervisor>,
) -> Result<(VmmExit, Duration), LaunchError> {
    let spawner = Spawner {
        child_mask: *old.as_ref(),
    };
    let started = Instant::now();
    let mut all = inherit.to_vec();
    all.extend(handed_over.iter().map(AsFd::as_fd));
    let mut child = spawner.spawn(argv, &all)?;
    drop(all);
    drop(handed_over);
    match wait_forwarding(&mut child, set, control, &spawner) {
        Ok(status) => Ok((VmmExit::from_status(status), started.elapsed())),
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            Err(LaunchError::Wait(e))
        }
    }
}

/// Starts `argv` with `inherit` kept open under their numbers and the
/// signal mask `child_mask`.
fn spawn(
    argv: &[OsString],
    inherit: &[BorrowedFd<'_>],
    child_mask: libc::sigset_t,
) -> Result<Child, LaunchError> {
    let Some((program, args)) = argv.split_first() else {
        return Err(LaunchError::Options("no VMM command given".into()));
    };
    let fds: Vec<RawFd> = inherit.iter().map(AsRawFd::as_raw_fd).collect();

    let mut cmd = Command::new(program);
    cmd.args(args);
    let hook = move || -> io::Result<()> {
        for &fd in &fds {
            // `fd` is open in the child: the parent holds it open (its
            // BorrowedFd outlives the spawn).
            keep_across_exec(fd)?;
        }
        // SAFETY: `child_mask` is a valid sigset_t copied from the parent's
        // mask before blocking; the old-mask pointer may be null.
        let rc =
            unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &child_mask, std::ptr::null_mut()) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        Ok(())
    };
    // SAFETY: the hook runs in the child between fork and exec, where only
    // async-signal-safe calls are allowed: it calls fcntl and
    // pthread_sigmask (both async-signal-safe) on values captured before the
    // fork, iterates a Vec without allocating, and touches no lock.
    unsafe { cmd.pre_exec(hook) };
    let child = cmd.spawn().map_err(|source| LaunchError::Spawn {
        program: program.clone(),
        source,
    })?;
    info!(pid = child.id(), inherited_fds = ?inherit.iter().map(AsRawFd::as_raw_fd).collect::<Vec<_>>(), "VMM started");
    Ok(child)
}

/// Clears `FD_CLOEXEC` on `fd`, so that the program this process execs next
/// inherits it under the same number. Only `fcntl`: async-signal-safe, so
/// the `pre_exec` hook of [`run_vmm`] calls it between fork and exec, and
/// `hugemem qemu-wrapper` before it execs QEMU.
///
/// # Errors
///
/// `fcntl`'s error (`EBADF` when `fd` is not open).
pub(crate) fn keep_across_exec(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl(F_GETFD/F_SETFD) only reads and writes the descriptor
    // flags of `fd`; on a number that is not open it fails with EBADF.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// How long one wait lasts where the kernel has no `pidfd_open` (before
/// 5.3): the child is polled with `try_wait` between waits. With a pidfd the
/// wait has no timeout.
const NO_PIDFD_POLL_MS: u16 = 50;

/// A pidfd of `pid`: readable once that process has exited. `pid` must be
/// our child, not yet reaped (so its number cannot have been reused).
pub(crate) fn pidfd(pid: Pid) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1;
    // it touches no memory of ours.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid.as_raw(), 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = RawFd::try_from(fd).map_err(|_| io::Error::other("pidfd out of range"))?;
    // SAFETY: `fd` was just returned by pidfd_open, is open, and nothing
    // else owns it. pidfds are close-on-exec.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn pid_of(child: &Child) -> io::Result<Pid> {
    Ok(Pid::from_raw(
        i32::try_from(child.id()).map_err(|_| io::Error::other("child pid out of range"))?,
    ))
}

/// Waits for `child`, forwarding signals from `set` (blocked by the caller)
/// and serving `control`, which may replace `child` by a successor.
fn wait_forwarding(
    child: &mut Child,
    set: &SigSet,
    mut control: Option<&mut dyn Supervisor>,
    spawner: &Spawner,
) -> io::Result<ExitStatus> {
    // Blocked signals stay pending until read here, so one sent between
    // the spawn and this is not lost.
    let signals = SignalFd::with_flags(set, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)?;
    let mut pid = pid_of(child)?;
    let mut exited = pidfd(pid)
        .inspect_err(|e| debug!(error = %e, "no pidfd; polling the VMM every 50 ms"))
        .ok();
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        let timeout = if exited.is_some() {
            PollTimeout::NONE
        } else {
            PollTimeout::from(NO_PIDFD_POLL_MS)
        };
        let mut fds = vec![PollFd::new(signals.as_fd(), PollFlags::POLLIN)];
        let control_at = control.as_ref().map(|c| {
            fds.push(PollFd::new(c.fd(), PollFlags::POLLIN));
            fds.len() - 1
        });
        if let Some(fd) = &exited {
            fds.push(PollFd::new(fd.as_fd(), PollFlags::POLLIN));
        }
        match poll(&mut fds, timeout) {
            Ok(_) | Err(Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
        let to_serve = control_at.is_some_and(|i| fds[i].revents().is_some_and(|r| !r.is_empty()));
        drop(fds);
        if to_serve {
            if let Some(control) = control.as_deref_mut() {
                control.serve(child, spawner);
            }
            let now = pid_of(child)?;
            if now != pid {
                // A successor: wait on its exit from now on.
                pid = now;
                exited = pidfd(pid).ok();
            }
        }
        while let Some(info) = signals.read_signal()? {
            forward(pid, &info);
        }
    }
}

/// Sends the signal of `info` on to the VMM, unless the terminal sent it to
/// the whole process group (the VMM included).
fn forward(pid: Pid, info: &libc::signalfd_siginfo) {
    let Ok(signal) = i32::try_from(info.ssi_signo).map(Signal::try_from) else {
        return;
    };
    let Ok(signal) = signal else {
        return;
    };
    if info.ssi_code == libc::SI_KERNEL {
        debug!(%signal, "terminal signal; the VMM got it too");
        return;
    }
    info!(%signal, "forwarding to the VMM");
    if let Err(e) = nix::sys::signal::kill(pid, signal) {
        // ESRCH: it exited already; the next try_wait collects it.
        debug!(error = %e, "cannot forward the signal");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn exit_codes() {
        assert_eq!(VmmExit::Code(3).shell_code(), 3);
        assert_eq!(VmmExit::Signal(15).shell_code(), 143);
        assert_eq!(
            VmmExit::from_status(ExitStatus::from_raw(1 << 8)),
            VmmExit::Code(1)
        );
        assert_eq!(
            VmmExit::from_status(ExitStatus::from_raw(9)),
            VmmExit::Signal(9)
        );
    }

    #[test]
    fn the_child_inherits_exactly_the_given_fds() {
        // A close-on-exec fd, like a region memfd received with MSG_CMSG_CLOEXEC.
        let file = std::fs::File::open("/proc/self/stat").expect("open");
        let other = std::fs::File::open("/proc/self/stat").expect("open");
        let (fd, other_fd) = (file.as_raw_fd(), other.as_raw_fd());
        let script = format!("test -e /dev/fd/{fd} && test ! -e /dev/fd/{other_fd}");
        let argv: Vec<OsString> = vec!["sh".into(), "-c".into(), script.into()];
        let (exit, _) = run_vmm(&argv, &[file.as_fd()]).expect("run");
        assert_eq!(
            exit,
            VmmExit::Code(0),
            "fd {fd} must be inherited, fd {other_fd} not"
        );
        // The parent's copy is still close-on-exec.
        // SAFETY: F_GETFD on an fd this test owns.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        assert_eq!(flags & libc::FD_CLOEXEC, libc::FD_CLOEXEC);
    }

    #[test]
    fn exit_status_and_missing_programs() {
        let argv: Vec<OsString> = vec!["sh".into(), "-c".into(), "exit 7".into()];
        assert_eq!(run_vmm(&argv, &[]).expect("run").0, VmmExit::Code(7));
        let argv: Vec<OsString> = vec!["sh".into(), "-c".into(), "kill -KILL $$".into()];
        assert_eq!(run_vmm(&argv, &[]).expect("run").0, VmmExit::Signal(9));
        let argv: Vec<OsString> = vec!["/nonexistent/vmm".into()];
        assert!(matches!(
            run_vmm(&argv, &[]),
            Err(LaunchError::Spawn { .. })
        ));
    }
}
