//! Before a phase and before each batch of starts: the huge pages the
//! batch will take, against what its daemon holds clean and what the
//! kernel has free and unreserved.
//!
//! The plan sizes a run exactly (the template and N VMs' memory, no
//! slack), and the host is shared: another process that takes pages
//! while the run goes on (a VM started outside the test lock, a pool
//! shrunk by someone else's reservation ending) leaves a batch short
//! part of the way through it. Each batch is therefore checked once the
//! daemon has settled (every region the last batch freed scrubbed, every
//! clone ended: a STATS answer, after the launchers were reaped):
//!
//! * a **copy clone** takes a region of its size from the pool's clean
//!   regions, else fresh pages from the kernel;
//! * a **shared clone** has the kernel reserve its whole size when its
//!   VMM maps the template (`resv_hugepages`), though it writes little;
//! * a **restore from the park** runs on memory the daemon already holds.
//!
//! A shortfall is first asked of the kernel (`guest_mem::ensure_free`, as
//! the run's reservation did at its start; the run gives the pool back to
//! its size before the run when it ends). When the kernel cannot give it
//! either, the batch is not started and the error says what is short and
//! which processes map pages of that size.

use guest_mem::size::format_size;
use guest_mem::PageSize;
use tracing::info;

use super::launch::Daemon;
use super::starts::kernel_pages;
use crate::vmm_update::error::VmmUpdateError;

/// What a batch takes, and from where.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Takes {
    /// Regions from the pool's clean regions or fresh kernel pages (copy
    /// clones, a new template).
    PoolOrKernel,
    /// Reservations of the kernel's free pages (shared clones).
    Kernel,
}

/// The pages there are for a batch, bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Supply {
    /// Clean in the daemon's pool, of the batch's page size.
    pub(crate) pool_clean: u64,
    /// The kernel's free pages of that size (`free_hugepages`).
    pub(crate) free: u64,
    /// Of them, reserved by mappings not faulted in yet (`resv_hugepages`).
    pub(crate) reserved: u64,
}

impl Supply {
    /// Now, from `daemon`'s STATS and the kernel's counters.
    fn now(daemon: &Daemon, page: PageSize) -> Result<Self, VmmUpdateError> {
        let stats = daemon.client()?.stats()?;
        let name = page.to_string();
        let pool_clean = stats
            .pools
            .iter()
            .filter(|p| p.page_size == name)
            .map(|p| p.clean_bytes)
            .sum();
        let (free, reserved) = kernel_pages(page);
        Ok(Self {
            pool_clean,
            free,
            reserved,
        })
    }

    /// The kernel's pages nobody holds yet.
    pub(crate) fn kernel_available(&self) -> u64 {
        self.free.saturating_sub(self.reserved)
    }

    /// Bytes of `need` (taken as `takes` says) that neither the pool nor
    /// the kernel has.
    pub(crate) fn short_of(&self, need: u64, takes: Takes) -> u64 {
        let pool = match takes {
            Takes::PoolOrKernel => self.pool_clean,
            Takes::Kernel => 0,
        };
        need.saturating_sub(pool.saturating_add(self.kernel_available()))
    }

    /// The kernel's part of `need`: what the pool does not cover.
    fn kernel_part(&self, need: u64, takes: Takes) -> u64 {
        match takes {
            Takes::PoolOrKernel => need.saturating_sub(self.pool_clean),
            Takes::Kernel => need,
        }
    }

    /// `pool 1.0G clean, kernel 512M free and unreserved (free 600M, reserved 88M)`.
    pub(crate) fn describe(&self) -> String {
        format!(
            "the pool {} clean, the kernel {} free and unreserved ({} free, {} reserved)",
            format_size(self.pool_clean),
            format_size(self.kernel_available()),
            format_size(self.free),
            format_size(self.reserved),
        )
    }
}

/// Makes sure `daemon`'s pool and the kernel cover `need` bytes of `page`
/// pages for `what` (e.g. `25 copy clones of 256M`), taken as `takes`
/// says; grows the kernel's pool by the shortfall when it can. Call it
/// once the daemon has settled.
///
/// # Errors
///
/// [`VmmUpdateError::Setup`] naming what is short, with the processes
/// that map pages of `page`; a STATS that fails.
pub(crate) fn ensure_covered(
    daemon: &Daemon,
    page: PageSize,
    (what, need, takes): (&str, u64, Takes),
) -> Result<Supply, VmmUpdateError> {
    let mut supply = Supply::now(daemon, page)?;
    if supply.short_of(need, takes) > 0 {
        let pages = supply.kernel_part(need, takes).div_ceil(page.bytes());
        info!(
            "{what}: {} of {page} pages short ({}); asking the kernel for {pages} free pages",
            format_size(supply.short_of(need, takes)),
            supply.describe()
        );
        // Its report is read back below, through the same counters.
        let _ = guest_mem::ensure_free(page, pages, None);
        supply = Supply::now(daemon, page)?;
    }
    let short = supply.short_of(need, takes);
    if short > 0 {
        return Err(VmmUpdateError::Setup(format!(
            "{what} need {} of {page} pages, {} short: {}; the kernel gave no more; {}",
            format_size(need),
            format_size(short),
            supply.describe(),
            holders(page),
        )));
    }
    info!(
        "{what}: {} of {page} pages covered by {}",
        format_size(need),
        supply.describe()
    );
    Ok(supply)
}

/// Bytes of `page_kib` KiB huge pages one `/proc/PID/smaps` maps (its
/// `Private_Hugetlb` and `Shared_Hugetlb` in mappings of that page size).
pub(crate) fn hugetlb_bytes(smaps: &str, page_kib: u64) -> u64 {
    let kib = |line: &str, key: &str| -> Option<u64> {
        line.strip_prefix(key)?
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()
    };
    // A mapping's block starts with its address range; its fields come
    // in any order: summed per block, kept when its page size is `page_kib`.
    let (mut total, mut block, mut this_size) = (0u64, 0u64, false);
    for line in smaps.lines() {
        let head = line.split_whitespace().next().unwrap_or("");
        if head.contains('-') && !head.ends_with(':') {
            if this_size {
                total += block;
            }
            (block, this_size) = (0, false);
        } else if let Some(k) = kib(line, "KernelPageSize:") {
            this_size = k == page_kib;
        } else if let Some(k) =
            kib(line, "Private_Hugetlb:").or_else(|| kib(line, "Shared_Hugetlb:"))
        {
            block += k * 1024;
        }
    }
    if this_size {
        total += block;
    }
    total
}

/// `processes mapping 2M pages: 7033 cloud-hyperviso 256M, …` (the
/// largest first, at most eight), or that none does.
fn holders(page: PageSize) -> String {
    let page_kib = page.bytes() / 1024;
    let mut found: Vec<(u64, u32, String)> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).ok()?;
            let bytes = hugetlb_bytes(&smaps, page_kib);
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            (bytes > 0).then(|| (bytes, pid, comm.trim().to_string()))
        })
        .collect();
    if found.is_empty() {
        return format!("no process maps {page} pages");
    }
    found.sort_unstable_by(|a, b| b.cmp(a));
    let listed: Vec<String> = found
        .iter()
        .take(8)
        .map(|(bytes, pid, comm)| format!("{pid} {comm} {}", format_size(*bytes)))
        .collect();
    format!("processes mapping {page} pages: {}", listed.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn supply(pool_clean: u64, free: u64, reserved: u64) -> Supply {
        Supply {
            pool_clean,
            free,
            reserved,
        }
    }

    #[test]
    fn copy_clones_count_the_pool_and_shared_ones_only_the_kernel() {
        let s = supply(512 * MIB, 1024 * MIB, 256 * MIB);
        assert_eq!(s.kernel_available(), 768 * MIB);
        assert_eq!(s.short_of(1280 * MIB, Takes::PoolOrKernel), 0);
        assert_eq!(s.short_of(1536 * MIB, Takes::PoolOrKernel), 256 * MIB);
        assert_eq!(s.short_of(1280 * MIB, Takes::Kernel), 512 * MIB);
        assert_eq!(s.kernel_part(1280 * MIB, Takes::PoolOrKernel), 768 * MIB);
        assert_eq!(s.kernel_part(1280 * MIB, Takes::Kernel), 1280 * MIB);
    }

    #[test]
    fn more_reserved_than_free_leaves_nothing() {
        let s = supply(0, 2 * MIB, 4 * MIB);
        assert_eq!(s.kernel_available(), 0);
        assert_eq!(s.short_of(2 * MIB, Takes::Kernel), 2 * MIB);
    }

    #[test]
    fn hugetlb_bytes_counts_mappings_of_one_page_size() {
        let smaps = "\
7f0000000000-7f0010000000 rw-s 00000000 00:10 123 /memfd:hugemem-r1 (deleted)
Size:             262144 kB
Private_Hugetlb:       0 kB
Shared_Hugetlb:   262144 kB
KernelPageSize:     2048 kB
7f1000000000-7f1040000000 rw-s 00000000 00:11 456 /dev/hugepages-1G/x
Shared_Hugetlb:  1048576 kB
KernelPageSize:  1048576 kB
7f2000000000-7f2010000000 rw-p 00000000 00:10 789 /memfd:template (deleted)
Private_Hugetlb:    4096 kB
Shared_Hugetlb:        0 kB
KernelPageSize:     2048 kB
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]
Private_Hugetlb:       0 kB
KernelPageSize:        4 kB
";
        assert_eq!(hugetlb_bytes(smaps, 2048), (262_144 + 4096) * 1024);
        assert_eq!(hugetlb_bytes(smaps, 1_048_576), 1 << 30);
        assert_eq!(hugetlb_bytes(smaps, 4), 0);
        assert_eq!(hugetlb_bytes("", 2048), 0);
    }
}
