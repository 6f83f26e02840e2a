//! The pinned workers: start gate, shared work queue, the worker loop, and
//! the run's report.

use std::any::Any;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use numa::{NodeId, Topology};

use super::job::*;
use super::plan::PlannedJob;

/// Start gate: workers wait here until every spawned worker has arrived.
///
/// Not a `std::sync::Barrier`: a barrier's party count is fixed when it is
/// created, and if spawning the k-th worker fails the k-1 already started
/// would wait forever. Here the count is set once spawning is over.
#[derive(Default)]
pub(super) struct StartGate {
    pub(super) state: Mutex<GateState>,
    pub(super) cv: Condvar,
}

#[derive(Default)]
pub(super) struct GateState {
    pub(super) arrived: usize,
    pub(super) expected: Option<usize>,
    pub(super) open: bool,
}

impl StartGate {
    pub(super) fn lock(&self) -> MutexGuard<'_, GateState> {
        // Nothing panics while holding this lock; if it were poisoned the
        // counters would still be consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn open_if_complete(&self, st: &mut GateState) {
        if st.expected.is_some_and(|e| st.arrived >= e) {
            st.open = true;
            self.cv.notify_all();
        }
    }

    /// Called by each worker; returns once all have arrived.
    pub(super) fn arrive_and_wait(&self) {
        let mut st = self.lock();
        st.arrived += 1;
        self.open_if_complete(&mut st);
        while !st.open {
            st = self.cv.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Called once by the spawning thread with the number of workers started.
    pub(super) fn expect(&self, workers: usize) {
        let mut st = self.lock();
        st.expected = Some(workers);
        self.open_if_complete(&mut st);
    }
}

pub(super) struct ProgressState {
    pub(super) last_at: Option<Instant>,
    pub(super) last_bytes: u64,
}

/// State shared by all workers of a run.
pub(super) struct Shared<E> {
    pub(super) total: u64,
    pub(super) done: AtomicU64,
    pub(super) stop: AtomicBool,
    pub(super) first_error: Mutex<Option<RunError<E>>>,
    pub(super) progress: Mutex<ProgressState>,
    pub(super) cursors: Vec<AtomicUsize>,
    pub(super) gate: StartGate,
}

impl<E> Shared<E> {
    /// Records `err` if it is the first error of the run, and stops the run.
    pub(super) fn fail(&self, err: RunError<E>) {
        let mut slot = self
            .first_error
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if slot.is_none() {
            *slot = Some(err);
        }
        self.stop.store(true, Ordering::Relaxed);
    }

    pub(super) fn report_progress(&self, cb: Option<&(dyn Fn(&Progress) + Sync)>) {
        let Some(cb) = cb else { return };
        let mut st = self.progress.lock().unwrap_or_else(PoisonError::into_inner);
        // Loaded under the lock, so successive calls see non-decreasing values.
        let done = self.done.load(Ordering::Relaxed);
        let now = Instant::now();
        let due = done == self.total
            || st
                .last_at
                .is_none_or(|t| now.duration_since(t) >= PROGRESS_INTERVAL);
        if due && done > st.last_bytes {
            st.last_at = Some(now);
            st.last_bytes = done;
            cb(&Progress {
                bytes_done: done,
                bytes_total: self.total,
            });
        }
    }
}

/// What one worker did.
pub(super) struct WorkerRecord {
    pub(super) job: usize,
    pub(super) started: Instant,
    pub(super) finished: Instant,
    pub(super) bytes: u64,
    pub(super) chunks: usize,
}

pub(super) fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

pub(super) fn to_u64(n: usize) -> u64 {
    // usize is at most 64 bits on every target Rust supports.
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// The body of one worker thread.
pub(super) fn worker<E, F>(
    shared: &Shared<E>,
    planned: &PlannedJob,
    topology: &Topology,
    opts: &RunOptions<'_>,
    work: &F,
) -> WorkerRecord
where
    F: Fn(&Chunk) -> Result<(), E>,
{
    let job = planned.index;
    // Pin before the gate so that all workers start on their CPUs. A panic here
    // must not skip the gate, or the other workers would wait forever.
    let pinned = match planned.pin_node {
        None => Ok(Ok(())),
        Some(n) => panic::catch_unwind(|| numa::pin_current_thread_to_node(topology, n)),
    };
    shared.gate.arrive_and_wait();
    let started = Instant::now();
    let mut rec = WorkerRecord {
        job,
        started,
        finished: started,
        bytes: 0,
        chunks: 0,
    };
    match pinned {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            shared.fail(RunError::Pin(e));
            return rec;
        }
        Err(payload) => {
            let message = panic_message(&*payload);
            shared.fail(RunError::WorkerPanicked { job, message });
            return rec;
        }
    }
    let cursor = &shared.cursors[job];
    let result = panic::catch_unwind(AssertUnwindSafe(|| loop {
        if shared.stop.load(Ordering::Relaxed) || opts.cancel.is_some_and(CancelToken::is_cancelled)
        {
            break;
        }
        let k = cursor.fetch_add(1, Ordering::Relaxed);
        let Some(chunk) = planned.plan.chunk(job, k) else {
            break;
        };
        if let Err(source) = work(&chunk) {
            shared.fail(RunError::Work { chunk, source });
            break;
        }
        let len = to_u64(chunk.len);
        rec.bytes += len;
        rec.chunks += 1;
        shared.done.fetch_add(len, Ordering::Relaxed);
        shared.report_progress(opts.progress);
    }));
    if let Err(payload) = result {
        let message = panic_message(&*payload);
        shared.fail(RunError::WorkerPanicked { job, message });
    }
    rec.finished = Instant::now();
    rec
}

pub(super) fn build_report(jobs: &[Job], records: &[WorkerRecord], bytes: u64) -> RunReport {
    struct Acc {
        node: Option<NodeId>,
        bytes: u64,
        threads: usize,
        chunks: usize,
        first: Instant,
        last: Instant,
    }
    let mut accs: Vec<Acc> = Vec::new();
    for r in records {
        let node = jobs[r.job].node;
        match accs.iter_mut().find(|a| a.node == node) {
            Some(a) => {
                a.bytes += r.bytes;
                a.threads += 1;
                a.chunks += r.chunks;
                a.first = a.first.min(r.started);
                a.last = a.last.max(r.finished);
            }
            None => accs.push(Acc {
                node,
                bytes: r.bytes,
                threads: 1,
                chunks: r.chunks,
                first: r.started,
                last: r.finished,
            }),
        }
    }
    let first = records.iter().map(|r| r.started).min();
    let last = records.iter().map(|r| r.finished).max();
    let seconds = match (first, last) {
        (Some(f), Some(l)) => l.duration_since(f).as_secs_f64(),
        _ => 0.0,
    };
    RunReport {
        nodes: accs
            .into_iter()
            .map(|a| NodeStats {
                node: a.node,
                bytes: a.bytes,
                seconds: a.last.duration_since(a.first).as_secs_f64(),
                threads: a.threads,
                chunks: a.chunks,
            })
            .collect(),
        bytes,
        seconds,
    }
}
