//! The hugemem daemon and CLI.
//!
//! - [`daemon`]: `hugemem serve`, a tokio control plane over a UNIX socket
//!   ([`proto`], specified in `docs/protocol.md`) that owns guest RAM regions
//!   (from `guest-mem`), keeps freed ones in a per-node pool scrubbed by pinned
//!   workers, and never hands out a page that is not clean.
//! - [`client`] and [`guest_memory`]: what a rust-vmm VMM links to get
//!   `connect → alloc → GuestMemoryMmap`; [`lazy`] and [`fault`] are the two
//!   ends of demand-fault clearing over a userfaultfd ([`uffd`]).
//! - [`launch`]: runs cloud-hypervisor or QEMU on daemon memory.
//! - [`bench`] and [`demo`]: measurements that report ratios against a
//!   baseline measured in the same run.

#![deny(missing_docs)]

/// Benchmarks behind `hugemem bench …`.
pub mod bench;
/// Blocking client for the daemon's socket protocol.
pub mod client;
/// The daemon: socket server, pool, scrubbers, sessions, metrics.
pub mod daemon;
/// `hugemem demo`: daemon, 1 GiB pages, micro-guest, scrub and pool reuse, as a timeline.
pub mod demo;
/// Diagnostics helpers: error chains, rate-limited log lines.
pub mod diag;
/// Lazy mode, daemon side: the userfaultfd fault service that clears pages on first touch.
pub mod fault;
/// An allocation's fds as a rust-vmm `GuestMemoryMmap` (client side of the vm-memory adapter).
pub mod guest_memory;
/// `hugemem hugepages`: reserve huge pages and mount hugetlbfs, with a report.
pub mod hugepages;
/// `hugemem launch`: cloud-hypervisor and QEMU command lines over daemon memory.
pub mod launch;
/// Lazy mode, VMM side: register guest RAM on a userfaultfd, hand it to the daemon, keep a fallback.
pub mod lazy;
mod private_dir;
/// The wire protocol: framing, messages, fd passing.
pub mod proto;
/// `hugemem rebalance`: the operator's REBALANCE client.
pub mod rebalance_cli;
/// `hugemem status`: STATS rendered as text for operators.
pub mod status;
/// Raw syscalls behind small safe wrappers (fd-owning `recvmsg`, `fstat` size, populate).
pub mod sys;
/// userfaultfd: kernel ABI and safe wrappers (no bindgen).
pub mod uffd;
