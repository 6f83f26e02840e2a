//! Regions passed on by another instance of the same daemon (an upgrade or
//! restart, `hugemem serve --takeover` or systemd's fd store): the fd comes
//! from the predecessor, and what it said about the file is checked against
//! the file before the region is mapped again.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32};

use super::spec::AdoptSpec;
use super::{state_unit, AdoptError, Region, UNBOUND};
use crate::state::{PageState, PageStates};
use crate::sys;

impl Region {
    /// Takes over a region another instance of the daemon created: checks
    /// that `fd` is what `spec` says (a regular file of exactly `len`
    /// bytes; on hugetlbfs of `page_size` pages, or on shmem for 4 KiB; a
    /// memfd still sealed against shrinking and further seals; one state
    /// per page), maps it `MAP_SHARED` (which reserves pages for any holes,
    /// or fails with `ENOMEM` here rather than `SIGBUS` later), keeps it
    /// out of forked children, and binds the mapping to its node again
    /// (the pages already in the file stay where they are).
    ///
    /// # Errors
    ///
    /// [`AdoptError`]; the fd is closed, nothing is kept.
    pub fn adopt(fd: OwnedFd, spec: AdoptSpec) -> Result<Self, AdoptError> {
        let name = spec.name.clone();
        let mismatch = |why: String| AdoptError::Mismatch {
            name: name.clone(),
            why,
        };
        let io = |what, source| AdoptError::Io {
            name: name.clone(),
            what,
            source,
        };
        let size = sys::file_size(fd.as_fd()).map_err(|e| io("fstat", e))?;
        if size != spec.len || spec.len == 0 || usize::try_from(spec.len).is_err() {
            return Err(mismatch(format!(
                "the file has {size} bytes, the state says {}",
                spec.len
            )));
        }
        let (fs, block) =
            sys::fstatfs_type_and_block_size(fd.as_fd()).map_err(|e| io("fstatfs", e))?;
        let on_hugetlbfs = fs == sys::HUGETLBFS_MAGIC;
        let page_ok = if spec.page_size.is_huge() {
            on_hugetlbfs && block == spec.page_size.bytes()
        } else {
            !on_hugetlbfs
        };
        if !page_ok {
            return Err(mismatch(format!(
                "the file is not on {} pages (file system {fs:#x}, block {block})",
                spec.page_size
            )));
        }
        if spec.path.is_none() {
            let seals = sys::seals(fd.as_fd()).map_err(|e| io("F_GET_SEALS", e))?;
            let want = libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;
            if seals & want != want || seals & (libc::F_SEAL_WRITE | libc::F_SEAL_GROW) != 0 {
                return Err(mismatch(format!(
                    "the memfd's seals are {seals:#x}, a region's are {want:#x}"
                )));
            }
        }
        let unit = state_unit(spec.page_size);
        let pages = usize::try_from(spec.len.div_ceil(unit)).unwrap_or(usize::MAX);
        if spec.states.len() != pages {
            return Err(mismatch(format!(
                "{} page states for {pages} pages",
                spec.states.len()
            )));
        }
        let states: Vec<PageState> = spec
            .states
            .iter()
            .map(|s| match s {
                PageState::Clearing => PageState::Dirty,
                other => *other,
            })
            .collect();
        let len = spec.len as usize;
        let addr = sys::mmap(
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
        .map_err(|e| io("mmap", e))?;
        // SAFETY: `addr..addr+len` is the mapping made just above.
        if let Err(e) = unsafe { sys::dont_fork(addr, len) } {
            tracing::warn!(error = %e, region = %spec.name, "MADV_DONTFORK failed; a forked child would inherit the mapping");
        }
        let region = Self {
            addr,
            len: spec.len,
            page_size: spec.page_size,
            node: AtomicU32::new(spec.node.unwrap_or(UNBOUND)),
            name: spec.name,
            fallback: None,
            states: PageStates::from_states(&states),
            path: spec.path,
            keep_path: AtomicBool::new(false),
            fd,
        };
        // Pages still dirty are the predecessor's work in progress: a lazy
        // guest's fault service and the scrubbers clear them through this
        // mapping, and the fault service requires them mapped here (a
        // dirty page not in this mapping is indistinguishable from a hole).
        // Reading maps the page-cache page as it is; nothing is written.
        for page in 0..region.states.len() {
            if region.states.get(page).ok() == Some(PageState::Dirty) {
                let (offset, len) = region.page_range(page);
                let at = region.addr.wrapping_add(offset as usize);
                // SAFETY: `at..at+len` lies inside our own mapping
                // (page_range clamps to the region's length).
                let populated = unsafe { sys::madvise(at, len as usize, sys::MADV_POPULATE_READ) };
                if let Err(e) = populated {
                    return Err(AdoptError::Io {
                        name: region.name.clone(),
                        what: "MADV_POPULATE_READ of a dirty page",
                        source: e,
                    });
                }
            }
        }
        if let Some(node) = spec.node {
            // The policy of our new VMA: pages faulted in later (holes,
            // growth) land on the node as before.
            region.bind_to(node).map_err(|e| AdoptError::Io {
                name: region.name.clone(),
                what: "mbind",
                source: std::io::Error::other(e.to_string()),
            })?;
        }
        Ok(region)
    }

    /// Leaves the hugetlbfs file in place when this value drops: the file
    /// was handed to a successor daemon, which owns it now.
    pub fn keep_file(&self) {
        self.keep_path
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Undoes [`Region::keep_file`]: the takeover did not happen.
    pub fn keep_file_undo(&self) {
        self.keep_path
            .store(false, std::sync::atomic::Ordering::Release);
    }
}
