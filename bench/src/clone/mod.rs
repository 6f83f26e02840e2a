//! `hugemem bench clone`: N clones of an S GiB template (a parked VM),
//! started one after another and N at once, in both modes (`hugemem launch
//! --clone-of NAME --clone-mode shared|copy`, the launcher's normal path),
//! against the floor measured in the same run (restores from the park of
//! the same VM, `hugemem launch --restore NAME`, one after another and N at
//! once) and cloud-hypervisor's own restore of the same VM from its
//! `file://` snapshot in every restore mode it offers. With `--vmm qemu`
//! every VM is a QEMU (`hugemem launch --control-socket … --
//! qemu-system-x86_64 …`, parked through that socket), and QEMU's own
//! save and restore of the same VM replace cloud-hypervisor's
//! (`qemu_own.rs`: its floor, `x-ignore-shared` to a file and back, and
//! its `migrate` of all RAM to a file).
//!
//! For every kind of start: each VM's request to its guest running (p50,
//! p95; "running" is the counting micro-guest's counter seen past the count
//! its memory held, `observe.rs`), the memory the VMs took from the pool
//! (STATS) and from the kernel (`free_hugepages` and `resv_hugepages`
//! deltas, smaps `Private_Hugetlb`), each clone's 4 KiB pages against the
//! template's (those outside the guest's own area must all match), and the
//! template's digest before and after.
//!
//! `plan.rs` decides which combinations of size and count fit this host's
//! memory and says why the others are left out; `phases.rs` runs them,
//! `cover.rs` checks that the pool and the kernel cover each batch before
//! it starts, `starts.rs` measures one batch, `ch_restore.rs` runs
//! cloud-hypervisor's restores; the table is `report/tables/clone.rs`'s, made from the JSON.

mod ch_restore;
mod cover;
mod launch;
mod observe;
mod phases;
pub mod plan;
mod qemu_own;
mod report;
mod run;
mod starts;

pub use ch_restore::CH_RESTORE_MODES;
pub use plan::{host_budget, parse_list, vmm_arg, CloneConfig, Combination, LeftOut, List, Plan};
pub use qemu_own::QEMU_RESTORE_KINDS;
pub use report::{
    nearest_rank, ChRestoreResult, CloneReport, QemuRestoreResult, Series, StartResult,
    TemplateCheck,
};
pub use run::{plan, run};
