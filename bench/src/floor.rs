//! The VMMs' floor, shared by `bench compare`, `bench churn`, `bench
//! vmstart` and `bench vmm-update`: guest RAM that needs no preparation. A hugetlb memfd of the run's size and page
//! size, populated (the kernel allocates and zeroes every page) before the
//! clock starts, and handed to the VMM the way `hugemem launch` hands over a
//! daemon's fds: the same region table (the VMM adapter's `build_args`) on
//! `/dev/fd/N`, the fd inherited under its number, no daemon.

use std::ffi::OsString;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use backend::proto::{RegionInfo, ANY_NODE};
use guest_mem::{MappingError, PageSize, SharedMapping};
use hugemem::launch::{BuildError, BuildOptions, MemoryFile, MemoryRegion, Vmm};

use crate::harness::rounds;

/// Why floor memory could not be made, or made zero again.
#[derive(Debug, thiserror::Error)]
pub enum FloorError {
    /// The size does not fit this machine's address space.
    #[error("the size does not fit this machine's address space")]
    Size,
    /// The memfd could not be made, mapped or populated (short of huge
    /// pages: `ENOMEM` at the map or the populate).
    #[error("cannot make the floor's memory ready")]
    Mapping(#[from] MappingError),
    /// Punching the memfd's pages out failed.
    #[error("cannot punch the floor's memfd to zero it again")]
    Punch(#[source] std::io::Error),
    /// More launches at once than [`FloorPool`] holds memfds.
    #[error("no floor memfd is free (more launches at once than memfds)")]
    NoneFree,
}

/// A resident hugetlb memfd, mapped by this process (which keeps its pages
/// faulted in while VMMs come and go).
#[derive(Debug)]
pub struct FloorMemory {
    mapping: SharedMapping,
    size: u64,
}

impl FloorMemory {
    /// A memfd of `size` bytes of `page` pages, every page populated
    /// (`MADV_POPULATE_WRITE` on this thread), and the time the populate
    /// took: the kernel's fault-time zeroing of `size` bytes on one thread.
    ///
    /// # Errors
    ///
    /// [`FloorError::Size`], [`FloorError::Mapping`].
    pub fn populated(size: u64, page: PageSize) -> Result<(Self, Duration), FloorError> {
        let len = usize::try_from(size).map_err(|_| FloorError::Size)?;
        let mapping = SharedMapping::memfd(len, page)?;
        let t = Instant::now();
        mapping.populate_write(0, len)?;
        Ok((Self { mapping, size }, t.elapsed()))
    }

    /// Zeroes the memory again after a guest wrote it: every page punched
    /// out of the file (`FALLOC_FL_PUNCH_HOLE`), then populated afresh (the
    /// kernel zeroes each new page), the same work as a fresh memfd's
    /// populate. Returns the populate's time.
    ///
    /// # Errors
    ///
    /// [`FloorError::Punch`]; [`FloorError::Mapping`] when the pages are no
    /// longer there to fault back in.
    pub fn rezero(&self) -> Result<Duration, FloorError> {
        backend::sys::punch_hole(self.mapping.fd(), 0, self.size).map_err(FloorError::Punch)?;
        let t = Instant::now();
        self.mapping.populate_write(0, self.mapping.len())?;
        Ok(t.elapsed())
    }

    /// The region table of the memory, as a daemon's ALLOC reply gives it:
    /// one clean region at guest address 0.
    pub fn region(&self) -> RegionInfo {
        RegionInfo {
            region_id: 0,
            guest_phys: 0,
            size: self.size,
            page_size: self.mapping.page_size().bytes(),
            node: ANY_NODE,
            flags: RegionInfo::FLAG_CLEAN,
        }
    }

    /// The memfd.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.mapping.fd()
    }
}

/// The kernel's fault-time zeroing of `size` bytes of `page` pages on one
/// thread, the limit a floor stands beside: `reps` populates of a fresh
/// memfd, each freed before the next, after one untimed (a warm-up).
///
/// # Errors
///
/// As [`FloorMemory::populated`].
pub fn zeroing_limit(
    size: u64,
    page: PageSize,
    reps: usize,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<Duration>, FloorError> {
    let populate = || FloorMemory::populated(size, page).map(|(_, took)| took);
    rounds::warm_up(progress, "one populate of a fresh memfd", populate)?;
    rounds::collect(reps, |_| populate())
}

/// Floor memfds lent to one launch at a time, each zeroed again before it is
/// lent anew, off the launch's clock: a floor for launches that run side by
/// side and one after another.
#[derive(Debug)]
pub struct FloorPool {
    free: Mutex<Vec<Lendable>>,
}

/// A memfd and whether a guest has written it since it was last zeroed.
#[derive(Debug)]
struct Lendable {
    memory: FloorMemory,
    written: bool,
}

impl FloorPool {
    /// `count` memfds, as [`FloorMemory::populated`] makes them.
    ///
    /// # Errors
    ///
    /// As [`FloorMemory::populated`].
    pub fn populated(count: usize, size: u64, page: PageSize) -> Result<Self, FloorError> {
        let free = (0..count)
            .map(|_| {
                FloorMemory::populated(size, page).map(|(memory, _)| Lendable {
                    memory,
                    written: false,
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            free: Mutex::new(free),
        })
    }

    /// Runs `launch` on a memfd no other launch holds, all zero: one a
    /// guest wrote is punched and populated again first
    /// ([`FloorMemory::rezero`]), before `launch` starts its clock. The
    /// memfd goes back to the pool afterwards, as written.
    ///
    /// # Errors
    ///
    /// [`FloorError::NoneFree`]; as [`FloorMemory::rezero`].
    pub fn lend<T>(&self, launch: impl FnOnce(&FloorMemory) -> T) -> Result<T, FloorError> {
        let slot = self
            .free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        let mut slot = slot.ok_or(FloorError::NoneFree)?;
        if slot.written {
            slot.memory.rezero()?;
        }
        slot.written = true;
        let out = launch(&slot.memory);
        self.free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(slot);
        Ok(out)
    }
}

/// `program` followed by the command line `hugemem launch` builds from
/// `user` (the VMM's own arguments) for `regions` in `fds`, each given as
/// `/dev/fd/N` of its current number.
///
/// # Errors
///
/// [`BuildError`] when `user` cannot carry the memory.
pub fn vmm_argv(
    vmm: Vmm,
    program: OsString,
    user: &[OsString],
    regions: &[RegionInfo],
    fds: &[BorrowedFd<'_>],
) -> Result<Vec<OsString>, BuildError> {
    let memory: Vec<MemoryRegion> = regions
        .iter()
        .zip(fds)
        .map(|(r, fd)| MemoryRegion {
            size: r.size,
            node: (r.node != ANY_NODE).then_some(r.node),
            file: MemoryFile::Fd(fd.as_raw_fd()),
        })
        .collect();
    let mut argv = vec![program];
    argv.extend(
        vmm.adapter()
            .build_args(user, &memory, &BuildOptions::default())?,
    );
    Ok(argv)
}
