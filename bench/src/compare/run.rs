//! The comparison end to end: the guest image, the private daemon, every
//! variant `reps` times, and the report.

use std::collections::BTreeMap;

use guest_mem::size::format_size;
use guest_mem::SharedMapping;

use super::bench::{Bench, Group};
use super::config::{CompareConfig, MARKER, START_GPA, STRIDE};
use super::error::CompareError;
use super::results::CompareReport;
use super::vmm::*;
use crate::harness::rounds;
use crate::private_dir::PrivateDir;

/// Runs the benchmark. `progress` gets one line per step.
///
/// # Errors
///
/// See [`CompareError`]. A variant whose guest does not report clean memory
/// and a clean power-off fails the run.
pub fn run(
    cfg: &CompareConfig,
    progress: &mut dyn FnMut(&str),
) -> Result<CompareReport, CompareError> {
    if cfg.size == 0 || cfg.reps == 0 || !cfg.size.is_multiple_of(2 << 20) {
        return Err(CompareError::Size);
    }
    let len = usize::try_from(cfg.size).map_err(|_| CompareError::Size)?;
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    let prealloc_threads = cfg.prealloc_threads.unwrap_or(cpus).max(1);

    let kvm = microguest::kvm_available();
    let qemu_version = version(&cfg.qemu);
    let ch_version = cfg.cloud_hypervisor.as_ref().map(version);
    let skipped = skip_reasons(&kvm, &qemu_version, ch_version.as_ref());

    let mut notes = Vec::new();
    let (page, _reservation) = reserve(cfg.size, cfg.page_size, &mut notes)?;
    let note = (!notes.is_empty()).then(|| notes.join("; "));

    let dir = PrivateDir::create("hugemem-compare").map_err(|source| CompareError::WorkDir {
        path: std::env::temp_dir(),
        source,
    })?;
    let elf = dir.path().join("guest.elf");
    let image = microguest::pvh_elf(&microguest::PvhConfig {
        stride: STRIDE,
        marker: MARKER,
        start_gpa: START_GPA,
        ..Default::default()
    })?;
    std::fs::write(&elf, image).map_err(|source| CompareError::WorkDir {
        path: elf.clone(),
        source,
    })?;

    progress(&format!(
        "{} on {page} pages, {cpus} CPU(s), prealloc-threads={prealloc_threads}, {} repetition(s){}",
        format_size(cfg.size),
        cfg.reps,
        note.as_deref()
            .map(|n| format!(" (note: {n})"))
            .unwrap_or_default()
    ));
    for (v, why) in &skipped {
        progress(&format!("{} skipped: {why}", v.key()));
    }
    rounds::warm_up(progress, "populating and freeing the pages once", || {
        SharedMapping::memfd(len, page)?.populate_write(0, len)
    })?;

    let mut bench = Bench {
        size: cfg.size,
        page,
        cpus,
        prealloc_threads,
        socket: dir.path().join("hugemem.sock"),
        elf,
        programs: crate::vmm_side::PerVmm {
            qemu: qemu_version.is_ok().then(|| cfg.qemu.clone()),
            cloud_hypervisor: match &ch_version {
                Some(Ok(_)) => cfg.cloud_hypervisor.clone(),
                _ => None,
            },
        },
        skipped,
        samples: BTreeMap::new(),
        scrub: Vec::new(),
        resident: Vec::new(),
        pool_holes: cfg.pool_holes,
        refault_ahead: cfg.refault_ahead,
        progress,
    };
    rounds::each(cfg.reps, |round| {
        (bench.progress)(&format!("repetition {round}"));
        for group in round.alternate(vec![Group::Own, Group::Hugemem, Group::Floor]) {
            bench.group(group, round)?;
        }
        Ok::<_, CompareError>(())
    })?;
    drop(dir);
    Ok(bench.report(
        cfg.reps,
        note,
        qemu_version.ok(),
        ch_version.and_then(Result::ok),
    ))
}
