//! `[scrub]`: the scrubber threads and the refault of detached regions.

use serde::Deserialize;

use super::byte_size::ByteSize;

/// Background scrubbing.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScrubConfig {
    /// Scrubber threads per NUMA node, pinned to the node's CPUs.
    pub threads_per_node: usize,
    /// Most bytes one scrubber clears with one kernel call (contiguous dirty
    /// pages are claimed together up to this); also how often it looks at
    /// the stop flag.
    pub batch: ByteSize,
    /// Fault a detached region's holes in ahead of its guest from fault
    /// helper processes of the daemon's own, at idle priority and outside
    /// the daemon's address space (`crate::fault_helpers`); off: on the
    /// scrubber threads, through the daemon's own mapping (the older way).
    pub refault_helpers: bool,
    /// Fault helpers per node while a region's holes are faulted in; 0 (the
    /// default): one per CPU of the node.
    pub refault_threads: usize,
}

impl Default for ScrubConfig {
    fn default() -> Self {
        Self {
            threads_per_node: 1,
            batch: ByteSize(64 << 20),
            refault_helpers: true,
            refault_threads: 0,
        }
    }
}
