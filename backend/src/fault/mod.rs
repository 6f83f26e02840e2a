//! Lazy mode, daemon side: serving a VMM's guest-RAM faults by clearing each
//! huge page just before the guest first touches it.
//!
//! A VMM that asked for lazy memory gets a dirty pooled region at once, maps
//! it, registers its mapping on a userfaultfd in MINOR mode and sends the
//! uffd here (`UFFD` request, see `docs/protocol.md`). A [`FaultService`]
//! then owns that uffd:
//!
//! * one **reader** thread (`hm-uffd-rd`) waits in `epoll` on the uffd, a
//!   stop `EventFd` and the VMM's pidfd; it reads events in batches, turns
//!   page faults into jobs (region, page, fault offset) through the range
//!   table, and applies UNMAP/REMAP events to that table in order;
//! * **handler** threads (`hm-uffd-hN`, 2 by default) serve jobs
//!   concurrently: faults on different pages never wait for each other
//!   (cloud-hypervisor serves its uffd from one thread, an open complaint
//!   there). A dirty page is cleared through the daemon's own mapping of the
//!   memfd with the multi-page kernel, the faulting 4 KiB neighbourhood last
//!   so it is cache-hot ([`clearing::clear_huge_page_raw`]), then
//!   `UFFDIO_CONTINUE` maps it into the VMM and wakes the vCPU;
//! * node-local **scrubbers** (`hm-uffd-sN-i`, pinned to node N's CPUs) run
//!   ahead: read-ahead hints after each fault first, then every page in
//!   guest-physical order; each page they clear is installed with
//!   `UFFDIO_CONTINUE` at once, so the guest never faults on it.
//!
//! Every page goes through the [`guest_mem::PageStates`] machine, so each is
//! cleared exactly once per dirty epoch and none is installed before it is
//! clean; the rules per state are in [`policy`]. The uffd mechanism and that
//! policy are apart (Firecracker's page-fault-handler split).
//!
//! # Kernel behaviour this relies on
//!
//! * MINOR faults fire only for pages in the file's page cache. Pooled pages
//!   are (they were populated and cleared before); a fresh, never-allocated
//!   page in a MINOR-only range raises no event at all and the kernel hands
//!   out a page it zeroed itself. [`FaultService::start`] therefore refuses a
//!   region with a dirty page that is not resident, and a page that the
//!   states call `Unpopulated` but that faults MINOR is the guest's own
//!   kernel-zeroed page: adopted, not cleared.
//! * Without `UFFD_FEATURE_EXACT_ADDRESS` fault addresses are aligned down to
//!   the huge page (the neighbourhood is then the page's start); the VMM
//!   client enables it.
//! * `UFFDIO_CONTINUE` on a page already mapped gives `EEXIST` and wakes
//!   nobody; [`crate::uffd::Uffd::continue_range`] wakes the range itself.
//!   `EAGAIN` (a non-cooperative event not read yet) is retried while the
//!   reader reads it.
//! * The uffd's ranges belong to the VMM's address space; the daemon cannot
//!   unregister them. When the VMM dies, the uffd reports nothing: the VMM's
//!   pidfd ends the service, or a fill fails with `ESRCH`.
//! * Closing the last uffd fd under a waiting MINOR fault maps the page as it
//!   is, uncleared. The VMM keeps its own copy for as long as the guest runs;
//!   stopping the service closes only the daemon's copy, so unserved faults
//!   stay pending rather than leak (see `docs/security.md`).
//!
//! # Alternatives
//!
//! One thread per service reading and serving inline is what
//! cloud-hypervisor does; a 1 GiB clear (~0.1 s) then stalls every other
//! vCPU's fault. N threads each polling the uffd would also serve
//! concurrently, but UNMAP/REMAP would race with faults read by another
//! thread; one reader keeps events in order.
//!
//! [`FaultService`]: crate::fault::FaultService
//! [`policy`]: crate::fault::policy
//! [`FaultService::start`]: crate::fault::FaultService::start

mod error;
pub mod metrics;
pub mod pagemap;
pub mod policy;
pub mod service;
pub use hugemem_client::table;

pub use error::{FaultError, Result};
pub use metrics::{FaultMetrics, FaultStats, FaultSums, FaultTotals, Histogram, LatencySummary};
pub use pagemap::dirty_pages_resident;
pub use service::{
    live_services, FaultMapping, FaultReport, FaultService, FaultServiceConfig, FaultServiceHandle,
    StopReason,
};
