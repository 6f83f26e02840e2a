//! `hugemem launch --restore NAME -- VMM …`: a VM parked in the daemon
//! (`hugemem park`) runs again in a new VMM process, on the same memory:
//! nothing is copied.
//!
//! The VMM's adapter makes the process's command line and its channels
//! (`VmmRestore::prepare`; cloud-hypervisor's: `vmm/cloud_hypervisor/restore.rs`)
//! before it runs. Once the process started, the launcher's watcher thread
//! has the adapter's receiver take the VM from the daemon (RESTORE) and the
//! allocation becomes the launcher's. From then on the launch is any
//! launch's: the watcher re-attaches after a daemon restart, and the memory
//! is freed when the VM ends (or reported parked again).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hugemem_client::client::{Allocation, Client};
use tracing::{info, warn};

use super::allocation::HeldAllocation;
use super::command_line::Vmm;
use super::config::LaunchConfig;
use super::control::{ControlServer, ControlSocket};
use super::error::LaunchError;
use super::exit_event::ExitEvent;
use super::process;
use super::reattach;
use super::report::{free_or_report_parked, say_replaced, LaunchReport};
use super::update::{MemorySlot, SuccessorMailbox, Updater};

/// What the watcher learned of the restored allocation.
#[derive(Debug, Clone, Default)]
struct Restored {
    id: u64,
    size: u64,
    page_sizes: Vec<u64>,
    took: Duration,
}

/// Restores the VM parked under `name` into the VMM of `cfg.command`,
/// supervises it, and frees the memory when it ends.
///
/// # Errors
///
/// [`LaunchError`]: options, the daemon, the process;
/// [`LaunchError::Unsupported`] for a VMM that cannot restore yet.
pub fn run(cfg: &LaunchConfig, name: &str) -> Result<LaunchReport, LaunchError> {
    let program = cfg.command.first().cloned().unwrap_or_default();
    let adapter = cfg
        .vmm
        .or_else(|| Vmm::detect(&program))
        .ok_or_else(|| {
            LaunchError::Options(
                "--restore runs the VM's VMM (cloud-hypervisor or qemu-system-*): name it after -- or with --vmm".into(),
            )
        })?
        .adapter();
    let vmm_restore = adapter.restore()?;
    let vmm = adapter.name();
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
    let launch = vmm_restore.prepare(cfg, private.path())?;
    let client = Client::connect(&cfg.socket)?;
    let restored: Arc<Mutex<Option<Restored>>> = Arc::default();
    let socket = cfg.socket.clone();
    let timeout = cfg.reattach_timeout;
    let mailbox = Arc::new(
        SuccessorMailbox::new()
            .map_err(|e| LaunchError::Options(format!("cannot create an eventfd: {e}")))?,
    );
    // `hugemem update` of the restored VM: its memory arrives in `slot`.
    let slot: MemorySlot = Arc::default();
    let mut server = match (control, launch.update) {
        (Some(control), Some(switch)) => {
            let updater = Updater::for_restore(cfg, switch, &mailbox, Arc::clone(&slot));
            info!(control = %control.path().display(), "listening for `hugemem update`");
            Some(ControlServer::new(control, updater))
        }
        _ => None,
    };
    // A copy clone (`--clone-of NAME --clone-mode copy`): RESTORE with
    // COPY, postcopy unless `--copy-eager` or the VMM cannot (QEMU).
    let copy = cfg.clone_of.is_some();
    let on_demand = cfg.on_demand || (copy && !cfg.copy_eager && adapter.restores_on_demand());
    if copy && !on_demand && !cfg.copy_eager {
        info!(
            name,
            "{vmm} takes no memory on demand: the copy is filled before its guest runs"
        );
    }
    let full = launch.argv;
    let mut receiver = launch.receiver;
    info!(name, on_demand, command = ?full, "starting {vmm} to restore a parked VM");
    let watch_restored = Arc::clone(&restored);
    let (outcome, client) = process::run_vmm_watching(
        &full,
        &[],
        launch.inherit,
        Some(move |exit: &ExitEvent| {
            let started = Instant::now();
            let mut client = client;
            let alloc = match receiver.receive(&mut client, name, on_demand) {
                Ok(a) => a,
                Err(e) => {
                    warn!(name, error = %e, "the restore failed; stopping the new {vmm} (the VM stays parked)");
                    slot.put(None);
                    receiver.stop();
                    return None;
                }
            };
            let held = HeldAllocation::of(&alloc);
            record_restored(
                &alloc,
                started.elapsed(),
                &slot,
                &watch_restored,
                (name, vmm),
                (on_demand, copy),
            );
            // The daemon's fds of the memory are not needed: the VMM has its own.
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
            "the VM parked as {name} was not restored; {vmm} ended with {exit}"
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
        restored: cfg.clone_of.is_none(),
        cloned: cfg
            .clone_of
            .as_ref()
            .map(|_| hugemem_client::proto::CloneMode::Copy),
        filled_first: copy && !on_demand,
    })
}

/// Keeps what the launcher learned of the restored allocation (the memory
/// `hugemem update` hands on, the report's figures) and logs the
/// "restored:" line (`ms`: the restore's start to the daemon's answer,
/// which for an on-demand restore comes once every page is filled).
fn record_restored(
    alloc: &Allocation,
    took: Duration,
    slot: &super::update::RestoredMemory,
    restored: &Mutex<Option<Restored>>,
    (name, vmm): (&str, &str),
    (on_demand, copy): (bool, bool),
) {
    slot.put(alloc.try_clone().ok());
    if copy {
        // The daemon gave the copy what a second process cannot hold of
        // the template's (a tap, a vsock's socket), one per line.
        say_replaced(name, alloc.note.lines());
    }
    if let Ok(mut r) = restored.lock() {
        *r = Some(Restored {
            id: alloc.id,
            size: alloc.size(),
            page_sizes: alloc.regions.iter().map(|r| r.page_size).collect(),
            took,
        });
    }
    let how = match (on_demand, copy) {
        (true, true) => {
            "on fresh memory filled from its template as it ran (postcopy: every page is now); the template stays parked"
        }
        (false, true) => {
            "on fresh memory copied from its template before it ran; the template stays parked"
        }
        (true, false) => "its memory filled as it asked (every page is now)",
        (false, false) => "on its parked memory",
    };
    let ms = took.as_secs_f64() * 1e3;
    info!(
        name,
        alloc = alloc.id,
        on_demand,
        ms,
        "restored: the VM runs in the new {vmm}, {how}"
    );
}
