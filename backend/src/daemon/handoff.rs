//! HANDOFF (issue 26): a VMM's successor process takes the VMM's
//! allocation over on its own connection, with the allocation's token.
//!
//! The move itself is one step under the pool's lock
//! ([`crate::daemon::pool::Pool::hand_off`]): the allocation belongs to the
//! old connection until it belongs to the new one. The successor gets what
//! an ALLOC would have given it — the region table, its own open file
//! descriptions of the regions ([`crate::sys::reopen`], so the write-lease
//! proof at release counts them), the hugetlbfs paths when asked — and a
//! new token, so the predecessor, which knew the old one, can neither take
//! the allocation back nor hand it on. Nothing is cleared: the memory is
//! the guest's.
//!
//! A reply that cannot be delivered releases the allocation, as for ALLOC
//! (the successor is gone, and it owned the allocation); the quarantine
//! keeps the regions from reuse while the predecessor still maps them.

use std::sync::Arc;

use guest_mem::Region;
use tracing::info;

use super::outcome::Outcome;
use super::pool::{AllocId, HandoffError, Pool, RegionId, SessionId};
use crate::proto::messages::{RegionInfo, Reply, ReplyBody};
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

/// Moves the allocation to `session` (peer `uid`) and builds the reply;
/// returns it with the connection that owned the allocation before. The
/// caller holds the allocation's change gate
/// ([`crate::daemon::pool::Pool::hand_off_gate`]).
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
) -> Result<(Outcome, Option<SessionId>), HandoffError> {
    let want_paths = req.want_paths;
    let (handed, (fds, paths)) =
        pool.hand_off(req.alloc_id, &req.token, session, uid, |regions| {
            let mut fds = Vec::with_capacity(regions.len());
            let mut paths = Vec::new();
            for (id, region) in regions {
                if want_paths {
                    let path = region.path().ok_or(HandoffError::NoPaths(req.alloc_id))?;
                    paths.push(path.display().to_string());
                }
                let fd = crate::sys::reopen(region.fd()).map_err(|e| {
                    HandoffError::Internal(format!("cannot open region {id} for the client: {e}"))
                })?;
                fds.push(fd);
            }
            Ok((fds, paths))
        })?;
    let regions = region_table_now(&handed.regions, handed.locked);
    // Two connections of one tenant can pass an allocation back and forth.
    if let Some(suppressed) = super::peer_log::HANDED_OFF.check(uid) {
        info!(
            session,
            uid,
            alloc = req.alloc_id,
            from = ?handed.previous,
            regions = regions.len(),
            suppressed,
            "HANDOFF: allocation moved to its VMM's successor connection"
        );
    }
    let outcome = Outcome {
        reply: Reply::ok(ReplyBody::Alloc {
            alloc_id: req.alloc_id,
            regions,
            paths,
            token: Some(handed.token),
        }),
        fds,
        alloc: Some(req.alloc_id),
        close: false,
    };
    Ok((outcome, handed.previous))
}

/// The status a HANDOFF refusal is answered with.
pub fn refusal_status(e: &HandoffError) -> Status {
    match e {
        HandoffError::Refused(_) => Status::NotFound,
        HandoffError::AlreadyYours(_)
        | HandoffError::NotCleared { .. }
        | HandoffError::NoPaths(_) => Status::Invalid,
        HandoffError::Internal(_) => Status::Internal,
    }
}

/// An allocation's region table as an ALLOC would report it now, in
/// guest-physical order: LAZY while pages are still to be cleared (as far
/// as the daemon knows), else CLEAN; LOCKED when locked. REATTACH and
/// HANDOFF answer with it.
pub fn region_table_now(regions: &[(RegionId, Arc<Region>)], locked: bool) -> Vec<RegionInfo> {
    let mut guest_phys = 0;
    regions
        .iter()
        .map(|(id, region)| {
            let counts = region.states().counts();
            let mut flags = if counts.dirty + counts.clearing > 0 {
                RegionInfo::FLAG_LAZY
            } else {
                RegionInfo::FLAG_CLEAN
            };
            if locked {
                flags |= RegionInfo::FLAG_LOCKED;
            }
            let info = RegionInfo {
                region_id: *id,
                guest_phys,
                size: region.len(),
                page_size: region.page_size().bytes(),
                node: region.node().unwrap_or(crate::proto::ANY_NODE),
                flags,
            };
            guest_phys += region.len();
            info
        })
        .collect()
}
