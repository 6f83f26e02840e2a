//! `hugemem demo`: the whole data path in a few seconds, with a timeline.
//!
//! 1. Reserve huge pages for the run (1 GiB, else 2 MiB, else 4 KiB shmem;
//!    every fallback is said out loud), through `numa::hugepages` like the
//!    tests and operators (`hugemem hugepages`) do. The host pool is set back afterwards.
//! 2. Start a daemon on a private socket in a fresh 0700 directory.
//! 3. Warm up: populate and free the size once, timed and reported as the
//!    outer host's first touch (docs/platform.md#first-touch: a virtual
//!    machine's host backs never-touched memory lazily, seconds per GiB).
//!    Then ALLOC the VM's RAM: fresh pages, populated (the kernel zeroes
//!    them) by workers pinned to the node.
//! 4. Map the fds like a rust-vmm VMM ([`backend::client::Allocation::guest_memory`])
//!    and run the project's micro-guest on them under KVM: it reads the first
//!    8 bytes of every 2 MiB, reports whether any was non-zero, and writes a
//!    marker there. Skipped with a note where KVM is not usable.
//! 5. FREE, and wait (with a deadline) until the daemon's pool shows the
//!    region clean: its scrubbers cleared the guest's markers.
//! 6. ALLOC again: served from the clean pool, once the freed region is
//!    clean and its punched pages refaulted (a resident hand-out; `fstat` of
//!    the fds received says so, resident and hole bytes). The guest runs
//!    again and must read zeros where the first guest left markers.
//!
//! The report is a short human timeline or (`--json`) one object. Times are
//! wall-clock on this machine; the ratio of the two ALLOCs is the point, and
//! it is printed with both sides.

mod config;
mod error;
mod guest;
mod pages;
mod pool_watch;
mod report;
mod run;
#[cfg(test)]
mod tests;

pub use config::{DemoConfig, DEFAULT_SIZE};
pub use error::DemoError;
pub use report::{DemoReport, GuestFigures, PoolFigures};
pub use run::run;
