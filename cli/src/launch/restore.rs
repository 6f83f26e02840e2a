//! `hugemem launch --restore NAME -- cloud-hypervisor …`: a VM parked in the
//! daemon (`hugemem park`) runs again in a new cloud-hypervisor, on the
//! same memory: nothing is copied.
//!
//! The launcher binds the new process's API socket itself (the user's
//! `--api-socket` path, or one in a private directory) and gives it an
//! event monitor, so both are there before the process runs. Once the
//! process started, the launcher's watcher thread has it
//! `receive-migration` on a socket in a private directory, waits for its
//! `migration-receive-ready` event, connects, and hands the connection to
//! the daemon with RESTORE: the daemon sends the parked memory's fds, the
//! configuration and the state, and the allocation becomes the launcher's
//! (the reply is an ALLOC reply). From then on the launch is any launch's:
//! the watcher re-attaches after a daemon restart, and the memory is freed
//! when the VM ends (or reported parked again).

use std::ffi::OsString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hugemem_client::client::{Allocation, Client};
use tracing::{info, warn};

use super::allocation::HeldAllocation;
use super::ch_api::ChApi;
use super::ch_events::{ChEvents, RECEIVE_READY};
use super::command_line::Vmm;
use super::config::LaunchConfig;
use super::control::{ControlServer, ControlSocket};
use super::error::LaunchError;
use super::exit_event::ExitEvent;
use super::process;
use super::reattach;
use super::report::{free_or_report_parked, LaunchReport};
use super::update::{MemorySlot, SuccessorMailbox, Updater};

/// What the watcher learned of the restored allocation.
#[derive(Debug, Clone, Default)]
struct Restored {
    id: u64,
    size: u64,
    page_sizes: Vec<u64>,
    took: Duration,
}

/// The command line with the launcher's API socket (`fd=`) and event
/// monitor in place of the user's `--api-socket`; returns it, the API's
/// path and the fds the process inherits.
fn command_line(
    cfg: &LaunchConfig,
    private: &std::path::Path,
) -> Result<(Vec<OsString>, PathBuf, UnixListener, OwnedFd, OwnedFd), LaunchError> {
    let opt = |m: String| LaunchError::Options(m);
    let program = cfg
        .command
        .first()
        .cloned()
        .ok_or_else(|| opt("no VMM command given after --".into()))?;
    let mut args: Vec<OsString> = cfg.command[1..].to_vec();
    if args
        .iter()
        .any(|a| a.to_string_lossy().starts_with("--event-monitor"))
    {
        return Err(opt("--restore gives cloud-hypervisor an event monitor of its own: leave out --event-monitor".into()));
    }
    let api_path = match super::cloud_hypervisor::api_socket_arg(&args) {
        Some((i, value)) => {
            if value.starts_with("fd=") {
                return Err(opt(
                    "--restore reaches cloud-hypervisor's API by path: give `--api-socket path=…`"
                        .into(),
                ));
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
    let listener = UnixListener::bind(&api_path).map_err(|e| {
        opt(format!(
            "cannot bind cloud-hypervisor's API socket {}: {e}",
            api_path.display()
        ))
    })?;
    let (events_read, events_write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| opt(format!("cannot make the event-monitor pipe: {e}")))?;
    let mut full = vec![
        program,
        "--api-socket".into(),
        format!("fd={}", listener.as_raw_fd()).into(),
        "--event-monitor".into(),
        format!("fd={}", events_write.as_raw_fd()).into(),
    ];
    full.extend(args);
    Ok((full, api_path, listener, events_read, events_write))
}

/// Restores the VM parked under `name` into the cloud-hypervisor of
/// `cfg.command`, supervises it, and frees the memory when it ends.
///
/// # Errors
///
/// [`LaunchError`]: options, the daemon, the process.
pub fn run(cfg: &LaunchConfig, name: &str) -> Result<LaunchReport, LaunchError> {
    let program = cfg.command.first().cloned().unwrap_or_default();
    let vmm = cfg.vmm.or_else(|| Vmm::detect(&program));
    if vmm != Some(Vmm::CloudHypervisor) {
        return Err(LaunchError::Options(
            "--restore runs cloud-hypervisor (a parked VM is a cloud-hypervisor VM)".into(),
        ));
    }
    // Bound before anything else: a name in use is refused first.
    let control = cfg
        .control
        .as_deref()
        .map(ControlSocket::bind)
        .transpose()
        .map_err(|e| LaunchError::Options(format!("cannot listen for updates: {e}")))?;
    let private = tempfile::Builder::new()
        .prefix("hugemem-restore-")
        .tempdir()
        .map_err(|e| LaunchError::Options(format!("cannot make a private directory: {e}")))?;
    let (full, api_path, api_listener, events_read, events_write) =
        command_line(cfg, private.path())?;
    let client = Client::connect(&cfg.socket)?;
    let restored: Arc<Mutex<Option<Restored>>> = Arc::default();
    // The process's own ends, closed here once it started (a copy kept here
    // would answer for a gone process's API).
    let handed_over: Vec<OwnedFd> = vec![OwnedFd::from(api_listener), events_write];
    let receive_path = private.path().join("restore.sock");
    let deadline = cfg.update_timeout;
    let socket = cfg.socket.clone();
    let timeout = cfg.reattach_timeout;
    let api = ChApi::new(&api_path);
    let mailbox = Arc::new(
        SuccessorMailbox::new()
            .map_err(|e| LaunchError::Options(format!("cannot create an eventfd: {e}")))?,
    );
    // `hugemem update` of the restored VM: its memory arrives in `slot`.
    let slot: MemorySlot = Arc::default();
    let mut server = match control {
        Some(control) => {
            let updater = Updater::for_restore(cfg, &api_path, &mailbox, Arc::clone(&slot))?;
            info!(control = %control.path().display(), "listening for `hugemem update`");
            Some(ControlServer::new(control, updater))
        }
        None => None,
    };
    let on_demand = cfg.on_demand;
    info!(name, on_demand, command = ?full, "starting cloud-hypervisor to restore a parked VM");
    let watch_restored = Arc::clone(&restored);
    let (outcome, client) = process::run_vmm_watching(
        &full,
        &[],
        handed_over,
        Some(move |exit: &ExitEvent| {
            let started = Instant::now();
            let mut client = client;
            let alloc = match restore_into(
                &mut client,
                &api,
                events_read,
                &receive_path,
                name,
                deadline,
                on_demand,
            ) {
                Ok(a) => a,
                Err(e) => {
                    warn!(name, error = %e, "the restore failed; stopping the new cloud-hypervisor (the VM stays parked)");
                    let _ = api.shutdown_vmm(deadline);
                    return None;
                }
            };
            let held = HeldAllocation::of(&alloc);
            record_restored(
                &alloc,
                started.elapsed(),
                &slot,
                &watch_restored,
                name,
                on_demand,
            );
            // The daemon's fds of the memory are not needed: cloud-hypervisor has its own.
            drop(alloc);
            reattach::watch(client, &socket, &held, timeout, exit, Some(&mailbox))
        }),
        server.as_mut().map(|s| s as &mut dyn process::Supervisor),
    );
    drop(server);
    let restored = restored.lock().ok().and_then(|r| r.clone());
    let Some(restored) = restored else {
        let (exit, _) = outcome?;
        return Err(LaunchError::Options(format!(
            "the VM parked as {name} was not restored; cloud-hypervisor ended with {exit}"
        )));
    };
    let parked_as = free_or_report_parked(client.flatten(), restored.id);
    let (exit, vmm_time) = outcome?;
    Ok(LaunchReport {
        exit,
        alloc: restored.took,
        vmm: vmm_time,
        size: restored.size,
        page_sizes: restored.page_sizes,
        note: String::new(),
        parked_as,
        restored: true,
    })
}

/// Keeps what the launcher learned of the restored allocation (the memory
/// `hugemem update` hands on, the report's figures) and logs the
/// "restored:" line (`ms`: the restore's start to the daemon's answer,
/// which for an on-demand restore comes once every page is filled).
fn record_restored(
    alloc: &Allocation,
    took: Duration,
    slot: &Mutex<Option<Allocation>>,
    restored: &Mutex<Option<Restored>>,
    name: &str,
    on_demand: bool,
) {
    if let (Ok(mut m), Ok(copy)) = (slot.lock(), alloc.try_clone()) {
        *m = Some(copy);
    }
    if let Ok(mut r) = restored.lock() {
        *r = Some(Restored {
            id: alloc.id,
            size: alloc.size(),
            page_sizes: alloc.regions.iter().map(|r| r.page_size).collect(),
            took,
        });
    }
    let how = if on_demand {
        "its memory filled as it asked (every page is now)"
    } else {
        "on its parked memory"
    };
    let ms = took.as_secs_f64() * 1e3;
    info!(
        name,
        alloc = alloc.id,
        on_demand,
        ms,
        "restored: the VM runs in the new cloud-hypervisor, {how}"
    );
}

/// The restore itself: `receive-migration` on the new process, its
/// readiness event, the connection handed to the daemon.
fn restore_into(
    client: &mut Client,
    api: &ChApi,
    events: OwnedFd,
    receive_path: &std::path::Path,
    name: &str,
    deadline: Duration,
    on_demand: bool,
) -> Result<Allocation, String> {
    let (done_tx, done_rx) = mpsc::channel();
    let receiver = api.clone();
    let listen = receive_path.to_path_buf();
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
    let mut events = ChEvents::new(events);
    events.wait_for(RECEIVE_READY, deadline).map_err(|e| {
        format!("cloud-hypervisor did not listen for the VM ({e}): is it cloud-hypervisor?")
    })?;
    let connect = || {
        UnixStream::connect(receive_path)
            .map_err(|e| format!("cannot reach cloud-hypervisor's migration socket: {e}"))
    };
    let stream = connect()?;
    let alloc = if on_demand {
        // Its fault connection: the second one it accepts.
        let fault = connect()?;
        client.restore_postcopy(name, &stream, &fault, false)
    } else {
        client.restore(name, &stream, false)
    }
    .map_err(|e| hugemem_client::diag::chain(&e))?;
    match done_rx.recv_timeout(deadline) {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(format!("cloud-hypervisor's receive-migration: {e}")),
        Err(_) => {
            return Err(format!(
                "cloud-hypervisor did not run the VM within {deadline:?}"
            ))
        }
    }
    events.drain_in_background();
    Ok(alloc)
}
