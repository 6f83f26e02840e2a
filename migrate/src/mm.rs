//! The kernel calls a move makes, behind a small trait.
//!
//! [`Host`] forwards to the safe wrappers in `numa` (`move_pages`,
//! `move_pages_query`, `mbind`) and reads live pool counts through
//! `guest_mem::pools`; this crate makes no syscall of its own. The trait
//! exists so the mover's batching, cancellation, rate limiting and failure
//! accounting can be tested against a simulated two-node machine on a
//! one-node host (`mover::tests`), where a real move to another node cannot
//! happen.

use guest_mem::{PageSize, PoolCounts, PoolError, PoolSnapshot};
use numa::{MbindFlags, MemPolicyMode, NodeId, NodeMask, PageLocation, PolicyError};

use crate::plan::Capacity;

/// What the mover needs from the kernel.
pub(crate) trait Mm {
    /// Where each page is (`move_pages` without targets).
    fn query(&self, addrs: &[usize]) -> Result<Vec<PageLocation>, PolicyError>;
    /// Moves every page to `node`; where each page is afterwards, or its errno.
    fn move_to(
        &self,
        addrs: &[usize],
        node: NodeId,
        move_all: bool,
    ) -> Result<Vec<PageLocation>, PolicyError>;
    /// `mbind(MPOL_BIND, {node})` without flags: later faults land on `node`.
    fn bind(&self, addr: usize, len: usize, node: NodeId) -> Result<(), PolicyError>;
    /// What `node` can take now.
    fn capacity(&self, page_size: PageSize, node: NodeId) -> Result<Capacity, PoolError>;
}

/// This machine's kernel.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Host;

impl Mm for Host {
    fn query(&self, addrs: &[usize]) -> Result<Vec<PageLocation>, PolicyError> {
        numa::move_pages_query(None, addrs)
    }

    fn move_to(
        &self,
        addrs: &[usize],
        node: NodeId,
        move_all: bool,
    ) -> Result<Vec<PageLocation>, PolicyError> {
        let targets = vec![node; addrs.len()];
        numa::move_pages(None, addrs, &targets, move_all)
    }

    fn bind(&self, addr: usize, len: usize, node: NodeId) -> Result<(), PolicyError> {
        numa::mbind(
            addr,
            len,
            MemPolicyMode::Bind,
            &NodeMask::single(node),
            MbindFlags::default(),
        )
    }

    fn capacity(&self, page_size: PageSize, node: NodeId) -> Result<Capacity, PoolError> {
        capacity(page_size, node)
    }
}

/// Live capacity of `node` for pages of `page_size` (see [`Capacity`]).
///
/// # Errors
///
/// A sysfs or meminfo file that exists but cannot be read or parsed.
pub fn capacity(page_size: PageSize, node: NodeId) -> Result<Capacity, PoolError> {
    if !page_size.is_huge() {
        let snapshot = PoolSnapshot::read(&[node])?;
        let free_bytes = snapshot
            .node_mem_free
            .iter()
            .find(|(n, _)| *n == node)
            .map_or(0, |(_, b)| *b);
        return Ok(Capacity::Memory { free_bytes });
    }
    let free = PoolCounts::read(page_size, Some(node))?.map_or(0, |p| p.free);
    let host_available = PoolCounts::read(page_size, None)?.map_or(0, |p| p.available());
    Ok(Capacity::Pool {
        free,
        host_available,
        fresh_fallback: page_size == PageSize::Huge2M,
    })
}
