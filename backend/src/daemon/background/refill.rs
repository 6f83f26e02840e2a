//! Refilling the pool while the daemon is idle (`pool.refill`): each
//! node's pool is brought up to its `target` with fresh regions, populated
//! and zeroed by the kernel ahead of demand, so the next ALLOC is served
//! from the clean pool instead of waiting for fresh pages.
//!
//! **Low priority.** One region at a time, never while an ALLOC is in
//! flight: an ALLOC that starts cancels a refill in progress between two
//! chunks of its populate (the half-made region goes straight back to the
//! kernel) and waits until it has, so the refill can never take pages an
//! ALLOC needs. Memfd regions only (the usual backing), in the largest huge
//! page size the kernel has free on the node, as large as the node's
//! shortfall under its target, its limit and the page size's limit allow.
//! A pooled region serves a request of its size, or a larger one by being
//! grown; a smaller request gives it back for fresh pages of its own size
//! (see `crate::daemon::requests::alloc`).
//!
//! **Progress** is in STATS (`refill`): the region being made (node, page
//! size, bytes done of total) and totals, shown by `hugemem status`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use clearing::{CancelToken, Progress, RunOptions};
use guest_mem::PageSize;
use hugemem_client::stats::{RefillCurrent, RefillStats};
use numa::{NodeId, Topology};
use tracing::{debug, info};

use crate::daemon::lifecycle::Lifecycle;
use crate::daemon::pool::free_pages;
use crate::daemon::pool::Pool;
use crate::diag::chain;
use guest_mem::size::format_size;

#[derive(Debug, Default)]
struct State {
    /// ALLOCs in flight.
    allocs: usize,
    /// The running refill's cancel token.
    running: Option<CancelToken>,
    /// The region being made: node, page size, bytes.
    current: Option<(NodeId, PageSize, u64)>,
}

/// The refill's shared state and counters (see the module docs), with the
/// pool it fills, the topology and the lifecycle its loop runs under.
#[derive(Debug)]
pub struct Refill {
    state: Mutex<State>,
    idle: Condvar,
    done: AtomicU64,
    regions: AtomicU64,
    bytes: AtomicU64,
    yielded: AtomicU64,
    pool: Arc<Pool>,
    topology: Arc<Topology>,
    lifecycle: Arc<Lifecycle>,
}

/// Held by an ALLOC from its start to its end (see [`Refill::alloc_started`]).
#[derive(Debug)]
pub struct AllocGuard<'a>(&'a Refill);

impl Drop for AllocGuard<'_> {
    fn drop(&mut self) {
        let mut s = self.0.lock();
        s.allocs = s.allocs.saturating_sub(1);
    }
}

impl Refill {
    /// A refill of `pool` (idle until [`refill_loop`] runs).
    pub fn new(pool: Arc<Pool>, topology: Arc<Topology>, lifecycle: Arc<Lifecycle>) -> Self {
        Self {
            state: Mutex::default(),
            idle: Condvar::new(),
            done: AtomicU64::new(0),
            regions: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            yielded: AtomicU64::new(0),
            pool,
            topology,
            lifecycle,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// An ALLOC starts: no refill starts until the guard drops, and one in
    /// progress is cancelled.
    pub fn alloc_started(&self) -> AllocGuard<'_> {
        let mut s = self.lock();
        s.allocs += 1;
        if let Some(c) = &s.running {
            c.cancel();
            self.yielded.fetch_add(1, Ordering::Relaxed);
        }
        AllocGuard(self)
    }

    /// Blocks until no refill runs (a cancelled one has given its pages
    /// back), or `deadline`.
    pub fn wait_yielded(&self, deadline: Instant) {
        let mut s = self.lock();
        while s.running.is_some() {
            let now = Instant::now();
            if now >= deadline {
                return;
            }
            s = self
                .idle
                .wait_timeout(s, deadline - now)
                .map_or_else(|e| e.into_inner().0, |(g, _)| g);
        }
    }

    /// Registers a refill run unless an ALLOC is in flight.
    fn start(&self, node: NodeId, page_size: PageSize, bytes: u64) -> Option<CancelToken> {
        let mut s = self.lock();
        if s.allocs > 0 || s.running.is_some() {
            return None;
        }
        let token = CancelToken::new();
        s.running = Some(token.clone());
        s.current = Some((node, page_size, bytes));
        self.done.store(0, Ordering::Relaxed);
        Some(token)
    }

    fn finish(&self) {
        let mut s = self.lock();
        s.running = None;
        s.current = None;
        drop(s);
        self.idle.notify_all();
    }

    /// STATS `refill`.
    pub fn stats(&self, enabled: bool) -> RefillStats {
        let s = self.lock();
        RefillStats {
            enabled,
            current: s.current.map(|(node, p, bytes)| RefillCurrent {
                node,
                page_size: p.to_string(),
                bytes,
                done_bytes: self.done.load(Ordering::Relaxed),
            }),
            regions: self.regions.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            yielded: self.yielded.load(Ordering::Relaxed),
        }
    }
}

/// Runs `step` every `period` (`pool.recheck_ms`, off the executor) until
/// shutdown.
pub async fn refill_loop(refill: Arc<Refill>, period: std::time::Duration) {
    let round = || {
        let refill = Arc::clone(&refill);
        async move {
            // One region per step; several steps back to back while there is
            // work, each one still yielding to ALLOCs.
            loop {
                let r = Arc::clone(&refill);
                match tokio::task::spawn_blocking(move || step(&r)).await {
                    Ok(true) if !refill.lifecycle.cancel().is_cancelled() => {}
                    _ => break,
                }
            }
            true
        }
    };
    refill.lifecycle.periodic(period, None, round).await;
}

/// What to make next: the first node below its target, in the largest huge
/// page size with room. `None` when every node is at its target.
fn plan(refill: &Refill) -> Option<(NodeId, PageSize, u64)> {
    let cfg = refill.pool.config();
    for node in refill
        .topology
        .nodes()
        .iter()
        .filter(|n| !n.is_memoryless())
    {
        let (target, limit) = cfg.limits(node.id);
        let pooled = refill.pool.pooled(node.id, None);
        if pooled >= target {
            continue;
        }
        let room = (target - pooled).min(limit.saturating_sub(pooled));
        for p in [PageSize::Huge1G, PageSize::Huge2M] {
            let free = free_pages(p, node.id).saturating_mul(p.bytes());
            let own = cfg
                .size_limit(p)
                .saturating_sub(refill.pool.pooled(node.id, Some(p)));
            let bytes = room.min(free).min(own) / p.bytes() * p.bytes();
            if bytes > 0 {
                return Some((node.id, p, bytes));
            }
        }
    }
    None
}

/// Makes one region if a node is below its target and no ALLOC runs.
/// Returns whether it made one.
fn step(refill: &Refill) -> bool {
    let Some((node, page_size, bytes)) = plan(refill) else {
        return false;
    };
    let Some(token) = refill.start(node, page_size, bytes) else {
        return false;
    };
    let progress = |p: &Progress| refill.done.store(p.bytes_done, Ordering::Relaxed);
    let opts = RunOptions {
        cancel: Some(&token),
        progress: Some(&progress),
        ..RunOptions::default()
    };
    let made = refill.pool.add_fresh(node, page_size, bytes, &opts);
    let ok = match made {
        Ok(id) => {
            refill.regions.fetch_add(1, Ordering::Relaxed);
            refill.bytes.fetch_add(bytes, Ordering::Relaxed);
            info!(
                region = id,
                node,
                page_size = %page_size,
                "refilled the pool with {} (pre-zeroed, ahead of demand)",
                format_size(bytes)
            );
            true
        }
        Err(e) => {
            debug!(node, page_size = %page_size, bytes, error = %chain(&e), "refill stopped (an ALLOC came, or the pages went)");
            false
        }
    };
    refill.finish();
    ok
}
