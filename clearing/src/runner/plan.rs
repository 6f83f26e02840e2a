//! Splitting jobs into node-local chunks and placing workers.

use std::num::NonZeroUsize;
use std::thread;

use numa::{NodeId, Topology};

use super::job::*;

/// How one job is split; pure arithmetic, computed before anything runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct JobPlan {
    pub(super) start: usize,
    pub(super) end: usize,
    /// End of chunk 0; the rest are `chunk_size` long from here (the last one
    /// clipped at `end`).
    pub(super) first_end: usize,
    pub(super) chunk_size: usize,
    pub(super) chunks: usize,
    pub(super) workers: usize,
}

/// `x` rounded up to a multiple of `align` (a power of two), or `None` on
/// overflow.
pub(super) fn align_up(x: usize, align: usize) -> Option<usize> {
    x.checked_add(align - 1).map(|v| v & !(align - 1))
}

pub(super) fn align_down(x: usize, align: usize) -> usize {
    x & !(align - 1)
}

impl JobPlan {
    /// Splits a validated, non-empty job for `cpus` CPUs. `max_chunk == 0`
    /// means no cap.
    pub(super) fn new(job: &Job, cpus: usize, max_chunk: usize) -> Self {
        let (start, len, align) = (job.start, job.len, job.align);
        let end = start + len; // validated: no overflow
        let min_chunk = job.min_chunk.max(1);
        let workers = job
            .max_threads
            .min((len / min_chunk).max(1))
            .min(cpus.max(1));

        // Smallest chunk the job allows, and the cap rounded down to `align`.
        let floor = align_up(min_chunk, align).unwrap_or(usize::MAX);
        let cap = if max_chunk == 0 {
            usize::MAX
        } else {
            align_down(max_chunk, align)
        };
        let target = (len / (workers * LOAD_BALANCE_FACTOR)).max(min_chunk);
        let chunk_size = align_up(target, align)
            .unwrap_or(usize::MAX)
            .min(cap)
            .max(floor);

        let single = Self {
            start,
            end,
            first_end: end,
            chunk_size,
            chunks: 1,
            workers: 1,
        };
        if chunk_size >= len {
            return single;
        }
        // Chunk 0 ends on an `align` boundary: the last one within
        // `chunk_size` of the start if that leaves at least `min_chunk`,
        // else the first one at least `min_chunk` in.
        let down = align_down(start + chunk_size, align);
        let first_end = if down > start && down - start >= min_chunk {
            down
        } else {
            match start
                .checked_add(min_chunk)
                .and_then(|x| align_up(x, align))
            {
                Some(e) => e,
                None => return single,
            }
        };
        if first_end >= end {
            return single;
        }
        let chunks = 1 + (end - first_end).div_ceil(chunk_size);
        Self {
            start,
            end,
            first_end,
            chunk_size,
            chunks,
            workers: workers.min(chunks),
        }
    }

    /// Chunk number `k` of job `job`, or `None` past the last one.
    pub(super) fn chunk(&self, job: usize, k: usize) -> Option<Chunk> {
        let (start, end) = if k == 0 {
            (self.start, self.first_end)
        } else if k < self.chunks {
            let s = self.first_end + (k - 1) * self.chunk_size;
            (s, s.saturating_add(self.chunk_size).min(self.end))
        } else {
            return None;
        };
        Some(Chunk {
            job,
            start,
            len: end - start,
        })
    }
}

/// A validated job ready to run.
#[derive(Debug, Clone, Copy)]
pub(super) struct PlannedJob {
    pub(super) index: usize,
    pub(super) plan: JobPlan,
    /// The node to pin workers to (the job's node, or the nearest node with
    /// CPUs when it has none); `None` for unpinned.
    pub(super) pin_node: Option<NodeId>,
}

/// Validates all jobs and splits the non-empty ones. Nothing runs if any job
/// is invalid.
pub(super) fn plan_jobs<E>(
    topology: &Topology,
    jobs: &[Job],
    max_chunk: usize,
) -> Result<Vec<PlannedJob>, RunError<E>> {
    let invalid = |job: usize, reason: String| RunError::InvalidJob { job, reason };
    let mut planned = Vec::with_capacity(jobs.len());
    for (index, job) in jobs.iter().enumerate() {
        if !job.align.is_power_of_two() {
            return Err(invalid(
                index,
                format!("align {} is not a power of two", job.align),
            ));
        }
        if job.max_threads == 0 {
            return Err(invalid(index, "max_threads is 0".to_owned()));
        }
        if job.start.checked_add(job.len).is_none() {
            return Err(invalid(
                index,
                format!(
                    "range {:#x} + {:#x} overflows the address space",
                    job.start, job.len
                ),
            ));
        }
        let (cpus, pin_node) = match job.node {
            None => (
                thread::available_parallelism().map_or(1, NonZeroUsize::get),
                None,
            ),
            Some(n) => {
                let node = topology
                    .node(n)
                    .map_err(|e| invalid(index, e.to_string()))?;
                let cpu_node = if node.cpus.is_empty() {
                    nearest_node_with_cpus(topology, n).ok_or_else(|| {
                        invalid(index, format!("no NUMA node has CPUs to work on node {n}"))
                    })?
                } else {
                    node
                };
                (cpu_node.cpus.len(), Some(cpu_node.id))
            }
        };
        if job.len == 0 {
            continue;
        }
        planned.push(PlannedJob {
            index,
            plan: JobPlan::new(job, cpus, max_chunk),
            pin_node,
        });
    }
    Ok(planned)
}

/// The node with CPUs closest to `to` (kernel distance), lowest id on ties.
pub(super) fn nearest_node_with_cpus(topology: &Topology, to: NodeId) -> Option<&numa::Node> {
    nearest_with_cpus(topology.nodes(), to, |a, b| topology.distance(a, b))
}

/// [`nearest_node_with_cpus`] over a plain node list, for tests.
pub(super) fn nearest_with_cpus(
    nodes: &[numa::Node],
    to: NodeId,
    distance: impl Fn(NodeId, NodeId) -> Option<u32>,
) -> Option<&numa::Node> {
    nodes
        .iter()
        .filter(|c| !c.cpus.is_empty())
        .min_by_key(|c| (distance(to, c.id).unwrap_or(u32::MAX), c.id))
}
