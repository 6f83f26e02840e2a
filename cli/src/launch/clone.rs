//! `hugemem launch --clone-of NAME [--clone-mode shared] -- VMM …`: a new
//! VM started from the VM parked as NAME (its template), which stays
//! parked, unchanged, for any number of clones.
//!
//! The VMM's adapter takes the template from the daemon and makes the
//! process's command line before it runs (`VmmClone::prepare`;
//! cloud-hypervisor's: `vmm/cloud_hypervisor/clone.rs`). Once the process
//! started, the launcher's watcher thread has the adapter's receiver start
//! the clone (shared mode; a copy clone is a restore, `restore.rs`).
//! The launcher keeps its daemon connection open while the
//! clone runs: the daemon counts the clone against its template for as
//! long (RESTORE and UNPARK of the template are refused meanwhile). A
//! shared clone has no allocation of its own: nothing is freed at the end.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hugemem_client::client::Client;
use hugemem_client::proto::CloneMode;
use tracing::{info, warn};

use super::command_line::Vmm;
use super::config::LaunchConfig;
use super::error::LaunchError;
use super::process;
use super::report::{say_replaced, LaunchReport};

/// Starts a clone of the VM parked under `name` in the VMM of
/// `cfg.command` (`cfg.clone_mode`), supervises it, and returns when it
/// ends. A copy clone is a restore of fresh memory filled from the
/// template (RESTORE with COPY, `restore.rs`); a shared one maps the
/// template (below).
///
/// # Errors
///
/// [`LaunchError`]: options, the daemon's refusal, the process;
/// [`LaunchError::Unsupported`] for a VMM that cannot clone yet.
pub fn run(cfg: &LaunchConfig, name: &str) -> Result<LaunchReport, LaunchError> {
    match cfg.clone_mode {
        CloneMode::Copy => super::restore::run(cfg, name),
        CloneMode::Shared => run_shared(cfg, name, CloneMode::Shared),
    }
}

/// A shared clone (see [`run`]).
fn run_shared(
    cfg: &LaunchConfig,
    name: &str,
    mode: CloneMode,
) -> Result<LaunchReport, LaunchError> {
    let program = cfg.command.first().cloned().unwrap_or_default();
    let adapter = cfg
        .vmm
        .or_else(|| Vmm::detect(&program))
        .ok_or_else(|| {
            LaunchError::Options(
                "--clone-of runs the template's VMM (cloud-hypervisor or qemu-system-*): name it after -- or with --vmm".into(),
            )
        })?
        .adapter();
    let vmm_clone = adapter.clone()?;
    let vmm = adapter.name();
    let private = tempfile::Builder::new()
        .prefix("hugemem-clone-")
        .tempdir()
        .map_err(|e| LaunchError::Options(format!("cannot make a private directory: {e}")))?;
    let started = Instant::now();
    let mut client = Client::connect(&cfg.socket)?;
    let launch = vmm_clone.prepare(cfg, private.path(), &mut client, (name, mode))?;
    let (bytes, page_size) = (launch.bytes, launch.page_size);
    // Before the guest runs.
    say_replaced(name, launch.replaced.iter().map(String::as_str));
    let mut receiver = launch.receiver;
    let ran: Arc<Mutex<Option<Duration>>> = Arc::default();
    let watch_ran = Arc::clone(&ran);
    info!(name, mode = mode.name(), command = ?launch.argv, "starting {vmm} as a clone of a parked VM");
    let (outcome, _client) = process::run_vmm_watching(
        &launch.argv,
        &[],
        launch.inherit,
        Some(move |_exit: &super::exit_event::ExitEvent| {
            if let Err(e) = receiver.start() {
                warn!(name, error = %e, "the clone did not start; stopping {vmm} (the template stays parked)");
                receiver.stop();
                return client;
            }
            let took = started.elapsed();
            if let Ok(mut r) = watch_ran.lock() {
                *r = Some(took);
            }
            let ms = took.as_secs_f64() * 1e3;
            info!(
                name,
                mode = mode.name(),
                ms,
                "cloned: the clone runs in the new {vmm}; the template stays parked"
            );
            // Held until the VMM ends: the daemon counts the clone while
            // this connection lasts.
            client
        }),
        None,
    );
    let took = ran.lock().ok().and_then(|r| *r);
    let (exit, vmm_time) = outcome?;
    let Some(took) = took else {
        return Err(LaunchError::Options(format!(
            "the clone of {name} did not start; {vmm} ended with {exit}"
        )));
    };
    Ok(LaunchReport {
        exit,
        alloc: took,
        vmm: vmm_time,
        size: bytes,
        page_sizes: vec![page_size],
        note: String::new(),
        parked_as: None,
        restored: false,
        cloned: Some(mode),
        filled_first: false,
    })
}
