//! A refused park-room request, counted and logged the same way for every
//! request (PARK, RESTORE, EXPORT, a copy clone): its counter, one
//! rate-limited line per uid, and the error reply.

use std::sync::atomic::AtomicU64;

use tracing::info;

use crate::daemon::counters::metrics::Metrics;
use crate::daemon::ids::SessionId;
use crate::daemon::requests::outcome::Outcome;
use crate::proto::Status;

/// Who asked for what, as the refusal's log line names them.
pub(super) struct Asker<'a> {
    /// The request, as the log line says it ("PARK", "RESTORE", …).
    pub what: &'static str,
    /// The asking connection.
    pub session: SessionId,
    /// Its uid (the log line's rate limit is per uid).
    pub uid: u32,
    /// The VM's name.
    pub name: &'a str,
}

/// Counts the refusal in `counter`, logs it (rate-limited per uid) and
/// answers `status` with `msg`.
pub(super) fn refuse(
    counter: &AtomicU64,
    asker: Asker<'_>,
    status: Status,
    msg: String,
) -> Outcome {
    Metrics::add(counter, 1);
    if let Some(suppressed) = crate::daemon::peers::peer_log::REQUEST_REFUSED.check(asker.uid) {
        info!(
            session = asker.session,
            uid = asker.uid,
            name = %asker.name,
            reason = %msg,
            suppressed,
            "{} refused",
            asker.what
        );
    }
    Outcome::error(status, msg)
}
