//! Lazy mode in the daemon: which of a session's allocations are lazy and
//! the fault service serving each (the pool chooses a lazy part's region:
//! `crate::daemon::pool::take`).
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

use crate::daemon::lifecycle::suspended::Suspended;
use crate::fault::{
    FaultMapping, FaultReport, FaultService, FaultServiceConfig, FaultServiceHandle,
};
use crate::proto::{check_uffd_ranges, RegionInfo, Status, UffdRange};
use crate::uffd::Uffd;

#[derive(Debug)]
struct LazyAlloc {
    infos: Vec<RegionInfo>,
    regions: Vec<Arc<Region>>,
    /// The UFFD request's mappings, once one was served.
    ranges: Vec<UffdRange>,
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
                    ranges: Vec::new(),
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
        check_uffd_ranges(ranges, &alloc.infos).map_err(|e| invalid(e.to_string()))?;
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
        let peer = peer_pid.and_then(|p| crate::pidfd::pidfd_open(p).ok());
        cfg.failure = Some(Arc::clone(&self.failed));
        cfg.label = format!("alloc {alloc_id}");
        // A duplicate to wake the ranges with once the service reads.
        let waker = uffd.try_clone().ok();
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
        alloc.ranges = ranges.to_vec();
        // Faults raised before this service read (a predecessor read their
        // events and stopped, or nothing read them yet) are woken so they
        // fault again and reach it; a page already mapped just resumes.
        if let Some(w) = waker {
            for r in ranges {
                if let Err(e) = w.wake(r.vmm_addr, r.len) {
                    tracing::warn!(alloc = alloc_id, error = %e, "cannot wake a lazy range");
                }
            }
        }
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

    /// Stops and forgets every allocation for which `keep` says no
    /// (blocking, as [`LazyAllocs::stop`]).
    pub fn retain(&mut self, mut keep: impl FnMut(u64) -> bool) {
        let gone: Vec<u64> = self.allocs.keys().copied().filter(|a| !keep(*a)).collect();
        for alloc in gone {
            self.stop(alloc);
        }
    }

    /// Stops every fault service (the connection is closing).
    pub fn stop_all(&mut self) {
        let ids: Vec<u64> = self.allocs.keys().copied().collect();
        for id in ids {
            self.stop(id);
        }
    }

    /// Stops every fault service for a takeover, keeping the VMMs'
    /// userfaultfds, and forgets the allocations (see [`Suspended`]).
    /// Blocking: at most one page clear per fault-service thread.
    pub fn suspend_all(&mut self) -> Vec<Suspended> {
        self.allocs
            .drain()
            .map(|(alloc, a)| {
                let uffd = a.service.and_then(|s| match s.stop_keeping_uffd() {
                    (_, Ok(fd)) => Some(fd),
                    (_, Err(e)) => {
                        tracing::error!(alloc, error = %e, "cannot keep a lazy allocation's userfaultfd; its VMM's fallback takes over when the connection closes");
                        None
                    }
                });
                Suspended {
                    alloc,
                    infos: a.infos,
                    ranges: a.ranges,
                    uffd,
                }
            })
            .collect()
    }

    /// Restarts suspended allocations (a takeover given up, or the
    /// successor taking them): records each and restarts its fault service
    /// over its userfaultfd. Returns the allocations whose service could
    /// not restart, with why (their VMM's fallback serves them once the
    /// connection closes: the caller closes it).
    pub fn resume(
        &mut self,
        suspended: Vec<Suspended>,
        regions_of: impl Fn(&[RegionInfo]) -> Option<Vec<Arc<Region>>>,
        peer_pid: Option<i32>,
        cfg: &FaultServiceConfig,
    ) -> Vec<(u64, String)> {
        let mut failed = Vec::new();
        for s in suspended {
            let Some(regions) = regions_of(&s.infos) else {
                failed.push((s.alloc, "its regions are gone".to_string()));
                continue;
            };
            self.record(s.alloc, s.infos, regions);
            if let Some(fd) = s.uffd {
                if let Err((_, why)) =
                    self.attach(s.alloc, &s.ranges, vec![fd], peer_pid, cfg.clone())
                {
                    failed.push((s.alloc, why));
                }
            }
        }
        failed
    }

    /// Marks the session's lazy service as failed (the connection closes,
    /// so the VMM's fallback serves).
    pub fn fail(&self) {
        self.failed.notify_one();
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
