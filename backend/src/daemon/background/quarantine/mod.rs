//! The quarantine: what a released region goes through before its pages
//! may be scrubbed and handed to another tenant. Nothing leaves it unless a
//! `/proc` scan finds no other holder and the proofs before reuse pass.
//!
//! One entry point per step of a FREE's region, from use to the clean pool:
//!
//! 1. **Enter.** FREE or disconnect: [`Pool::release`] /
//!    [`Pool::release_session`] (`pool/release.rs`) turn the allocation's
//!    regions `Quarantined` (or give them back to the kernel over a limit);
//!    the session unlocks them and kicks the loop
//!    (`crate::daemon::connections::session::settle_released`).
//! 2. **Wake.** [`quarantine_loop`] (`recheck.rs`) runs on every kick, every
//!    `pool.recheck_ms`, and when a holder it watches exits (pidfds).
//! 3. **List.** [`QuarantineBook::quarantined`] (`pool/quarantine.rs`): each region
//!    with the daemon's own fd and mapping, which the scan exempts.
//! 4. **Check**, on a blocking thread, off the pool's lock:
//!    [`reuse::check_quarantined`] (`reuse.rs`) runs one [`holders::scan`]
//!    (`daemon/peers/holders.rs`) for all, then [`reuse::judge`] on each: held, else
//!    [`reuse::prove_unreachable`] (the write lease), else the file's size
//!    and, with `pool.detach_pages`, [`reuse::detach_pages`] under the
//!    [`gate::ReserveGate`] (`pool/gate.rs`); a [`reuse::Verdict`]
//!    (`pool/quarantine.rs`, which applies it) names who is to blame.
//! 5. **Apply.** [`QuarantineBook::apply_scan`] (`pool/quarantine.rs`): free regions
//!    turn `Dirty`, or `Clean` at once when detached; held and withheld ones
//!    stay; the others go back to the kernel (`pool/release.rs`).
//! 6. **Clean.** The node's scrubbers (`crate::daemon::background::scrub`) take dirty
//!    pages, or a detached region's holes, through [`Scrubbing::next_scrub`] and
//!    report through [`Scrubbing::scrub_done`] / [`Scrubbing::refault_done`]
//!    (`pool/scrubbing.rs`); the region is in the clean pool, where
//!    [`Pool::take`] finds it.
//!
//! [`Pool::release`]: crate::daemon::pool::Pool::release
//! [`Pool::release_session`]: crate::daemon::pool::Pool::release_session
//! [`QuarantineBook::quarantined`]: crate::daemon::pool::QuarantineBook::quarantined
//! [`QuarantineBook::apply_scan`]: crate::daemon::pool::QuarantineBook::apply_scan
//! [`Scrubbing::next_scrub`]: crate::daemon::pool::Scrubbing::next_scrub
//! [`Scrubbing::scrub_done`]: crate::daemon::pool::Scrubbing::scrub_done
//! [`Scrubbing::refault_done`]: crate::daemon::pool::Scrubbing::refault_done
//! [`Pool::take`]: crate::daemon::pool::Pool::take
//! [`quarantine_loop`]: crate::daemon::background::quarantine::quarantine_loop
//! [`holders::scan`]: crate::daemon::peers::holders::scan
//! [`reuse::check_quarantined`]: crate::daemon::background::quarantine::reuse::check_quarantined
//! [`reuse::judge`]: crate::daemon::background::quarantine::reuse::judge
//! [`reuse::prove_unreachable`]: crate::daemon::background::quarantine::reuse::prove_unreachable
//! [`reuse::detach_pages`]: crate::daemon::background::quarantine::reuse::detach_pages
//! [`reuse::Verdict`]: crate::daemon::pool::Verdict
//! [`gate::ReserveGate`]: crate::daemon::pool::ReserveGate

mod recheck;
pub mod reuse;

pub use recheck::{quarantine_loop, Recheck, MAX_HOLDER_WATCHES};
