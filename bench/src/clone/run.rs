//! The run: the plan, then for each page size and template size the shared
//! phase, the copy phase with the floor, and cloud-hypervisor's own
//! restores (QEMU's own saves and restores with `--vmm qemu`). The
//! repetitions are `harness::rounds`'.

use std::path::Path;
use std::time::Duration;

use guest_mem::PageSize;

use super::ch_restore::ch_restores;
use super::phases::Phase;
use super::plan::{host_budget, CloneConfig, Combination, Plan};
use super::qemu_own::qemu_restores;
use super::report::{CloneReport, StartResult, TemplateCheck};
use super::starts::kernel_pages;
use crate::harness::rounds;
use crate::private_dir::PrivateDir;
use crate::vmm_update::error::{io, VmmUpdateError};
use crate::vmm_update::guest::host_tsc_hz;
use crate::vmm_update::setup::{reserve_pages, write_spin_elf};

/// The plan `cfg` gives on this host.
pub fn plan(cfg: &CloneConfig) -> (Plan, Vec<(PageSize, u64)>) {
    let budget = cfg.budget.clone().unwrap_or_else(host_budget);
    (
        Plan::new(&cfg.page_sizes, &cfg.sizes, &cfg.counts, &budget),
        budget,
    )
}

/// An empty result for one kind of start.
fn result(c: &Combination, mode: &str, start: &str) -> StartResult {
    StartResult {
        page_size: c.page_size.to_string(),
        size: c.size,
        count: c.count,
        mode: mode.into(),
        start: start.into(),
        ..StartResult::default()
    }
}

/// Runs the bench.
///
/// # Errors
///
/// [`VmmUpdateError`]: no KVM or huge pages, or a step failed (a
/// cloud-hypervisor restore mode that fails is a note instead).
pub fn run(
    cfg: &CloneConfig,
    progress: &mut dyn FnMut(&str),
) -> Result<CloneReport, VmmUpdateError> {
    if cfg.reps == 0 {
        return Err(VmmUpdateError::Setup("--reps must be at least 1".into()));
    }
    microguest::kvm_available().map_err(VmmUpdateError::Setup)?;
    let (plan, budget) = plan(cfg);
    for l in &plan.left_out {
        progress(&format!(
            "left out: {} clones of {} on {} pages: {}",
            l.combination.count,
            guest_mem::size::format_size(l.combination.size),
            l.combination.page_size,
            l.why
        ));
    }
    let dir = PrivateDir::create_in(&cfg.dir, "hugemem-bench-clone")
        .map_err(io(format!("a directory under {}", cfg.dir.display())))?;
    let elf = dir.path().join("spin.elf");
    write_spin_elf(&elf, host_tsc_hz(Duration::from_millis(200)))?;
    let mut report = CloneReport {
        config: cfg.clone(),
        budget: budget.iter().map(|(p, b)| (p.to_string(), *b)).collect(),
        left_out: plan.left_out.clone(),
        starts: Vec::new(),
        templates: Vec::new(),
        ch_restore: Vec::new(),
        qemu_restore: Vec::new(),
        notes: Vec::new(),
    };
    for &page in &cfg.page_sizes {
        let peak = plan.peak(page);
        if peak == 0 {
            continue;
        }
        let _pages = reserve_pages(peak, page).map_err(VmmUpdateError::Setup)?;
        for &size in &cfg.sizes {
            let combos: Vec<Combination> = plan
                .run
                .iter()
                .filter(|c| c.page_size == page && c.size == size)
                .copied()
                .collect();
            if combos.is_empty() {
                continue;
            }
            one_size(cfg, dir.path(), &elf, &combos, &mut report, progress);
            let of = (size, page);
            match cfg.vmm {
                hugemem::launch::Vmm::CloudHypervisor => {
                    report
                        .ch_restore
                        .extend(ch_restores(cfg, dir.path(), &elf, of, progress))
                }
                hugemem::launch::Vmm::Qemu => {
                    report
                        .qemu_restore
                        .extend(qemu_restores(cfg, dir.path(), &elf, of, progress))
                }
            }
        }
    }
    Ok(report)
}

/// Both phases for one template size, its combinations `combos`. A phase
/// that fails (a template the launcher cannot clone) is a note in the
/// report, and the run goes on.
fn one_size(
    cfg: &CloneConfig,
    dir: &Path,
    elf: &Path,
    combos: &[Combination],
    report: &mut CloneReport,
    progress: &mut dyn FnMut(&str),
) {
    let (size, page) = (combos[0].size, combos[0].page_size);
    let label = format!("{} on {page} pages", guest_mem::size::format_size(size));
    let kernel = |when: &str| {
        let (free, reserved) = kernel_pages(page);
        format!(
            "{label}: {when}, the kernel has {} of {page} pages free, {} of them reserved",
            guest_mem::size::format_size(free),
            guest_mem::size::format_size(reserved)
        )
    };
    progress(&kernel("before the shared phase"));
    match shared_phase(cfg, (dir, elf), combos, progress) {
        Ok((starts, template)) => {
            report.starts.extend(starts);
            report.templates.push(template);
        }
        Err(e) => {
            progress(&format!("{label}: shared clones failed: {e}"));
            report
                .notes
                .push(format!("{label}: shared clones not measured: {e}"));
        }
    }
    progress(&kernel("after the shared phase"));
    match copy_phase(cfg, (dir, elf), combos, progress) {
        Ok((starts, template)) => {
            report.starts.extend(starts);
            report.templates.push(template);
        }
        Err(e) => {
            progress(&format!("{label}: copy clones failed: {e}"));
            report.notes.push(format!(
                "{label}: copy clones and restores from the park not measured: {e}"
            ));
        }
    }
    progress(&kernel("after the copy phase"));
}

/// What a phase gives: its starts and its template's check.
type PhaseResult = Result<(Vec<StartResult>, TemplateCheck), VmmUpdateError>;

/// The shared phase: the pool holds the template alone.
fn shared_phase(
    cfg: &CloneConfig,
    (dir, elf): (&Path, &Path),
    combos: &[Combination],
    progress: &mut dyn FnMut(&str),
) -> PhaseResult {
    let (size, page) = (combos[0].size, combos[0].page_size);
    let most = combos.iter().map(|c| c.count).max().unwrap_or(1);
    let label = guest_mem::size::format_size(size);
    let mut shared: Vec<[StartResult; 2]> = combos
        .iter()
        .map(|c| {
            [
                result(c, "shared", "one_at_a_time"),
                result(c, "shared", "at_once"),
            ]
        })
        .collect();
    let mut phase = Phase::start(cfg, dir, elf, (size, page, size, most), "shared")?;
    rounds::each::<VmmUpdateError>(cfg.reps, |round| {
        for (c, [one, all]) in combos.iter().zip(shared.iter_mut()) {
            phase.shared_rep(c.count, one, all)?;
            progress(&format!(
                "{label} repetition {round}: {} shared clone(s): one at a time p50 {:.1} ms, at once p95 {:.1} ms",
                c.count, one.running_ms.p50, all.running_ms.p95
            ));
        }
        Ok(())
    })?;
    let template = phase.finish()?;
    Ok((shared.into_iter().flatten().collect(), template))
}

/// The copy phase with the floor: the template and `most` copies.
fn copy_phase(
    cfg: &CloneConfig,
    (dir, elf): (&Path, &Path),
    combos: &[Combination],
    progress: &mut dyn FnMut(&str),
) -> PhaseResult {
    let (size, page) = (combos[0].size, combos[0].page_size);
    let most = combos.iter().map(|c| c.count).max().unwrap_or(1);
    let label = guest_mem::size::format_size(size);
    let mut copy: Vec<[StartResult; 4]> = combos
        .iter()
        .map(|c| {
            [
                result(c, "copy", "one_at_a_time"),
                result(c, "copy", "at_once"),
                result(c, "park", "one_at_a_time"),
                result(c, "park", "at_once"),
            ]
        })
        .collect();
    let pool = size * (most as u64 + 1);
    let mut phase = Phase::start(cfg, dir, elf, (size, page, pool, most), "copy")?;
    rounds::each::<VmmUpdateError>(cfg.reps, |round| {
        for (c, [a, b, f1, f2]) in combos.iter().zip(copy.iter_mut()) {
            phase.copy_rep(c.count, [&mut *a, &mut *b, &mut *f1, &mut *f2])?;
            progress(&format!(
                "{label} repetition {round}: {} copy clone(s) one at a time p50 {:.1} ms, at once p95 {:.1} ms; restores from the park one at a time p50 {:.1} ms, at once p95 {:.1} ms",
                c.count, a.running_ms.p50, b.running_ms.p95, f1.running_ms.p50, f2.running_ms.p95
            ));
        }
        Ok(())
    })?;
    let template = phase.finish()?;
    Ok((copy.into_iter().flatten().collect(), template))
}
