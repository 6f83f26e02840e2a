//! `hugemem bench alloc`: time until a VM's RAM is ready, every way, in one run, beside its limits.
//!
//! * `fresh_eager_s`: hugemem without the daemon: [`Region::allocate`](guest_mem::Region::allocate) per
//!   NUMA node (memfd, `mbind`, then `MADV_POPULATE_WRITE` by workers pinned
//!   to the node; the kernel zeroes each new huge page), all nodes at once.
//! * `fresh_eager_daemon_s`: the same through the daemon: ALLOC on a daemon
//!   whose pool is empty (socket round trip, pool bookkeeping, fd passing).
//! * `pooled_eager_s`: ALLOC on the same daemon after a FREE of the same size
//!   and after its scrubbers have cleaned it: the clean-pool hand-out. Its
//!   price is paid after the FREE: `free_to_clean_s` (wall) and
//!   `scrub_cpu_s_per_gib` (CPU seconds of the daemon per GiB scrubbed).
//!   With `pool.detach_pages` "clean" is punched holes that the scrubbers
//!   refault ahead, so `pooled_eager` gives what it got (resident / hole
//!   bytes).
//! * `pooled_resident_s` / `pooled_resident_touched_s`: on a daemon of its
//!   own, the ALLOC once the freed region is clean and refaulted (resident),
//!   and until one thread has written every page once through the mapping.
//! * `pooled_holes_s` / `pooled_holes_touched_s`: the same on a daemon with
//!   `pool.refault_ahead = false`: a hand-out of punched holes, which the
//!   kernel zeroes at that touch. Each hand-out's resident and hole bytes
//!   come from `fstat` of the fds received ([`HandOut`]).
//! * `limits` ([`AllocLimits`]): the kernel's fault-time zeroing with 1
//!   thread, with cloud-hypervisor style's threads and with all CPUs (the
//!   scaling run always measures those counts), and memory bandwidth (the
//!   non-temporal clear by all CPUs); `ratios` set figures against them.
//!
//! Every variant is timed to the same point: the memory mapped in this
//! process and ready for a VMM. The daemon-less ones end with their own
//! populated mapping; both daemon ALLOCs include receiving the fds and
//! mapping them as a rust-vmm VMM does (`Allocation::guest_memory`). What
//! still differs: the daemon variants' page tables in the VMM's mapping are
//! filled by minor faults later (the pages exist; nothing is zeroed then).
//! * `cloud_hypervisor_style_s`: what cloud-hypervisor does with
//!   `prefault=on` today: a hugetlb memfd mapped shared, then
//!   `threads = min(CPUs, 16, pages, size / 4 GiB)` (at least 1) unpinned
//!   threads, each `MADV_POPULATE_WRITE` over its share of the pages.
//!
//! **Scaling** (`scaling`, `--threads 1,2,…`): the daemon-less fresh
//! populate again, with exactly N workers pinned to the nodes (N split over
//! the nodes with memory and CPUs; each node's memfd `mbind`-ed to it, then
//! `MADV_POPULATE_WRITE` chunk by chunk through [`clearing::run_jobs`], the
//! mechanism [`Region::prepare_eager`](guest_mem::Region::prepare_eager) uses with all CPUs), best and median
//! of `reps` per count, and GB/s relative to the first count.
//!
//! Every figure is the best of `reps`; each repetition runs all of them, in
//! alternating order (even repetitions daemon-less first, odd ones daemon
//! first), so drift hits them alike. Before anything is timed the whole size
//! is populated and freed once, because the outer host backs never-touched
//! memory lazily (docs/platform.md#first-touch: a first 1 GiB fault ~1.5 s, later ones ~0.2 s).
//! At most `size` bytes of huge pages are held at any time, so the run needs
//! `size / page` free pages, which it reserves through `numa::hugepages`.
//!
//! # Page size and size fallback
//!
//! 1 GiB pages at the asked size first; then 2 MiB pages at the asked size;
//! then the largest size the kernel's free 1 GiB (then 2 MiB) pages allow.
//! Any change is reported in `page_size`, `size_bytes` and `note`, never
//! silently.

mod config;
mod daemon;
mod error;
mod handout;
mod limits;
mod populate;
mod report;
mod run;
/// The report as a table for operators.
mod table;
#[cfg(test)]
mod tests;

pub use config::AllocBenchConfig;
pub use error::AllocBenchError;
pub(crate) use handout::resident_and_holes;
pub use handout::HandOut;
pub use limits::AllocLimits;
pub(crate) use populate::cloud_hypervisor_style;
pub use populate::cloud_hypervisor_threads;
pub use report::{AllocBenchReport, AllocMedians, AllocRatios, AllocSamples, ScalingPoint};
pub use run::run;
