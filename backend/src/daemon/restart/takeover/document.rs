//! The state document built from the components' states: the
//! orchestration of a takeover's and of the fd store's save. Each
//! component saves itself through [`Persist`] and numbers its own fds in
//! the document's [`FdList`].

use std::os::fd::OwnedFd;

use super::parts::Parts;
use super::state::{self, State};
use crate::daemon::persist::fds::FdList;
use crate::daemon::persist::{Persist, SaveContext, SaveError};
use crate::daemon::pool::Snapshot;
use crate::daemon::requests::parked::loads_record::LoadSnapshot;

/// Who a state document is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// A successor on the control channel: connections travel.
    Successor,
    /// systemd's fd store (`crate::daemon::restart::fdstore`): no connection
    /// survives, so every allocation is orphaned until its VMM re-attaches;
    /// `last` when the daemon is frozen and stopping (the document is then
    /// exact).
    FdStore {
        /// Written frozen, at a clean stop.
        last: bool,
    },
}

/// The state document of `parts` (with the pool's snapshot `snap`) and its
/// fds; `seq` is the fd store's sequence, for a successor to go on from.
///
/// # Errors
///
/// An fd that cannot be duplicated.
pub fn build(
    parts: &Parts,
    snap: &Snapshot,
    target: Target,
    seq: u64,
) -> Result<(State, Vec<OwnedFd>), SaveError> {
    let to_store = matches!(target, Target::FdStore { .. });
    let mut fds = FdList::new(!to_store);
    let mut ctx = SaveContext {
        fds: &mut fds,
        to_store,
    };
    let listeners = parts.listeners.save(&mut ctx)?;
    let regions = save_all(&snap.regions, &mut ctx)?;
    let parked = parts.lifecycle.parked();
    let travelling = if to_store { &[][..] } else { &parked[..] };
    let connections = save_all(travelling, &mut ctx)?;
    let max_session = travelling.iter().map(|c| c.session).max().unwrap_or(0);
    drop(parked);
    let allocations = save_all(&snap.allocs, &mut ctx)?;
    let fills = save_all(&LoadSnapshot::all(&parts.fills), &mut ctx)?;
    let doc = State {
        format: state::FORMAT.into(),
        version: state::VERSION,
        // The fd store's sequence, for a successor to go on from.
        seq,
        last: matches!(target, Target::FdStore { last: true }) || target == Target::Successor,
        daemon_version: env!("CARGO_PKG_VERSION").into(),
        pid: std::process::id(),
        listener: listeners.listener,
        metrics: listeners.metrics,
        socket_owned: listeners.socket_owned,
        next_region: snap.next_region,
        next_alloc: snap.next_alloc,
        next_session: parts.next_session_hint().max(max_session + 1),
        regions,
        allocations,
        connections,
        fills,
        clone_templates: parts.clones.marked(),
        counters: parts.metrics.to_map(),
    };
    Ok((doc, fds.into_fds()))
}

/// Every component of `parts` saved, in order.
fn save_all<P: Persist>(
    parts: &[P],
    ctx: &mut SaveContext<'_>,
) -> Result<Vec<P::State>, SaveError> {
    parts.iter().map(|p| p.save(ctx)).collect()
}
