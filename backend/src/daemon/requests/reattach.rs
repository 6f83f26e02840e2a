//! REATTACH: after a daemon restart, a VMM takes its orphaned allocation
//! back on a new connection with the allocation's token. Beside ALLOC
//! ([`crate::daemon::requests::alloc::serve()`]) and HANDOFF
//! ([`crate::daemon::requests::handoff::serve`]), the third way an allocation is
//! handed out; what it hands out is an orphan, re-attached.
//!
//! The move is one step under the pool's lock
//! ([`crate::daemon::pool::Owners::reattach`]); the VMM kept its fds and
//! mappings, so the reply ([`crate::daemon::requests::delivery`], REATTACH's body) is
//! the region table only, as the daemon has it now.

use std::sync::Arc;

use tracing::info;

use crate::daemon::pool::{AllocId, AllocToken, OwnershipError, Pool, SessionId};
use crate::daemon::requests::delivery::{rows_now, Delivery, HandOut, LazyHandedOut, Served};
use crate::daemon::requests::outcome::Outcome;
use crate::proto::messages::RegionInfo;
use crate::proto::Status;

/// Takes orphaned allocation `alloc_id` into `session` (peer `uid`) with
/// its `token` and builds the reply. An allocation whose faults its VMM's
/// fallback served since the restart comes back as a lazy allocation for
/// the session to record: its VMM may hand the uffd back (UFFD), and the
/// fault service then resumes on these regions.
///
/// # Errors
///
/// The refusal, one text for every reason (see [`Owners::reattach`](crate::daemon::pool::Owners::reattach)).
pub fn serve(
    pool: &Pool,
    session: SessionId,
    uid: u32,
    alloc_id: AllocId,
    token: &AllocToken,
) -> Result<Served, OwnershipError> {
    let (regions, locked) = pool.owners().reattach(alloc_id, token, session, uid)?;
    let lazy_fallback = pool.owners().lazy_fallback(alloc_id);
    // REATTACH's hand-out opens nothing (the VMM kept its fds): it
    // cannot fail, and should it all the same, the VMM hears why.
    let hand_out = match HandOut::open(Delivery::Reattach, rows_now(&regions, locked)) {
        Ok(h) => h,
        Err(e) => return Ok(Outcome::error(Status::Internal, e.to_string()).into()),
    };
    let lazy = lazy_fallback.then(|| LazyHandedOut {
        alloc: alloc_id,
        infos: hand_out
            .table()
            .iter()
            .map(|i| RegionInfo {
                flags: i.flags | RegionInfo::FLAG_LAZY,
                ..*i
            })
            .collect(),
        regions: regions.iter().map(|(_, r)| Arc::clone(r)).collect(),
    });
    info!(
        session,
        uid,
        alloc = alloc_id,
        regions = hand_out.table().len(),
        lazy_fallback,
        "REATTACH: orphaned allocation taken back by its VMM"
    );
    Ok(Served {
        outcome: hand_out.reply(alloc_id, None),
        lazy,
    })
}
