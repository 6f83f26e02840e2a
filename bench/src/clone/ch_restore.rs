//! cloud-hypervisor's own restore of the same VM from its `file://`
//! snapshot, in every restore mode its `--restore` offers
//! (`memory_restore_mode=copy`, the same with `prefault=on`, and
//! `memory_restore_mode=ondemand`): a cloud-hypervisor on its own memory
//! (`--memory size=S,shared=on,hugepages=on,hugepage_size=P`) is paused,
//! snapshotted and ended; each restore is a new process started with
//! `--restore source_url=file://DIR,resume=true,MODE`, timed from its start
//! to the guest counting past the snapshot's count. The snapshot's files
//! stay in the page cache (a platform restoring one snapshot many times
//! finds them there).

use std::ffi::OsString;
use std::path::Path;
use std::time::{Duration, Instant};

use guest_mem::PageSize;

use super::plan::CloneConfig;
use super::report::ChRestoreResult;
use crate::vmm_side::{BenchVmm, CloudHypervisor};
use crate::vmm_update::ch::{BenchCh, CH_DEADLINE};
use crate::vmm_update::error::{io, VmmUpdateError};
use crate::vmm_update::guest::GuestRam;

/// The restore modes this cloud-hypervisor's `--restore` offers (its
/// `--help`: `prefault=on|off`, `memory_restore_mode=copy|ondemand`).
pub const CH_RESTORE_MODES: [&str; 3] = [
    "memory_restore_mode=copy",
    "memory_restore_mode=copy,prefault=on",
    "memory_restore_mode=ondemand",
];

/// How long a restore may take to have its guest counting.
const RESTORE_WAIT: Duration = Duration::from_secs(120);

fn ch(what: String) -> VmmUpdateError {
    VmmUpdateError::Ch(what)
}

/// The files of one size and page size: `dir/ch-P-S-…`.
fn name(page: PageSize, size: u64, what: &str) -> String {
    format!("ch-{page}-{size}-{what}")
}

/// Takes the snapshot into `dir/ch-P-S-snapshot`; the count it holds.
fn snapshot(
    cfg: &CloneConfig,
    dir: &Path,
    elf: &Path,
    size: u64,
    page: PageSize,
) -> Result<u64, VmmUpdateError> {
    let mut argv = CloudHypervisor.spin_guest_args(&cfg.cloud_hypervisor, elf);
    argv.push("--memory".into());
    argv.push(format!("size={size},shared=on,hugepages=on,hugepage_size={page}").into());
    let mut src = BenchCh::start(&argv, dir, &name(page, size, "src"), &[])?;
    src.drain_events();
    src.wait_running()?;
    let ram = GuestRam::wait_memfd(src.pid(), RESTORE_WAIT)?;
    ram.counting_past(0)?;
    let snap = dir.join(name(page, size, "snapshot"));
    std::fs::create_dir(&snap).map_err(io(format!("create {}", snap.display())))?;
    src.api()
        .put("vm.pause", None, CH_DEADLINE)
        .map_err(|e| ch(format!("vm.pause: {e}")))?;
    let url = format!("file://{}", snap.display());
    src.api()
        .put(
            "vm.snapshot",
            Some(&serde_json::json!({ "destination_url": url })),
            CH_DEADLINE,
        )
        .map_err(|e| ch(format!("vm.snapshot: {e}")))?;
    let count = ram.spin()?.count;
    drop(ram);
    src.retire();
    Ok(count)
}

/// One restore in `mode`: its start to the guest counting past `count`, ms,
/// and the guest's bad pages.
fn restore_once(
    cfg: &CloneConfig,
    dir: &Path,
    (mode, count): (&str, u64),
    (page, size, i): (PageSize, u64, usize),
) -> Result<(f64, u64), VmmUpdateError> {
    let url = format!(
        "file://{}",
        dir.join(name(page, size, "snapshot")).display()
    );
    let me = name(page, size, &format!("restore{i}"));
    let argv: [OsString; 3] = [
        cfg.cloud_hypervisor.clone(),
        "--restore".into(),
        format!("source_url={url},resume=true,{mode}").into(),
    ];
    let started = Instant::now();
    let mut dst = BenchCh::start(&argv, dir, &me, &[])?;
    dst.drain_events();
    let pid = dst.pid();
    loop {
        let state = GuestRam::of_memfd(pid).and_then(|r| r.spin());
        if let Ok(s) = state {
            if s.spinning && s.count > count {
                let ms = started.elapsed().as_secs_f64() * 1e3;
                drop(dst);
                return Ok((ms, s.bad));
            }
        }
        let gone = std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
            s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        });
        if gone || started.elapsed() > RESTORE_WAIT {
            let log =
                std::fs::read_to_string(dir.join(format!("ch-restore{i}.log"))).unwrap_or_default();
            let last = log
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("");
            return Err(ch(format!(
                "the restore with {mode} did not run its guest ({}): {last}",
                if gone { "it exited" } else { "timed out" }
            )));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Every mode, `reps` restores each, of a `size` guest on `page` pages. A
/// snapshot that fails is a note on every mode's row.
pub(crate) fn ch_restores(
    cfg: &CloneConfig,
    dir: &Path,
    elf: &Path,
    (size, page): (u64, PageSize),
    progress: &mut dyn FnMut(&str),
) -> Vec<ChRestoreResult> {
    let snapshot = snapshot(cfg, dir, elf, size, page);
    let mut out = Vec::new();
    let mut i = 0;
    for mode in CH_RESTORE_MODES {
        let mut r = ChRestoreResult {
            page_size: page.to_string(),
            size,
            mode: mode.to_string(),
            ..ChRestoreResult::default()
        };
        let count = match &snapshot {
            Ok(count) => *count,
            Err(e) => {
                r.note = Some(format!("the snapshot failed: {e}"));
                out.push(r);
                continue;
            }
        };
        for _ in 0..cfg.reps {
            i += 1;
            match restore_once(cfg, dir, (mode, count), (page, size, i)) {
                Ok((ms, bad)) => {
                    r.running_ms.extend([ms]);
                    r.guest_bad = r.guest_bad.max(bad);
                }
                Err(e) => {
                    progress(&format!("cloud-hypervisor's restore with {mode}: {e}"));
                    r.note = Some(e.to_string());
                    break;
                }
            }
        }
        progress(&format!(
            "cloud-hypervisor's own restore of {} on {page} pages ({mode}): p50 {:.1} ms",
            guest_mem::size::format_size(size),
            r.running_ms.p50
        ));
        out.push(r);
    }
    let snap = dir.join(name(page, size, "snapshot"));
    if let Err(e) = std::fs::remove_dir_all(&snap) {
        progress(&format!("cannot remove {}: {e}", snap.display()));
    }
    out
}
