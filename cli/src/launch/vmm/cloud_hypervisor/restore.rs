//! cloud-hypervisor's side of `hugemem launch --restore NAME`: a new
//! cloud-hypervisor that receives the VM parked as NAME.
//!
//! The launcher binds the new process's API socket itself (the user's
//! `--api-socket` path, or one in a private directory) and gives it an
//! event monitor, so both are there before the process runs. Once it
//! started, the receiver has it `receive-migration` on a socket in the
//! private directory, waits for its `migration-receive-ready` event,
//! connects, and hands the connection to the daemon with RESTORE: the
//! daemon sends the parked memory's fds, the configuration and the state,
//! and the allocation becomes the launcher's (the reply is an ALLOC
//! reply). On demand, a second connection is its fault connection.

use std::error::Error;
use std::ffi::OsString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use hugemem_client::client::{Allocation, Client, ClientError};
use hugemem_client::park::RestoreOptions;

use super::api::{ChApi, ChApiError};
use super::command_line::api_socket_arg;
use super::events::{ChEvents, ChEventsError, RECEIVE_READY};
use super::switch::ChSwitch;
use crate::launch::config::LaunchConfig;
use crate::launch::error::LaunchError;
use crate::launch::update::VmmSwitch;
use crate::launch::vmm::adapter::{RestoreLaunch, RestoreReceiver, VmmRestore};

/// cloud-hypervisor restores parked VMs.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct ChRestore;

/// Why receiving the parked VM failed.
#[derive(Debug, thiserror::Error)]
pub enum ReceiveError {
    /// No `migration-receive-ready` event in time.
    #[error("cloud-hypervisor did not listen for the VM ({0}): is it cloud-hypervisor?")]
    NotListening(ChEventsError),
    /// The migration socket could not be reached.
    #[error("cannot reach cloud-hypervisor's migration socket: {0}")]
    Connect(std::io::Error),
    /// The daemon refused or failed RESTORE.
    #[error("{}", hugemem_client::diag::chain(.0))]
    Daemon(ClientError),
    /// `receive-migration` failed.
    #[error("cloud-hypervisor's receive-migration: {0}")]
    Receive(ChApiError),
    /// `receive-migration` did not answer in time.
    #[error("cloud-hypervisor did not run the VM within {0:?}")]
    NotRunning(Duration),
}

/// The new process's sockets.
pub(super) struct Sockets {
    pub(super) argv: Vec<OsString>,
    pub(super) api_path: PathBuf,
    pub(super) api_listener: UnixListener,
    pub(super) events_read: OwnedFd,
    pub(super) events_write: OwnedFd,
}

/// The command line with the launcher's API socket (`fd=`) and event
/// monitor in place of the user's `--api-socket`.
pub(super) fn command_line(cfg: &LaunchConfig, private: &Path) -> Result<Sockets, LaunchError> {
    let opt = |m: String| LaunchError::Options(m);
    let program = cfg
        .command
        .first()
        .cloned()
        .ok_or_else(|| opt("no VMM command given after --".into()))?;
    let mut args: Vec<OsString> = cfg.command[1..].to_vec();
    // The launcher's option this command line is for.
    let option = if cfg.clone_of.is_some() {
        "--clone-of"
    } else {
        "--restore"
    };
    if args
        .iter()
        .any(|a| a.to_string_lossy().starts_with("--event-monitor"))
    {
        return Err(opt(format!("{option} gives cloud-hypervisor an event monitor of its own: leave out --event-monitor")));
    }
    let api_path = match api_socket_arg(&args) {
        Some((i, value)) => {
            if value.starts_with("fd=") {
                return Err(opt(format!(
                    "{option} reaches cloud-hypervisor's API by path: give `--api-socket path=…`"
                )));
            }
            let path = PathBuf::from(value.strip_prefix("path=").unwrap_or(&value));
            let n = if args[i].to_string_lossy().contains('=') {
                1
            } else {
                2
            };
            args.drain(i..i + n);
            path
        }
        None => private.join("api.sock"),
    };
    if api_path.exists() {
        if UnixStream::connect(&api_path).is_ok() {
            return Err(opt(format!(
                "{} is in use by another process",
                api_path.display()
            )));
        }
        std::fs::remove_file(&api_path).map_err(|e| opt(format!("{}: {e}", api_path.display())))?;
    }
    let api_listener = UnixListener::bind(&api_path).map_err(|e| {
        opt(format!(
            "cannot bind cloud-hypervisor's API socket {}: {e}",
            api_path.display()
        ))
    })?;
    let (events_read, events_write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| opt(format!("cannot make the event-monitor pipe: {e}")))?;
    let mut argv = vec![
        program,
        "--api-socket".into(),
        format!("fd={}", api_listener.as_raw_fd()).into(),
        "--event-monitor".into(),
        format!("fd={}", events_write.as_raw_fd()).into(),
    ];
    argv.extend(args);
    Ok(Sockets {
        argv,
        api_path,
        api_listener,
        events_read,
        events_write,
    })
}

impl VmmRestore for ChRestore {
    fn prepare(&self, cfg: &LaunchConfig, private: &Path) -> Result<RestoreLaunch, LaunchError> {
        let s = command_line(cfg, private)?;
        // Its update passes its own memory to its successor: the switch
        // needs only the API, by path.
        let update = match cfg.control.as_deref() {
            Some(control) => {
                let mut argv: Vec<OsString> = cfg.command.first().cloned().into_iter().collect();
                let api_arg = [OsString::from("--api-socket"), s.api_path.clone().into()];
                let (switch, _none) =
                    ChSwitch::for_launch(&mut argv, &api_arg, control, cfg.update_timeout)?;
                Some(Box::new(switch) as Box<dyn VmmSwitch>)
            }
            None => None,
        };
        let receiver = ChReceiver {
            copy: cfg.clone_of.is_some(),
            api: ChApi::new(&s.api_path),
            events: Some(s.events_read),
            receive_path: private.join("restore.sock"),
            deadline: cfg.update_timeout,
        };
        Ok(RestoreLaunch {
            argv: s.argv,
            // The process's own ends, closed once it started (a copy kept
            // would answer for a gone process's API).
            inherit: vec![OwnedFd::from(s.api_listener), s.events_write],
            receiver: Box::new(receiver),
            update,
        })
    }
}

/// The receiving half: the new process's API and events.
struct ChReceiver {
    /// A copy clone (`--clone-of NAME --clone-mode copy`): RESTORE with COPY.
    copy: bool,
    api: ChApi,
    events: Option<OwnedFd>,
    receive_path: PathBuf,
    deadline: Duration,
}

impl ChReceiver {
    /// `receive-migration` on the new process, its readiness event, the
    /// connection handed to the daemon.
    fn receive_into(
        &mut self,
        client: &mut Client,
        name: &str,
        on_demand: bool,
    ) -> Result<Allocation, ReceiveError> {
        let deadline = self.deadline;
        let (done_tx, done_rx) = mpsc::channel();
        let receiver = self.api.clone();
        let listen = self.receive_path.clone();
        std::thread::spawn(move || {
            let answer = if on_demand {
                let body = serde_json::json!({
                    "receiver_url": format!("unix:{}", listen.display()),
                    "memory_mode": "Postcopy",
                });
                receiver
                    .put("vm.receive-migration", Some(&body), deadline)
                    .map(drop)
            } else {
                receiver.receive_migration(&listen, deadline)
            };
            let _ = done_tx.send(answer);
        });
        let events = self
            .events
            .take()
            .ok_or(ReceiveError::NotListening(ChEventsError::Closed))?;
        let mut events = ChEvents::new(events);
        events
            .wait_for(RECEIVE_READY, deadline)
            .map_err(ReceiveError::NotListening)?;
        let connect = || UnixStream::connect(&self.receive_path).map_err(ReceiveError::Connect);
        let stream = connect()?;
        // On demand, its fault connection: the second one it accepts.
        let fault = if on_demand { Some(connect()?) } else { None };
        let how = RestoreOptions {
            paused: false,
            fault: fault.as_ref(),
            copy: self.copy,
        };
        let alloc = client
            .restore_with(name, &stream, how)
            .map_err(ReceiveError::Daemon)?;
        match done_rx.recv_timeout(deadline) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(ReceiveError::Receive(e)),
            Err(_) => return Err(ReceiveError::NotRunning(deadline)),
        }
        events.drain_in_background();
        Ok(alloc)
    }
}

impl RestoreReceiver for ChReceiver {
    fn receive(
        &mut self,
        client: &mut Client,
        name: &str,
        on_demand: bool,
    ) -> Result<Allocation, Box<dyn Error + Send + Sync>> {
        Ok(self.receive_into(client, name, on_demand)?)
    }

    fn stop(&self) {
        let _ = self.api.shutdown_vmm(self.deadline);
    }
}

#[cfg(test)]
mod tests {
    use super::command_line;

    #[test]
    fn command_line_refusals_name_the_launchers_option() {
        let dir = tempfile::tempdir().expect("tempdir");
        for (clone_of, option) in [(None, "--restore"), (Some("tmpl"), "--clone-of")] {
            let mut cfg = crate::launch::tests::cfg();
            cfg.clone_of = clone_of.map(str::to_owned);
            for args in [
                &["cloud-hypervisor", "--event-monitor", "path=/tmp/x"][..],
                &["cloud-hypervisor", "--api-socket", "fd=3"][..],
            ] {
                cfg.command = args.iter().map(Into::into).collect();
                match command_line(&cfg, dir.path()) {
                    Err(e) => assert!(e.to_string().starts_with(option), "{e}"),
                    Ok(_) => panic!("{args:?} was taken"),
                }
            }
        }
    }
}
