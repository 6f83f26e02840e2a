//! Lazy mode in the daemon: which of a session's allocations are lazy and
//! the fault service serving each (the pool chooses a lazy part's region:
//! `super::pool::take`).
//!
//! The session records lazy allocations in its [`LazyAllocs`], hands UFFD
//! requests to [`LazyAllocs::attach`], and stops the service
//! ([`LazyAllocs::stop`]) before FREE releases the regions and before a
//! closing connection's socket is closed (the VMM's fallback may serve faults
//! once it sees the connection close, so the daemon must have stopped by
//! then). The fault service itself (`crate::fault`) knows nothing of the
//! daemon.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use guest_mem::Region;
use hugemem_client::stats::LazyAlloc as LazyAllocStats;
use tokio::sync::Notify;
use tracing::info;

use crate::fault::{
    FaultMapping, FaultReport, FaultService, FaultServiceConfig, FaultServiceHandle,
};
use crate::proto::{check_uffd_ranges, RegionInfo, Status, UffdRange};
use crate::uffd::Uffd;

#[derive(Debug)]
struct LazyAlloc {
    infos: Vec<RegionInfo>,
    regions: Vec<Arc<Region>>,
    service: Option<FaultServiceHandle>,
}

/// The lazy allocations of one session and their fault services.
#[derive(Debug, Default)]
pub struct LazyAllocs {
    allocs: HashMap<u64, LazyAlloc>,
    failed: Arc<Notify>,
}

impl LazyAllocs {
    /// No lazy allocation yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Remembers an allocation with at least one LAZY region (others are
    /// ignored): `infos` as sent in the ALLOC reply, `regions` in the same order.
    pub fn record(&mut self, alloc_id: u64, infos: Vec<RegionInfo>, regions: Vec<Arc<Region>>) {
        if infos.iter().any(|i| i.flags & RegionInfo::FLAG_LAZY != 0) {
            self.allocs.insert(
                alloc_id,
                LazyAlloc {
                    infos,
                    regions,
                    service: None,
                },
            );
        }
    }

    /// Serves a UFFD request for `alloc_id` (whose ownership the caller
    /// checked): validates the fd count, the fd, and the ranges, then starts
    /// the fault service. `peer_pid` is the VMM's pid (its exit stops the
    /// service).
    ///
    /// # Errors
    ///
    /// The status and message of the error reply.
    pub fn attach(
        &mut self,
        alloc_id: u64,
        ranges: &[UffdRange],
        mut fds: Vec<OwnedFd>,
        peer_pid: Option<i32>,
        mut cfg: FaultServiceConfig,
    ) -> Result<(), (Status, String)> {
        let invalid = |m: String| (Status::Invalid, m);
        if fds.len() != 1 {
            return Err(invalid(format!(
                "UFFD carries exactly one fd, got {}",
                fds.len()
            )));
        }
        let Some(alloc) = self.allocs.get_mut(&alloc_id) else {
            return Err(invalid(format!("allocation {alloc_id} has no lazy region")));
        };
        if alloc.service.is_some() {
            return Err(invalid(format!(
                "allocation {alloc_id} already has a userfaultfd"
            )));
        }
        check_uffd_ranges(ranges, &alloc.infos).map_err(invalid)?;
        let fd = fds.pop().ok_or_else(|| invalid("no fd".into()))?;
        let uffd = Uffd::from_owned_fd(fd).map_err(|e| invalid(format!("UFFD fd: {e}")))?;
        let mut mappings = Vec::with_capacity(ranges.len());
        for r in ranges {
            let Some(i) = alloc.infos.iter().position(|g| g.region_id == r.region_id) else {
                return Err(invalid(format!(
                    "region {} is not in allocation {alloc_id}",
                    r.region_id
                )));
            };
            mappings.push(FaultMapping {
                vmm_start: r.vmm_addr,
                len: r.len,
                region: Arc::clone(&alloc.regions[i]),
                region_offset: r.offset,
            });
        }
        let peer = peer_pid.and_then(|p| crate::daemon::peer::pidfd_open(p).ok());
        cfg.failure = Some(Arc::clone(&self.failed));
        cfg.label = format!("alloc {alloc_id}");
        let service = FaultService::start(cfg, uffd, mappings, peer).map_err(|e| {
            let status = match e {
                crate::fault::FaultError::Setup(_) | crate::fault::FaultError::Threads(_) => {
                    Status::Internal
                }
                _ => Status::Invalid,
            };
            (status, crate::diag::chain(&e))
        })?;
        alloc.service = Some(service);
        info!(
            alloc = alloc_id,
            ranges = ranges.len(),
            "lazy allocation served through the VMM's userfaultfd"
        );
        Ok(())
    }

    /// Stops the fault service of `alloc_id` (FREE) and forgets it. Blocks
    /// until its threads are joined: at most one page clear per thread.
    pub fn stop(&mut self, alloc_id: u64) -> Option<FaultReport> {
        let report = self
            .allocs
            .remove(&alloc_id)?
            .service
            .map(FaultServiceHandle::stop);
        if let Some(r) = &report {
            info!(alloc = alloc_id, reason = ?r.reason, faults = r.stats.faults, p99_ns = r.stats.latency.p99_ns, "lazy fault service stopped");
        }
        report
    }

    /// Takes the fault service of `alloc_id` out (to stop it off the async
    /// executor) and forgets the allocation.
    pub fn take_service(&mut self, alloc_id: u64) -> Option<FaultServiceHandle> {
        self.allocs.remove(&alloc_id)?.service
    }

    /// Stops every fault service (the connection is closing).
    pub fn stop_all(&mut self) {
        let ids: Vec<u64> = self.allocs.keys().copied().collect();
        for id in ids {
            self.stop(id);
        }
    }

    /// Resolves when a fault service of this session ended abnormally (a
    /// panic, a uffd error): the daemon then closes the connection, so the
    /// VMM's fallback takes over.
    pub async fn failed(&self) {
        self.failed.notified().await;
    }

    /// Per-allocation fault counters, for STATS (`lazy`).
    pub fn stats(&self) -> Vec<LazyAllocStats> {
        self.allocs
            .iter()
            .map(|(id, a)| LazyAllocStats {
                alloc: *id,
                attached: a.service.is_some(),
                dirty_pages: a
                    .regions
                    .iter()
                    .map(|r| r.states().counts().dirty as u64)
                    .sum(),
                faults: a.service.as_ref().map(FaultServiceHandle::stats),
            })
            .collect()
    }
}
