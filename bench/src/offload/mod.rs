//! `hugemem bench offload --size S`: hugemem as cloud-hypervisor's offload
//! daemon (`hugemem park`, `hugemem launch --restore`, `hugemem unpark
//! --save`, `hugemem park --from-dir`), against cloud-hypervisor's own
//! `file://` snapshot and restore and its reference `offload_daemon`, in
//! the same run, on the same spinning micro-guest (`microguest::spin`,
//! `bench vmm-update`'s), on 2 MiB pages or 1 GiB pages (`--page-size`). Each repetition runs every
//! variant once, in turn, so that what moves a whole repetition (the
//! shared host's load, its disk's cache) moves all of them:
//!
//! 1. **From the park** (`hugemem_side.rs`): a VM launched by `hugemem
//!    launch` on a private daemon is parked (`hugemem park`: its memory
//!    moves into the parked record) and restored (`hugemem launch
//!    --restore`: a new cloud-hypervisor on the same pages). Park time is
//!    the `hugemem park` command's wall time; restore time the restore
//!    command's start to the guest counting again; the guest's pause its
//!    largest recorded gap across both; bytes copied the daemon's STATS
//!    for the park (0 expected) and what the old cloud-hypervisor wrote
//!    (`/proc/PID/io` `wchar`, last read before it exited).
//! 2. **From disk through hugemem** (`hugemem_side.rs`): the same VM parked
//!    again, saved (`hugemem unpark NAME --save DIR`), its files dropped
//!    from the page cache, the disk's sequential read rate measured on its
//!    memory file (cold, as `bench fill` does), the files dropped again,
//!    loaded (`hugemem park NAME2 --from-dir DIR`: the fill engine) and
//!    restored. The load's rate is guest RAM over its wall time, against
//!    the disk's.
//! 3. **cloud-hypervisor's own `file://`** (`ch_side.rs`): a
//!    cloud-hypervisor on its own memory (`--memory
//!    size=S,shared=on,hugepages=on,hugepage_size=2M`) is paused and
//!    snapshotted (`vm.pause`, `vm.snapshot file://DIR`) and shut down; its
//!    files dropped from the page cache; a new one started with `--restore
//!    source_url=file://DIR,resume=true`: its start to the guest counting.
//! 4. **The reference offload daemon** (`ch_side.rs`): `offload_daemon
//!    snapshot` receives the same kind of VM by local migration
//!    (`send-migration … local=on`) and writes it to a directory; after the
//!    cache is dropped a new cloud-hypervisor `receive-migration`s from
//!    `offload_daemon restore --resume`: the new process's start to the
//!    guest counting.
//!
//! 5. **QEMU** (`qemu_side.rs`, with `--qemu`): a launched QEMU parked
//!    and restored through hugemem, against QEMU's own `migrate` to a file
//!    and `-incoming` from it, and its floor (`x-ignore-shared` to a file
//!    and back on a resident memfd, no daemon).
//!
//!    Then **on demand** (`hugemem_side.rs`): the same files, cache
//!    dropped, parked with `--on-demand` (checked, nothing read) and
//!    restored with `hugemem launch --restore --on-demand`
//!    (cloud-hypervisor's postcopy: the daemon reads each page as the
//!    guest faults it and the rest in the background): the restore's start
//!    to the guest counting, and to every page filled (the launcher's
//!    "restored:" line), then the host's check of the guest's pages.
//!
//! Each save is measured in a round of the disk's own write rates
//! (`save_vs_disk.rs`, `disk_write.rs`), on the same file system, as many
//! bytes: right before it one direct writer (`dd bs=1M oflag=direct
//! conv=fsync`) and direct writers as the saver's (its threads, 8 MiB
//! writes), right after it the same two in the reverse order, then one
//! writer through the page cache with `fsync`. The save's rate over the
//! mean of each direct writer's before and after is its share of the
//! disk (expected: 0.8x or more of the `dd`-like rate).
//!
//! With `--dense` (`dense.rs`) every guest's RAM is filled with
//! incompressible bytes before its first park or snapshot, all but what
//! the micro-guest uses or checks: a guest that wrote all its memory.
//! Without it, the guest holds one word per 4 KiB page and zeros.
//!
//! Page caches are dropped per file (fsync, `POSIX_FADV_DONTNEED`), never
//! host-wide.

mod ch_side;
mod dense;
mod disk_write;
mod error;
mod figure;
mod hugemem_side;
mod qemu_report;
mod qemu_side;
mod report;
mod run;
mod save_vs_disk;
mod steps;

pub use error::OffloadError;
pub use qemu_report::{QemuComparison, QemuResult, OVER_FLOOR_MS};
pub(crate) use qemu_side::{floor_save_restore, own_save_restore};
pub use report::{
    ChFileResult, Figure, FromDiskResult, FromParkResult, OffloadConfig, OffloadDaemonResult,
    OffloadReport, OnDemandResult,
};
pub use run::run;
pub use save_vs_disk::{DiskWriteResult, SaveOverDisk, Spread, SAVE_SHARE};
