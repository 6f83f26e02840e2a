//! Reserving huge pages for a run: a thin layer over [`numa::hugepages`].
//!
//! Operators (`hugemem hugepages`), CI, the benches and the tests all reserve
//! huge pages through [`numa::HugePages`], so there is one code path that
//! writes `nr_hugepages`, compacts memory when the kernel falls short, and
//! reports what it really got. It reads and writes sysfs directly: nothing here
//! depends on the source tree or on a helper program.

use numa::{HugePages, HugePagesError, NodeId, ReserveMode};

use crate::mapping::PageSize;

/// Errors reserving huge pages.
#[derive(Debug, thiserror::Error)]
pub enum ReserveError {
    /// Base pages need no reservation.
    #[error("4 KiB pages are not reserved")]
    NotHuge,
    /// The pool must change and this process may not write it.
    #[error("reserving huge pages needs root (cannot write {path})")]
    NotRoot {
        /// The sysfs file.
        path: std::path::PathBuf,
        /// EACCES or EPERM.
        #[source]
        source: std::io::Error,
    },
    /// A node id this host does not have.
    #[error("no NUMA node {node}; this host has nodes {available:?}")]
    NoSuchNode {
        /// The id asked for.
        node: NodeId,
        /// The ids that exist.
        available: Vec<NodeId>,
    },
    /// Reading or writing the pool in sysfs failed (or the kernel has no
    /// pool of that size).
    #[error("huge-page pool in sysfs")]
    Sysfs(#[source] HugePagesError),
    /// The pages beyond those asked for could not be held back.
    #[error("cannot hold back the pages beyond those asked for")]
    Ballast(#[source] std::io::Error),
}

impl From<HugePagesError> for ReserveError {
    fn from(e: HugePagesError) -> Self {
        match e {
            HugePagesError::NotRoot { path, source } => Self::NotRoot { path, source },
            HugePagesError::NoSuchNode { node, available } => Self::NoSuchNode { node, available },
            other => Self::Sysfs(other),
        }
    }
}

/// What the kernel gave for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReserveReport {
    /// Page size.
    pub page_size: PageSize,
    /// Pages asked for.
    pub requested: u64,
    /// Pool size afterwards.
    pub total: u64,
    /// Pages free and not reserved by another mapping afterwards.
    pub free: u64,
    /// True when the request was met in full.
    pub met: bool,
}

fn huge_bytes(page_size: PageSize) -> Result<u64, ReserveError> {
    match page_size {
        PageSize::Huge1G | PageSize::Huge2M => Ok(page_size.bytes()),
        PageSize::Base4K => Err(ReserveError::NotHuge),
    }
}

fn reserve(
    page_size: PageSize,
    count: u64,
    mode: ReserveMode,
    node: Option<NodeId>,
) -> Result<ReserveReport, ReserveError> {
    let bytes = huge_bytes(page_size)?;
    let r = HugePages::host().reserve(bytes, count, node, mode)?;
    Ok(ReserveReport {
        page_size,
        requested: r.requested,
        total: r.after.total,
        free: r.after.available(),
        met: r.met,
    })
}

/// Makes sure at least `pages` pages of `page_size` are free (on `node`, or
/// host-wide), growing the pool when needed; the pool stays as it is after.
/// A report with `met == false` says the kernel gave fewer.
pub fn ensure_free(
    page_size: PageSize,
    pages: u64,
    node: Option<u32>,
) -> Result<ReserveReport, ReserveError> {
    reserve(page_size, pages, ReserveMode::Free, node)
}

/// Huge pages held reserved and never faulted in, by a hugetlb memfd of
/// that many pages mapped once (`MAP_SHARED`, no `MAP_NORESERVE`): the
/// reservation of a shared hugetlb mapping belongs to the file, so it lasts
/// while the fd is open. The pages stay in the host's pool but count
/// against what anyone else can take (`free - resv_hugepages`), and come
/// back when this value drops. How [`set_available`] makes a host exactly
/// as full as asked without shrinking the pool: a 1 GiB page given back to
/// the kernel may never be had again once memory fragments.
#[derive(Debug)]
pub struct Ballast {
    _fd: std::os::fd::OwnedFd,
}

impl Ballast {
    /// Reserves `pages` pages of `page_size`.
    ///
    /// # Errors
    ///
    /// `ENOMEM` when fewer are available; other `memfd_create`, `ftruncate`
    /// or `mmap` errors.
    pub fn new(page_size: PageSize, pages: u64) -> std::io::Result<Self> {
        use std::os::fd::{AsFd, AsRawFd};
        if !page_size.is_huge() {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        }
        let fd = crate::sys::memfd_create(
            c"hugemem-ballast",
            page_size.memfd_flags() | libc::MFD_CLOEXEC,
        )?;
        let len = pages.saturating_mul(page_size.bytes());
        crate::sys::ftruncate(fd.as_fd(), len)?;
        let len =
            usize::try_from(len).map_err(|_| std::io::Error::from_raw_os_error(libc::EFBIG))?;
        let addr = crate::sys::mmap(len, libc::PROT_READ, libc::MAP_SHARED, fd.as_raw_fd(), 0)?;
        // SAFETY: the mapping made just above, never touched, known to no
        // one else.
        unsafe { crate::sys::munmap(addr, len) }?;
        Ok(Self { _fd: fd })
    }
}

/// Makes exactly `pages` pages of `page_size` available host-wide (free and
/// not reserved by any mapping), whatever earlier runs left: a full host,
/// where nothing is to spare but what the caller asked for. The pool grows
/// when it has too few; pages beyond `pages` are held by the returned
/// [`Ballast`] (none when nothing is beyond), never given back to the
/// kernel. The report's `met` is false when the kernel gave fewer.
///
/// # Errors
///
/// As [`ensure_free`]; [`ReserveError::Ballast`] when the pages beyond
/// `pages` cannot be held back.
pub fn set_available(
    page_size: PageSize,
    pages: u64,
) -> Result<(ReserveReport, Option<Ballast>), ReserveError> {
    let grown = ensure_free(page_size, pages, None)?;
    let bytes = huge_bytes(page_size)?;
    let hp = HugePages::host();
    let extra = hp.pool(bytes, None)?.available().saturating_sub(pages);
    let ballast = if extra > 0 && grown.met {
        Some(Ballast::new(page_size, extra).map_err(ReserveError::Ballast)?)
    } else {
        None
    };
    let available = hp.pool(bytes, None)?.available();
    Ok((
        ReserveReport {
            requested: pages,
            free: available,
            met: available == pages,
            ..grown
        },
        ballast,
    ))
}

/// Host-wide pool size of `page_size` from sysfs.
fn host_pool_total(page_size: PageSize) -> Option<u64> {
    let bytes = huge_bytes(page_size).ok()?;
    HugePages::host().pool(bytes, None).ok().map(|p| p.total)
}

/// Huge pages reserved for the lifetime of this value: the host pool is grown
/// so that `pages` are free, and set back to its earlier size on drop.
#[derive(Debug)]
pub struct Reservation {
    report: ReserveReport,
    previous_total: Option<u64>,
    /// Pages held back to make the host exactly as full as asked.
    ballast: Option<Ballast>,
}

impl Reservation {
    /// Reserves `pages` free pages of `page_size` host-wide for this value's lifetime.
    pub fn for_run(page_size: PageSize, pages: u64) -> Result<Self, ReserveError> {
        let previous_total = host_pool_total(page_size);
        let report = ensure_free(page_size, pages, None)?;
        Ok(Self {
            report,
            previous_total,
            ballast: None,
        })
    }

    /// [`set_available`] for this value's lifetime: the ballast goes and
    /// the pool goes back to its earlier size on drop.
    pub fn exactly(page_size: PageSize, pages: u64) -> Result<Self, ReserveError> {
        let previous_total = host_pool_total(page_size);
        let (report, ballast) = set_available(page_size, pages)?;
        Ok(Self {
            report,
            previous_total,
            ballast,
        })
    }

    /// What the kernel gave.
    pub fn report(&self) -> ReserveReport {
        self.report
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        // The held-back pages first: the pool may then shrink past them.
        drop(self.ballast.take());
        let Some(previous) = self.previous_total else {
            return;
        };
        if Some(previous) == host_pool_total(self.report.page_size) {
            return;
        }
        if let Err(e) = reserve(self.report.page_size, previous, ReserveMode::Exact, None) {
            tracing::warn!(error = %e, "could not give reserved huge pages back");
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::{Mutex, MutexGuard, PoisonError};

    static POOLS: Mutex<()> = Mutex::new(());

    /// Held by this crate's unit tests that change the host's 2 MiB pool, so
    /// that one test's give-back does not meet another's reservation.
    pub(crate) fn pool_lock() -> MutexGuard<'static, ()> {
        POOLS.lock().unwrap_or_else(PoisonError::into_inner)
    }

    #[test]
    fn base_pages_are_not_reserved() {
        assert!(matches!(
            ensure_free(PageSize::Base4K, 1, None),
            Err(ReserveError::NotHuge)
        ));
    }

    #[test]
    fn typed_errors_come_through() {
        let e = ReserveError::from(HugePagesError::NoSuchNode {
            node: 7,
            available: vec![0],
        });
        assert!(
            matches!(e, ReserveError::NoSuchNode { node: 7, .. }),
            "{e:?}"
        );
        assert_eq!(e.to_string(), "no NUMA node 7; this host has nodes [0]");
        match ensure_free(PageSize::Huge2M, 0, Some(u32::MAX)) {
            Err(ReserveError::NoSuchNode { node, available }) => {
                assert_eq!(node, u32::MAX);
                assert!(!available.contains(&u32::MAX));
            }
            other => panic!("expected NoSuchNode, got {other:?}"),
        }
    }

    #[test]
    fn reserves_2m_pages_through_sysfs_and_gives_them_back() {
        let _pools = pool_lock();
        let before = host_pool_total(PageSize::Huge2M);
        {
            let r = match Reservation::for_run(PageSize::Huge2M, 2) {
                Ok(r) => r,
                Err(ReserveError::NotRoot { path, .. }) => {
                    test_support::skip!("reserving huge pages needs root ({})", path.display());
                    return;
                }
                Err(e) => panic!("reserve failed: {e}"),
            };
            let report = r.report();
            assert!(
                report.met,
                "kernel gave fewer 2 MiB pages than asked: {report:?}"
            );
            assert!(report.free >= 2, "{report:?}");
            assert_eq!(Some(report.total), host_pool_total(PageSize::Huge2M));
        }
        // Given back on drop (other processes are kept out by the machine
        // lock the tests run under, other tests here by `pool_lock`).
        assert_eq!(host_pool_total(PageSize::Huge2M), before);
    }
}
