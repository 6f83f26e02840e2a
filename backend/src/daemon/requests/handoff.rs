//! HANDOFF: a VMM's successor process takes the VMM's allocation over on
//! its own connection, with the allocation's token. Beside ALLOC
//! ([`crate::daemon::requests::alloc::serve()`]) and REATTACH
//! ([`crate::daemon::requests::reattach::serve`]), the third way an allocation is
//! handed out; what it hands out is a live allocation, moved.
//!
//! The move itself is one step under the pool's lock
//! ([`crate::daemon::pool::Owners::hand_off`]): the allocation belongs to the
//! old connection until it belongs to the new one. The successor gets what
//! an ALLOC would have given it ([`crate::daemon::requests::delivery`], opened inside
//! that step before anything moves) and a new token, so the predecessor,
//! which knew the old one, can neither take the allocation back nor hand it
//! on. Nothing is cleared: the memory is the guest's.
//!
//! A reply that cannot be delivered releases the allocation, as for ALLOC
//! (the successor is gone, and it owned the allocation); the quarantine
//! keeps the regions from reuse while the predecessor still maps them.

use tracing::info;

use crate::daemon::pool::{AllocId, HandoffError, Pool, SessionId};
use crate::daemon::requests::delivery::{rows_now, Delivery, HandOut, HandOutError};
use crate::daemon::requests::outcome::Outcome;
use crate::proto::{Status, TOKEN_SIZE};

/// A decoded HANDOFF request.
#[derive(Debug, Clone, Copy)]
pub struct HandoffRequest {
    /// The allocation.
    pub alloc_id: AllocId,
    /// Its current token.
    pub token: [u8; TOKEN_SIZE],
    /// Send the regions' hugetlbfs paths.
    pub want_paths: bool,
}

/// Moves the allocation to `session` (peer `uid`) and builds the reply. The
/// caller holds the allocation's change gate
/// ([`crate::daemon::pool::Owners::hand_off_gate`]).
///
/// # Errors
///
/// The refusal: [`HandoffError::Refused`] is the one a session counts
/// toward closing the connection (a token guesser).
pub fn serve(
    pool: &Pool,
    session: SessionId,
    uid: u32,
    req: HandoffRequest,
) -> Result<Outcome, HandoffError> {
    let delivery = Delivery::Alloc {
        want_paths: req.want_paths,
    };
    let (handed, hand_out) =
        pool.owners()
            .hand_off(req.alloc_id, &req.token, session, uid, |regions, locked| {
                HandOut::open(delivery, rows_now(regions, locked)).map_err(|e| match e {
                    HandOutError::NoPath(_) => HandoffError::NoPaths(req.alloc_id),
                    e @ HandOutError::Open { .. } => HandoffError::Internal(e.to_string()),
                })
            })?;
    // Two connections of one tenant can pass an allocation back and forth.
    if let Some(suppressed) = crate::daemon::peers::peer_log::HANDED_OFF.check(uid) {
        info!(
            session,
            uid,
            alloc = req.alloc_id,
            from = ?handed.previous,
            regions = handed.regions.len(),
            suppressed,
            "HANDOFF: allocation moved to its VMM's successor connection"
        );
    }
    let outcome = hand_out.reply(req.alloc_id, Some(handed.token));
    Ok(outcome)
}

/// The status a HANDOFF refusal is answered with: the one place that
/// says a refusal a guesser could learn from is NOT_FOUND.
pub fn refusal_status(e: &HandoffError) -> Status {
    match e {
        HandoffError::Refused(_) => Status::NotFound,
        HandoffError::AlreadyYours(_)
        | HandoffError::NotCleared { .. }
        | HandoffError::NoPaths(_) => Status::Invalid,
        HandoffError::Internal(_) => Status::Internal,
    }
}
