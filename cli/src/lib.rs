//! The `hugemem` command's library half: what the binary's subcommands run
//! beside `serve` (which is `backend::daemon::serve`), public so that the
//! integration tests can call the benches and the launchers directly.
//!
//! - [`launch`]: runs cloud-hypervisor or QEMU on daemon memory.
//! - [`qemu_wrapper`]: the QEMU a libvirt domain names as its emulator.
//! - [`bench`] and [`demo`]: measurements that report ratios against a
//!   baseline measured in the same run.
//! - [`status`], [`rebalance_cli`], [`hugepages`]: the operator's commands.
//!
//! [`bench`]: mod@bench

#![deny(missing_docs)]

/// Benchmarks behind `hugemem bench …`.
pub mod bench;
/// `hugemem demo`: daemon, 1 GiB pages, micro-guest, scrub and pool reuse, as a timeline.
pub mod demo;
/// `hugemem hugepages`: reserve huge pages and mount hugetlbfs, with a report.
pub mod hugepages;
/// `hugemem launch`: cloud-hypervisor and QEMU command lines over daemon memory.
pub mod launch;
mod private_dir;
/// `hugemem qemu-wrapper`: the emulator a libvirt domain names, on daemon memory.
pub mod qemu_wrapper;
/// `hugemem rebalance`: the operator's REBALANCE client.
pub mod rebalance_cli;
/// `hugemem status`: STATS rendered as text for operators.
pub mod status;
