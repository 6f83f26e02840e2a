//! One adapter per VMM: everything `hugemem` does that depends on which
//! VMM runs the guest, behind one trait ([`VmmAdapter`]).
//!
//! * [`qemu`] (`qemu/`): QEMU's command line (`memory-backend-file` per
//!   region), its QMP monitor, and its live update (a migration with
//!   `x-ignore-shared` over a socket pair). No park or restore yet: the
//!   adapter says so.
//! * [`cloud_hypervisor`] (`cloud_hypervisor/`): cloud-hypervisor's
//!   command line (`--memory size=0` and one shared file zone per region),
//!   its REST API and event monitor, its live update (its own local
//!   migration), park (its offload snapshot sent to the daemon) and
//!   restore (a parked VM received by a new cloud-hypervisor).
//!
//! A reader of one VMM's support opens its folder. The launcher picks the
//! adapter once ([`Vmm::adapter`](crate::launch::Vmm::adapter), the one
//! place that turns a VMM kind into its code, in `select.rs`) and calls
//! through the trait from then on; nothing outside this folder branches on
//! the kind. A new VMM is a new folder and one line there.
//!
//! Imports point one way: the adapters use the launcher's shared parts
//! (the command-line vocabulary, `allocation.rs`, the update's
//! `VmmSwitch` and report, the configuration); only `run.rs`,
//! `restore.rs` and the commands above the launcher use the adapters.

mod adapter;
pub mod cloud_hypervisor;
pub mod qemu;
mod select;

pub use adapter::{
    CloneLaunch, CloneReceiver, ParkError, RestoreLaunch, RestoreReceiver, VmmAdapter, VmmClone,
    VmmRestore,
};
pub use select::by_name;
