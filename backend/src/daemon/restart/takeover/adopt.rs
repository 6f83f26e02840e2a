//! The successor's import (see [`crate::daemon::restart::takeover`]): every region
//! of the document adopted and checked, the pooled ones as at FREE, then
//! entered into the pool; every connection resumed by the server.

use std::sync::Arc;
use std::time::Instant;

use tracing::{info, warn};

use super::receive::Inherited;
use super::state::ConnectionRecord;
use crate::daemon::background::quarantine::reuse;
use crate::daemon::connections::server::{self, Server};
use crate::daemon::lifecycle::ParkedConnection;
use crate::daemon::peers::holders::Predecessor;
use crate::daemon::peers::peer::PidWatch;
use crate::daemon::persist::{Persist, RestoreContext};
use crate::daemon::pool::{
    AdoptError, Adopted, AllocSnapshot, Life, MalformedToken, Pool, RegionSnapshot,
};

/// Adopts every region of the document, checks the pooled ones as at FREE
/// ([`reuse::judge_inherited`]), and enters what passed into `pool` with
/// the document's allocations. The predecessor (unless it is this very
/// process: a test) is recorded in `predecessor`, so holder scans skip it
/// while it runs.
pub fn adopt_into(
    topology: &numa::Topology,
    pool: &Pool,
    predecessor: &Predecessor,
    inh: &mut Inherited,
) {
    let started = Instant::now();
    let own = i32::try_from(std::process::id()).ok();
    inh.predecessor = inh.predecessor.filter(|p| Some(*p) != own);
    predecessor.set(inh.predecessor);
    let (mut adopted, refused) = adopt_regions(topology, inh);
    // What failed its checks went back to the kernel: counted released,
    // so that created − released stays what the daemon holds.
    pool.records().released_unadopted(refused.bytes);
    // A document written while its daemon served may be older than the
    // last hand-out: none of its pooled regions is trusted clean.
    if !inh.state.last {
        for a in &mut adopted {
            if matches!(a.life, Life::Clean | Life::Dirty) {
                a.life = Life::Quarantined;
            }
        }
    }
    let quarantined = check_pooled(&mut adopted, inh.predecessor);
    let mut ctx = RestoreContext {
        fds: &mut inh.fds,
        topology,
    };
    let allocs: Vec<AllocSnapshot> = std::mem::take(&mut inh.state.allocations)
        .into_iter()
        .filter_map(|a| match AllocSnapshot::restore(a, &mut ctx) {
            Ok(a) => Some(a),
            Err(MalformedToken(alloc)) => {
                warn!(
                    alloc,
                    "an inherited allocation's token is malformed; not tracked"
                );
                None
            }
        })
        .collect();
    let regions = adopted.len();
    let kept = pool
        .records()
        .import(adopted, allocs, inh.state.next_region, inh.state.next_alloc);
    info!(
        regions,
        refused = refused.regions,
        quarantined,
        allocations = kept,
        ms = started.elapsed().as_secs_f64() * 1e3,
        "takeover: regions adopted and checked"
    );
}

/// Regions of the document that failed their checks (and went back to
/// the kernel), and their bytes.
#[derive(Debug, Default, Clone, Copy)]
struct Refused {
    regions: u64,
    bytes: u64,
}

/// Every region record restored ([`Persist`], which adopts it: `RegionRecord::adopt`), and
/// those that went back to the kernel.
fn adopt_regions(topology: &numa::Topology, inh: &mut Inherited) -> (Vec<Adopted>, Refused) {
    let mut adopted = Vec::new();
    let mut refused = Refused::default();
    let records = std::mem::take(&mut inh.state.regions);
    let mut ctx = RestoreContext {
        fds: &mut inh.fds,
        topology,
    };
    for r in records {
        let (id, len) = (r.id, r.len);
        match RegionSnapshot::restore(r, &mut ctx) {
            Ok(a) => adopted.push(a),
            // The document named no fd for it: nothing to adopt or give back.
            Err(AdoptError::NoFd) => {}
            Err(why) => {
                warn!(region = id, reason = %why, "an inherited region failed its checks; back to the kernel");
                refused.regions += 1;
                refused.bytes += len;
            }
        }
    }
    (adopted, refused)
}

/// The pooled regions' checks; one that fails goes through quarantine.
/// Returns how many did.
fn check_pooled(adopted: &mut [Adopted], predecessor: Option<i32>) -> u64 {
    let pooled: Vec<usize> = adopted
        .iter()
        .enumerate()
        .filter(|(_, a)| matches!(a.life, Life::Clean | Life::Dirty))
        .map(|(i, _)| i)
        .collect();
    let checks: Vec<reuse::Inherited<'_>> = pooled
        .iter()
        .map(|&i| reuse::Inherited {
            region: &adopted[i].region,
            whole: adopted[i].life == Life::Clean && !adopted[i].fill,
        })
        .collect();
    let verdicts = reuse::judge_inherited(&checks, predecessor);
    let mut quarantined = 0u64;
    for (&i, why) in pooled.iter().zip(verdicts) {
        if let Some(why) = why {
            let a = &mut adopted[i];
            warn!(region = a.id, reason = %why, "an inherited pooled region goes through quarantine");
            a.life = Life::Quarantined;
            quarantined += 1;
        }
    }
    quarantined
}

/// Starts a handler for every inherited connection (with its half-read
/// frame and its lazy allocations' fault services), and watches the
/// predecessor's exit.
pub fn resume_connections(server: &Arc<Server>, inh: &mut Inherited, conns: Vec<ConnectionRecord>) {
    let mut ctx = RestoreContext {
        fds: &mut inh.fds,
        topology: &server.rooms.topology,
    };
    for c in conns {
        let session = c.session;
        let conn = match ParkedConnection::restore(c, &mut ctx) {
            Ok(Some(conn)) => conn,
            Ok(None) => continue,
            Err(e) => {
                warn!(session, error = %e, "an inherited connection's half-read frame is malformed; closing it");
                continue;
            }
        };
        if let Err(e) = server::adopt_connection(server, conn) {
            warn!(session, error = %e, "cannot take an inherited connection over; its allocations stay until its VMM exits");
        }
    }
    watch_predecessor(server, inh.predecessor);
}

/// The predecessor holds every region until it exits; scans skip it until
/// then, and look again at once when it is gone.
fn watch_predecessor(server: &Server, predecessor: Option<i32>) {
    let Some(pid) = predecessor else { return };
    let lifecycle = Arc::clone(&server.lifecycle);
    match PidWatch::new(pid) {
        Ok(watch) => {
            let kick = Arc::clone(&server.rooms.quarantine_kick);
            lifecycle.tracker().clone().spawn(async move {
                let _ = watch.exited().await;
                lifecycle.predecessor().set(None);
                info!(pid, "the predecessor daemon exited");
                kick.notify_one();
            });
        }
        Err(_) => lifecycle.predecessor().set(None),
    }
}
