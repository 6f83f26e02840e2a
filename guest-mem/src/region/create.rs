//! Creating a region ([`Region::create`]) as its steps: the request
//! checked, the page size chosen from the pools (the fallback logged), the
//! fd created and sized (a memfd sealed, a hugetlbfs file unlinked again if
//! the region does not come to be), the `MAP_SHARED` mapping made, the
//! region bound to its node.

use std::ffi::CString;
use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use numa::{NodeId, Topology};
use tracing::{info, warn};

use super::spec::Backing;
use super::spec::PagePolicy;
use super::spec::RegionSpec;
use super::{state_unit, Region, RegionError, UNBOUND};
use crate::mapping::PageSize;
use crate::pools::{self, PoolSnapshot};
use crate::state::{PageState, PageStates};
use crate::sys;

impl Region {
    /// Creates a region: checks the node and the pools, picks the page size,
    /// creates and sizes the fd, maps it `MAP_SHARED` (reserving hugetlb
    /// pages now) and binds the mapping to the node. Pages are not populated:
    /// every page starts `Unpopulated`; call [`Region::prepare_eager`], or use
    /// [`Region::allocate`] which does both.
    ///
    /// # Errors
    ///
    /// Before anything is allocated: [`RegionError::BadSize`],
    /// [`RegionError::BadName`], [`RegionError::UnknownNode`],
    /// [`RegionError::MemorylessNode`], [`RegionError::Unavailable`] (naming
    /// the free pages per node and size), hugetlbfs mount errors. After:
    /// [`RegionError::Create`], [`RegionError::Size`], [`RegionError::Map`],
    /// [`RegionError::Bind`]; whatever was created is released again.
    pub fn create(topology: &Topology, spec: &RegionSpec) -> Result<Self, RegionError> {
        let (c_name, node_ids) = check_request(topology, spec)?;
        let (page_size, fallback) = choose_page_size(spec, &node_ids)?;
        let (fd, mut unlink) = create_file(spec, &c_name, page_size)?;
        let addr = map_shared(spec, &fd, page_size, &node_ids)?;
        // The region owns the path now and unlinks it when it drops.
        let path = unlink.0.take();
        let unit = state_unit(page_size);
        let pages = usize::try_from(spec.size.div_ceil(unit)).unwrap_or(usize::MAX);
        let region = Self {
            addr,
            len: spec.size,
            page_size,
            node: AtomicU32::new(spec.node.unwrap_or(UNBOUND)),
            name: spec.name.clone(),
            fallback,
            states: PageStates::new(pages, PageState::Unpopulated),
            path,
            keep_path: std::sync::atomic::AtomicBool::new(false),
            fd,
        };

        if let Some(node) = spec.node {
            // Bind before any page exists: MPOL_BIND applies to later
            // allocations only. No MPOL_MF_MOVE/STRICT: there is nothing to
            // move or check yet. For hugetlb this is the policy of our VMA
            // (hugetlb has no shared policy); for shmem it is stored on the
            // file. Pages are then populated through this mapping, so they
            // are allocated under this policy. On error `region` drops:
            // unmapped, closed, unlinked.
            region.bind_to(node).map_err(|source| RegionError::Bind {
                name: spec.name.clone(),
                node,
                source,
            })?;
        }
        info!(
            region = %region.name,
            size = region.len,
            page_size = %page_size,
            node = ?region.node(),
            backing = ?spec.backing,
            "region created"
        );
        Ok(region)
    }
}

/// Checks what can be checked before anything is created: the size, the
/// name, the node. Returns the name for `memfd_create` and the host's nodes.
fn check_request(
    topology: &Topology,
    spec: &RegionSpec,
) -> Result<(CString, Vec<NodeId>), RegionError> {
    if spec.size == 0 || usize::try_from(spec.size).is_err() {
        return Err(RegionError::BadSize(spec.size));
    }
    let c_name = CString::new(spec.name.as_bytes())
        .ok()
        .filter(|_| !spec.name.contains('/'))
        .ok_or_else(|| RegionError::BadName(spec.name.clone()))?;
    let node_ids: Vec<NodeId> = topology.nodes().iter().map(|n| n.id).collect();
    if let Some(node) = spec.node {
        let Some(n) = topology.nodes().iter().find(|n| n.id == node) else {
            return Err(RegionError::UnknownNode {
                node,
                available: node_ids,
            });
        };
        if n.is_memoryless() {
            return Err(RegionError::MemorylessNode(node));
        }
    }
    Ok((c_name, node_ids))
}

/// Picks the page size from the pools as they are now (and, on hugetlbfs,
/// the mount's size); a fallback is logged and returned as its reasons.
fn choose_page_size(
    spec: &RegionSpec,
    node_ids: &[NodeId],
) -> Result<(PageSize, Option<String>), RegionError> {
    // The mount fixes the page size of a hugetlbfs file; learn it before
    // creating anything.
    let mount_size = match &spec.backing {
        Backing::Memfd => None,
        Backing::HugetlbfsDir(dir) => Some(hugetlbfs_page_size(dir)?),
    };

    let snapshot = PoolSnapshot::read(node_ids).map_err(RegionError::Pools)?;
    // On a hugetlbfs mount `Best` means the mount's size: choosing the
    // mount was the caller's choice of page size, so it is no fallback.
    let candidates = match (spec.policy, mount_size) {
        (PagePolicy::Best, Some(m)) => vec![m],
        (policy, _) => policy.candidates(),
    };
    let choice = pools::choose(&candidates, spec.size, mount_size, |p, n| {
        snapshot.availability(p, n, spec.node)
    });
    let Some(page_size) = choice.page_size else {
        return Err(RegionError::Unavailable {
            size: spec.size,
            node: spec.node,
            policy: spec.policy,
            choice: Box::new(choice),
            snapshot: Box::new(snapshot),
        });
    };
    let fallback = (!choice.skipped.is_empty()).then(|| choice.reasons());
    if let Some(reasons) = &fallback {
        warn!(
            region = %spec.name,
            size = spec.size,
            node = ?spec.node,
            policy = %spec.policy,
            page_size = %page_size,
            %reasons,
            "region falls back to {page_size} pages"
        );
    }
    Ok((page_size, fallback))
}

/// Creates the region's file and sizes it; a memfd is sealed. The guard
/// unlinks a hugetlbfs file again unless the region takes its path.
fn create_file(
    spec: &RegionSpec,
    c_name: &CString,
    page_size: PageSize,
) -> Result<(OwnedFd, UnlinkOnDrop), RegionError> {
    let (fd, path) = match &spec.backing {
        Backing::Memfd => (create_memfd(c_name, &spec.name, page_size)?, None),
        Backing::HugetlbfsDir(dir) => {
            let (fd, path) = create_hugetlbfs_file(dir, &spec.name)?;
            (fd, Some(path))
        }
    };
    // From here on the guard unlinks the file again on any early return
    // (the fd closes as it drops).
    let unlink = UnlinkOnDrop(path);
    sys::ftruncate(fd.as_fd(), spec.size).map_err(|source| RegionError::Size {
        name: spec.name.clone(),
        source,
    })?;
    if unlink.0.is_none() {
        seal(fd.as_fd(), &spec.name)?;
    }
    Ok((fd, unlink))
}

/// Maps the whole file `MAP_SHARED`, reserving its hugetlb pages now, and
/// keeps the mapping out of forked children.
fn map_shared(
    spec: &RegionSpec,
    fd: &OwnedFd,
    page_size: PageSize,
    node_ids: &[NodeId],
) -> Result<*mut u8, RegionError> {
    // Never MAP_NORESERVE: a hugetlb pool that cannot honour the whole
    // reservation fails here with ENOMEM, not in a guest with SIGBUS.
    // The size was checked to fit usize (`check_request`).
    let len = spec.size as usize;
    let addr = sys::mmap(
        len,
        libc::PROT_READ | libc::PROT_WRITE,
        libc::MAP_SHARED,
        fd.as_raw_fd(),
        0,
    )
    .map_err(|source| RegionError::Map {
        size: spec.size,
        page_size,
        snapshot: PoolSnapshot::read(node_ids).map_or_else(|e| e.to_string(), |s| s.to_string()),
        source,
    })?;
    // A child this process forks (a daemon's helper, a test's forked
    // tenant) never inherits guest RAM: it would hold the region for
    // the holder scan and could read what the next tenant writes.
    // SAFETY: `addr..addr+len` is the mapping made just above.
    if let Err(e) = unsafe { sys::dont_fork(addr, len) } {
        tracing::warn!(error = %e, region = %spec.name, "MADV_DONTFORK failed; a forked child would inherit the mapping");
    }
    Ok(addr)
}

/// Unlinks a hugetlbfs file created for a region that did not come to be.
struct UnlinkOnDrop(Option<PathBuf>);

impl Drop for UnlinkOnDrop {
    fn drop(&mut self) {
        if let Some(path) = self.0.take() {
            let _ = std::fs::remove_file(path);
        }
    }
}

fn create_memfd(c_name: &CString, name: &str, page_size: PageSize) -> Result<OwnedFd, RegionError> {
    let flags = libc::MFD_ALLOW_SEALING | page_size.memfd_flags();
    sys::memfd_create(c_name, flags).map_err(|source| RegionError::Create {
        name: name.to_string(),
        source,
    })
}

/// Seals a sized memfd: no shrinking, no further seals (see the module docs;
/// growing stays possible for [`Region::grow`]).
fn seal(fd: BorrowedFd<'_>, name: &str) -> Result<(), RegionError> {
    sys::add_seals(fd, libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL).map_err(|source| {
        RegionError::Size {
            name: name.to_string(),
            source,
        }
    })
}

/// A unique name in `dir`: `NAME.PID.N`.
fn create_hugetlbfs_file(dir: &Path, name: &str) -> Result<(OwnedFd, PathBuf), RegionError> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("{name}.{}.{n}", std::process::id()));
        match OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
        {
            Ok(file) => return Ok((OwnedFd::from(file), path)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(source) => {
                return Err(RegionError::Create {
                    name: name.to_string(),
                    source,
                })
            }
        }
    }
}

/// The page size of the hugetlbfs mount that holds `dir`.
fn hugetlbfs_page_size(dir: &Path) -> Result<PageSize, RegionError> {
    let not_hugetlbfs = || RegionError::NotHugetlbfs(dir.to_path_buf());
    let file = std::fs::File::open(dir).map_err(|_| not_hugetlbfs())?;
    let (kind, bytes) =
        sys::fstatfs_type_and_block_size(file.as_fd()).map_err(|_| not_hugetlbfs())?;
    if kind != sys::HUGETLBFS_MAGIC {
        return Err(not_hugetlbfs());
    }
    PageSize::from_bytes(bytes)
        .filter(|p| p.is_huge())
        .ok_or_else(|| RegionError::UnknownMountPageSize {
            path: dir.to_path_buf(),
            bytes,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_hugetlbfs_is_refused() {
        assert!(matches!(
            hugetlbfs_page_size(Path::new("/tmp")),
            Err(RegionError::NotHugetlbfs(_))
        ));
        assert!(matches!(
            hugetlbfs_page_size(Path::new("/nonexistent/dir")),
            Err(RegionError::NotHugetlbfs(_))
        ));
    }
}
