//! The quarantine loop: released regions leave quarantine only after a
//! `/proc` holder scan found nobody else holding them and the proofs of
//! [`super::reuse`] passed (the write lease, the file's size, and with
//! `pool.detach_pages` the punch of every page); the same loop trims the
//! pool.
//!
//! It runs every `pool.recheck_ms`, and at once on every kick: a FREE or
//! disconnect, the exit of a client process (its pidfd, see
//! `crate::daemon::connections::session`), an ALLOC that waits for a quarantined region, and the
//! exit of any **holder** a scan found. For each holder pid the loop opens
//! a pidfd and watches it (at most [`MAX_HOLDER_WATCHES`] at once), so a
//! region whose last holder exits leaves quarantine within one scan of the
//! exit, not one period later, and an ALLOC waiting for it (see
//! `crate::daemon::requests::alloc`) is woken by the pool as soon as it is dirty.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tracing::{debug, error};

use super::reuse;
use crate::daemon::lifecycle::Lifecycle;
use crate::daemon::peers::peer::PidWatch;
use crate::daemon::pool::{Pool, Verdict};

/// Most holder pids watched at once (a tenant that forks many holders gets
/// the periodic scan for the rest).
pub const MAX_HOLDER_WATCHES: usize = 256;

/// What the quarantine loop uses.
#[derive(Debug)]
pub struct Recheck {
    /// The pool whose quarantined regions it checks and which it trims.
    pub pool: Arc<Pool>,
    /// Rounds pause for a takeover; holder watches end at shutdown.
    pub lifecycle: Arc<Lifecycle>,
    /// A FREE, a disconnect, a client's or a holder's exit.
    pub quarantine_kick: Arc<Notify>,
    /// `pool.recheck_ms`.
    pub period: Duration,
}

/// Re-checks quarantined regions every `pool.recheck_ms`, on every kick (FREE,
/// disconnect, client exit), and trims the pool.
pub async fn quarantine_loop(quarantine: Arc<Recheck>) {
    let period = quarantine.period;
    let watched: Arc<Mutex<HashSet<i32>>> = Arc::default();
    let kick = Some(&*quarantine.quarantine_kick);
    let round = || recheck(Arc::clone(&quarantine), Arc::clone(&watched));
    quarantine.lifecycle.periodic(period, kick, round).await;
}

/// One round: scans the holders of quarantined regions, applies the
/// verdicts, and trims the pool.
async fn recheck(quarantine: Arc<Recheck>, watched: Arc<Mutex<HashSet<i32>>>) -> bool {
    let quarantined = quarantine.pool.quarantine().quarantined();
    if !quarantined.is_empty() {
        let detach = quarantine.pool.config().detach_pages;
        let pool = Arc::clone(&quarantine.pool);
        let started = Instant::now();
        let predecessor = quarantine.lifecycle.predecessor().get();
        // The holder scan, then the proofs before reuse (`super::reuse`):
        // no reference the scan cannot see, the file whole, its pages
        // detached from any pin.
        let scan = tokio::task::spawn_blocking(move || {
            reuse::check_quarantined(quarantined, detach, pool.reserve_gate(), predecessor)
        });
        match scan.await {
            Ok(verdicts) => {
                for pid in verdicts.iter().filter_map(|(_, v)| match v {
                    Verdict::Held(h) => Some(h.pid),
                    _ => None,
                }) {
                    watch_holder(&quarantine, &watched, pid);
                    // A fault helper still faulting a region released since:
                    // its work is moot (the detach punches every page), so
                    // it goes now, and its exit wakes the next round.
                    if crate::fault_helpers::stop_own_helper(pid) {
                        debug!(pid, "stopped the fault helpers of a released region");
                    }
                }
                let (left, dropped) = quarantine.pool.quarantine().apply_scan(verdicts);
                debug!(
                    left,
                    discarded = dropped.len(),
                    ms = started.elapsed().as_secs_f64() * 1e3,
                    "quarantine checked"
                );
                if !dropped.is_empty() {
                    drop(tokio::task::spawn_blocking(move || drop(dropped)));
                }
            }
            Err(e) => error!(error = %e, "holder scan failed"),
        }
    }
    let trimmed = quarantine.pool.trim(Instant::now());
    if !trimmed.is_empty() {
        debug!(regions = trimmed.len(), "dropping trimmed regions");
        // munmap of large hugetlb mappings frees pages: off the executor.
        drop(tokio::task::spawn_blocking(move || drop(trimmed)));
    }
    true
}

/// Watches `pid`'s pidfd (once per pid) and kicks the quarantine when it
/// exits.
fn watch_holder(quarantine: &Arc<Recheck>, watched: &Arc<Mutex<HashSet<i32>>>, pid: i32) {
    if u32::try_from(pid).is_ok_and(|p| p == std::process::id()) {
        return;
    }
    {
        let mut w = watched
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if w.len() >= MAX_HOLDER_WATCHES || !w.insert(pid) {
            return;
        }
    }
    let forget = {
        let watched = Arc::clone(watched);
        move || {
            watched
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .remove(&pid);
        }
    };
    match PidWatch::new(pid) {
        Ok(watch) => {
            let quarantine = Arc::clone(quarantine);
            quarantine.lifecycle.tracker().clone().spawn(async move {
                tokio::select! {
                    r = watch.exited() => {
                        if r.is_ok() {
                            debug!(pid, "a holder of a quarantined region exited; re-checking quarantine");
                            quarantine.quarantine_kick.notify_one();
                        }
                    }
                    () = quarantine.lifecycle.cancel().cancelled() => {}
                }
                forget();
            });
        }
        Err(e) => {
            debug!(pid, error = %e, "cannot watch a holder of a quarantined region");
            forget();
            // Gone already: scan again now. Any other error: the periodic
            // scan covers it.
            if e.raw_os_error() == Some(libc::ESRCH) {
                quarantine.quarantine_kick.notify_one();
            }
        }
    }
}
