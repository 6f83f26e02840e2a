//! The refault of detached regions by fault helpers, so that the kernel's
//! zeroing of a huge page never holds the daemon's own `mmap_lock`.
//!
//! Two threads per node (`hm-refault-nN-I`, started with the scrubbers),
//! each waiting for a region of its node with holes to fault in that the
//! other does not work on ([`Scrubbing::next_refault`](crate::daemon::pool::Scrubbing::next_refault): a region handed out
//! first, then the pooled one released longest ago; two at once, so that a
//! pooled region is not left waiting behind a region of fewer chunks than
//! helpers, such as one 1 GiB page; never both on one region, whose one set
//! of helpers already takes every CPU of the node), then
//! forks `scrub.refault_threads` fault helpers over it
//! ([`crate::fault_helpers`]: own address space, the node's CPUs,
//! `SCHED_IDLE`), and keeps two chunks per helper in flight, claimed lowest
//! offset first ([`Scrubbing::claim_refault`](crate::daemon::pool::Scrubbing::claim_refault)), so the pages fill in the order a
//! guest touches its memory: the lowest guest address, where a VMM loads
//! the kernel, first. The region becomes fill work when it leaves
//! quarantine, which the VMM's exit wakes (a pidfd), so the refault starts
//! at the VMM's exit. The thread itself only waits: on the pool, and on
//! the helpers' answers or the stop event.
//!
//! At a stop (takeover, shutdown) the helpers are killed; the chunks they
//! had not answered go back to their fill ([`Scrubbing::fill_abandoned`](crate::daemon::pool::Scrubbing::fill_abandoned)).
//! Helpers that die or cannot start give the rest of that fill up: its
//! holes fault at the guest's first touch, zeroed by the kernel then.

use std::os::fd::AsFd;

use nix::sys::eventfd::EventFd;
use numa::NodeId;
use tracing::{debug, warn};

use crate::daemon::counters::metrics::{Metrics, ScrubCounters};
use crate::daemon::pool::{Pool, RefaultError, RefaultTicket, RefaultWork};
use crate::fault_helpers::{FaultHelpers, Faulted, Next, Ready};

/// What one node's refault thread works with.
#[derive(Debug, Clone)]
pub struct RefaultNode {
    /// The node.
    pub node: NodeId,
    /// Its CPUs (the helpers' affinity; every CPU when empty).
    pub cpus: Vec<usize>,
    /// Helpers per region.
    pub helpers: usize,
    /// Bytes per chunk (rounded to whole pages).
    pub chunk: u64,
}

/// Runs until the pool stops or `stop` is signalled.
pub fn refault_loop(pool: &Pool, at: &RefaultNode, stop: &EventFd, counters: &ScrubCounters) {
    while let Some(first) = pool.scrubbing().next_refault(at.node, at.chunk) {
        let taken = first.ticket();
        let go_on = refault_region(pool, at, first, stop, counters);
        pool.scrubbing().fill_left(&taken);
        if !go_on {
            break;
        }
    }
}

/// Faults one region's holes in with a set of helpers; `false` when
/// stopped.
fn refault_region(
    pool: &Pool,
    at: &RefaultNode,
    first: RefaultWork,
    stop: &EventFd,
    counters: &ScrubCounters,
) -> bool {
    let id = first.id;
    let spawned = FaultHelpers::spawn(
        first.region.fd(),
        first.region.len(),
        &at.cpus,
        first.region.node(),
        at.helpers,
    );
    // From here on only the helpers' mappings keep the region's file: a
    // region no one else references can be grown in place meanwhile.
    let first = {
        let ticket = first.ticket();
        drop(first);
        ticket
    };
    let helpers = match spawned {
        Ok(h) => h,
        Err(e) => {
            pool.scrubbing()
                .refault_done(&first, Err(RefaultError::HelpersStart(e)));
            return true;
        }
    };
    match helpers.wait_ready(stop.as_fd()) {
        Ok(Ready::Ready) => {}
        Ok(Ready::Stopped) => {
            pool.scrubbing().fill_abandoned(&first);
            return false;
        }
        Ok(Ready::Failed(e)) | Err(e) => {
            pool.scrubbing()
                .refault_done(&first, Err(RefaultError::HelpersStart(e)));
            return true;
        }
    }
    // Ready means mapped: from here on any holder scan of the region sees
    // the helpers. A release before that (its scan may have missed them
    // between fork and mmap) must not meet a fault: nothing is sent.
    if pool.scrubbing().is_released(id) {
        pool.scrubbing().fill_abandoned(&first);
        return true;
    }
    debug!(
        region = id,
        helpers = helpers.pids().len(),
        "fault helpers ready"
    );
    let mut in_flight: Vec<RefaultTicket> = Vec::new();
    let mut next = Some(first);
    let depth = 2 * helpers.pids().len();
    loop {
        while in_flight.len() < depth {
            let Some(work) = next.take().or_else(|| {
                pool.scrubbing()
                    .claim_refault(id, at.chunk)
                    .map(|w| w.ticket())
            }) else {
                break;
            };
            if let Err(e) = helpers.send(work.offset, work.len) {
                pool.scrubbing()
                    .refault_done(&work, Err(RefaultError::HelpersGone(e)));
                give_up(pool, &mut in_flight);
                return true;
            }
            in_flight.push(work);
        }
        if in_flight.is_empty() {
            helpers.finish();
            return true;
        }
        match helpers.next(stop.as_fd()) {
            Ok(Next::Faulted(f)) => record(pool, counters, &mut in_flight, &f),
            Ok(Next::Stopped) => {
                abandon(pool, &mut in_flight);
                return false;
            }
            Ok(Next::Gone) | Err(_) if pool.scrubbing().is_released(id) => {
                // The quarantine stopped them: the region was released, and
                // its detach starts a new fill.
                abandon(pool, &mut in_flight);
                return true;
            }
            Ok(Next::Gone) | Err(_) => {
                // Never started again for this fill: a helper that dies
                // would die again. The rest faults at first touch.
                give_up(pool, &mut in_flight);
                return true;
            }
        }
    }
}

/// Reports one helper's answer `f` for its chunk in `in_flight`.
fn record(pool: &Pool, counters: &ScrubCounters, in_flight: &mut Vec<RefaultTicket>, f: &Faulted) {
    let Some(i) = in_flight.iter().position(|w| w.offset == f.offset) else {
        warn!(
            offset = f.offset,
            "a fault helper answered for work it was not sent"
        );
        return;
    };
    let work = in_flight.swap_remove(i);
    let result = f.result.map_err(|errno| RefaultError::Populate {
        start: work.offset,
        end: work.offset + work.len,
        source: std::io::Error::from_raw_os_error(errno),
    });
    if result.is_ok() {
        Metrics::add(&counters.refault_bytes, work.len);
        Metrics::add(
            &counters.refault_nanos,
            u64::try_from(f.spent.as_nanos()).unwrap_or(u64::MAX),
        );
    }
    pool.scrubbing().refault_done(&work, result);
}

/// The helpers died with `in_flight` unanswered: this fill gives up.
fn give_up(pool: &Pool, in_flight: &mut Vec<RefaultTicket>) {
    for work in in_flight.drain(..) {
        pool.scrubbing()
            .refault_done(&work, Err(RefaultError::HelpersExited));
    }
}

fn abandon(pool: &Pool, in_flight: &mut Vec<RefaultTicket>) {
    for work in in_flight.drain(..) {
        pool.scrubbing().fill_abandoned(&work);
    }
}
