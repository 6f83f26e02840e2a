//! A churn end to end: the guest image, the baseline side, the private
//! daemon and the hugemem side, and the report.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Mutex};

use backend::client::Client;
use backend::daemon::{ByteSize, Config};
use backend::proto::PagePolicy;
use guest_mem::size::format_size;
use guest_mem::{PageSize, PoolCounts};
use hugemem_client::stats::Stats;

use super::error::{io_err, launch_error, ChurnError};
use super::options::{ChurnConfig, ChurnVmm};
use super::plan::{policy_text, Plan, Side, MARKER, START_GPA, STRIDE};
use super::report::{page_key, ChurnReport, LaunchSample, SpanReport, Spread};
use crate::private_dir::PrivateDir;
use crate::serve_child::{ServeChild, ServeOptions};

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

/// The untimed first launch of a side.
fn warm_up(
    plan: &Plan,
    side: Side,
    progress: &mut dyn FnMut(&str),
) -> Result<LaunchSample, ChurnError> {
    let warm = plan
        .launch(side)
        .map_err(launch_error(side, "warm-up".into()))?;
    progress(&format!(
        "{} warm-up launch: {:.1} ms{}",
        side.name(),
        warm.ms,
        pages_text(&warm.page_sizes)
    ));
    Ok(warm)
}

/// `vms` timed launches, `parallel` at once, in start order. Every guest
/// must end normally.
fn churn(
    plan: &Plan,
    side: Side,
    vms: usize,
    parallel: usize,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<LaunchSample>, ChurnError> {
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let results: Mutex<Vec<Option<Result<LaunchSample, String>>>> =
        Mutex::new((0..vms).map(|_| None).collect());
    let (tx, rx) = mpsc::channel::<String>();
    std::thread::scope(|s| {
        for _ in 0..parallel.min(vms) {
            let tx = tx.clone();
            let (next, stop, results) = (&next, &stop, &results);
            s.spawn(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= vms || stop.load(Ordering::Relaxed) {
                    return;
                }
                let r = plan.launch(side);
                let line = match &r {
                    Ok(x) => format!(
                        "{} launch {}/{vms}: {:.1} ms{}{}",
                        side.name(),
                        i + 1,
                        x.ms,
                        pages_text(&x.page_sizes),
                        if x.stale { ", STALE READ" } else { "" }
                    ),
                    Err(e) => {
                        stop.store(true, Ordering::Relaxed);
                        format!("{} launch {}/{vms} failed: {e}", side.name(), i + 1)
                    }
                };
                let _ = tx.send(line);
                if let Ok(mut g) = results.lock() {
                    g[i] = Some(r);
                }
            });
        }
        drop(tx);
        for line in rx {
            progress(&line);
        }
    });
    let results = results
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut out = Vec::with_capacity(vms);
    for (i, r) in results.into_iter().enumerate() {
        match r {
            Some(Ok(x)) => out.push(x),
            Some(Err(why)) => return Err(launch_error(side, (i + 1).to_string())(why)),
            None => {}
        }
    }
    if out.len() != vms {
        return Err(launch_error(side, "?".into())(
            "stopped after another launch failed".into(),
        ));
    }
    Ok(out)
}

fn pages_text(sizes: &[u64]) -> String {
    if sizes.is_empty() {
        String::new()
    } else {
        format!(" on {} pages", page_key(sizes))
    }
}

/// Pages of `page` the host has for new allocations: free in the kernel,
/// plus idle (not in use) in the daemon's pools per `stats`.
fn pages_on_hand(page: PageSize, stats: Option<&Stats>) -> u64 {
    let free = PoolCounts::read(page, None)
        .ok()
        .flatten()
        .map_or(0, |c| c.available());
    let idle: u64 = stats.map_or(0, |s| {
        s.pools
            .iter()
            .filter(|p| p.page_size == page.to_string())
            .map(|p| p.clean_bytes + p.dirty_bytes + p.quarantined_bytes)
            .sum()
    });
    free + idle / page.bytes()
}

/// The largest page the policy allows (and that divides the size) of which
/// the host has enough for `parallel` launches; 4K when none.
fn expected_page(cfg: &ChurnConfig, stats: Option<&Stats>) -> PageSize {
    let candidates: Vec<PageSize> = match cfg.page_policy {
        PagePolicy::Best => vec![PageSize::Huge1G, PageSize::Huge2M],
        PagePolicy::Huge1G => return PageSize::Huge1G,
        PagePolicy::Huge2M => return PageSize::Huge2M,
        PagePolicy::Base4K => return PageSize::Base4K,
    };
    let want = |p: PageSize| cfg.size / p.bytes() * cfg.parallel as u64;
    candidates
        .into_iter()
        .filter(|p| cfg.size.is_multiple_of(p.bytes()))
        .find(|&p| pages_on_hand(p, stats) >= want(p))
        .unwrap_or(PageSize::Base4K)
}

/// The daemon's `downgrades` counter; `None` from a daemon whose STATS has
/// none (read by key: the typed `Counters` would say 0).
fn downgrade_counter(stats: &serde_json::Value) -> Option<u64> {
    stats.get("counters")?.get("downgrades")?.as_u64()
}

fn choose_vmm(cfg: &ChurnConfig) -> Result<(ChurnVmm, OsString), ChurnError> {
    let qemu_runs = || {
        Command::new(&cfg.qemu)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    let vmm = match cfg.vmm {
        Some(v) => v,
        None if cfg.cloud_hypervisor.is_some() => ChurnVmm::CloudHypervisor,
        None if qemu_runs() => ChurnVmm::Qemu,
        None => ChurnVmm::Micro,
    };
    let program = match vmm {
        ChurnVmm::CloudHypervisor => cfg.cloud_hypervisor.clone().ok_or_else(|| {
            ChurnError::Missing(
                "--vmm cloud-hypervisor needs CLOUD_HYPERVISOR to name the binary".into(),
            )
        })?,
        ChurnVmm::Qemu if !qemu_runs() => {
            return Err(ChurnError::Missing(format!(
                "{} --version does not run",
                cfg.qemu.to_string_lossy()
            )))
        }
        ChurnVmm::Qemu => cfg.qemu.clone(),
        ChurnVmm::Micro => OsString::new(),
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
        "churn: {} x {} on {}, {} at once; expected page size {}; baseline first",
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
    };
    let base_warm = warm_up(&plan, Side::Baseline, progress)?;
    let baseline = churn(&plan, Side::Baseline, cfg.vms, cfg.parallel, progress)?;

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
            hugemem,
        },
    ))
}

/// The page sizes a run can expect, from the host's (or the live daemon's)
/// pages at the start.
struct PagesAtStart {
    /// What the hugemem side should get.
    expected: PageSize,
    /// What the baseline preallocates.
    baseline: PageSize,
    /// How many of these VMs the pages hold: 1 is an exact fit, 2 or more
    /// leaves pages to spare.
    host_vm_fits: u64,
}

impl PagesAtStart {
    fn of(cfg: &ChurnConfig) -> Result<Self, ChurnError> {
        let live_stats = match &cfg.socket {
            Some(s) => Some(Client::connect(s)?.stats()?),
            None => None,
        };
        let expected = expected_page(cfg, live_stats.as_ref());
        let host_vm_fits = if expected.is_huge() {
            pages_on_hand(expected, live_stats.as_ref()) / (cfg.size / expected.bytes()).max(1)
        } else {
            0
        };
        let baseline = match (expected, cfg.page_policy) {
            (PageSize::Base4K, _) | (_, PagePolicy::Base4K) => {
                return Err(ChurnError::Missing(format!(
                    "the baseline preallocates huge pages, and the host has neither {} x 1G nor {} x 2M free for {} launch(es) at once",
                    cfg.size >> 30,
                    cfg.size >> 21,
                    cfg.parallel
                )))
            }
            (p, _) => p,
        };
        Ok(Self {
            expected,
            baseline,
            host_vm_fits,
        })
    }
}

/// The hugemem side's launches, with the daemon's STATS around the timed ones.
struct HugememSide {
    warm: LaunchSample,
    before: serde_json::Value,
    after: serde_json::Value,
    launches: Vec<LaunchSample>,
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

/// Both sides' launches.
struct Sides {
    base_warm: LaunchSample,
    baseline: Vec<LaunchSample>,
    hugemem: HugememSide,
}

/// The report of a run whose launches all ended normally.
fn report(cfg: &ChurnConfig, vmm: ChurnVmm, pages: &PagesAtStart, sides: Sides) -> ChurnReport {
    let Sides {
        base_warm,
        baseline,
        hugemem:
            HugememSide {
                warm,
                before,
                after,
                launches,
            },
    } = sides;
    let expected = pages.expected;
    let (downgrades, source) = match (downgrade_counter(&before), downgrade_counter(&after)) {
        (Some(b), Some(a)) => (a.saturating_sub(b), "daemon"),
        _ => (
            launches
                .iter()
                .filter(|l| l.page_sizes.iter().any(|&p| p < expected.bytes()))
                .count() as u64,
            "replies",
        ),
    };
    let mut page_sizes = BTreeMap::new();
    for l in &launches {
        *page_sizes.entry(page_key(&l.page_sizes)).or_insert(0) += 1;
    }
    let (h, b) = (Spread::of(&launches), Spread::of(&baseline));
    let ready = SpanReport::of(&launches, &baseline, |l| l.ready_ms);
    let touched = SpanReport::of(&launches, &baseline, |l| l.touched_ms);
    let allocs: Vec<f64> = launches.iter().filter_map(|l| l.alloc_ms).collect();
    ChurnReport {
        vmm,
        vms: cfg.vms,
        parallel: cfg.parallel,
        size_bytes: cfg.size,
        page_policy: policy_text(cfg.page_policy).into(),
        daemon: cfg
            .socket
            .as_ref()
            .map_or_else(|| "private".into(), |s| s.display().to_string()),
        expected_page_size: expected.to_string(),
        page_sizes,
        downgrades,
        downgrades_source: source,
        stale_reads: launches.iter().filter(|l| l.stale).count(),
        baseline_stale_reads: baseline.iter().filter(|l| l.stale).count(),
        p50_ms: h.p50,
        p99_ms: h.p99,
        max_ms: h.max,
        alloc_p50_ms: crate::stats::median(&allocs),
        baseline_p50_ms: b.p50,
        baseline_p99_ms: b.p99,
        baseline_max_ms: b.max,
        baseline_page_size: pages.baseline.to_string(),
        speedup_p50: crate::stats::ratio(b.p50, h.p50),
        speedup_p99: crate::stats::ratio(b.p99, h.p99),
        p99_over_p50: crate::stats::ratio(h.p99, h.p50),
        host_vm_fits: pages.host_vm_fits,
        ready,
        touched,
        warmup_ms: warm.ms,
        warmup_page_sizes: warm.page_sizes,
        baseline_warmup_ms: base_warm.ms,
        launches,
        baseline,
    }
}
