//! The launcher's views of its allocation: the region table a VMM's
//! command line names, and what the daemon watcher and a live update's
//! HANDOFF need to know of it. Both the watcher (`reattach.rs`) and the
//! update (`update/`) use them, so they live beside both.

use std::os::fd::AsRawFd;
use std::path::PathBuf;

use hugemem_client::client::Allocation;
use hugemem_client::proto::{RegionInfo, ANY_NODE, TOKEN_SIZE};

use super::command_line::{MemoryFile, MemoryRegion};
use super::error::LaunchError;

/// The region table as the VMM will see it: `/dev/fd/N` of `alloc`'s fds,
/// or the daemon's hugetlbfs paths (`hugemem qemu-wrapper` uses it too).
pub(crate) fn memory_regions(
    alloc: &Allocation,
    hugetlbfs: bool,
) -> Result<Vec<MemoryRegion>, LaunchError> {
    if hugetlbfs && alloc.paths.len() != alloc.regions.len() {
        return Err(LaunchError::Reply(format!(
            "asked for hugetlbfs paths, got {} for {} regions (does the daemon have a hugetlbfs mount?)",
            alloc.paths.len(),
            alloc.regions.len()
        )));
    }
    let mut out = Vec::with_capacity(alloc.regions.len());
    for (i, (r, fd)) in alloc.regions.iter().zip(&alloc.fds).enumerate() {
        let file = if hugetlbfs {
            MemoryFile::Path(PathBuf::from(&alloc.paths[i]))
        } else {
            MemoryFile::Fd(fd.as_raw_fd())
        };
        if r.flags & RegionInfo::FLAG_LAZY != 0 {
            return Err(LaunchError::Reply(
                "a lazy region needs a userfaultfd, which VMMs cannot hand over".into(),
            ));
        }
        out.push(MemoryRegion {
            size: r.size,
            node: (r.node != ANY_NODE).then_some(r.node),
            file,
        });
    }
    Ok(out)
}

/// The allocation a launch holds, as the daemon watcher and HANDOFF know
/// it: no descriptors, only what names it to the daemon and what the VMM
/// mapped.
#[derive(Debug, Clone)]
pub(crate) struct HeldAllocation {
    /// Allocation id.
    pub(crate) id: u64,
    /// Its token (`None`: the daemon does not speak `FEATURE_REATTACH`).
    /// A HANDOFF gives the allocation a new one.
    pub(crate) token: Option<[u8; TOKEN_SIZE]>,
    /// The region table the VMM mapped.
    pub(crate) regions: Vec<RegionInfo>,
}

impl HeldAllocation {
    /// What the watcher and HANDOFF need of `alloc`.
    pub(crate) fn of(alloc: &Allocation) -> Self {
        Self {
            id: alloc.id,
            token: alloc.token(),
            regions: alloc.regions.clone(),
        }
    }
}
