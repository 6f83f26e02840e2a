//! The bench's view of a running counting guest (`microguest::spin`):
//! its spin block read through a VMM's memory fd, the clock it counts in,
//! and what the bench checks in its RAM afterwards.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};

use guest_mem::PageSize;
use microguest::{pattern, SpinState, MAX_GAP_GPA, SPIN_BLOCK_GPA, SPIN_BLOCK_LEN};
use vm_memory::{Bytes, MmapRegion, VolatileMemory};

use super::error::VmmUpdateError;

/// Reads the TSC.
fn rdtsc() -> u64 {
    // SAFETY: RDTSC reads a counter; it has no memory operands and every
    // x86-64 CPU has it.
    unsafe { core::arch::x86_64::_rdtsc() }
}

/// The host's TSC rate, ticks per second, measured against
/// `CLOCK_MONOTONIC` over `window` (a sleep: this measures, it waits for
/// nothing).
pub(crate) fn host_tsc_hz(window: Duration) -> f64 {
    let (t0, c0) = (Instant::now(), rdtsc());
    std::thread::sleep(window);
    let (c1, t1) = (rdtsc(), Instant::now());
    (c1.wrapping_sub(c0)) as f64 / (t1 - t0).as_secs_f64()
}

/// `CLOCK_MONOTONIC` now, ns: the clock `hugemem update` reports the switch in.
pub(crate) fn monotonic_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|t| {
            u64::try_from(t.tv_sec()).unwrap_or(0) * 1_000_000_000
                + u64::try_from(t.tv_nsec()).unwrap_or(0)
        })
        .unwrap_or(0)
}

/// The host TSC at a `CLOCK_MONOTONIC` time, from one pair read together
/// and the measured rate.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HostClock {
    mono_ns: u64,
    tsc: u64,
    hz: f64,
}

impl HostClock {
    /// Reads the pair now.
    pub(crate) fn now(hz: f64) -> Self {
        let mono_ns = monotonic_ns();
        Self {
            mono_ns,
            tsc: rdtsc(),
            hz,
        }
    }

    /// The host TSC at `ns`.
    pub(crate) fn tsc_at(&self, ns: u64) -> i128 {
        let delta_ns = i128::from(ns) - i128::from(self.mono_ns);
        i128::from(self.tsc) + (delta_ns as f64 * self.hz / 1e9) as i128
    }
}

/// The largest gap the guest recorded (in its ring) that overlaps the
/// guest-TSC interval `[from, to]`: the pause at a switch whose host-clock
/// window is known.
pub(crate) fn gap_within(state: &SpinState, from: i128, to: i128) -> Option<u64> {
    state
        .recent_gaps
        .iter()
        .filter(|g| {
            let end = i128::from(g.end_tsc);
            end - i128::from(g.ticks) <= to && end >= from
        })
        .map(|g| g.ticks)
        .max()
}

/// Guest RAM as one QEMU maps it: a file opened from `/proc/PID/fd/N`,
/// read with `pread`; the 2 MiB page of the spin block is mapped too (a
/// hugetlbfs file takes no `write`), for [`GuestRam::reset_max_gap`].
pub(crate) struct GuestRam {
    file: File,
    block_page: MmapRegion,
    /// The guest address `block_page` starts at.
    block_page_start: u64,
}

const BLOCK_PAGE: u64 = MAX_GAP_GPA - MAX_GAP_GPA % (2 << 20);

impl GuestRam {
    /// The RAM of QEMU `pid`: its fd `mem-path=/dev/fd/N` (a `hugemem
    /// launch`ed QEMU), or else its `memfd:` fd (QEMU's own
    /// `memory-backend-memfd`).
    pub(crate) fn of(pid: u32) -> Result<Self, VmmUpdateError> {
        // Right after the exec the command line may still read empty.
        let deadline = Instant::now() + Duration::from_secs(30);
        let cmdline = loop {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))
                .map_err(|e| VmmUpdateError::Guest(format!("QEMU {pid}: {e}")))?;
            if cmdline.windows(7).any(|w| w == b"-object") || Instant::now() > deadline {
                break cmdline;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        let by_path = String::from_utf8_lossy(&cmdline).split('\0').find_map(|a| {
            a.split(',')
                .find_map(|kv| kv.strip_prefix("mem-path=/dev/fd/"))
                .map(str::to_owned)
        });
        let fd = match by_path {
            Some(fd) => fd,
            None => memfd_of(pid)?,
        };
        Self::open(Path::new(&format!("/proc/{pid}/fd/{fd}")))
    }

    /// The RAM of a cloud-hypervisor that `hugemem launch` (pid
    /// `launcher`) started as `vmm`: the memory zone's `file=/dev/fd/N` on
    /// its command line, opened through the launcher, which holds that
    /// descriptor for the VM's whole life (a successor gets the memory by
    /// migration, with fd numbers of its own).
    pub(crate) fn of_launched_ch(launcher: u32, vmm: u32) -> Result<Self, VmmUpdateError> {
        // Right after the exec the command line may still read empty.
        let deadline = Instant::now() + Duration::from_secs(30);
        let fd = loop {
            let cmdline = std::fs::read(format!("/proc/{vmm}/cmdline"))
                .map_err(|e| VmmUpdateError::Guest(format!("cloud-hypervisor {vmm}: {e}")))?;
            let fd = String::from_utf8_lossy(&cmdline).split('\0').find_map(|a| {
                a.split(',')
                    .find_map(|kv| kv.strip_prefix("file=/dev/fd/"))
                    .map(str::to_owned)
            });
            match fd {
                Some(fd) => break fd,
                None if Instant::now() > deadline => {
                    return Err(VmmUpdateError::Guest(format!(
                        "no file=/dev/fd/N on cloud-hypervisor's command line: {}",
                        String::from_utf8_lossy(&cmdline).replace('\0', " ")
                    )))
                }
                None => std::thread::sleep(Duration::from_millis(1)),
            }
        };
        Self::open(Path::new(&format!("/proc/{launcher}/fd/{fd}")))
    }

    /// The RAM of cloud-hypervisor `pid` once it holds a memfd whose spin
    /// block says the guest spins (deadline `wait`, looks every
    /// millisecond): a process that receives its memory by migration or
    /// from a snapshot has none at first, a booting guest has not started.
    pub(crate) fn wait_memfd(pid: u32, wait: Duration) -> Result<Self, VmmUpdateError> {
        let deadline = Instant::now() + wait;
        loop {
            let found = Self::of_memfd(pid).and_then(|r| match r.spin()?.spinning {
                true => Ok(r),
                false => Err(VmmUpdateError::Guest(format!(
                    "process {pid}: no memfd with a spinning guest within {wait:?}"
                ))),
            });
            match found {
                Ok(ram) => return Ok(ram),
                Err(e) if Instant::now() > deadline => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(1)),
            }
        }
    }

    /// The RAM of cloud-hypervisor `pid` started on its own memory
    /// (`--memory …,hugepages=on,shared=on`: a hugetlb memfd).
    /// A VM above 3 GiB has a memfd per RAM region; the guest's spin
    /// block is in the one from guest address 0, the one whose block says
    /// the guest spins (the block's bytes are zero in the others: the guest
    /// writes one word per 4 KiB page, at its start). Until one says so,
    /// the first.
    pub(crate) fn of_memfd(pid: u32) -> Result<Self, VmmUpdateError> {
        let mut first = None;
        for fd in memfds_of(pid)? {
            let Ok(ram) = Self::open(Path::new(&format!("/proc/{pid}/fd/{fd}"))) else {
                continue;
            };
            if ram.spin().is_ok_and(|s| s.spinning) {
                return Ok(ram);
            }
            first.get_or_insert(ram);
        }
        first.ok_or_else(|| VmmUpdateError::Guest(format!("process {pid}: no memfd maps")))
    }

    /// The guest RAM file at `path` (`/proc/PID/fd/N` of a process holding
    /// it), on 2 MiB pages, its offsets the guest's physical addresses.
    pub(crate) fn open(path: &Path) -> Result<Self, VmmUpdateError> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| VmmUpdateError::Guest(format!("{}: {e}", path.display())))?;
        Self::from_file(file)
    }

    /// The guest RAM in `file`, as [`GuestRam::open`] (on 2 MiB or 1 GiB
    /// pages: the spin block's page is mapped whole).
    pub(crate) fn from_file(file: File) -> Result<Self, VmmUpdateError> {
        let copy = file
            .try_clone()
            .map_err(|e| VmmUpdateError::Guest(format!("dup: {e}")))?;
        let page = match nix::sys::statfs::fstatfs(&file) {
            Ok(fs) if fs.optimal_transfer_size() as u64 == PageSize::Huge1G.bytes() => {
                PageSize::Huge1G
            }
            _ => PageSize::Huge2M,
        };
        let page_start = BLOCK_PAGE - BLOCK_PAGE % page.bytes();
        let len = usize::try_from(page.bytes()).unwrap_or(usize::MAX);
        let block_page = guest_mem::shared_file_mapping(copy, page_start, len, page)
            .map_err(|e| VmmUpdateError::Guest(format!("cannot map the spin block's page: {e}")))?;
        Ok(Self {
            file,
            block_page,
            block_page_start: page_start,
        })
    }

    /// The guest RAM file.
    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// The spin block now.
    pub(crate) fn spin(&self) -> Result<SpinState, VmmUpdateError> {
        let mut block = vec![0u8; SPIN_BLOCK_LEN];
        self.file
            .read_exact_at(&mut block, SPIN_BLOCK_GPA)
            .map_err(|e| VmmUpdateError::Guest(format!("cannot read the spin block: {e}")))?;
        SpinState::parse(&block).ok_or_else(|| VmmUpdateError::Guest("short spin block".into()))
    }

    /// Host TSC minus guest TSC: the least difference over 20 reads of the
    /// guest's latest tick (each read lags the tick by at most one
    /// iteration).
    pub(crate) fn tsc_offset(&self) -> Result<i128, VmmUpdateError> {
        let mut best = i128::MAX;
        for _ in 0..20 {
            let guest = self.spin()?.tsc;
            best = best.min(i128::from(rdtsc()) - i128::from(guest));
        }
        Ok(best)
    }

    /// Sets the guest's largest gap to 0, so that it measures from now.
    pub(crate) fn reset_max_gap(&self) -> Result<(), VmmUpdateError> {
        let at = usize::try_from(MAX_GAP_GPA - self.block_page_start).unwrap_or(usize::MAX);
        self.block_page
            .as_volatile_slice()
            .write_obj(0u64, at)
            .map_err(|e| VmmUpdateError::Guest(format!("cannot reset the largest gap: {e}")))
    }

    /// Waits (deadline 60 s, reads every millisecond) until the guest's
    /// counter passes `past`: a spinning guest that has touched its pages.
    pub(crate) fn counting_past(&self, past: u64) -> Result<SpinState, VmmUpdateError> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let s = self.spin()?;
            if s.spinning && s.count > past {
                return Ok(s);
            }
            if Instant::now() > deadline {
                return Err(VmmUpdateError::Guest(format!(
                    "the guest's counter did not pass {past} within 60 s: {s:?}"
                )));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Host-side check of every `stride` page in `[start, end)`: counts the
    /// pages not holding `pattern(marker, gpa)` (stale or lost writes).
    pub(crate) fn stale_pages(
        &self,
        start: u64,
        end: u64,
        stride: u64,
        marker: u64,
    ) -> Result<u64, VmmUpdateError> {
        const CHUNK: u64 = 2 << 20;
        let mut buf = vec![0u8; CHUNK as usize];
        let mut stale = 0;
        let mut at = start - start % CHUNK;
        while at < end {
            let len = CHUNK.min(end - at) as usize;
            self.file.read_exact_at(&mut buf[..len], at).map_err(|e| {
                VmmUpdateError::Guest(format!("cannot read guest RAM at {at:#x}: {e}"))
            })?;
            let mut gpa = at.max(start).next_multiple_of(stride);
            while gpa + 8 <= at + len as u64 {
                let off = (gpa - at) as usize;
                let mut word = [0u8; 8];
                word.copy_from_slice(&buf[off..off + 8]);
                if u64::from_le_bytes(word) != pattern(marker, gpa) {
                    stale += 1;
                }
                gpa += stride;
            }
            at += len as u64;
        }
        Ok(stale)
    }
}

/// The fds of process `pid` that are memfds (QEMU's
/// `memory-backend-memfd`, cloud-hypervisor's own guest RAM), in fd order.
fn memfds_of(pid: u32) -> Result<Vec<u32>, VmmUpdateError> {
    let dir = format!("/proc/{pid}/fd");
    let entries =
        std::fs::read_dir(&dir).map_err(|e| VmmUpdateError::Guest(format!("{dir}: {e}")))?;
    let mut seen = Vec::new();
    let mut found = Vec::new();
    for entry in entries.flatten() {
        if let Ok(target) = std::fs::read_link(entry.path()) {
            let target = target.to_string_lossy().into_owned();
            match entry.file_name().to_string_lossy().parse::<u32>() {
                Ok(fd) if target.starts_with("/memfd:") => found.push(fd),
                _ => seen.push(target),
            }
        }
    }
    found.sort_unstable();
    if found.is_empty() {
        return Err(VmmUpdateError::Guest(format!(
            "process {pid} has no memory fd the bench can read (its fds: {})",
            seen.join(", ")
        )));
    }
    Ok(found)
}

/// The first memfd of process `pid`.
fn memfd_of(pid: u32) -> Result<String, VmmUpdateError> {
    memfds_of(pid).map(|fds| fds[0].to_string())
}
