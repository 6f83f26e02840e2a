//! Rate limits for the log lines a peer can cause at will, one limiter per
//! line and per uid.
//!
//! A tenant that loops on a request (guessing tokens, connecting and
//! disconnecting, ALLOC and FREE) would otherwise write a line per request:
//! a token-guessing flood measured 60,000 refusals a second, over a
//! terabyte of log a day. Each line below lets a short burst and then one
//! line a second per uid through and counts the rest (`suppressed=` in the
//! next line of that uid), so the log keeps its shape and its totals, and
//! one uid's flood never silences another uid's lines. Counters (`/metrics`, STATS) still
//! count every event.
//!
//! Keys are peers' uids; the allowed uids are few, but a refused uid still
//! reaches its refusal's line, so each limiter remembers at most
//! [`MAX_UIDS`] of them (see [`KeyedRateLimit`]).

use std::time::Duration;

use crate::diag::KeyedRateLimit;

/// A per-uid limiter of one log line.
pub type PerUid = KeyedRateLimit<u32>;

/// Uids each limiter remembers.
pub const MAX_UIDS: usize = 256;

/// Every limiter here earns one line per uid a second.
const PERIOD: Duration = Duration::from_secs(1);

/// A line that stands for trouble (a refusal, a closed connection): one a
/// second per uid says it goes on, the counts say how much.
const fn one_per_second() -> PerUid {
    KeyedRateLimit::new(PERIOD, 1, MAX_UIDS)
}

/// A line of normal operation (a session, an ALLOC): a VMM's usual burst
/// (a few connections at start, a handoff) is logged whole, then one a
/// second.
const fn a_few_per_second() -> PerUid {
    KeyedRateLimit::new(PERIOD, 4, MAX_UIDS)
}

/// "session started".
pub static SESSION_STARTED: PerUid = a_few_per_second();
/// "session ended".
pub static SESSION_ENDED: PerUid = a_few_per_second();
/// "session ended with live allocations; released": ALLOC then disconnect,
/// in a loop.
pub static SESSION_RELEASED: PerUid = a_few_per_second();
/// A REATTACH or HANDOFF refused for its id, uid or token (a guess).
pub static TOKEN_REFUSED: PerUid = one_per_second();
/// Any other refusal at INFO: HANDOFF (not a token's), UFFD.
pub static REQUEST_REFUSED: PerUid = one_per_second();
/// "closing connection" (a protocol error, 8 refused tokens).
pub static CONNECTION_CLOSED: PerUid = one_per_second();
/// A request that carried file descriptors it should not have.
pub static STRAY_FDS: PerUid = one_per_second();
/// A connecting uid that is not allowed.
pub static UID_REFUSED: PerUid = one_per_second();
/// A connection over its uid's share, or over the daemon's.
pub static NO_SLOT: PerUid = one_per_second();
/// "HANDOFF: allocation moved": two connections can pass one allocation
/// back and forth.
pub static HANDED_OFF: PerUid = a_few_per_second();
/// "ALLOC served" (and its note).
pub static ALLOC_SERVED: PerUid = a_few_per_second();
/// "ALLOC refused" and "ALLOC failed".
pub static ALLOC_REFUSED: PerUid = one_per_second();
/// "ALLOC reply not delivered; allocation released".
pub static ALLOC_UNDELIVERED: PerUid = one_per_second();
/// "allocation released into quarantine" (FREE, a closing connection).
pub static RELEASED: PerUid = a_few_per_second();
/// "allocation lock state changed": LOCK and UNLOCK in a loop.
pub static LOCK_CHANGED: PerUid = a_few_per_second();
/// "REBALANCE done" and "REBALANCE refused or failed".
pub static REBALANCE: PerUid = a_few_per_second();
/// "region left quarantine", by the uid that last held the region: ALLOC
/// and FREE in a loop release a region each time.
pub static LEFT_QUARANTINE: PerUid = a_few_per_second();
/// "region scrubbed; clean in the pool", by the uid that last held it.
pub static SCRUBBED: PerUid = a_few_per_second();

/// [`KeyedRateLimit::check`] for a line about a region last handed to
/// `tenant`; a region no tenant ever held is not a peer's doing, and its
/// line is not limited.
pub fn check_tenant(limit: &PerUid, tenant: Option<u32>) -> Option<u64> {
    match tenant {
        Some(uid) => limit.check(uid),
        None => Some(0),
    }
}
