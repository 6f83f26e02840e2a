//! `hugemem-client`: what a VMM links to take its guest RAM from a hugemem
//! daemon (`docs/integrating.md`).
//!
//! - [`client`]: a blocking client for the daemon's socket protocol
//!   ([`proto`], specified in `docs/protocol.md`): connect, ALLOC, FREE,
//!   LOCK, REBALANCE, STATS.
//! - [`guest_memory`]: an allocation's fds as a rust-vmm `GuestMemoryMmap`.
//! - [`lazy`]: lazy mode on the VMM side: register guest RAM on a
//!   userfaultfd ([`uffd`]), hand it to the daemon, keep a fallback that
//!   serves faults itself if the daemon dies.
//!
//! - [`park`]: PARK, RESTORE and UNPARK of a cloud-hypervisor VM, over
//!   cloud-hypervisor's own migration protocol (the `ch-migration` crate).
//! - [`saved_vm`]: a parked VM saved to a directory and parked from one.
//!
//! No tokio, clap, toml or KVM: the daemon (`backend`) and the `hugemem`
//! binary bring those.

#![deny(missing_docs)]

/// Blocking client for the daemon's socket protocol.
pub mod client;
/// Diagnostics helpers: error chains, rate-limited log lines.
pub mod diag;
/// An allocation's fds as a rust-vmm `GuestMemoryMmap` (the vm-memory adapter).
pub mod guest_memory;
/// Lazy mode, VMM side: register guest RAM on a userfaultfd, hand it to the daemon, keep a fallback.
pub mod lazy;
/// `/proc/self/pagemap`: which pages of a mapping are present.
pub mod pagemap;
/// PARK, RESTORE and UNPARK: a cloud-hypervisor VM parked in the daemon.
pub mod park;
/// The wire protocol: framing, messages, fd passing.
pub mod proto;
pub mod saved_vm;
/// The STATS reply as types, shared by the daemon and its readers.
pub mod stats;
/// Raw syscalls behind small safe wrappers (the fd-owning `recvmsg`, an aligned buffer).
pub mod sys;
/// Address ranges to targets (a VMM's guest-RAM mappings to regions).
pub mod table;
/// userfaultfd: kernel ABI and safe wrappers (no bindgen).
pub mod uffd;
