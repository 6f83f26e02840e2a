//! A launch end to end: allocate through the daemon, run the VMM on the
//! memory while watching the daemon connection, free.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::Instant;

use guest_mem::size::format_size;
use hugemem_client::client::Client;
use tracing::{info, warn};

use super::allocation::{memory_regions, HeldAllocation};
use super::command_line::Vmm;
use super::config::LaunchConfig;
use super::control::{ControlServer, ControlSocket};
use super::error::LaunchError;
use super::exit_event::ExitEvent;
use super::process;
use super::reattach;
pub use super::report::LaunchReport;
use super::update::{SuccessorMailbox, Updater};

/// Allocates, runs the VMM, waits, frees. Returns how the VMM ended; the
/// caller exits with [`VmmExit::shell_code`](super::VmmExit::shell_code).
///
/// Call from the main thread of a process that has started no other thread
/// that could take SIGTERM/SIGINT (see [`run_vmm`](crate::launch::run_vmm)):
/// it blocks them first of all, so that no thread started later takes one.
///
/// # Errors
///
/// Option, command-line, daemon and process errors; see [`LaunchError`].
/// Nothing is allocated when the command line is refused.
pub fn run(cfg: &LaunchConfig) -> Result<LaunchReport, LaunchError> {
    // Before any thread starts: every thread inherits the mask.
    let _signals = process::hold_forwarded_signals()?;
    if let Some(name) = &cfg.restore {
        return super::restore::run(cfg, name);
    }
    if let Some(name) = &cfg.clone_of {
        return super::clone::run(cfg, name);
    }
    let program = cfg
        .command
        .first()
        .ok_or_else(|| LaunchError::Options("no VMM command given after --".into()))?;
    // The VMM's adapter, picked once: everything particular to it goes
    // through it from here on.
    let vmm = cfg
        .vmm
        .or_else(|| Vmm::detect(program))
        .ok_or_else(|| LaunchError::UnknownVmm(program.clone()))?
        .adapter();
    let user_args = &cfg.command[1..];
    let opts = cfg.build_options();
    let request = cfg.alloc_request()?;
    // The daemon makes one region per part (one when no part is given).
    vmm.check_args(user_args, &opts, request.parts.len().max(1))?;
    // Bound before anything is allocated: a name in use is refused first.
    let control = bind_control(cfg)?;

    info!(
        size = %format_size(request.total_size),
        parts = request.parts.len(),
        socket = %cfg.socket.display(),
        "asking the daemon for guest RAM (populated and zeroed before the VMM starts)"
    );
    let started = Instant::now();
    let mut client = Client::connect(&cfg.socket)?;
    client.set_alloc_wait(cfg.alloc_wait);
    let alloc = client.alloc(request)?;
    let alloc_time = started.elapsed();
    let note = alloc.note.clone();
    if !note.is_empty() {
        warn!(%note, "the daemon's note on this allocation");
    }
    let page_sizes: Vec<u64> = alloc.regions.iter().map(|r| r.page_size).collect();
    info!(
        id = alloc.id,
        size = %format_size(alloc.size()),
        regions = alloc.regions.len(),
        page_sizes = ?page_sizes.iter().map(|p| format_size(*p)).collect::<Vec<_>>(),
        seconds = alloc_time.as_secs_f64(),
        "memory allocated"
    );
    let regions = memory_regions(&alloc, cfg.hugetlbfs)?;
    let argv = vmm.build_args(user_args, &regions, &opts)?;
    let mut full = Vec::with_capacity(argv.len() + 1);
    full.push(program.clone());
    full.extend(argv);
    let mailbox = Arc::new(
        SuccessorMailbox::new()
            .map_err(|e| LaunchError::Options(format!("cannot create an eventfd: {e}")))?,
    );
    let (mut server, update_fds) = match control {
        Some(control) => {
            let (switch, fds) = vmm.update_switch(cfg, &mut full)?;
            let updater = Updater::for_launch(cfg, switch, &alloc, &mailbox)?;
            info!(control = %control.path().display(), "listening for `hugemem update`");
            (Some(ControlServer::new(control, updater)), fds)
        }
        None => (None, Vec::new()),
    };
    let vmm = vmm.name();
    info!(command = ?full, "starting {vmm}");

    let inherit: Vec<BorrowedFd<'_>> = if cfg.hugetlbfs {
        Vec::new()
    } else {
        alloc.fds.iter().map(AsFd::as_fd).collect()
    };
    let held = HeldAllocation::of(&alloc);
    let socket = cfg.socket.as_path();
    let timeout = cfg.reattach_timeout;
    // The watcher owns the connection while the VMM runs and gives back the
    // one to FREE on (a new one after a daemon restart), if any.
    let (outcome, client) = process::run_vmm_watching(
        &full,
        &inherit,
        update_fds,
        Some(|exit: &ExitEvent| {
            reattach::watch(client, socket, &held, timeout, exit, Some(&mailbox))
        }),
        server.as_mut().map(|s| s as &mut dyn process::Supervisor),
    );
    drop(inherit);
    // The launcher's copies of the memory and the monitor go before FREE.
    drop(server);
    let size = alloc.size();
    let id = alloc.id;
    // Close our copies before FREE, so the daemon sees no holder but itself.
    drop(alloc);
    let parked_as = super::report::free_or_report_parked(client.flatten(), id);
    let (exit, vmm_time) = outcome?;
    let after = if parked_as.is_some() {
        "its memory parked"
    } else {
        "memory freed"
    };
    info!(exit = %exit, vmm_seconds = vmm_time.as_secs_f64(), "{vmm} exited; {after}");
    Ok(LaunchReport {
        exit,
        alloc: alloc_time,
        vmm: vmm_time,
        size,
        page_sizes,
        note,
        parked_as,
        restored: false,
        cloned: None,
        filled_first: false,
    })
}

/// The control socket for `hugemem update`, when asked for.
fn bind_control(cfg: &LaunchConfig) -> Result<Option<ControlSocket>, LaunchError> {
    cfg.control
        .as_deref()
        .map(ControlSocket::bind)
        .transpose()
        .map_err(|e| LaunchError::Options(format!("cannot listen for updates: {e}")))
}
