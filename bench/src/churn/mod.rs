//! `hugemem bench churn`: N VM launches back to back (K at once) against one
//! daemon, each guest probing the memory the previous guests wrote, and the
//! same churn on the VMM's own preallocated memory as the baseline.
//!
//! # What runs
//!
//! Every launch boots the project's micro-guest on `size` bytes of RAM. The
//! guest reads the first 8 bytes of every 2 MiB of RAM from 1 MiB up and then
//! writes `marker ^ gpa` there ([`microguest::pattern`]). Every guest of a
//! churn has the same RAM layout, so each one *probes exactly the addresses
//! every earlier guest wrote*, before writing them itself. A non-zero read
//! there (the guest's `nonzero=1`) is an earlier guest's marker seen by a
//! later one: a **stale read**. Nothing else writes those addresses (the
//! guest starts at 1 MiB because QEMU's firmware writes the real-mode vector
//! table at GPA 0).
//!
//! The VMM, `--vmm` or else the first that is there:
//!
//! * `cloud-hypervisor` (the binary `CLOUD_HYPERVISOR` names) and `qemu`
//!   (`qemu-system-x86_64 -M microvm`): each launch is a real
//!   `hugemem launch --size S -- VMM …` process (ALLOC, VMM run, FREE, as an
//!   operator runs it); the page sizes come from its summary line. The
//!   baseline runs the same VMM on its own memory: QEMU
//!   `memory-backend-memfd,hugetlb=on,prealloc=on,prealloc-threads=<CPUs>`,
//!   cloud-hypervisor `--memory size=S,hugepages=on,prefault=on`.
//! * `micro`: hugemem's own KVM runner ([`microguest::run`]) in this process,
//!   on daemon memory the way a rust-vmm VMM takes it (connect, ALLOC, map
//!   the fds, run, unmap, FREE); the baseline maps anonymous hugetlb memory
//!   and populates it (`MADV_POPULATE_WRITE`: the kernel allocates and zeroes
//!   every page before the vCPU starts, the same work as `MAP_POPULATE`).
//!
//! The **floor**, a third side: the same VMM command line and guest as
//! hugemem's side (for `micro`: the same runner and mapping path) on a
//! hugetlb memfd of the same size and page size that the bench populated
//! before the clock, handed to the VMM as `/dev/fd/N` exactly as `hugemem
//! launch` hands over a daemon's fds, no daemon: RAM that needs no
//! preparation ([`crate::floor`], shared with `bench compare`). One memfd
//! per launch at once; since each guest writes markers, the memfd is zeroed
//! again between launches, off the clock: punched
//! (`FALLOC_FL_PUNCH_HOLE`) and populated again (`MADV_POPULATE_WRITE`), so
//! every floor guest reads zeros like the others (`floor.stale_reads`).
//! `over_floor`: hugemem's p50 minus the floor's, for the launch, ready and
//! all touched. With `--socket` the floor still runs; where its memory
//! cannot be had (the live daemon's pool may hold the pages) it is skipped
//! and `floor_skipped` says why; without `--socket` that fails the run.
//!
//! The **limit** beside "all RAM touched", `limits.kernel_zeroing_1_thread_ms`:
//! the kernel's fault-time zeroing of the size on one thread, the least a
//! one-vCPU guest touching memory with holes can take. Measured in the same
//! run with the floor's memory before its launches: one untimed populate of
//! a fresh memfd (warm-up), then three timed ones (`MADV_POPULATE_WRITE` of a
//! fresh memfd on the bench's thread, each memfd freed before the next);
//! the median, every sample, and the rate.
//!
//! # What is measured
//!
//! Three spans per launch, each from the launch's start: `ready_ms`, to the
//! guest's first instruction; `touched_ms`, to the guest having read and
//! written every 2 MiB of its RAM; `ms`, to the launch's end (below). The
//! guest marks the first two on port 0x3f0 (123, then 124); the VMM's debug
//! console on that port (QEMU `isa-debugcon`, cloud-hypervisor
//! `--debug-console`) writes them to its stdout, where they are timed as
//! they arrive; `micro` takes them from its runner. Each is reported as
//! p50/p99 against the baseline's (`ready`, `touched`), and the report says
//! how many VMs of this size the host's pages held at the start
//! (`host_vm_fits`: 1 is an exact fit, 2 or more leaves pages to spare).
//!
//! A launch's time runs from the start of the `hugemem launch` process (for
//! `micro`: the connect) to its end after the guest powered off and the
//! memory was freed; a baseline launch's from the VMM's start to its exit.
//! Both sides end at the same point, and hugemem's side also carries the
//! FREE and its own process start. Per side: p50, p99 (nearest rank) and max
//! of the N launches; one untimed warm-up launch comes first on each side
//! (`warmup_ms`: the outer host backs never-touched memory lazily, and the
//! daemon's first ALLOC takes fresh pages). A floor launch runs from the
//! VMM's start (for `micro`: the mapping of the memfd) to its exit. The
//! order is baseline, floor, then hugemem: the baseline runs first, before
//! a private daemon exists, so it finds the huge pages free, and the floor
//! frees its memfds before the daemon starts (an exact-fit host has the
//! pages of one VM only). The private
//! daemon (no `--socket`) is `hugemem serve` in a process of its own, as a
//! host runs it: in the bench's process its scrubbers' page faults would
//! hold the `mmap_lock` the micro runner's mappings need.
//!
//! `downgrades`: the daemon's `downgrades` counter over the timed launches
//! when its STATS has one (`downgrades_source: "daemon"`); else the launches
//! whose reply had a page smaller than `expected_page_size`, the largest
//! page the policy allowed (for `best`: that divides the size) of which the
//! host had enough for K launches at the start, free in the kernel or idle
//! in the daemon's pool (`downgrades_source: "replies"`).

mod assemble;
mod error;
mod floor_side;
mod launches;
mod options;
mod pages;
mod plan;
mod process;
mod report;
mod run;

pub use error::ChurnError;
pub use options::{ChurnConfig, ChurnVmm};
pub use report::{
    ChurnLimits, ChurnReport, FloorReport, LaunchSample, OverFloor, SpanReport, Spread,
};
pub use run::run;
