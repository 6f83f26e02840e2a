//! The hugemem daemon library.
//!
//! - [`daemon`]: `hugemem serve`, a tokio control plane over a UNIX socket
//!   ([`proto`], specified in `docs/protocol.md`) that owns guest RAM regions
//!   (from `guest-mem`), keeps freed ones in a per-node pool scrubbed by pinned
//!   workers, and never hands out a page that is not clean.
//! - [`client`] and [`guest_memory`]: what a rust-vmm VMM links to get
//!   `connect → alloc → GuestMemoryMmap` (re-exported from `hugemem-client`,
//!   which a VMM should depend on directly); [`lazy`] and [`fault`] are the
//!   two ends of demand-fault clearing over a userfaultfd ([`uffd`]).
//!
//! The `hugemem` binary (crate `cli/`) is built on this library: it adds the
//! command line, `status`, `rebalance`, `launch`, `hugepages`, `demo` and the
//! benches.

#![deny(missing_docs)]

pub use hugemem_client::{client, diag, guest_memory, lazy, stats, uffd};

/// The daemon: socket server, pool, scrubbers, sessions, metrics.
pub mod daemon;
/// Lazy mode, daemon side: the userfaultfd fault service that clears pages on first touch.
pub mod fault;
/// Processes of the daemon's own that fault a region's holes in, at idle priority.
pub mod fault_helpers;
pub mod pidfd;
/// The wire protocol (`hugemem_client::proto`) and its async framing for the daemon.
pub mod proto;
/// Raw syscalls behind small safe wrappers (fd-owning `recvmsg`, `fstat` size, populate).
pub mod sys;
