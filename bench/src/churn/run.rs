//! A churn end to end: the guest image, the baseline side, the floor side,
//! the private daemon and the hugemem side, and the report.

use std::ffi::OsString;
use std::process::{Command, Stdio};

use backend::client::Client;
use backend::daemon::{ByteSize, Config};
use guest_mem::size::format_size;
use hugemem::launch::Vmm;

use super::assemble::{report, HugememSide, Sides};
use super::error::{io_err, ChurnError};
use super::floor_side::floor_side;
use super::launches::{churn, warm_up};
use super::options::{ChurnConfig, ChurnVmm};
use super::pages::PagesAtStart;
use super::plan::{Plan, Side, MARKER, START_GPA, STRIDE};
use super::report::ChurnReport;
use crate::harness::serve::{ServeChild, ServeOptions};
use crate::private_dir::PrivateDir;
use crate::vmm_side::PerVmm;

/// Starts the run's private daemon on `socket` (default configuration;
/// pool target and limit at least `parallel` x `size`) and waits until it
/// answers.
fn start_daemon(
    launcher: &std::path::Path,
    socket: &std::path::Path,
    size: u64,
    parallel: usize,
) -> Result<ServeChild, ChurnError> {
    let defaults = Config::default();
    let hold = ByteSize(size.saturating_mul(parallel as u64));
    let opts = ServeOptions {
        socket: socket.to_path_buf(),
        pool: Some((
            defaults.pool.target.max(hold).0,
            defaults.pool.limit.max(hold).0,
        )),
        ..ServeOptions::default()
    };
    Ok(ServeChild::start(launcher, &opts)?)
}

fn choose_vmm(cfg: &ChurnConfig) -> Result<(ChurnVmm, OsString), ChurnError> {
    let qemu_runs = Command::new(&cfg.qemu)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    // Each VMM's program, or why it cannot run.
    let programs = PerVmm {
        qemu: qemu_runs
            .then(|| cfg.qemu.clone())
            .ok_or_else(|| format!("{} --version does not run", cfg.qemu.to_string_lossy())),
        cloud_hypervisor: cfg.cloud_hypervisor.clone().ok_or_else(|| {
            "--vmm cloud-hypervisor needs CLOUD_HYPERVISOR to name the binary".to_string()
        }),
    };
    // Unasked: the first VMM that runs here, else the micro-guest.
    let vmm = cfg.vmm.unwrap_or_else(|| {
        Vmm::ALL
            .into_iter()
            .find(|&vmm| programs.get(vmm).is_ok())
            .map_or(ChurnVmm::Micro, ChurnVmm::Launched)
    });
    let program = match vmm.kind() {
        Some(kind) => programs.get(kind).clone().map_err(ChurnError::Missing)?,
        None => OsString::new(),
    };
    Ok((vmm, program))
}

/// Runs the benchmark; `progress` gets one line per launch.
///
/// # Errors
///
/// See [`ChurnError`]; a launch whose guest does not run to a normal end
/// fails the run (a stale read does not: it is counted).
pub fn run(cfg: &ChurnConfig, progress: &mut dyn FnMut(&str)) -> Result<ChurnReport, ChurnError> {
    if cfg.vms == 0 || cfg.parallel == 0 || cfg.size == 0 || !cfg.size.is_multiple_of(STRIDE) {
        return Err(ChurnError::Options(
            "--vms and --parallel must be non-zero and --size a non-zero multiple of 2M".into(),
        ));
    }
    microguest::kvm_available().map_err(ChurnError::Missing)?;
    let (vmm, program) = choose_vmm(cfg)?;
    let dir =
        PrivateDir::create("hugemem-churn").map_err(io_err("cannot create a private directory"))?;
    let elf = dir.path().join("guest.elf");
    let image = microguest::pvh_elf(&microguest::PvhConfig {
        stride: STRIDE,
        marker: MARKER,
        start_gpa: START_GPA,
        ..Default::default()
    })
    .map_err(|e| ChurnError::Options(e.to_string()))?;
    std::fs::write(&elf, image).map_err(io_err(format!("cannot write {}", elf.display())))?;

    let pages = PagesAtStart::of(cfg)?;
    progress(&format!(
        "churn: {} x {} on {}, {} at once; expected page size {}; baseline, floor, then hugemem",
        cfg.vms,
        format_size(cfg.size),
        vmm.name(),
        cfg.parallel,
        pages.expected
    ));
    let mut plan = Plan {
        vmm,
        size: cfg.size,
        policy: cfg.page_policy,
        baseline_page: pages.baseline,
        socket: cfg.socket.clone().unwrap_or_default(),
        launcher: cfg.launcher.clone(),
        program,
        elf,
        cpus: std::thread::available_parallelism().map_or(1, usize::from),
        timeout: cfg.timeout,
        floor: None,
    };
    let base_warm = warm_up(&plan, Side::Baseline, progress)?;
    let baseline = churn(&plan, Side::Baseline, cfg.vms, cfg.parallel, progress)?;
    // Before the daemon, which at exact fit needs the floor's pages.
    let floor = floor_side(&mut plan, cfg, progress)?;

    let private: Option<ServeChild> = match &cfg.socket {
        Some(_) => None,
        None => {
            let socket = dir.path().join("hugemem.sock");
            let d = start_daemon(&cfg.launcher, &socket, cfg.size, cfg.parallel)?;
            plan.socket = socket;
            Some(d)
        }
    };
    let result = hugemem_side(&plan, cfg, progress);
    if let Some(d) = private {
        d.stop();
    }
    let hugemem = result?;
    Ok(report(
        cfg,
        vmm,
        &pages,
        Sides {
            base_warm,
            baseline,
            floor,
            hugemem,
        },
    ))
}

fn hugemem_side(
    plan: &Plan,
    cfg: &ChurnConfig,
    progress: &mut dyn FnMut(&str),
) -> Result<HugememSide, ChurnError> {
    let warm = warm_up(plan, Side::Hugemem, progress)?;
    let before = Client::connect(&plan.socket)?.stats_json()?;
    let launches = churn(plan, Side::Hugemem, cfg.vms, cfg.parallel, progress)?;
    let after = Client::connect(&plan.socket)?.stats_json()?;
    Ok(HugememSide {
        warm,
        before,
        after,
        launches,
    })
}
