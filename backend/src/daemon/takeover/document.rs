//! The state document built from the components' states: the
//! orchestration of a takeover's and of the fd store's save. Each
//! component numbers its own fds in the document's [`FdList`].

use std::os::fd::OwnedFd;

use super::parts::Parts;
use super::state::{self, State};
use crate::daemon::lifecycle::ParkedConnection;
use crate::daemon::persist::fds::FdList;
use crate::daemon::persist::SaveError;
use crate::daemon::pool::Snapshot;

/// Who a state document is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// A successor on the control channel: connections travel.
    Successor,
    /// systemd's fd store (`crate::daemon::fdstore`): no connection
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
    let listeners = parts.listeners.save(&mut fds, to_store)?;
    let regions = save_regions(snap, &mut fds)?;
    let parked = parts.lifecycle.parked();
    let travelling = if to_store { &[][..] } else { &parked[..] };
    let (connections, max_session) = save_connections(travelling, &mut fds)?;
    drop(parked);
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
        allocations: snap.allocs.iter().map(|a| a.save(to_store)).collect(),
        connections,
        counters: parts.metrics.to_map(),
    };
    Ok((doc, fds.into_fds()))
}

/// The pool's regions, each with its fd.
fn save_regions(snap: &Snapshot, fds: &mut FdList) -> Result<Vec<state::RegionRecord>, SaveError> {
    snap.regions
        .iter()
        .map(|r| Ok(r.save(fds.add(r.region.fd())?)))
        .collect()
}

/// The parked connections ([`ParkedConnection::save`]); and the highest
/// session id among them.
fn save_connections(
    travelling: &[ParkedConnection],
    fds: &mut FdList,
) -> Result<(Vec<state::ConnectionRecord>, u64), SaveError> {
    let max_session = travelling.iter().map(|c| c.session).max().unwrap_or(0);
    let connections = travelling
        .iter()
        .map(|c| c.save(fds))
        .collect::<Result<_, _>>()?;
    Ok((connections, max_session))
}
