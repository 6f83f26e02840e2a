//! Live update of a launched VMM without copying guest RAM.
//!
//! `hugemem launch --name VM -- qemu-system-x86_64 …` listens on a control
//! socket (`control.rs`); `hugemem update VM [--qemu NEW]` asks it to
//! update. The launcher does it on the thread that waits for the VMM
//! (`Updater`, `updater.rs`):
//!
//! 1. the running VMM's control channel is made ready (QEMU: its QMP
//!    monitor greeted, `qmp.rs`);
//! 2. the successor's guest RAM (`successor_memory.rs`): a second daemon
//!    connection takes the allocation over with HANDOFF (its own file
//!    descriptors, a new token; the old connection then owns nothing) and
//!    goes to the daemon watcher through the mailbox (`mailbox.rs`); from a
//!    daemon without HANDOFF, duplicates of the launcher's descriptors;
//! 3. the successor starts on that memory with the same arguments and the
//!    channels the switch needs;
//! 4. the switch moves the guest over (`switch.rs`: the `VmmSwitch` trait,
//!    the VMM-specific part, which each VMM's adapter implements in its own
//!    folder, `launch/vmm/qemu/switch.rs` and
//!    `launch/vmm/cloud_hypervisor/switch.rs`), and returns once the
//!    successor runs the guest;
//! 5. the waiting thread supervises the successor from then on (signals,
//!    exit status); the replaced VMM is told to exit and reaped, and the
//!    report (`request.rs`) goes back to `hugemem update`.
//!
//! On a failure before the switch, the successor is killed and the old VMM
//! keeps running the guest (QEMU: resumed with `cont` if the migration had
//! stopped it); the error goes back to `hugemem update`. Memory is never at
//! risk: both VMMs map the same daemon pages, and the daemon keeps pages
//! any process maps.
//!
//! Another VMM kind plugs in as a `VmmSwitch` of its own, made by its
//! adapter (`launch/vmm/`); the memory, the mailbox, the supervision
//! hand-over and the report are shared. Nothing here names a VMM.

mod error;
mod mailbox;
mod request;
mod restored_memory;
mod successor_memory;
mod switch;
mod updater;

pub use error::UpdateError;
pub(crate) use mailbox::SuccessorMailbox;
pub use request::{ParkReport, Reply, Request, UpdateReport};
pub(crate) use restored_memory::RestoredMemory;
pub(crate) use switch::monotonic_ns;
pub use switch::{MigrationFigures, SuccessorCommand, Switched, VmmSwitch};
pub(crate) use updater::{MemorySlot, Updater};
