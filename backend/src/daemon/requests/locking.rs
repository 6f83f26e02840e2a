//! LOCK and UNLOCK: mlock or munlock an allocation's regions in the
//! daemon's mapping, in chunks, off the executor.
//!
//! The ownership check, the mlock or munlock and the recorded state are one
//! step: the allocation's change gate ([`crate::daemon::pool::ChangeGate`]) is held
//! throughout (a HANDOFF waits for it, so its reply reports the state this
//! request leaves), and the state is recorded only while the requesting
//! session still owns the allocation. Should it have lost it all the same,
//! the mapping is put back as recorded for the new owner and the request is
//! answered NOT_FOUND, as it would be after the move.

use std::sync::Arc;

use guest_mem::Region;
use numa::Topology;
use tracing::{info, warn};

use crate::daemon::peers::peer_log;
use crate::daemon::pool::{AllocId, Pool, SessionId};
use crate::daemon::requests::alloc;
use crate::daemon::requests::outcome::Outcome;
use crate::proto::messages::{Reply, ReplyBody};
use crate::proto::Status;

/// Serves LOCK (`lock`) or UNLOCK of `alloc_id` for `session` (peer `uid`).
pub(crate) async fn serve(
    pool: &Pool,
    topology: &Arc<Topology>,
    (session, uid): (SessionId, u32),
    alloc_id: AllocId,
    chunk: u64,
    lock: bool,
) -> Outcome {
    let gate = match pool.owners().change_gate(alloc_id, session) {
        Ok(g) => g,
        Err(e) => return Outcome::error(Status::NotFound, e.to_string()),
    };
    let _held = gate.lock_owned().await;
    let (regions, _) = match pool.owners().regions_of(alloc_id, session) {
        Ok(r) => r,
        Err(e) => return Outcome::error(Status::NotFound, e.to_string()),
    };
    match set_lock(topology, regions.clone(), lock, chunk).await {
        Ok((bytes, micros)) => {
            if let Err((lost, recorded)) = pool.owners().set_locked(alloc_id, session, lock) {
                let recorded = recorded.unwrap_or(false);
                if recorded != lock {
                    if let Err(o) = set_lock(topology, regions, recorded, 0).await {
                        warn!(session, alloc = alloc_id, reason = %o.reply.message, "cannot restore a lost allocation's lock state");
                    }
                }
                return Outcome::error(Status::NotFound, lost.to_string());
            }
            if let Some(suppressed) = peer_log::LOCK_CHANGED.check(uid) {
                info!(
                    session,
                    uid,
                    alloc = alloc_id,
                    bytes,
                    micros,
                    lock,
                    suppressed,
                    "allocation lock state changed"
                );
            }
            Outcome::reply(Reply::ok(ReplyBody::Lock { bytes, micros }))
        }
        Err(refused) => refused,
    }
}

/// mlock (`lock`) or munlock `regions` on a blocking thread; the bytes and
/// microseconds it took, or the error reply.
async fn set_lock(
    topology: &Arc<Topology>,
    regions: Vec<Arc<Region>>,
    lock: bool,
    chunk: u64,
) -> Result<(u64, u64), Outcome> {
    let topology = Arc::clone(topology);
    let job = tokio::task::spawn_blocking(move || {
        let refs: Vec<&Region> = regions.iter().map(|r| &**r).collect();
        alloc::lock_regions(&topology, &refs, lock, chunk, None)
    });
    match job.await {
        Ok(Ok(done)) => Ok(done),
        Ok(Err((status, msg))) => Err(Outcome::error(status, msg)),
        Err(e) => Err(Outcome::error(
            Status::Internal,
            alloc::join_error(&e).to_string(),
        )),
    }
}
