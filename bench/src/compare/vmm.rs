//! One VMM run, timed from outside, and the checks of its output.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::Read;
use std::os::fd::BorrowedFd;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use backend::proto::RegionInfo;
use guest_mem::size::format_size;
use guest_mem::vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
use guest_mem::{PageSize, Reservation};

use super::config::{DONE_BYTE, FIRST_BYTE, MARKER, STRIDE, VMM_DEADLINE};
use super::error::CompareError;
use super::variant::{Runner, Variant};
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

/// A VMM run as seen from outside: when the port 0x3f0 bytes arrived, when
/// it exited, and what it printed.
#[derive(Debug)]
pub(super) struct VmmRun {
    pub(super) first: Option<Duration>,
    pub(super) done: Option<Duration>,
    pub(super) exit: Duration,
    pub(super) status: ExitStatus,
    pub(super) stdout: String,
    pub(super) stderr: String,
}

impl VmmRun {
    pub(super) fn guest_line(&self) -> Option<&str> {
        self.stdout
            .lines()
            .find_map(|l| l.find("HUGEMEM-GUEST ").map(|i| l[i..].trim()))
    }

    pub(super) fn describe(&self) -> String {
        format!(
            "{}; stdout {:?}; stderr {:?}",
            self.status,
            self.stdout,
            tail(&self.stderr, 2000)
        )
    }
}

pub(super) fn tail(s: &str, max: usize) -> &str {
    let mut start = s.len().saturating_sub(max);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
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

/// Spawns `argv` with `inherit` open in the child under their current
/// numbers, stdout and stderr piped, and timestamps (from `t0`) the reads
/// that bring the guest's port 0x3f0 bytes. Kills it after [`VMM_DEADLINE`].
///
/// Not [`crate::launch::run_vmm`]: that one forwards signals and, in a
/// process with other threads (this one has the daemon's), sees the child's
/// exit only at its next 50 ms poll; here the exit is seen at once through
/// EOF on stdout and a blocking wait.
pub(super) fn run_vmm_timed(
    argv: &[OsString],
    inherit: &[BorrowedFd<'_>],
    t0: Instant,
) -> Result<VmmRun, CompareError> {
    let Some((program, args)) = argv.split_first() else {
        return Err(CompareError::Spawn {
            program: OsString::new(),
            source: std::io::Error::other("empty command"),
        });
    };
    let mut cmd = Command::new(program);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    crate::floor::inherit_fds(&mut cmd, inherit);
    let mut child = cmd.spawn().map_err(|source| CompareError::Spawn {
        program: program.clone(),
        source,
    })?;
    let (Some(mut stdout), Some(mut stderr)) = (child.stdout.take(), child.stderr.take()) else {
        let _ = child.kill();
        let _ = child.wait();
        return Err(CompareError::Wait(std::io::Error::other(
            "the VMM's output pipes are missing",
        )));
    };
    let pid = i32::try_from(child.id())
        .map(nix::unistd::Pid::from_raw)
        .map_err(|_| CompareError::Wait(std::io::Error::other("child pid out of range")))?;
    // The watchdog kills by pid, which is safe only while the child is not
    // reaped: it is joined before the wait below.
    let (stop, stopped) = mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(VMM_DEADLINE) {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            return true;
        }
        false
    });
    let err_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = stderr.read_to_end(&mut v);
        v
    });
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let (mut first, mut done) = (None, None);
    let read_result = loop {
        match stdout.read(&mut buf) {
            Ok(0) => break Ok(()),
            Ok(n) => {
                let at = t0.elapsed();
                let chunk = &buf[..n];
                if first.is_none() && chunk.contains(&FIRST_BYTE) {
                    first = Some(at);
                }
                if done.is_none() && chunk.contains(&DONE_BYTE) {
                    done = Some(at);
                }
                out.extend_from_slice(chunk);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => break Err(e),
        }
    };
    if read_result.is_err() {
        let _ = child.kill();
    }
    // A send error means the watchdog already fired and is gone.
    let _ = stop.send(());
    let killed = watchdog.join().unwrap_or(false);
    let status = child.wait().map_err(CompareError::Wait)?;
    let exit = t0.elapsed();
    read_result.map_err(CompareError::Wait)?;
    let stderr = err_reader.join().unwrap_or_default();
    let run = VmmRun {
        first,
        done,
        exit,
        status,
        stdout: String::from_utf8_lossy(&out).into_owned(),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
    };
    if killed {
        return Err(CompareError::Wait(std::io::Error::other(format!(
            "{} ran longer than {VMM_DEADLINE:?} and was killed: {}",
            program.to_string_lossy(),
            run.describe()
        ))));
    }
    Ok(run)
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
        .first
        .ok_or_else(|| fail(format!("no first-instruction mark: {}", run.describe())))?;
    let ready = if v == Variant::QemuLazy {
        run.done
            .ok_or_else(|| fail(format!("no all-pages-touched mark: {}", run.describe())))?
    } else {
        first
    };
    Ok(Sample {
        ready: ready.as_secs_f64(),
        first_instruction: first.as_secs_f64(),
        touched: run.done.map(|d| d.as_secs_f64()),
        poweroff: run.exit.as_secs_f64(),
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
