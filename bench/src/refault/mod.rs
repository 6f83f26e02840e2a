//! `hugemem bench refault`: the refault of punched huge pages, all in one
//! run on pages reserved for it:
//!
//! * rates (`rates.rs`): fault helpers (processes at `SCHED_IDLE`, what the
//!   daemon uses), threads of this process through its own mapping (the
//!   way before), and `fallocate` on the file, each with 1, 2, 4, … and all
//!   CPUs of the node; beside them the limit, the memory's write bandwidth
//!   (a non-temporal clear with as many threads);
//! * a CPU-bound tenant (`tenant.rs`): its rate alone, and while helpers or
//!   threads of normal priority refault on the same CPUs;
//! * the daemon's responsiveness (`daemon.rs`): STATS round trips while a
//!   released region is refaulted, with helpers and with the scrubber
//!   thread, against the same daemon idle.

mod daemon;
mod error;
mod load;
mod rates;
mod run;
mod tenant;

pub use daemon::Responsiveness;
pub use error::RefaultBenchError;
pub use rates::{RatePoint, Rates};
pub use run::{run, RefaultBenchConfig, RefaultBenchReport};
pub use tenant::TenantFigures;
