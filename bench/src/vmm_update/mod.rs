//! `hugemem bench vmm-update --vmm qemu --size S`: a live update of QEMU
//! under a running guest on hugemem memory (`hugemem update`: a new QEMU on
//! the same pages, `x-ignore-shared`, no RAM copied) beside its floor (the
//! same updates by plain QEMUs on one resident memfd, no daemon) and
//! against a plain local QEMU migration that copies RAM into the
//! destination's own memory, in the same run, on the same guest. Both
//! baselines are written once for both VMMs (`baselines.rs`), over each
//! VMM's processes (`qemu.rs`, `ch.rs`).
//!
//! `--vmm cloud-hypervisor` measures the same for cloud-hypervisor, whose
//! update is its own local migration (the memory's fds move over the
//! socket): its floor is two plain cloud-hypervisors doing that migration on
//! one resident memfd, its copy the migration without `local=on`. Its RAM
//! bytes sent are what the old process wrote during the switch
//! (`/proc/PID/io` `wchar`).
//!
//! The guest is the micro-guest in spin mode (`microguest::spin`): it writes
//! `marker ^ gpa` into every 4 KiB page of its RAM (so each page is data a
//! copying migration must send), then re-reads its pages forever, counting
//! and keeping the largest gap between two iterations in TSC ticks. The bench
//! reads that block through the running QEMU's memory fd.
//!
//! * **Downtime** is the guest-visible pause: the bench sets the guest's
//!   largest gap to 0 just before the update and reads it right after; that
//!   gap, divided by the TSC rate the bench measured (host TSC against
//!   `CLOCK_MONOTONIC`; the guest's TSC runs at the same rate, checked), is
//!   the longest the guest did not run. The same figure over an idle window
//!   of the same length before is the noise floor (host scheduling on a
//!   busy machine), reported beside it.
//! * **Update time**: request to the old QEMU gone (hugemem), `migrate` to
//!   the destination's RESUME plus the source's exit (copy).
//! * **RAM bytes transferred**: QEMU's `query-migrate` `ram.transferred`.
//! * **Stale reads**: pages the guest found changed (its own check) plus
//!   pages the host finds without the guest's value after the update.
//! * **Allocation accounting** (hugemem side): the daemon's
//!   `created − released == held` after each update and after the VM exits,
//!   and bytes it cleared during the updates (0 expected).

mod baselines;
pub(crate) mod ch;
pub(crate) mod error;
pub(crate) mod guest;
pub(crate) mod qemu;
mod report;
mod run;
pub(crate) mod series;
pub(crate) mod setup;
mod side;

pub use error::VmmUpdateError;
pub use report::{CopyResult, UpdateResult, UpdateSeries, VmmUpdateConfig, VmmUpdateReport};
pub use run::run;
