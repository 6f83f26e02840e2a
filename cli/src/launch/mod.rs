//! `hugemem launch`: allocate guest RAM through the daemon and run a VMM on it.
//!
//! ```text
//! hugemem launch --size 4G --nodes 0:2G,1:2G -- cloud-hypervisor --kernel vmlinux …
//! hugemem launch --size 2G -- qemu-system-x86_64 -M microvm -kernel guest.elf …
//! ```
//!
//! # Design
//!
//! The work is split in three:
//!
//! * **One adapter per VMM** ([`vmm`]: `vmm/qemu/`, `vmm/cloud_hypervisor/`,
//!   behind [`VmmAdapter`]): everything particular to a VMM — its command
//!   line, its live update, park and restore. The launcher picks the
//!   adapter once ([`Vmm::adapter`]) and calls through it.
//! * **Command-line construction** ([`VmmAdapter::build_args`]) is pure: user arguments and a region table in, the
//!   VMM's argument list out. It refuses any user option that would give the
//!   VMM a second, conflicting idea of guest RAM (`--memory`, `-m`,
//!   `-object memory-backend-*`, …) with a message naming the option, rather
//!   than produce a command line whose meaning depends on which option the VMM
//!   parses last. The checks run *before* anything is allocated
//!   ([`VmmAdapter::check_args`]).
//! * **Allocation** goes through [`hugemem_client::client::Client`] like any VMM would.
//! * **Running the VMM** ([`run_vmm`]) spawns it with the region fds
//!   inherited, forwards SIGTERM/SIGINT/SIGHUP to it, waits, and returns its
//!   exit status; [`run`] then sends FREE. The daemon releases the allocation
//!   on disconnect as well, so a `launch` killed with SIGKILL leaks nothing.
//! * **The daemon connection** is watched on a thread while the VMM runs
//!   (`reattach.rs`): when the daemon closes it (a crash or a restart, after
//!   which the new daemon restores the allocation orphaned), launch
//!   reconnects within [`reattach_timeout`] and re-attaches the
//!   allocation with the token of its ALLOC reply, so FREE at the end still
//!   works. If that fails it says so and the VMM keeps running: its memory
//!   stays mapped, and the daemon never reuses memory a process maps.
//!
//! * **Live update** (`--name`): a control socket for `hugemem update`
//!   ([`control`]); the launcher starts a new VMM on the same memory and
//!   moves the guest to it without copying RAM ([`update`], a folder of its
//!   own, with each VMM's switch in its adapter: QEMU's a migration with
//!   `x-ignore-shared` on memory from a daemon HANDOFF, cloud-hypervisor's
//!   its local migration, which passes its memory fds on).
//!
//! # How the VMM reaches the memory
//!
//! * **fd mode** (default): the region memfds are inherited by the VMM and
//!   named `/dev/fd/N` on its command line. cloud-hypervisor opens `file=` with
//!   no create, truncate or fallocate, and takes alignment from `statfs` of
//!   the file, which for a hugetlb memfd reports the huge-page size; QEMU's
//!   `memory-backend-file` does the same with `mem-path=`. The fds keep their
//!   numbers: `FD_CLOEXEC` is cleared in the child only, after `fork`, for
//!   exactly these fds (see [`run_vmm`] for why not `dup2` to fixed numbers).
//! * **hugetlbfs mode** (`--hugetlbfs`): the daemon creates each region as a
//!   file on a hugetlbfs mount and sends its path (ALLOC flag `PATHS`). Needed
//!   where a memfd will not do: cloud-hypervisor `--landlock` adds a landlock
//!   rule for each file in its configuration, and adding one for a memfd
//!   (`/dev/fd/N`, a file of the kernel's internal hugetlbfs mount) fails with
//!   EBADFD, so the VM is not created (`docs/operations.md`).
//!
//! # What hugemem does instead of the VMM
//!
//! cloud-hypervisor refuses `host_numa_node` for a shared file zone, so NUMA
//! placement is done by the daemon (one region per node, `mbind` before the
//! first fault). cloud-hypervisor splits guest RAM around the 3 GiB hole and
//! maps one zone file at two offsets; that needs nothing from hugemem beyond a
//! file as large as the zone. Prefault is left off: the daemon hands out
//! memory that is already populated and clean.
//!
//! [`vmm`]: crate::launch::vmm
//! [`VmmAdapter`]: crate::launch::vmm::VmmAdapter
//! [`VmmAdapter::build_args`]: crate::launch::vmm::VmmAdapter::build_args
//! [`VmmAdapter::check_args`]: crate::launch::vmm::VmmAdapter::check_args
//! [`Vmm::adapter`]: crate::launch::Vmm::adapter
//! [`run_vmm`]: crate::launch::run_vmm
//! [`run`]: crate::launch::run
//! [`reattach_timeout`]: crate::launch::LaunchConfig::reattach_timeout
//! [`update`]: crate::launch::update
//! [`control`]: crate::launch::control

mod allocation;
mod clone;
mod command_line;
mod config;
pub mod control;
pub mod control_dir;
mod error;
mod exit_event;
mod process;
mod reattach;
mod report;
mod restore;
mod run;
#[cfg(test)]
mod tests;
pub mod update;
pub mod vmm;

pub(crate) use allocation::memory_regions;
pub(crate) use command_line::{option_name, text};
pub use command_line::{BuildError, BuildOptions, MemoryFile, MemoryRegion, Vmm};
pub use config::{
    parse_nodes, parse_page_policy, LaunchConfig, NodesError, DEFAULT_REATTACH_TIMEOUT,
    DEFAULT_UPDATE_TIMEOUT, NODES_SYNTAX,
};
pub use control::{control_socket_path, request_park, request_update, ControlError};
pub use error::{LaunchError, Unsupported};
pub(crate) use process::keep_across_exec;
pub use process::{run_vmm, VmmExit};
pub use run::{run, LaunchReport};
pub use update::{ParkReport, UpdateError, UpdateReport};
