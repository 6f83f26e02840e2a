//! What both sides of the bench share: the guest's parameters, huge-page
//! reservations, finding a launcher's QEMU, the idle-window gap.

use std::time::{Duration, Instant};

use guest_mem::{PageSize, Reservation};

use microguest::{pvh_elf, PvhConfig};

use super::error::io;
use super::error::VmmUpdateError;
use super::guest::GuestRam;

/// The guest writes `MARKER ^ gpa` into each page.
pub(crate) const MARKER: u64 = 0x766d_6d2d_7570_6400;
/// The guest's first page (QEMU's firmware writes below 1 MiB).
pub(crate) const START_GPA: u64 = 1 << 20;
/// One guest page per 4 KiB: every page holds data a copy must send.
pub(crate) const STRIDE: u64 = 4 << 10;
/// The host re-reads guest RAM below this GPA (where the memory file's
/// offset is the GPA under microvm); the guest checks all of it itself.
pub(crate) const HOST_CHECK_END: u64 = 2 << 30;
/// The host's 1 GiB pages, `(nr_hugepages, free_hugepages)`; zeros where
/// it has no such pool.
pub(crate) fn one_gib_pages() -> (u64, u64) {
    numa::HugePages::host()
        .pool(1 << 30, None)
        .map_or((0, 0), |p| (p.total, p.free))
}

/// 2 MiB pages for `bytes`, held until the guard drops.
pub(crate) fn reserve(bytes: u64) -> Result<Reservation, String> {
    reserve_pages(bytes, PageSize::Huge2M)
}

/// Huge pages of `page` size for `bytes`, held until the guard drops.
pub(crate) fn reserve_pages(bytes: u64, page: PageSize) -> Result<Reservation, String> {
    let pages = bytes.div_ceil(page.bytes());
    let name = match page {
        PageSize::Huge1G => "1 GiB",
        _ => "2 MiB",
    };
    match Reservation::for_run(page, pages) {
        Ok(r) if r.report().met => Ok(r),
        Ok(r) => Err(format!(
            "{pages} free {name} pages needed, the host has {}",
            r.report().free
        )),
        Err(e) => Err(format!("cannot reserve {pages} {name} pages: {e}")),
    }
}

/// The first child process of `parent`, once it has exec'd (deadline 30 s).
pub(crate) fn child_of(parent: u32) -> Result<u32, VmmUpdateError> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let children = std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children"))
            .unwrap_or_default();
        // Between fork and exec the child is a copy of its parent.
        let exe = |pid: u32| std::fs::read_link(format!("/proc/{pid}/exe")).ok();
        let child: Option<u32> = children
            .split_whitespace()
            .next()
            .and_then(|p| p.parse().ok());
        if let Some(pid) = child.filter(|&p| exe(p).is_some() && exe(p) != exe(parent)) {
            return Ok(pid);
        }
        if Instant::now() > deadline {
            return Err(VmmUpdateError::Qemu(format!(
                "process {parent} started no QEMU within 30 s"
            )));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The number at `pointer` in a QMP reply (0 when absent).
pub(crate) fn number(v: &serde_json::Value, pointer: &str) -> u64 {
    v.pointer(pointer)
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(0)
}

/// The largest gap over an idle window of `window`, seconds.
pub(crate) fn idle_gap(
    ram: &GuestRam,
    window: Duration,
    tsc_hz: f64,
) -> Result<f64, VmmUpdateError> {
    ram.reset_max_gap()?;
    std::thread::sleep(window);
    Ok(ram.spin()?.max_gap as f64 / tsc_hz)
}

/// Writes the spinning micro-guest's image to `path`: it fills its pages
/// from [`START_GPA`] every [`STRIDE`] with [`MARKER`]'s pattern, then
/// counts; gaps of 0.2 ms and more go to its ring (its ticks are ~50 µs
/// apart here), `tsc_hz` the host's TSC rate.
pub(crate) fn write_spin_elf(path: &std::path::Path, tsc_hz: f64) -> Result<(), VmmUpdateError> {
    let image = pvh_elf(&PvhConfig {
        stride: STRIDE,
        marker: MARKER,
        start_gpa: START_GPA,
        spin: true,
        gap_min_ticks: (tsc_hz * 2e-4) as u64,
        ..Default::default()
    })
    .map_err(|e| VmmUpdateError::Setup(e.to_string()))?;
    std::fs::write(path, image).map_err(io("write the guest image"))
}
