//! One batch of VM starts and what it measures: each VM's request to its
//! guest running, the memory the batch took from the pool and from the
//! kernel while all of them ran, and each clone's pages against the
//! template's.

use std::fs::File;
use std::time::Instant;

use guest_mem::PageSize;

use super::launch::{Daemon, Launcher, Source};
use super::observe::{private_hugetlb, wait_running, ReadRam, Starting};
use super::report::StartResult;
use crate::vmm_update::error::VmmUpdateError;

/// The kernel's `(free, reserved)` huge pages of `page`, host-wide, bytes.
pub(crate) fn kernel_pages(page: PageSize) -> (u64, u64) {
    let dir = format!(
        "/sys/kernel/mm/hugepages/hugepages-{}kB",
        page.bytes() / 1024
    );
    let read = |f: &str| {
        std::fs::read_to_string(format!("{dir}/{f}"))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    (
        read("free_hugepages") * page.bytes(),
        read("resv_hugepages") * page.bytes(),
    )
}

/// The memory figures before a batch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Before {
    pool_in_use: u64,
    free: u64,
    reserved: u64,
}

impl Before {
    pub(crate) fn now(daemon: &Daemon, page: PageSize) -> Result<Self, VmmUpdateError> {
        let stats = daemon.client()?.stats()?;
        let (free, reserved) = kernel_pages(page);
        Ok(Self {
            pool_in_use: stats.pool_sum(|p| p.in_use_bytes),
            free,
            reserved,
        })
    }
}

/// What a batch is: its VMs' source, how they start, how many.
pub(crate) struct Batch<'a> {
    pub(crate) sources: Vec<Source<'a>>,
    /// The count each VM's memory holds as it starts.
    pub(crate) from_counts: Vec<u64>,
    pub(crate) at_once: bool,
    pub(crate) size: u64,
    pub(crate) page: PageSize,
}

/// Starts `batch` on `daemon`: one after the other (each once the one
/// before runs) or all at once. Adds each VM's time to `out`; returns the
/// running VMs (their launchers and the VMs' RAM).
pub(crate) fn start(
    daemon: &mut Daemon,
    batch: &Batch<'_>,
    out: &mut StartResult,
) -> Result<Vec<Starting>, VmmUpdateError> {
    let mut started: Vec<Starting> = Vec::new();
    let first = Instant::now();
    for (source, &from_count) in batch.sources.iter().zip(&batch.from_counts) {
        let asked = Instant::now();
        let launcher: Launcher = daemon.launch(*source, batch.size, batch.page)?;
        started.push(Starting {
            launcher,
            asked,
            from_count,
            ram: None,
            running_after: None,
            bad: 0,
        });
        if !batch.at_once {
            let last = started.len() - 1;
            wait_running(&mut started[last..], batch.size)?;
        }
    }
    if batch.at_once {
        wait_running(&mut started, batch.size)?;
        out.batch_ms.extend([first.elapsed().as_secs_f64() * 1e3]);
    }
    out.running_ms.extend(
        started
            .iter()
            .filter_map(|s| s.running_after)
            .map(|d| d.as_secs_f64() * 1e3),
    );
    out.guest_bad = out
        .guest_bad
        .max(started.iter().map(|s| s.bad).max().unwrap_or(0));
    Ok(started)
}

/// The memory the running `vms` took since `before`, per VM, into `out`;
/// with `template`, the first and the last clone's pages compared with it
/// (each clone's RAM read as `ReadRam` says).
pub(crate) fn measure(
    daemon: &Daemon,
    page: PageSize,
    before: Before,
    vms: &[Starting],
    template: Option<(&File, ReadRam)>,
    out: &mut StartResult,
) -> Result<(), VmmUpdateError> {
    let n = vms.len().max(1) as u64;
    let now = Before::now(daemon, page)?;
    let per_vm = |a: u64, b: u64| a.saturating_sub(b) / n;
    out.pool_bytes_per_vm = out
        .pool_bytes_per_vm
        .max(per_vm(now.pool_in_use, before.pool_in_use));
    out.kernel_taken_bytes_per_vm = out
        .kernel_taken_bytes_per_vm
        .max(per_vm(before.free, now.free));
    out.kernel_reserved_bytes_per_vm = out
        .kernel_reserved_bytes_per_vm
        .max(per_vm(now.reserved, before.reserved));
    let private: u64 = vms
        .iter()
        .filter_map(|s| s.ram.as_ref())
        .map(|r| private_hugetlb(r.vmm))
        .sum();
    out.private_hugetlb_bytes_per_vm = out.private_hugetlb_bytes_per_vm.max(private / n);
    if let Some((template, read)) = template {
        let own_end = microguest::IMAGE_END_GPA.max(crate::vmm_update::setup::START_GPA);
        // The first and the last clone of the batch: reading a clone's
        // RAM takes seconds per GiB on this host.
        let rams: Vec<_> = vms.iter().filter_map(|s| s.ram.as_ref()).collect();
        let last = rams.len().saturating_sub(1);
        for ram in rams
            .iter()
            .enumerate()
            .filter(|(i, _)| *i == 0 || *i == last)
            .map(|(_, r)| r)
        {
            let (own, stale) = ram.differing_pages(template, own_end, read)?;
            out.own_pages_written_max = out.own_pages_written_max.max(own);
            out.stale_pages += stale;
            out.clones_checked += 1;
        }
    }
    Ok(())
}
