//! One VMM run, timed from outside, and the checks of its output.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::os::fd::BorrowedFd;
use std::process::{Command, Stdio};
use std::time::Instant;

use backend::proto::RegionInfo;
use guest_mem::size::format_size;
use guest_mem::vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
use guest_mem::{PageSize, Reservation};

use super::config::{MARKER, STRIDE, VMM_DEADLINE};
use super::error::CompareError;
use super::variant::{Runner, Variant};
use crate::harness::vmm::{run_to_end, Stop, VmmRun, VmmRunError};
use crate::vmm_side::PerVmm;

/// One repetition of one variant.
#[derive(Debug, Clone)]
pub(super) struct Sample {
    pub(super) ready: f64,
    pub(super) first_instruction: f64,
    /// Launch to the guest's all-pages-touched mark (`None`: not seen).
    pub(super) touched: Option<f64>,
    pub(super) poweroff: f64,
    pub(super) alloc: Option<f64>,
    pub(super) guest: Option<String>,
}

/// Picks the page size for every variant and reserves `size / page` pages.
pub(super) fn reserve(
    size: u64,
    only: Option<PageSize>,
    notes: &mut Vec<String>,
) -> Result<(PageSize, Reservation), CompareError> {
    let candidates: Vec<PageSize> = match only {
        Some(p) => vec![p],
        None => vec![PageSize::Huge1G, PageSize::Huge2M],
    };
    for page in candidates {
        if !page.is_huge() {
            notes.push("4K pages are not compared: the QEMU baseline is hugetlb".into());
            continue;
        }
        if !size.is_multiple_of(page.bytes()) {
            notes.push(format!(
                "{} is not a multiple of {page} pages",
                format_size(size)
            ));
            continue;
        }
        let want = size / page.bytes();
        match Reservation::for_run(page, want) {
            Ok(r) if r.report().met => {
                if !notes.is_empty() {
                    notes.push(format!(
                        "so the QEMU baseline (hugetlbsize={page}), cloud-hypervisor and hugemem all use {page} pages"
                    ));
                }
                return Ok((page, r));
            }
            Ok(r) => notes.push(format!(
                "{} needs {want} free {page} pages, the kernel has {}",
                format_size(size),
                r.report().free
            )),
            Err(e) => notes.push(format!("cannot reserve {page} pages: {e}")),
        }
    }
    Err(CompareError::NoPages(notes.join("; ")))
}

/// First line of `program --version`, or why not.
pub(super) fn version(program: &OsString) -> Result<String, String> {
    match Command::new(program)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
    {
        Ok(o) if o.status.success() => Ok(String::from_utf8_lossy(&o.stdout)
            .lines()
            .next()
            .unwrap_or("")
            .trim()
            .to_string()),
        Ok(o) => Err(format!(
            "{} --version failed ({})",
            program.to_string_lossy(),
            o.status
        )),
        Err(e) => Err(format!("{} not found: {e}", program.to_string_lossy())),
    }
}

/// Runs `argv` to its end (`crate::harness::vmm`), `inherit` open in it
/// under their numbers, timed from `t0`; killed after [`VMM_DEADLINE`].
pub(super) fn run_vmm_timed(
    argv: &[OsString],
    inherit: &[BorrowedFd<'_>],
    t0: Instant,
) -> Result<VmmRun, CompareError> {
    let stop = Stop {
        after: VMM_DEADLINE,
        grace: None,
    };
    run_to_end(argv, inherit, t0, stop).map_err(|e| match e {
        VmmRunError::Spawn { program, source } => CompareError::Spawn { program, source },
        other => CompareError::Wait(std::io::Error::other(other.to_string())),
    })
}

/// Checks a VMM run (exit status, the guest's report, the port marks) and
/// turns it into a sample.
pub(super) fn check_vmm(
    v: Variant,
    run: &VmmRun,
    alloc: Option<f64>,
) -> Result<Sample, CompareError> {
    let fail = |why: String| CompareError::Failed {
        variant: v.key(),
        why,
    };
    let line = run
        .guest_line()
        .ok_or_else(|| fail(format!("no guest report: {}", run.describe())))?;
    if !line.contains(" nonzero=0") {
        return Err(fail(format!("the guest read non-zero memory: {line}")));
    }
    // QEMU's isa-debug-exit: the guest writes 0, QEMU exits (0 << 1) | 1.
    let exit_ok = match v.runner() {
        Runner::Vmm(vmm) => run.status.code() == Some(vmm.adapter().exit_status_of_guest(0)),
        Runner::Client => run.status.success(),
    };
    if !exit_ok {
        return Err(fail(format!("unexpected exit: {}", run.describe())));
    }
    let first = run
        .ready
        .ok_or_else(|| fail(format!("no first-instruction mark: {}", run.describe())))?;
    let ready = if v == Variant::QemuLazy {
        run.touched
            .ok_or_else(|| fail(format!("no all-pages-touched mark: {}", run.describe())))?
    } else {
        first
    };
    Ok(Sample {
        ready: ready.as_secs_f64(),
        first_instruction: first.as_secs_f64(),
        touched: run.touched.map(|d| d.as_secs_f64()),
        poweroff: run.elapsed.as_secs_f64(),
        alloc,
        guest: Some(line.to_string()),
    })
}

/// The client variant: map the allocation like a rust-vmm VMM and run the
/// micro-guest on it under KVM.
pub(super) fn run_client(
    v: Variant,
    regions: &[RegionInfo],
    fds: &[BorrowedFd<'_>],
    t0: Instant,
    alloc_s: Option<f64>,
) -> Result<Sample, CompareError> {
    // The mapping leaves [3 GiB, 4 GiB) free (a region crossing 3 GiB
    // becomes two vm-memory regions), so each region maps as it is.
    let mem = backend::guest_memory::guest_memory_from_fds(regions, fds)?;
    let mut ram = Vec::with_capacity(mem.num_regions());
    for r in mem.iter() {
        let len = usize::try_from(r.len()).map_err(|_| CompareError::Size)?;
        // SAFETY: `r.as_ptr() .. + len` is the live read-write shared mapping
        // vm-memory made for this region; `mem` outlives `ram` (both die at
        // the end of this function, `ram` first), and no Rust reference to
        // the memory exists while the guest runs.
        ram.push(unsafe {
            microguest::GuestRam::from_raw_parts(r.as_ptr(), len, r.start_addr().0)
        });
    }
    // RAM leaves [3 GiB, 4 GiB) free, so the runner's default control slot
    // (4 GiB - 1 MiB) does not collide with it.
    let cfg = microguest::RunConfig {
        stride: STRIDE,
        marker: MARKER,
        start_gpa: 0,
        ..Default::default()
    };
    let run_started = t0.elapsed();
    let report = microguest::run(&ram, &cfg)?;
    let poweroff = t0.elapsed();
    drop(ram);
    drop(mem);
    if report.saw_nonzero {
        return Err(CompareError::Failed {
            variant: v.key(),
            why: format!("the guest read non-zero memory: {}", report.serial.trim()),
        });
    }
    let first = run_started + report.setup + report.first_instruction;
    let touched = run_started + report.setup + report.all_touched;
    Ok(Sample {
        ready: first.as_secs_f64(),
        first_instruction: first.as_secs_f64(),
        touched: Some(touched.as_secs_f64()),
        poweroff: poweroff.as_secs_f64(),
        alloc: alloc_s,
        guest: Some(report.serial.trim().to_string()),
    })
}

/// Why each variant cannot run here, from what is installed.
pub(super) fn skip_reasons(
    kvm: &Result<(), String>,
    qemu: &Result<String, String>,
    ch: Option<&Result<String, String>>,
) -> BTreeMap<Variant, String> {
    let mut skipped = BTreeMap::new();
    let vmm_missing = PerVmm {
        qemu: qemu.as_ref().err().cloned(),
        cloud_hypervisor: match ch {
            None => Some("CLOUD_HYPERVISOR does not name a cloud-hypervisor binary".to_string()),
            Some(r) => r.as_ref().err().cloned(),
        },
    };
    for v in Variant::ALL {
        let why = if let Err(e) = kvm {
            Some(format!("no usable KVM: {e}"))
        } else {
            match v.runner() {
                Runner::Vmm(vmm) => vmm_missing.get(vmm).clone(),
                Runner::Client => None,
            }
        };
        if let Some(why) = why {
            skipped.insert(v, why);
        }
    }
    skipped
}
