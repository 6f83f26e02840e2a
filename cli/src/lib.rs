//! The `hugemem` command's library half: what the binary's subcommands run
//! beside `serve` (which is `backend::daemon::serve`), public so that the
//! integration tests, and the benches of the `hugemem-bench` crate, can call
//! the launchers directly.
//!
//! - [`launch`]: runs cloud-hypervisor or QEMU on daemon memory.
//! - [`qemu_wrapper`]: the QEMU a libvirt domain names as its emulator.
//! - [`status`], [`rebalance_cli`], [`hugepages`], [`check`]: the operator's commands.
//! - [`companion`]: finds a binary installed beside this one (`hugemem demo`
//!   and `hugemem bench …` run `hugemem-bench`, which is not part of this
//!   crate, so that the shipped daemon carries no benchmark and no guest).
//! - [`arg_values`]: the value parsers both command lines share.

#![deny(missing_docs)]

pub mod arg_values;
/// `hugemem check`: whether this host is ready for the daemon and its tenants.
pub mod check;
pub mod companion;
/// `hugemem hugepages`: reserve huge pages and mount hugetlbfs, with a report.
pub mod hugepages;
/// `hugemem launch`: cloud-hypervisor and QEMU command lines over daemon memory.
pub mod launch;
/// `hugemem park` and `hugemem unpark`.
pub mod park_cli;
/// `hugemem qemu-wrapper`: the emulator a libvirt domain names, on daemon memory.
pub mod qemu_wrapper;
/// `hugemem rebalance`: the operator's REBALANCE client.
pub mod rebalance_cli;
/// `hugemem status`: STATS rendered as text for operators.
pub mod status;
