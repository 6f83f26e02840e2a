//! Pinning threads to CPUs and NUMA nodes.
//!
//! Workers that clear or fault in guest memory run best on the node that owns
//! the memory: the clearing figures in docs/benchmarks.md come from pinned workers, and
//! first-touch placement only follows the worker if it cannot wander. Pinning
//! is `sched_setaffinity` on the calling thread, with the CPU sets taken from a
//! [`Topology`] snapshot; [`spawn_pinned`] starts a named thread that pins
//! itself before running its work.
//!
//! The alternative, pinning with cgroups/cpusets, needs a cgroup per worker
//! pool and privileges the daemon may not have; affinity is per thread and
//! needs none for the caller's own threads.

use std::thread::{self, JoinHandle};

use crate::sys;
use crate::topology::{Node, NodeId, Topology};

/// Errors pinning a thread.
#[derive(Debug, thiserror::Error)]
pub enum PinError {
    /// An empty CPU set.
    #[error("no CPUs to pin to")]
    NoCpus,
    /// A CPU id beyond what `cpu_set_t` can hold.
    #[error("CPU {0} is out of range")]
    CpuOutOfRange(usize),
    /// The node has no online CPUs.
    #[error("NUMA node {0} has no online CPUs")]
    MemoryOnlyNode(NodeId),
    /// The node does not exist.
    #[error(transparent)]
    Topology(#[from] crate::topology::TopologyError),
    /// `sched_setaffinity`/`getcpu` failed.
    #[error("{op} failed")]
    Syscall {
        /// Which call.
        op: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// Pins the calling thread to `cpus`.
///
/// Threads the caller spawns afterwards inherit the set.
///
/// # Errors
///
/// [`PinError::NoCpus`] for an empty slice, [`PinError::CpuOutOfRange`] for an
/// id `cpu_set_t` cannot hold (1024 and up), both before any syscall;
/// [`PinError::Syscall`] when the kernel refuses, e.g. EINVAL when none of
/// the CPUs exists or is online, or all are outside the thread's cpuset.
pub fn pin_current_thread(cpus: &[usize]) -> Result<(), PinError> {
    if cpus.is_empty() {
        return Err(PinError::NoCpus);
    }
    if let Some(&cpu) = cpus.iter().find(|&&c| c >= sys::CPU_SETSIZE) {
        return Err(PinError::CpuOutOfRange(cpu));
    }
    sys::sched_setaffinity(cpus).map_err(|source| PinError::Syscall {
        op: "sched_setaffinity",
        source,
    })
}

/// Pins the calling thread to the online CPUs of `node`.
///
/// A node without online CPUs (memory only, such as CXL or PMEM expansion, or
/// a node whose CPUs are all offline) pins to the CPUs of the nearest node by
/// distance that has online CPUs, ties going to the lowest node id. This
/// mirrors the kernel's own choice for CPU-less nodes,
/// `numa_nearest_node(node, N_CPU)` in `mm/mempolicy.c` (smallest
/// `node_distance`, first node found on a tie), which the scheduler uses to
/// find CPUs for such a node.
///
/// # Errors
///
/// [`PinError::Topology`] when `node` is unknown; [`PinError::MemoryOnlyNode`]
/// when no node has online CPUs; otherwise as [`pin_current_thread`].
pub fn pin_current_thread_to_node(topology: &Topology, node: NodeId) -> Result<(), PinError> {
    let cpus = &node_cpus_or_nearest(topology, node)?.cpus;
    pin_current_thread(cpus)
}

/// `node` itself when it has online CPUs, else the nearest node that does
/// (see [`pin_current_thread_to_node`]).
fn node_cpus_or_nearest(topology: &Topology, node: NodeId) -> Result<&Node, PinError> {
    let target = topology.node(node)?;
    if !target.cpus.is_empty() {
        return Ok(target);
    }
    // `nodes()` is ascending by id and `min_by_key` keeps the first minimum,
    // so a tie goes to the lowest id, as in the kernel. A missing distance
    // (malformed topology) ranks last.
    let nearest = topology
        .nodes()
        .iter()
        .filter(|n| !n.cpus.is_empty())
        .min_by_key(|n| topology.distance(node, n.id).unwrap_or(u32::MAX))
        .ok_or(PinError::MemoryOnlyNode(node))?;
    tracing::debug!(
        node,
        nearest = nearest.id,
        "node has no online CPUs; pinning to the nearest node with CPUs"
    );
    Ok(nearest)
}

/// The CPU the calling thread runs on now (`getcpu`), with its node.
///
/// Unless the thread is pinned to one CPU, the answer may be stale as soon as
/// it returns.
///
/// # Errors
///
/// [`PinError::Syscall`] when `getcpu` fails.
pub fn current_cpu() -> Result<(usize, NodeId), PinError> {
    let (cpu, node) = sys::getcpu().map_err(|source| PinError::Syscall {
        op: "getcpu",
        source,
    })?;
    // u32 -> usize is lossless on the 64-bit hosts this crate builds for.
    Ok((cpu as usize, node))
}

/// The CPUs the calling thread may run on now (`sched_getaffinity`), ascending.
///
/// Useful to restore a thread's affinity after pinning it temporarily.
///
/// # Errors
///
/// [`PinError::Syscall`] when `sched_getaffinity` fails.
pub fn current_affinity() -> Result<Vec<usize>, PinError> {
    sys::sched_getaffinity().map_err(|source| PinError::Syscall {
        op: "sched_getaffinity",
        source,
    })
}

/// Spawns a thread called `name` that pins itself to `cpus`, then runs `f`.
///
/// The join handle yields `Err` (and `f` never runs) when pinning fails, so a
/// worker pool never silently runs unpinned. For a node's workers pass
/// `topology.node(id)?.cpus.clone()`.
///
/// # Errors
///
/// The `io::Error` of [`std::thread::Builder::spawn`] when the thread cannot
/// be created.
pub fn spawn_pinned<F, T>(
    name: String,
    cpus: Vec<usize>,
    f: F,
) -> std::io::Result<JoinHandle<Result<T, PinError>>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    thread::Builder::new().name(name).spawn(move || {
        pin_current_thread(&cpus)?;
        Ok(f())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_support::fixture::SysTree as Tree;

    #[test]
    fn empty_and_out_of_range_rejected_before_syscall() {
        assert!(matches!(pin_current_thread(&[]), Err(PinError::NoCpus)));
        assert!(matches!(
            pin_current_thread(&[0, 4096]),
            Err(PinError::CpuOutOfRange(4096))
        ));
        assert!(matches!(
            pin_current_thread(&[sys::CPU_SETSIZE]),
            Err(PinError::CpuOutOfRange(1024))
        ));
    }

    #[test]
    fn cpu_less_node_uses_nearest_node_with_cpus() {
        // Node 2 (memory only) is 17 from node 1 and 28 from node 0.
        let tree = Tree::new()
            .cpu_online("0-3")
            .node(0, "0-1", 1000, &[10, 20, 28], &[])
            .node(1, "2-3", 1000, &[20, 10, 17], &[])
            .node(2, "", 1000, &[28, 17, 10], &[]);
        let topo = tree.parse(Topology::from_sysfs);
        assert_eq!(node_cpus_or_nearest(&topo, 2).expect("nearest").id, 1);
        assert_eq!(node_cpus_or_nearest(&topo, 0).expect("itself").id, 0);
    }

    #[test]
    fn cpu_less_node_tie_goes_to_lowest_id() {
        let tree = Tree::new()
            .cpu_online("0-3")
            .node(0, "0-1", 1000, &[10, 20, 20, 30], &[])
            .node(1, "", 1000, &[20, 10, 20, 20], &[])
            .node(2, "2", 1000, &[20, 20, 10, 20], &[])
            .node(3, "3", 1000, &[30, 20, 20, 10], &[]);
        let topo = tree.parse(Topology::from_sysfs);
        // Node 1 is 20 from nodes 0, 2 and 3 (all with CPUs): node 0 wins.
        assert_eq!(node_cpus_or_nearest(&topo, 1).expect("nearest").id, 0);
    }

    #[test]
    fn node_with_only_offline_cpus_counts_as_cpu_less() {
        let tree = Tree::new()
            .cpu_online("0")
            .node(0, "0", 1000, &[10, 21], &[])
            .node(1, "1", 1000, &[21, 10], &[]);
        let topo = tree.parse(Topology::from_sysfs);
        assert_eq!(node_cpus_or_nearest(&topo, 1).expect("fallback").id, 0);
    }

    #[test]
    fn no_node_with_cpus_is_memory_only() {
        let tree = Tree::new()
            .cpu_online("")
            .node(0, "", 1000, &[10, 20], &[])
            .node(1, "", 1000, &[20, 10], &[]);
        let topo = tree.parse(Topology::from_sysfs);
        assert!(matches!(
            pin_current_thread_to_node(&topo, 1),
            Err(PinError::MemoryOnlyNode(1))
        ));
    }

    #[test]
    fn unknown_node_is_topology_error() {
        let tree = Tree::new().cpu_online("0").node(0, "0", 1000, &[10], &[]);
        let topo = tree.parse(Topology::from_sysfs);
        let err = pin_current_thread_to_node(&topo, 5).expect_err("no node 5");
        assert!(matches!(err, PinError::Topology(_)));
        assert_eq!(err.to_string(), "no NUMA node 5; this host has nodes [0]");
    }

    #[test]
    fn spawn_pinned_reports_pin_failure_without_running() {
        let handle =
            spawn_pinned("bad-pin".to_owned(), vec![], || panic!("must not run")).expect("spawn");
        let result = handle.join().expect("thread did not panic");
        assert!(matches!(result, Err(PinError::NoCpus)));
    }
}
