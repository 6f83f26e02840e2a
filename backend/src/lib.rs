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

pub use hugemem_client::{client, diag, guest_memory, lazy, stats, uffd};

/// Benchmarks behind `hugemem bench …`.
pub mod bench;
/// The daemon: socket server, pool, scrubbers, sessions, metrics.
pub mod daemon;
/// `hugemem demo`: daemon, 1 GiB pages, micro-guest, scrub and pool reuse, as a timeline.
pub mod demo;
/// Lazy mode, daemon side: the userfaultfd fault service that clears pages on first touch.
pub mod fault;
/// `hugemem hugepages`: reserve huge pages and mount hugetlbfs, with a report.
pub mod hugepages;
/// `hugemem launch`: cloud-hypervisor and QEMU command lines over daemon memory.
pub mod launch;
mod private_dir;
/// The wire protocol (`hugemem_client::proto`) and its async framing for the daemon.
pub mod proto;
/// `hugemem rebalance`: the operator's REBALANCE client.
pub mod rebalance_cli;
/// `hugemem status`: STATS rendered as text for operators.
pub mod status;
/// Raw syscalls behind small safe wrappers (fd-owning `recvmsg`, `fstat` size, populate).
pub mod sys;
