//! Watching VMs the bench started through `hugemem launch`: the
//! cloud-hypervisor under each launcher, its guest RAM read through
//! `/proc/PID/mem` (a shared clone's written pages are in its private
//! mapping only) or, for a copy clone whose fill ended, through the file
//! it maps (`ReadRam`), the moment its counter passes where the template
//! stopped, and what it wrote.
//!
//! "Running" is the counting micro-guest's counter seen past the count its
//! memory held when parked, read every millisecond: the one observation
//! that is the same for a clone, a restore from the park and
//! cloud-hypervisor's own restore (the event monitor of a launched
//! cloud-hypervisor is its launcher's, not the bench's).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use microguest::{SpinState, SPIN_BLOCK_GPA, SPIN_BLOCK_LEN};

use crate::vmm_update::error::VmmUpdateError;

/// How long one VM may take to run.
pub(crate) const RUN_WAIT: Duration = Duration::from_secs(300);

/// CH maps guest RAM below the 32-bit hole (at most 3 GiB) from file
/// offset 0: the mapping the spin block is in.
pub(crate) const LOW_RAM: u64 = 3 << 30;

fn guest(what: String) -> VmmUpdateError {
    VmmUpdateError::Guest(what)
}

/// The first child of `parent` that exec'd something else, if any yet.
fn vmm_child(parent: u32) -> Option<u32> {
    let children =
        std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children")).ok()?;
    let exe = |pid: u32| std::fs::read_link(format!("/proc/{pid}/exe")).ok();
    let mine = exe(parent);
    children
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .find(|&p| exe(p).is_some() && exe(p) != mine)
}

/// Where `pid` maps guest RAM from offset 0 (`len` bytes): the mapping's
/// start, or `None` while it has none.
fn ram_base(pid: u32, len: u64) -> Option<u64> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    maps.lines().find_map(|l| {
        let mut w = l.split_whitespace();
        let (range, _perms, offset) = (w.next()?, w.next()?, w.next()?);
        // A file's mapping (an inode), not an anonymous one of that length.
        let inode = w.nth(1)?;
        let (start, end) = range.split_once('-')?;
        let (start, end) = (
            u64::from_str_radix(start, 16).ok()?,
            u64::from_str_radix(end, 16).ok()?,
        );
        (end - start == len && offset.trim_start_matches('0').is_empty() && inode != "0")
            .then_some(start)
    })
}

/// How a clone's RAM is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReadRam {
    /// Through its cloud-hypervisor's mapping (`/proc/PID/mem`): a shared
    /// clone's written pages are in its private mapping only.
    Mapping,
    /// Through the file it maps shared (`/proc/PID/map_files`): a copy
    /// clone's memory, whatever its cloud-hypervisor has mapped of it yet.
    File,
}

/// One VM's guest RAM as its cloud-hypervisor maps it.
pub(crate) struct VmRam {
    /// The cloud-hypervisor.
    pub(crate) vmm: u32,
    mem: File,
    base: u64,
    len: u64,
}

impl VmRam {
    /// The RAM of cloud-hypervisor `vmm` for a guest of `size`, once mapped.
    pub(crate) fn find(vmm: u32, size: u64) -> Option<Self> {
        let len = size.min(LOW_RAM);
        let base = ram_base(vmm, len)?;
        let mem = File::open(format!("/proc/{vmm}/mem")).ok()?;
        Some(Self {
            vmm,
            mem,
            base,
            len,
        })
    }

    /// Its guest RAM file, opened through `/proc/PID/map_files` (root):
    /// a copy clone's memory, still there once the VM is parked.
    pub(crate) fn memory_file(&self) -> Result<File, VmmUpdateError> {
        let path = format!(
            "/proc/{}/map_files/{:x}-{:x}",
            self.vmm,
            self.base,
            self.base + self.len
        );
        File::open(&path).map_err(|e| guest(format!("{path}: {e}")))
    }

    /// The spin block now.
    pub(crate) fn spin(&self) -> Option<SpinState> {
        let mut block = vec![0u8; SPIN_BLOCK_LEN];
        self.mem
            .read_exact_at(&mut block, self.base + SPIN_BLOCK_GPA)
            .ok()?;
        SpinState::parse(&block)
    }

    /// 4 KiB pages that differ from `template` (its guest RAM file):
    /// `(below, above)` the guest's own area `own_end` (the image, its
    /// stack and spin block, which a running guest writes), over the low
    /// RAM mapping, read as `read` says. A page above it that differs is
    /// stale or foreign.
    pub(crate) fn differing_pages(
        &self,
        template: &File,
        own_end: u64,
        read: ReadRam,
    ) -> Result<(u64, u64), VmmUpdateError> {
        let (source, base) = match read {
            ReadRam::Mapping => (None, self.base),
            ReadRam::File => (Some(self.memory_file()?), 0),
        };
        let source = source.as_ref().unwrap_or(&self.mem);
        const CHUNK: u64 = 8 << 20;
        const PAGE: usize = 4096;
        let mut ours = vec![0u8; CHUNK as usize];
        let mut theirs = vec![0u8; CHUNK as usize];
        let (mut own, mut other) = (0, 0);
        let mut at = 0;
        while at < self.len {
            let n = CHUNK.min(self.len - at) as usize;
            source
                .read_exact_at(&mut ours[..n], base + at)
                .map_err(|e| guest(format!("read clone {} at {at:#x}: {e}", self.vmm)))?;
            template
                .read_exact_at(&mut theirs[..n], at)
                .map_err(|e| guest(format!("read the template at {at:#x}: {e}")))?;
            for (i, (a, b)) in ours[..n]
                .chunks(PAGE)
                .zip(theirs[..n].chunks(PAGE))
                .enumerate()
            {
                if a != b {
                    if at + (i * PAGE) as u64 + (PAGE as u64) <= own_end {
                        own += 1;
                    } else {
                        other += 1;
                    }
                }
            }
            at += n as u64;
        }
        Ok((own, other))
    }
}

/// Huge-page bytes process `pid` holds privately (smaps_rollup
/// `Private_Hugetlb`): the pages a shared clone wrote.
pub(crate) fn private_hugetlb(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.strip_prefix("Private_Hugetlb:"))
        .filter_map(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .sum::<u64>()
        * 1024
}

/// A VM being started: its launcher (a `hugemem launch` the bench
/// spawned), when it was asked for, and once known its VMM's RAM and the
/// moment it ran.
pub(crate) struct Starting {
    pub(crate) launcher: super::launch::Launcher,
    pub(crate) asked: Instant,
    /// The count its memory holds when it starts: running is past it.
    pub(crate) from_count: u64,
    pub(crate) ram: Option<VmRam>,
    pub(crate) running_after: Option<Duration>,
    /// The guest's own count of bad pages when seen running.
    pub(crate) bad: u64,
}

/// Waits until every VM of `batch` (guests of `size`) runs, looking at all
/// of them every millisecond; each one's time from its request to its
/// counter seen past `from_count`.
///
/// # Errors
///
/// A launcher that exits first, or [`RUN_WAIT`] passing.
pub(crate) fn wait_running(batch: &mut [Starting], size: u64) -> Result<(), VmmUpdateError> {
    let deadline = Instant::now() + RUN_WAIT;
    loop {
        let mut waiting = 0;
        for s in batch.iter_mut().filter(|s| s.running_after.is_none()) {
            waiting += 1;
            if s.ram.is_none() {
                s.ram = vmm_child(s.launcher.pid()).and_then(|vmm| VmRam::find(vmm, size));
            }
            let seen = s.ram.as_ref().and_then(VmRam::spin);
            if let Some(state) = seen.filter(|st| st.spinning && st.count > s.from_count) {
                s.running_after = Some(s.asked.elapsed());
                s.bad = state.bad;
                waiting -= 1;
                continue;
            }
            if let Some(status) = s.launcher.exited() {
                return Err(guest(format!(
                    "{} exited ({status}) before its guest ran; its log: {}",
                    s.launcher.what,
                    s.launcher.log_tail()
                )));
            }
        }
        if waiting == 0 {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(guest(format!(
                "{waiting} VM(s) not running within {RUN_WAIT:?}"
            )));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}
