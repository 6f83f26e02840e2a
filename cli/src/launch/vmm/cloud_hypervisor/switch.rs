//! cloud-hypervisor's switch: its own local migration
//! (`send-migration destination_url=unix:…,local=on` to a successor's
//! `receive-migration`), which passes the guest memory's file descriptors
//! over the migration socket (SCM_RIGHTS) instead of copying RAM, driven
//! over each cloud-hypervisor's REST API (`ch_api.rs`).
//!
//! Unlike QEMU's switch, the successor needs no memory of the launcher's:
//! the running cloud-hypervisor sends it its own descriptors of the same
//! pages, so the allocation stays on the launcher's daemon connection
//! throughout (no HANDOFF) and is never released while a guest runs on it.
//!
//! The launcher binds each cloud-hypervisor's API socket itself and passes
//! it as `--api-socket fd=N` (unless the user named one for the first), so
//! a request can be sent the moment the process starts and a successor that
//! exits shows up as a refused connection, never as a wait. The successor's
//! `receive-migration` binds the migration socket itself and answers only
//! once the guest runs there; the moment it listens is its event
//! `migration-receive-ready`, read from its `--event-monitor` pipe (a probe
//! connection would be taken for the migration). Once the guest runs in the
//! successor and the replaced process is reaped, the successor's API socket
//! is renamed to the path the first one had, so whatever reached the VM's
//! API before reaches it after.

use std::ffi::OsString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use hugemem_client::client::Allocation;
use tracing::{debug, warn};

use super::api::{ChApi, ChApiError};
use super::command_line::api_socket_arg;
use super::events::{ChEvents, RECEIVE_READY};
use crate::launch::command_line::option_name;
use crate::launch::error::LaunchError;
use crate::launch::update::{
    monotonic_ns, MigrationFigures, SuccessorCommand, Switched, UpdateError, VmmSwitch,
};

fn api_err(what: &str) -> impl FnOnce(ChApiError) -> UpdateError + '_ {
    move |source| UpdateError::Control {
        what: what.to_owned(),
        source: Box::new(source),
    }
}

/// A started successor, from [`VmmSwitch::successor`] to
/// [`VmmSwitch::switch`].
#[derive(Debug)]
struct Pending {
    /// Its API (the socket the launcher bound for it).
    api: ChApi,
    /// The read end of its event-monitor pipe.
    events: OwnedFd,
}

/// cloud-hypervisor's side of live updates.
#[derive(Debug)]
pub(crate) struct ChSwitch {
    /// The program running now.
    program: OsString,
    /// Options of the user's command line a successor needs too
    /// (`--seccomp`, `-v`); its VM, its landlock rules included, comes with
    /// the migration (cloud-hypervisor refuses `--landlock` without a
    /// payload on the command line).
    carried: Vec<OsString>,
    /// The path the VM's API is reached at: the user's `--api-socket
    /// path=…`, or the socket the launcher bound beside the control socket.
    api_path: PathBuf,
    /// The launcher bound `api_path` (and removes it at the end).
    own_api: bool,
    /// The running cloud-hypervisor's API.
    api: ChApi,
    /// Where a successor's API socket goes until the switch is done.
    next_api_path: PathBuf,
    /// The migration socket a successor listens on.
    migration_path: PathBuf,
    /// How long any one request and the switch may take.
    deadline: Duration,
    /// Between `successor` and `switch`.
    pending: Option<Pending>,
    /// The replaced cloud-hypervisor's API, between `switch` and `retired`.
    replaced: Option<ChApi>,
}

/// The options of `args` a successor is started with too.
fn carried_options(args: &[OsString]) -> Vec<OsString> {
    let mut out = Vec::new();
    let mut it = args.iter().peekable();
    while let Some(arg) = it.next() {
        let text = arg.to_string_lossy();
        let name = text.strip_prefix("--").and_then(|_| option_name(&text));
        match name {
            Some("seccomp") => {
                out.push(arg.clone());
                if !text.contains('=') {
                    if let Some(value) = it.next() {
                        out.push(value.clone());
                    }
                }
            }
            _ if text.starts_with("-v") && text[1..].chars().all(|c| c == 'v') => {
                out.push(arg.clone());
            }
            _ => {}
        }
    }
    out
}

/// Binds a UNIX socket at `path` (mode 0600), replacing a stale file that
/// nobody listens on.
fn bind_api_socket(path: &Path) -> std::io::Result<UnixListener> {
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                format!("{} is in use by another process", path.display()),
            ));
        }
        std::fs::remove_file(path)?;
    }
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// `path` with `suffix` added to its file name.
fn beside(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_owned();
    name.push(suffix);
    path.with_file_name(name)
}

impl ChSwitch {
    /// The switch for the first cloud-hypervisor, about to run `full`
    /// (program first, then `user_args`' options among others), whose
    /// control socket is `control`: gives it an API socket when the user
    /// named none, and returns the descriptor it inherits for that.
    ///
    /// # Errors
    ///
    /// [`LaunchError::Options`] for an `--api-socket fd=…` of the user's
    /// (the launcher must reach the API by path) and when the socket
    /// cannot be bound.
    pub(crate) fn for_launch(
        full: &mut Vec<OsString>,
        user_args: &[OsString],
        control: &Path,
        deadline: Duration,
    ) -> Result<(Self, Vec<OwnedFd>), LaunchError> {
        let io = |e: std::io::Error| {
            LaunchError::Options(format!("cannot set up cloud-hypervisor's API socket: {e}"))
        };
        let (api_path, own_api, inherit) = match api_socket_arg(user_args).map(|(_, value)| value) {
            Some(value) if value.starts_with("fd=") => return Err(LaunchError::Options(
                "live update reaches cloud-hypervisor's API by path: give `--api-socket path=…` \
                     or leave it out (hugemem launch then makes one beside the control socket)"
                    .into(),
            )),
            Some(value) => {
                let path = value.strip_prefix("path=").unwrap_or(&value);
                (PathBuf::from(path), false, Vec::new())
            }
            None => {
                let path = beside(control, ".api");
                let listener = bind_api_socket(&path).map_err(io)?;
                let fd = OwnedFd::from(listener);
                full.splice(
                    1..1,
                    [
                        OsString::from("--api-socket"),
                        format!("fd={}", fd.as_raw_fd()).into(),
                    ],
                );
                (path, true, vec![fd])
            }
        };
        let switch = Self {
            program: full.first().cloned().unwrap_or_default(),
            carried: carried_options(user_args),
            api: ChApi::new(&api_path),
            api_path,
            own_api,
            next_api_path: beside(control, ".api-next"),
            migration_path: beside(control, ".migration"),
            deadline,
            pending: None,
            replaced: None,
        };
        Ok((switch, inherit))
    }

    /// The bytes process `pid` has written (`/proc/PID/io` `wchar`): the
    /// migration stream is written with `write`, so the difference over a
    /// switch bounds what it carried.
    fn written_bytes(pid: u32) -> Option<u64> {
        let io = std::fs::read_to_string(format!("/proc/{pid}/io")).ok()?;
        io.lines()
            .find_map(|l| l.strip_prefix("wchar:"))
            .and_then(|v| v.trim().parse().ok())
    }

    /// Runs the migration once the successor listens: returns the time of
    /// the send and once the successor runs the guest.
    fn migrate(
        &mut self,
        pending: Pending,
        running_pid: u32,
        successor: &mut Child,
    ) -> Result<Switched, UpdateError> {
        let receiver = pending.api.clone();
        let listen = self.migration_path.clone();
        let deadline = self.deadline;
        let (done_tx, done_rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = done_tx.send(receiver.receive_migration(&listen, deadline));
        });
        let mut events = ChEvents::new(pending.events);
        if let Err(why) = events.wait_for(RECEIVE_READY, self.deadline) {
            // Its API's answer, if it gave one, says more (a refusal, or
            // the connection closed by a process that exited).
            let api = match done_rx.recv_timeout(Duration::ZERO) {
                Ok(Err(e)) => format!("; its API: {}", hugemem_client::diag::chain(&e)),
                _ => String::new(),
            };
            return Err(UpdateError::Migration {
                status: "not started".into(),
                detail: format!(
                    "the new process did not listen for the migration ({why}){api}: is it cloud-hypervisor?"
                ),
            });
        }
        let written_before = Self::written_bytes(running_pid);
        let sent = Instant::now();
        let migrate_at_ns = monotonic_ns();
        self.api
            .send_migration(&self.migration_path, true, self.deadline)
            .map_err(api_err("send-migration on the running cloud-hypervisor"))?;
        let received = done_rx
            .recv_timeout(self.deadline)
            .map_err(|_| UpdateError::Migration {
                status: "not finished".into(),
                detail: format!(
                    "the new cloud-hypervisor did not run the guest within {:?}",
                    self.deadline
                ),
            })?;
        received.map_err(api_err("receive-migration on the new cloud-hypervisor"))?;
        let switch_time = sent.elapsed();
        let resumed_at_ns = monotonic_ns();
        let written_after = Self::written_bytes(running_pid);
        events.drain_in_background();
        let _ = std::fs::remove_file(&self.migration_path);
        let state = pending
            .api
            .vm_state(self.deadline)
            .map_err(api_err("vm.info on the new cloud-hypervisor"))?;
        if state != "Running" {
            return Err(UpdateError::Migration {
                status: "received".into(),
                detail: format!("the new cloud-hypervisor's VM is {state}, not Running"),
            });
        }
        if let Ok(Some(status)) = successor.try_wait() {
            return Err(UpdateError::Migration {
                status: "with the new cloud-hypervisor gone".into(),
                detail: format!("it ended with {status}"),
            });
        }
        self.replaced = Some(std::mem::replace(&mut self.api, pending.api));
        Ok(Switched {
            switch_time,
            migrate_at_ns,
            resumed_at_ns,
            figures: MigrationFigures {
                ram_transferred_bytes: match (written_before, written_after) {
                    (Some(b), Some(a)) => a.saturating_sub(b),
                    _ => 0,
                },
                ..MigrationFigures::default()
            },
        })
    }
}

impl VmmSwitch for ChSwitch {
    fn name(&self) -> &'static str {
        "cloud-hypervisor"
    }

    fn program(&self) -> &OsString {
        &self.program
    }

    fn memory_by_handoff(&self) -> bool {
        false
    }

    fn connect_running(&mut self) -> Result<(), UpdateError> {
        self.api
            .ping(self.deadline)
            .map_err(api_err("the running cloud-hypervisor's API"))
    }

    fn successor(
        &mut self,
        program: &OsString,
        _memory: &Allocation,
    ) -> Result<SuccessorCommand, UpdateError> {
        let listener = bind_api_socket(&self.next_api_path)?;
        let _ = std::fs::remove_file(&self.migration_path);
        let (events, events_theirs) =
            nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(std::io::Error::from)?;
        let api_fd = OwnedFd::from(listener);
        let mut argv = vec![
            program.clone(),
            "--api-socket".into(),
            format!("fd={}", api_fd.as_raw_fd()).into(),
            "--event-monitor".into(),
            format!("fd={}", events_theirs.as_raw_fd()).into(),
        ];
        argv.extend(self.carried.iter().cloned());
        self.pending = Some(Pending {
            api: ChApi::new(&self.next_api_path),
            events,
        });
        Ok(SuccessorCommand {
            argv,
            inherit: vec![api_fd, events_theirs],
        })
    }

    fn switch(&mut self, running: &Child, successor: &mut Child) -> Result<Switched, UpdateError> {
        let pending = self.pending.take().ok_or_else(|| {
            UpdateError::Io(std::io::Error::other(
                "no successor cloud-hypervisor was prepared",
            ))
        })?;
        self.migrate(pending, running.id(), successor)
    }

    fn keep_old_running(&mut self) {
        let _ = std::fs::remove_file(&self.next_api_path);
        let _ = std::fs::remove_file(&self.migration_path);
        match self.api.vm_state(self.deadline) {
            Ok(state) if state == "Running" => {}
            Ok(state) => {
                warn!(%state, "the running cloud-hypervisor's VM is not running after the failed update; resuming it");
                if let Err(e) = self.api.resume(self.deadline) {
                    warn!(error = %e, "cannot resume the running cloud-hypervisor's VM");
                }
            }
            Err(e) => {
                warn!(error = %e, "cannot ask the running cloud-hypervisor for its VM's state")
            }
        }
    }

    fn retire_old(&mut self) {
        // A local migration's source exits by itself once the destination
        // runs the guest; one that lingers is told to.
        if let Some(old) = &self.replaced {
            if let Err(e) = old.shutdown_vmm(self.deadline) {
                debug!(error = %e, "vmm.shutdown on the old cloud-hypervisor (gone already)");
            }
        }
    }

    fn retired(&mut self) {
        self.replaced = None;
        // The replaced process is gone: its API path now names the
        // successor's socket.
        match std::fs::rename(&self.next_api_path, &self.api_path) {
            Ok(()) => self.api = ChApi::new(&self.api_path),
            Err(e) => warn!(
                from = %self.next_api_path.display(),
                to = %self.api_path.display(),
                error = %e,
                "cannot move the new cloud-hypervisor's API socket to the VM's API path; it stays where it is"
            ),
        }
    }
}

impl Drop for ChSwitch {
    fn drop(&mut self) {
        if self.own_api {
            let _ = std::fs::remove_file(&self.api_path);
        }
        let _ = std::fs::remove_file(&self.next_api_path);
        let _ = std::fs::remove_file(&self.migration_path);
    }
}
