//! `hugemem bench takeover`: a daemon upgrade or restart by
//! `hugemem serve --takeover` against the plain stop and start
//! it replaces, the baseline, and against no switch at all, the floor,
//! measured in the same run on the same settings.
//!
//! # Setup (the same for both modes, afresh for each)
//!
//! A private daemon (`hugemem serve` as a child process, its own socket in
//! a private directory, a config whose pool target and limit hold
//! everything) with `allocations` tenants, each an ALLOC of `alloc_bytes`
//! held on a connection of its own, mapped and written (a word per 4 KiB)
//! like a running VM, and `pool_bytes` of clean pool: regions of
//! `alloc_bytes` allocated, freed, and waited for until STATS shows them
//! clean and fully present (`not_present` 0, nothing pending or in
//! quarantine).
//!
//! # The switch
//!
//! While every tenant connection and `idle_clients` more send STATS in a
//! loop and one more thread opens connection after connection:
//!
//! * **takeover**: `hugemem serve --takeover` with the same config and
//!   socket is spawned; the old process must exit by itself.
//! * **stop-start** (the baseline): SIGTERM, wait for the exit, spawn a
//!   plain `hugemem serve`.
//!
//! From the switch's start (the spawn, or the SIGTERM) a prober connects
//! again and again until the **new** process answers (STATS `pid`), then
//! ALLOCs one pool region's size: `first_alloc_ms` ends at its reply, and
//! it was *warm* when STATS `counters.regions_pooled` went up by one and
//! `regions_fresh` did not. The prober then ALLOCs the rest of the old
//! pool's size (the next VMs): `pool_served_ms` ends when all of it was
//! served, warm when every region came from the pool.
//!
//! # The floor (no switch)
//!
//! Each round also runs the same setup afresh with nothing switched: the
//! same clients, then the same prober path (connect, STATS, ALLOC) against
//! the steady daemon, from the moment a switch would start: the first ALLOC
//! from the clean pool, then the old pool's size, and the clients' longest
//! stall over a window as long as the round's longer switch kept them
//! (`window_ms`). Its bytes zeroed are counter deltas of the same process;
//! their limit is 0.
//!
//! # What is reported, per mode (the floor included) and round
//!
//! * the longest stall any client saw: from a request sent to the next
//!   successful reply, failed attempts and reconnects included;
//! * failed requests, and connections refused (nothing listening);
//! * bytes zeroed by the new daemon across the switch: `scrub.bytes` (the
//!   new process's own) + `counters.pages_detached` x page size +
//!   `counters.bytes_created` (regions created fresh, which the kernel
//!   zeroes), counter deltas against the old daemon's last STATS when the
//!   counters came over (takeover), else against 0 (a fresh process);
//! * allocations still known (tenant ids the new daemon's STATS lists) and
//!   free-able (each tenant's FREE on its own connection: the original one,
//!   or the one it had to open again after losing it);
//! * tenants whose memory still reads what they wrote.

mod clients;
mod config;
mod error;
mod report;
mod run;
mod switch;
mod table;
mod tenant;

pub use clients::ClientRun;
pub use config::{Mode, TakeoverConfig};
pub use error::TakeoverError;
pub use report::{Expectation, ModeRound, ModeSummary, OverFloor, Ratios, Spread, TakeoverReport};
pub use run::run;
