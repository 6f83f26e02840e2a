//! Background scrubbers: dedicated OS threads, pinned to each NUMA node's
//! CPUs, that clear the dirty pages of pooled regions on their node.
//!
//! # Design
//!
//! * **Never on the executor.** Clearing is memory-bound CPU work (a 1 GiB
//!   page takes ~0.2 s at the measured 6.5 GB/s). It runs on threads started
//!   with [`numa::spawn_pinned`] to the node's CPUs, so the stores come from
//!   the memory's own node, and the tokio workers stay free for the control
//!   plane. A pinned pool per node is what QEMU's thread-context and
//!   cloud-hypervisor PR 8785 found to matter for prefault throughput.
//! * **Claim through page states.** A scrubber claims pages `Dirty →
//!   Clearing` ([`guest_mem::PageStates`]) in [`crate::daemon::pool::Scrubbing::next_scrub`]
//!   under the pool lock, so it never starts pages of a region that is not
//!   `Dirty` (quarantined or reserved by an ALLOC), and an ALLOC that clears a
//!   dirty region itself ([`guest_mem::Region::prepare_eager`]) skips the pages
//!   a scrubber holds.
//! * **Multi-page clears.** Contiguous dirty pages are claimed together up to
//!   `scrub.batch` (64 MiB by default) and cleared with one
//!   [`clearing::clear_raw`] call of [`clearing::ClearKernel::default_kernel`]
//!   (`rep stosb` over the whole run), not one call per 4 KiB page: 32 pages of
//!   2 MiB are one string instruction, a 1 GiB page is cleared in batch-sized
//!   runs so the stop flag is looked at every ~10 ms.
//! * **Wake-ups** come from the pool's condition variable: new dirty work
//!   (quarantine exits) and shutdown both notify it.
//!
//! The alternative, `clearing::run_jobs` per dirty region, starts and pins
//! fresh threads for every job; right for a one-off eager prepare, wasteful
//! for a steady trickle of released regions.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use clearing::ClearKernel;
use numa::{NodeId, PinError, Topology};
use tracing::{debug, error, info};

use nix::sys::eventfd::EventFd;

use crate::daemon::background::refault::{refault_loop, RefaultNode};
use crate::daemon::config::ScrubConfig;
use crate::daemon::counters::metrics::{Metrics, ScrubCounters};
use crate::daemon::pool::{Pool, RefaultError, RefaultWork, ScrubWork, Scrubbed, Work};

/// Regions each node's refault works on at once, one thread and one set
/// of fault helpers each.
const REFAULT_REGIONS_AT_ONCE: usize = 2;

/// The scrubber threads of all nodes, and each node's refault threads
/// (`crate::daemon::background::refault`) when the fault helpers are on.
#[derive(Debug)]
pub struct Scrubbers {
    stop: Arc<AtomicBool>,
    /// Wakes the refault threads out of their wait for helpers' answers.
    stop_event: Arc<EventFd>,
    threads: Vec<JoinHandle<Result<(), PinError>>>,
    counters: Vec<Arc<ScrubCounters>>,
    batch: u64,
    refault_helpers: bool,
    refault_threads: usize,
}

impl Scrubbers {
    /// Starts `cfg.threads_per_node` pinned scrubbers on every node with
    /// memory, and with `cfg.refault_helpers` two refault threads per node.
    ///
    /// # Errors
    ///
    /// Thread creation errors (already started threads are stopped again).
    pub fn start(
        topology: &Topology,
        pool: &Arc<Pool>,
        cfg: &ScrubConfig,
    ) -> std::io::Result<Self> {
        let mut me = Self {
            stop: Arc::new(AtomicBool::new(false)),
            stop_event: Arc::new(EventFd::new().map_err(std::io::Error::from)?),
            threads: Vec::new(),
            counters: Vec::new(),
            batch: cfg.batch.0,
            refault_helpers: cfg.refault_helpers,
            refault_threads: cfg.refault_threads,
        };
        for node in topology.nodes().iter().filter(|n| !n.is_memoryless()) {
            me.counters
                .push(Arc::new(ScrubCounters::new(node.id, cfg.threads_per_node)));
        }
        if let Err(e) = me.spawn_all(topology, pool) {
            me.stop_and_join(pool);
            return Err(e);
        }
        Ok(me)
    }

    /// Starts every node's threads, with the counters already made.
    fn spawn_all(&mut self, topology: &Topology, pool: &Arc<Pool>) -> std::io::Result<()> {
        for counters in self.counters.clone() {
            let Some(node) = topology.nodes().iter().find(|n| n.id == counters.node) else {
                continue;
            };
            // A node without CPUs of its own is scrubbed from anywhere.
            let cpus = if node.cpus.is_empty() {
                numa::current_affinity().unwrap_or_default()
            } else {
                node.cpus.clone()
            };
            let node_id = node.id;
            for t in 0..counters.threads {
                let (worker_pool, stop, c) = (
                    Arc::clone(pool),
                    Arc::clone(&self.stop),
                    Arc::clone(&counters),
                );
                let (batch, fills) = (self.batch, !self.refault_helpers);
                let h = numa::spawn_pinned(
                    format!("hm-scrub-n{node_id}-{t}"),
                    cpus.clone(),
                    move || {
                        scrub_loop(&worker_pool, node_id, t, batch, fills, &stop, &c);
                    },
                )?;
                self.threads.push(h);
            }
            // Two regions at once per node: a region of fewer chunks than
            // helpers (one 1 GiB page is one chunk) would otherwise hold the
            // node's refault until it is done, and a pooled region waits for
            // the one its guest is running on (which goes first), while the
            // node has helpers and CPUs to spare.
            for loop_index in 0..usize::from(self.refault_helpers) * REFAULT_REGIONS_AT_ONCE {
                let at = RefaultNode {
                    node: node_id,
                    helpers: if self.refault_threads == 0 {
                        cpus.len().max(1)
                    } else {
                        self.refault_threads
                    },
                    cpus: cpus.clone(),
                    chunk: self.batch,
                };
                let (worker_pool, stop, c) = (
                    Arc::clone(pool),
                    Arc::clone(&self.stop_event),
                    Arc::clone(&counters),
                );
                info!(
                    node = node_id,
                    helpers = at.helpers,
                    thread = loop_index,
                    "refault by fault helpers (SCHED_IDLE)"
                );
                let h = numa::spawn_pinned(
                    format!("hm-refault-n{node_id}-{loop_index}"),
                    cpus.clone(),
                    move || {
                        refault_loop(&worker_pool, &at, &stop, &c);
                    },
                )?;
                self.threads.push(h);
            }
            info!(node = node_id, threads = counters.threads, cpus = ?node.cpus, "scrubbers started");
        }
        Ok(())
    }

    /// Starts the threads again after [`Scrubbers::stop_and_join`] (a
    /// takeover that did not happen), with the same counters.
    ///
    /// # Errors
    ///
    /// Thread creation errors.
    pub fn restart(&mut self, topology: &Topology, pool: &Arc<Pool>) -> std::io::Result<()> {
        self.stop.store(false, Ordering::Relaxed);
        self.stop_event = Arc::new(EventFd::new().map_err(std::io::Error::from)?);
        pool.records().resume();
        self.spawn_all(topology, pool)
    }

    /// Per-node counters.
    pub fn counters(&self) -> &[Arc<ScrubCounters>] {
        &self.counters
    }

    /// Asks every scrubber to stop (they finish their current batch, at most
    /// `scrub.batch` bytes), kills the fault helpers, and joins them.
    pub fn stop_and_join(&mut self, pool: &Pool) {
        self.stop.store(true, Ordering::Relaxed);
        if let Err(e) = self.stop_event.write(1) {
            error!(error = %e, "cannot signal the refault threads to stop");
        }
        pool.stop();
        for h in self.threads.drain(..) {
            let name = h.thread().name().unwrap_or("scrubber").to_string();
            match h.join() {
                Ok(Ok(())) => debug!(thread = %name, "scrubber stopped"),
                Ok(Err(e)) => error!(thread = %name, error = %e, "scrubber could not be pinned"),
                Err(_) => error!(thread = %name, "scrubber panicked"),
            }
        }
    }
}

fn scrub_loop(
    pool: &Pool,
    node: NodeId,
    index: usize,
    batch: u64,
    fills: bool,
    stop: &AtomicBool,
    counters: &ScrubCounters,
) {
    let kernel = ClearKernel::default_kernel();
    let mut hint = index.wrapping_mul(7919);
    while !stop.load(Ordering::Relaxed) {
        let work = match pool.scrubbing().next_scrub(node, batch, hint, fills) {
            None => break,
            Some(Work::Refault(fill)) => {
                refault(pool, &fill, counters);
                continue;
            }
            Some(Work::Scrub(work)) => work,
        };
        hint = work.first + work.count;
        let started = Instant::now();
        let cleared = match clear(&work, kernel, batch, stop) {
            Ok(cleared) => cleared,
            Err(reason) => {
                // The tenant damaged the file (truncated it, punched a hole
                // the host cannot fill): never touch it, give it back.
                let dropped = pool
                    .scrubbing()
                    .scrub_done(&work, Scrubbed::Damaged(reason.to_string()));
                drop(work);
                drop(dropped);
                continue;
            }
        };
        let nanos = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        if cleared {
            let (offset, _) = work.region.page_range(work.first);
            let (last_off, last_len) = work.region.page_range(work.first + work.count - 1);
            Metrics::add(&counters.bytes, last_off + last_len - offset);
            Metrics::add(&counters.nanos, nanos);
            Metrics::add(&counters.batches, 1);
        }
        let outcome = if cleared {
            Scrubbed::Cleared
        } else {
            Scrubbed::Stopped
        };
        drop(pool.scrubbing().scrub_done(&work, outcome));
    }
}

/// Faults a chunk of a detached region's holes in ahead of its guest (see
/// `crate::daemon::pool::RefaultWork`): the kernel allocates and zeroes each page in
/// this thread, on this node's CPUs, under the region's NUMA policy.
fn refault(pool: &Pool, work: &RefaultWork, counters: &ScrubCounters) {
    let started = Instant::now();
    // Offsets are inside the region, whose length fits usize (checked at creation).
    let (off, n) = (work.offset as usize, work.len as usize);
    let result =
        crate::sys::populate_write(work.region.as_ptr().wrapping_add(off), n).map_err(|source| {
            RefaultError::Populate {
                start: work.offset,
                end: work.offset + work.len,
                source,
            }
        });
    if result.is_ok() {
        let nanos = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        Metrics::add(&counters.refault_bytes, work.len);
        Metrics::add(&counters.refault_nanos, nanos);
    }
    pool.scrubbing().refault_done(&work.ticket(), result);
}
/// A scrub batch its tenant damaged: a page of it cannot be faulted in (a
/// truncation, a hole the host cannot fill). The region goes back to the
/// kernel, never scrubbed.
#[derive(Debug, thiserror::Error)]
#[error("bytes {start}..{end} cannot be populated: {source}")]
struct ScrubDamage {
    start: usize,
    end: usize,
    #[source]
    source: std::io::Error,
}

/// Clears the claimed pages in runs of at most `batch` bytes; `Ok(false)`
/// when the stop flag cut it short (the pages go back to `Dirty`). Each run
/// is populated (`MADV_POPULATE_WRITE`) before a byte of it is stored, so a
/// file a tenant truncated or punched beyond what the host can refill is an
/// `Err` with the reason, never a `SIGBUS` that kills the daemon.
fn clear(
    work: &ScrubWork,
    kernel: ClearKernel,
    batch: u64,
    stop: &AtomicBool,
) -> Result<bool, ScrubDamage> {
    let (start, _) = work.region.page_range(work.first);
    let (last_off, last_len) = work.region.page_range(work.first + work.count - 1);
    let end = last_off + last_len;
    let mut at = start;
    while at < end {
        if stop.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let len = (end - at).min(batch);
        // Offsets are inside the region, whose length fits usize (checked at creation).
        let (off, n) = (at as usize, len as usize);
        // SAFETY: `off` is below the region's length, so the pointer stays
        // inside the region's own mapping.
        let ptr = unsafe { work.region.as_ptr().add(off) };
        if let Err(e) = crate::sys::populate_write(ptr, n) {
            return Err(ScrubDamage {
                start: off,
                end: off + n,
                source: e,
            });
        }
        // SAFETY: off..off+n lies inside the region's own live mapping (the
        // Arc in `work` keeps it mapped; page_range clips to the length),
        // which is MAP_SHARED read-write over the region's file, and every page
        // of the run was just populated (the populate above failed instead
        // where a store would SIGBUS). Every page in the range is in `Clearing`, owned by
        // this thread: no other clearer can claim it, no ALLOC hands it out
        // (only `Clean` pages can become `Mapped`), and the region reached
        // `Dirty` only after a holder scan found no process but the daemon
        // mapping or holding it, so no guest can read or write it. No Rust
        // reference to these bytes exists (only the unsafe slice accessors
        // make them, under the same exclusivity rule).
        unsafe { clearing::clear_raw(kernel, ptr, n) };
        at += len;
    }
    Ok(true)
}
