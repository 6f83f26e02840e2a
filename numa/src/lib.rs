//! NUMA topology, memory-policy syscalls, CPU pinning and huge-page pools
//! (reservation per node and size, hugetlbfs mounts: [`hugepages`]) for hugemem.
//!
//! Everything here is read from `/sys/devices/system` or done with raw
//! syscalls (`mbind`, `set_mempolicy`, `get_mempolicy`, `move_pages`,
//! `migrate_pages`, `sched_setaffinity`, `getcpu`), as cloud-hypervisor does:
//! the existing NUMA crates either need libnuma/libhwloc at build time or return
//! wrong data (see `docs/design.md`). Raw syscalls live only in the private
//! `sys` module; the rest of the crate and its users see safe functions with
//! typed errors.
//!
//! ```
//! use numa::{current_cpu, spawn_pinned, Topology};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let topo = Topology::detect()?;
//! for node in topo.nodes() {
//!     println!("node {}: cpus {:?}, {} MiB", node.id, node.cpus, node.mem_total >> 20);
//! }
//! // A worker pinned to the first node's CPUs.
//! let home = &topo.nodes()[0];
//! let worker = spawn_pinned("worker-0".to_owned(), home.cpus.clone(), current_cpu)?;
//! let (cpu, _node) = worker.join().expect("worker panicked")??;
//! assert!(home.cpus.contains(&cpu));
//! # Ok(())
//! # }
//! ```

#![deny(missing_docs)]

pub mod hugepages;
pub mod pin;
pub mod policy;
mod sys;
pub mod topology;

pub use hugepages::{
    HugePages, HugePagesError, MountReport, MountState, NodePool, PoolReport, PoolState,
    ReserveMode,
};
pub use pin::{
    current_affinity, current_cpu, pin_current_thread, pin_current_thread_to_node, spawn_pinned,
    PinError,
};
pub use policy::{
    get_mempolicy, get_mempolicy_node_of_addr, mbind, migrate_pages, move_pages, move_pages_query,
    set_mempolicy, MbindFlags, MemPolicyMode, NodeMask, PageLocation, PolicyError,
};
pub use topology::{parse_cpulist, HugePagePool, Node, NodeId, Topology, TopologyError};

/// The two huge-page sizes hugemem manages, in bytes.
pub const HUGE_PAGE_1G: u64 = 1 << 30;
/// 2 MiB huge pages, in bytes.
pub const HUGE_PAGE_2M: u64 = 2 << 20;
