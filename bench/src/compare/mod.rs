//! `hugemem bench compare`: hugemem against the VMMs' own ways of making
//! guest RAM ready, each booting the project's PVH micro-guest, in one run.
//!
//! # Variants
//!
//! * `qemu_prealloc` (**the baseline**): Debian's `qemu-system-x86_64 -accel
//!   kvm -M microvm,memory-backend=ram0` with `-object
//!   memory-backend-memfd,id=ram0,hugetlb=on,hugetlbsize=P,prealloc=on,prealloc-threads=N`
//!   (N = online CPUs): QEMU populates every page (the kernel zeroes it) before
//!   the vCPU starts.
//! * `qemu_lazy`: the same without `prealloc`: the guest's own first touches
//!   fault the pages in while it runs.
//! * `qemu_hugemem_fresh`, `qemu_hugemem_pool`: the same QEMU given hugemem
//!   memory the way `hugemem launch` does (ALLOC on a daemon, the memfd
//!   inherited as `/dev/fd/N`, `memory-backend-file,share=on`, no prealloc):
//!   from a daemon whose pool is empty (fresh pages, populated and zeroed by
//!   node-local workers), and from its clean pool (pages a guest used before,
//!   scrubbed in the background after FREE).
//! * `ch_prefault`, `ch_hugemem_pool`: cloud-hypervisor with `--memory
//!   size=S,hugepages=on,hugepage_size=P,prefault=on`, and with hugemem memory
//!   from the clean pool (`--memory size=0 --memory-zone …,file=/dev/fd/N,shared=on`).
//!   Only when the environment variable `CLOUD_HYPERVISOR` names a binary
//!   (the CLI passes it in); skipped with a note otherwise.
//! * `client_fresh`, `client_pool`: hugemem's own rust-vmm path, no VMM
//!   process: [`Client::alloc`], [`backend::client::Allocation::guest_memory`],
//!   and [`microguest::run`] on the mapped memory, KVM driven directly.
//! * `qemu_floor`, `ch_floor`, `client_floor`: each one's **floor**: the
//!   same VMM (or client) and guest on a hugetlb memfd of the same size and
//!   page size that the bench populated before the clock started, handed
//!   over as hugemem's fds are, no daemon: RAM that needs no preparation.
//!   `over_floor` gives every measured variant's best and median times
//!   minus its VMM's floor's.
//!
//! The pool variants get a **resident** region: after each FREE the bench
//! waits until the pool shows it clean and its punched pages refaulted
//! (`pool_resident_s`). `--pool-holes` takes it the moment it is clean
//! instead, holes and all (`pool_hand_out` says which).
//!
//! # What is measured, per variant
//!
//! * `first_instruction_s`: launch (VMM spawn, or ALLOC for hugemem) to the
//!   guest's first instruction.
//! * `ready_s`: launch to guest RAM ready. Where the memory is populated
//!   before the vCPU starts (prealloc, prefault, hugemem) that is the first
//!   instruction; for `qemu_lazy` it is the guest's "all pages touched" mark,
//!   because only its own touches populate the RAM.
//! * `poweroff_s`: launch to the VMM's exit after the guest powered off (for
//!   the client: to [`microguest::run`] returning).
//! * `alloc_s`: the hugemem ALLOC (connect included), part of the above.
//! * `gib_per_s`: size / best `ready_s`.
//! * `ratios`: the baseline's best time over the variant's best time, for
//!   `ready_s` and `poweroff_s`: above 1 means faster than QEMU prealloc.
//!
//! # How the first instruction is seen
//!
//! The micro-guest's first instruction writes 123 (`{`) to port 0x3f0, and
//! it writes 124 (`|`) there once every page is touched. QEMU gets an
//! `isa-debugcon` device on that port whose chardev writes into the same
//! stdout pipe as the serial console; cloud-hypervisor gets `--debug-console
//! file=/dev/stdout,iobase=0x3f0`. The bench timestamps the read that brought
//! each byte. The alternative, a start marker printed on the serial console,
//! would need a change to the guest image and would come some instructions
//! later; the port write *is* the first instruction.
//!
//! # Order and state
//!
//! Each repetition runs every variant once, in two groups whose order
//! alternates (the VMM-owned memory first on even repetitions, hugemem first
//! on odd ones), and the order inside each group rotates. The hugemem group
//! starts a private daemon with an empty pool, runs one fresh variant, frees
//! (the pool scrubs it: `pool_scrub_s`), runs the pool variants one after the
//! other, each freeing and waiting for the scrub, then stops the daemon; the
//! other fresh variant runs on a second daemon. So at most `size` bytes of
//! huge pages are held at any time, which is what makes 2 GiB on 1 GiB pages
//! fit a machine with 3 of them. Before anything is timed the whole size is
//! populated and freed once (the outer host backs never-touched memory
//! lazily).
//!
//! # Page size
//!
//! 1 GiB pages when `size / 1 GiB` free pages can be reserved, else 2 MiB
//! pages, for **every** variant of the run (QEMU's `hugetlbsize`,
//! cloud-hypervisor's `hugepage_size` and hugemem's ALLOC): a fallback is
//! written into `page_size` and `note`, and the size is never changed.
//!
//! [`Client::alloc`]: backend::client::Client::alloc

mod bench;
mod config;
mod error;
mod report;
mod results;
mod run;
#[cfg(test)]
mod tests;
mod variant;
mod vmm;

pub use config::{CompareConfig, DEFAULT_SIZE};
pub use error::CompareError;
pub use report::{plot, plot_script};
pub use results::{CompareReport, Figure, OverFloor, Ratio, VariantReport, VariantSamples};
pub use run::run;
pub use variant::{Variant, BASELINE};
