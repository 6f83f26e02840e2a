//! Lazy mode, VMM side: register guest RAM on a userfaultfd, hand it to the
//! daemon, and keep a fallback that serves faults itself if the daemon dies.
//!
//! A lazy ALLOC returns regions flagged [`RegionInfo::FLAG_LAZY`]: their
//! pages may still hold a previous tenant's data, and the daemon clears each
//! one just before the guest first touches it. For that the VMM:
//!
//! 1. maps each region's fd `MAP_SHARED`, read-write (as for eager memory);
//! 2. creates a userfaultfd in its own process **with kernel faults allowed**
//!    ([`CreateFlags::new`], not user-mode-only: KVM reaches guest RAM from
//!    kernel mode, and with `UFFD_USER_MODE_ONLY` those accesses become silent
//!    MMIO exits), does the handshake (`EXACT_ADDRESS`, so the daemon clears
//!    the faulting neighbourhood last) and registers every mapping in MINOR
//!    mode (needs `UFFD_FEATURE_MINOR_HUGETLBFS`);
//! 3. sends the uffd and its mapping table to the daemon (UFFD request);
//! 4. **keeps its own copy** of the uffd while the guest runs, and a watcher
//!    thread on the daemon connection.
//!
//! [`LazyGuest::attach`] does 2-4 for a [`Client`].
//!
//! # Why the VMM keeps a copy and a fallback
//!
//! When the last fd of a uffd closes under a waiting MINOR fault, the kernel
//! unregisters the range and the fault maps the page as it is: the guest
//! would read the previous tenant's data. Keeping a copy makes a daemon crash
//! leave faults *pending* instead. The watcher turns "pending forever" into
//! "served": when the daemon connection closes (the daemon exited, was
//! killed, or stopped serving — it stops its fault service before it closes a
//! connection), the watcher wakes every registered range (so faults whose
//! events the daemon read but never answered are raised again) and then
//! serves faults itself: it clears the whole huge page through a second,
//! unregistered mapping of the same file and answers `UFFDIO_CONTINUE`.
//!
//! The fallback has no page states (they live in the dead daemon). It does
//! not need them:
//!
//! * A page that MINOR-faults has no page-table entry in the registered
//!   mapping. Entries of a hugetlb `MAP_SHARED` mapping go away only by
//!   `munmap`/`mremap` (the range then is not this mapping any more),
//!   `MADV_DONTNEED`/`MADV_REMOVE` (a balloon: the guest gave the page up and
//!   its contents are no longer promised), or truncation (the memfd is
//!   sealed). Hugetlb pages are never reclaimed or swapped, and migration
//!   installs migration entries, not empty ones. So at a MINOR fault the
//!   guest either never saw the page through this mapping or gave it up:
//!   clearing it destroys nothing the guest relies on, even if the daemon had
//!   already cleared it (a clean, never-installed page is cleared twice; that
//!   costs time, not data).
//! * An event can be stale: two vCPUs fault on one page, the daemon serves
//!   the first event and dies before reading the second. The page is then
//!   mapped and may hold the guest's writes, so the fallback looks first
//!   (`/proc/self/pagemap`): a mapped page is only woken, never cleared.
//!   Only the fallback installs pages once the daemon is gone, so the look
//!   cannot race.
//!
//! # Rules for the VMM
//!
//! * Access guest RAM only through the registered mappings; a read through
//!   any other mapping of the fd can see uncleared data (the VMM is trusted;
//!   see `docs/security.md`). Keep guest RAM `MADV_DONTFORK` and do not
//!   `mremap` it.
//! * Drop the [`LazyGuest`] only after the vCPUs have stopped and guest RAM
//!   is unmapped: dropping it closes the VMM's uffd copy.
//! * If [`LazyGuest::attach`] fails, the memory is not clean: do not start
//!   the guest on it (or serve it locally with [`PreparedLazy::start_local`]).
//!
//! [`RegionInfo::FLAG_LAZY`]: crate::proto::RegionInfo::FLAG_LAZY
//! [`CreateFlags::new`]: crate::uffd::CreateFlags::new
//! [`LazyGuest::attach`]: crate::lazy::LazyGuest::attach
//! [`Client`]: crate::client::Client
//! [`LazyGuest`]: crate::lazy::LazyGuest
//! [`PreparedLazy::start_local`]: crate::lazy::PreparedLazy::start_local

mod fallback;

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use clearing::ClearKernel;
use guest_mem::vm_memory::mmap::{MmapRegionBuilder, MmapRegionError};
use guest_mem::vm_memory::FileOffset;
use guest_mem::PageSize;
use nix::sys::eventfd::{EfdFlags, EventFd};
use tracing::{info, warn};

use crate::client::{Allocation, Client, ClientError};
use crate::pagemap::Pagemap;
use crate::proto::{RegionInfo, ReplyBody, Request, UffdRange};
use crate::table::{Range, RangeTable};
use crate::uffd::{abi, CreateFlags, Features, RegisterMode, Uffd, UffdError};
use fallback::{watch, Counters, Fallback, Scratch};

/// Errors setting lazy mode up.
#[derive(Debug, thiserror::Error)]
pub enum LazyError {
    /// A userfaultfd operation failed.
    #[error("userfaultfd setup failed")]
    Uffd(#[from] UffdError),
    /// The kernel cannot serve MINOR faults on hugetlbfs.
    #[error("the kernel's userfaultfd lacks MINOR_HUGETLBFS (it offers {0})")]
    NoMinorHugetlbfs(Features),
    /// A mapping names a region the allocation does not have.
    #[error("mapping {mapping} names region {region_id}, which is not in the allocation")]
    UnknownRegion {
        /// Index in the mapping list.
        mapping: usize,
        /// Region id.
        region_id: u64,
    },
    /// A mapping is empty, misaligned, runs past its region, or is not on huge pages.
    #[error("mapping {mapping} of region {region_id} is empty, misaligned, past the region's end or not on huge pages")]
    BadMapping {
        /// Index in the mapping list.
        mapping: usize,
        /// Region id.
        region_id: u64,
    },
    /// Mappings overlap.
    #[error("the mappings overlap")]
    Overlap(#[source] crate::table::TableError),
    /// The fallback's own mapping of a region could not be made.
    #[error("cannot map region {region_id} for the fallback")]
    Scratch {
        /// Region id.
        region_id: u64,
        /// The cause.
        #[source]
        source: MmapRegionError,
    },
    /// Duplicating an fd, eventfd or pagemap setup failed.
    #[error("cannot set up the fallback")]
    Setup(#[source] io::Error),
    /// The watcher thread could not be started.
    #[error("cannot start the fallback thread")]
    Thread(#[source] io::Error),
    /// The daemon refused or failed the UFFD request.
    #[error("the daemon did not take the userfaultfd")]
    Client(#[from] ClientError),
}

/// One of the VMM's guest-RAM mappings: `len` bytes of region `region_id`
/// from `region_offset`, mapped `MAP_SHARED` at `addr` in this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuestMapping {
    /// Region id from the ALLOC reply.
    pub region_id: u64,
    /// Offset in the region (page aligned).
    pub region_offset: u64,
    /// Start of the mapping in this process (page aligned).
    pub addr: u64,
    /// Bytes (a multiple of the page size).
    pub len: u64,
}

/// Lazy-mode options.
#[derive(Debug, Clone, Copy)]
pub struct LazyOptions {
    /// `UFFD_FEATURE_*` bits for the handshake. Default `EXACT_ADDRESS`.
    ///
    /// The non-cooperative events (`EVENT_UNMAP`, `EVENT_REMOVE`,
    /// `EVENT_REMAP`) are served by the daemon but off by default: with one
    /// enabled, the VMM's `munmap`/`madvise`/`mremap` of guest RAM waits until
    /// someone reads the event, and after FREE nobody does.
    pub features: u64,
    /// Start the fallback watcher. Default true.
    pub fallback: bool,
    /// Kernel the fallback clears with. Default [`ClearKernel::default_kernel`].
    pub kernel: ClearKernel,
}

impl Default for LazyOptions {
    fn default() -> Self {
        Self {
            features: abi::UFFD_FEATURE_EXACT_ADDRESS,
            fallback: true,
            kernel: ClearKernel::default_kernel(),
        }
    }
}

/// Counters of the fallback.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FallbackStats {
    /// Whether the fallback took over.
    pub active: bool,
    /// Page faults it read.
    pub faults: u64,
    /// Pages it cleared and installed.
    pub cleared: u64,
    /// Faults on pages already mapped (stale events): woken only.
    pub stale: u64,
    /// Faults outside every mapping (left pending).
    pub unknown: u64,
}

/// Guest RAM registered on a userfaultfd, not yet handed to the daemon.
#[derive(Debug)]
pub struct PreparedLazy {
    uffd: Uffd,
    ranges: Vec<UffdRange>,
    fallback: Fallback,
    opts: LazyOptions,
}

/// Lazy guest RAM being served by the daemon, with the VMM's uffd copy and
/// the fallback watcher (see the module docs). Dropping it stops the watcher
/// and closes the copy: drop it only after the guest stopped.
#[derive(Debug)]
pub struct LazyGuest {
    uffd: Uffd,
    /// The UFFD request's mappings (for [`LazyGuest::hand_back`]).
    ranges: Vec<UffdRange>,
    fallback: Arc<Fallback>,
    stop: Arc<EventFd>,
    watcher: Option<JoinHandle<()>>,
}

impl PreparedLazy {
    /// Creates the uffd (kernel faults allowed), does the handshake, checks
    /// MINOR_HUGETLBFS, registers every mapping MINOR, and maps each range a
    /// second time for the fallback. `regions` and `fds` are the ALLOC reply's.
    ///
    /// # Errors
    ///
    /// [`LazyError`].
    pub fn new(
        mappings: &[GuestMapping],
        regions: &[RegionInfo],
        fds: &[BorrowedFd<'_>],
        opts: LazyOptions,
    ) -> Result<Self, LazyError> {
        let mut ranges = Vec::with_capacity(mappings.len());
        let mut table = Vec::with_capacity(mappings.len());
        let mut scratch = Vec::with_capacity(mappings.len());
        for (i, m) in mappings.iter().enumerate() {
            let bad = || LazyError::BadMapping {
                mapping: i,
                region_id: m.region_id,
            };
            let Some(r) = regions.iter().position(|r| r.region_id == m.region_id) else {
                return Err(LazyError::UnknownRegion {
                    mapping: i,
                    region_id: m.region_id,
                });
            };
            let (info, fd) = (&regions[r], fds.get(r).ok_or_else(bad)?);
            let page = PageSize::from_bytes(info.page_size)
                .filter(|p| p.is_huge())
                .ok_or_else(bad)?;
            let p = page.bytes();
            let fits = m
                .region_offset
                .checked_add(m.len)
                .is_some_and(|e| e <= info.size);
            if m.len == 0 || m.addr % p != 0 || m.len % p != 0 || m.region_offset % p != 0 || !fits
            {
                return Err(bad());
            }
            let len = usize::try_from(m.len).map_err(|_| bad())?;
            let file = std::fs::File::from(fd.try_clone_to_owned().map_err(LazyError::Setup)?);
            let map = MmapRegionBuilder::new(len)
                .with_file_offset(FileOffset::new(file, m.region_offset))
                .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
                .with_mmap_flags(libc::MAP_SHARED)
                .with_hugetlbfs(true)
                .build()
                .map_err(|source| LazyError::Scratch {
                    region_id: m.region_id,
                    source,
                })?;
            scratch.push(Scratch { map, page_size: p });
            table.push(Range {
                vmm_start: m.addr,
                len: m.len,
                offset: 0,
                target: i,
            });
            ranges.push(UffdRange {
                region_id: m.region_id,
                offset: m.region_offset,
                vmm_addr: m.addr,
                len: m.len,
            });
        }
        let table = RangeTable::new(table).map_err(LazyError::Overlap)?;
        let uffd = Uffd::new(CreateFlags::new())?;
        let info = uffd.api(opts.features)?;
        if !info.available.contains(abi::UFFD_FEATURE_MINOR_HUGETLBFS) {
            return Err(LazyError::NoMinorHugetlbfs(info.available));
        }
        for r in &ranges {
            uffd.register(r.vmm_addr, r.len, RegisterMode::MINOR)?;
        }
        let fallback = Fallback {
            uffd: uffd.try_clone().map_err(LazyError::Setup)?,
            table: Mutex::new(table),
            scratch,
            pagemap: Pagemap::open_self().map_err(LazyError::Setup)?,
            kernel: opts.kernel,
            counters: Counters::default(),
        };
        Ok(Self {
            uffd,
            ranges,
            fallback,
            opts,
        })
    }

    /// The UFFD request for allocation `alloc_id` (send it with [`Self::uffd`]).
    pub fn request(&self, alloc_id: u64) -> Request {
        Request::Uffd {
            alloc_id,
            ranges: self.ranges.clone(),
        }
    }

    /// The uffd to attach to the UFFD request.
    pub fn uffd(&self) -> &Uffd {
        &self.uffd
    }

    /// Starts the watcher on `daemon` (an fd of the daemon connection, or
    /// anything that reports `POLLHUP` when the daemon is gone).
    ///
    /// # Errors
    ///
    /// [`LazyError::Setup`], [`LazyError::Thread`].
    pub fn start(self, daemon: OwnedFd) -> Result<LazyGuest, LazyError> {
        let fallback = self.opts.fallback;
        self.spawn(if fallback { Some(daemon) } else { None })
    }

    /// Serves the faults locally from the start (no daemon): for a VMM that
    /// got lazy memory but cannot hand the uffd over.
    ///
    /// # Errors
    ///
    /// As [`Self::start`].
    pub fn start_local(self) -> Result<LazyGuest, LazyError> {
        let (a, _b) = std::os::unix::net::UnixStream::pair().map_err(LazyError::Setup)?;
        // `_b` drops at the end of this call: the watcher sees a closed peer at once.
        self.spawn(Some(OwnedFd::from(a)))
    }

    fn spawn(self, daemon: Option<OwnedFd>) -> Result<LazyGuest, LazyError> {
        let stop = Arc::new(
            EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
                .map_err(|e| LazyError::Setup(e.into()))?,
        );
        let fallback = Arc::new(self.fallback);
        let watcher = match daemon {
            None => None,
            Some(daemon) => Some(spawn_watcher(&fallback, &stop, daemon)?),
        };
        Ok(LazyGuest {
            uffd: self.uffd,
            ranges: self.ranges,
            fallback,
            stop,
            watcher,
        })
    }
}

/// Starts the watcher thread on `daemon` (see [`watch`]).
fn spawn_watcher(
    fallback: &Arc<Fallback>,
    stop: &Arc<EventFd>,
    daemon: OwnedFd,
) -> Result<JoinHandle<()>, LazyError> {
    let (fb, st) = (Arc::clone(fallback), Arc::clone(stop));
    std::thread::Builder::new()
        .name("hm-lazy-fb".into())
        .spawn(move || watch(&fb, &st, &daemon))
        .map_err(LazyError::Thread)
}

impl LazyGuest {
    /// Sets lazy mode up for `alloc`: registers `mappings` (the VMM's own
    /// `MAP_SHARED` mappings of the allocation's regions) on a new uffd,
    /// sends it to the daemon with a UFFD request, and starts the fallback
    /// watcher on a duplicate of the client's socket.
    ///
    /// # Errors
    ///
    /// [`LazyError`]; on any error the memory is not clean: do not run the
    /// guest on it.
    pub fn attach(
        client: &mut Client,
        alloc: &Allocation,
        mappings: &[GuestMapping],
        opts: LazyOptions,
    ) -> Result<Self, LazyError> {
        let fds: Vec<BorrowedFd<'_>> = alloc.fds.iter().map(AsFd::as_fd).collect();
        let prepared = PreparedLazy::new(mappings, &alloc.regions, &fds, opts)?;
        let watch = client
            .socket()
            .try_clone_to_owned()
            .map_err(LazyError::Setup)?;
        match client.call_with_fds(&prepared.request(alloc.id), &[prepared.uffd().as_fd()])? {
            (ReplyBody::Empty, _) => {}
            (other, _) => return Err(ClientError::Unexpected(format!("{other:?} to UFFD")).into()),
        }
        info!(
            alloc = alloc.id,
            ranges = mappings.len(),
            "lazy guest RAM handed to the daemon"
        );
        prepared.start(watch)
    }

    /// The VMM's own copy of the uffd.
    pub fn uffd(&self) -> &Uffd {
        &self.uffd
    }

    /// Hands the faults back to a daemon after a restart: once
    /// the allocation was re-attached on `client` (REATTACH), the fallback
    /// — which served every fault since the old connection closed — stops
    /// after the events it read, the uffd goes to the daemon again (UFFD
    /// request, same mappings), and a new watcher guards the new
    /// connection. The daemon then clears only pages that fault (each one
    /// has no page-table entry here, so the guest holds nothing in it): a
    /// page the fallback installed never faults again and is never cleared
    /// twice, and the daemon runs no scrubber ahead of the guest, since it
    /// cannot know which pages the fallback installed.
    ///
    /// # Errors
    ///
    /// The UFFD request's refusal or a transport error; the fallback then
    /// serves again at once, as before the call.
    pub fn hand_back(&mut self, client: &mut Client, alloc_id: u64) -> Result<(), LazyError> {
        // Stop the fallback: it answers the events it read, then returns.
        let _ = self.stop.write(1);
        if let Some(w) = self.watcher.take() {
            if w.join().is_err() {
                warn!("the lazy-mode fallback thread panicked");
            }
        }
        let stop = Arc::new(
            EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
                .map_err(|e| LazyError::Setup(e.into()))?,
        );
        self.stop = stop;
        let request = Request::Uffd {
            alloc_id,
            ranges: self.ranges.clone(),
        };
        let sent = client
            .socket()
            .try_clone_to_owned()
            .map_err(LazyError::Setup)
            .and_then(
                |watch| match client.call_with_fds(&request, &[self.uffd.as_fd()])? {
                    (ReplyBody::Empty, _) => Ok(watch),
                    (other, _) => Err(ClientError::Unexpected(format!("{other:?} to UFFD")).into()),
                },
            );
        match sent {
            Ok(watch) => {
                self.fallback
                    .counters
                    .active
                    .store(false, Ordering::Release);
                self.watcher = Some(spawn_watcher(&self.fallback, &self.stop, watch)?);
                info!(alloc = alloc_id, "lazy guest RAM handed back to the daemon");
                Ok(())
            }
            Err(e) => {
                // Serve on locally: a watcher on a closed peer takes over at once.
                let (a, _b) = std::os::unix::net::UnixStream::pair().map_err(LazyError::Setup)?;
                self.watcher = Some(spawn_watcher(&self.fallback, &self.stop, OwnedFd::from(a))?);
                Err(e)
            }
        }
    }

    /// The fallback's counters.
    pub fn stats(&self) -> FallbackStats {
        let c = &self.fallback.counters;
        FallbackStats {
            active: c.active.load(Ordering::Acquire),
            faults: c.faults.load(Ordering::Relaxed),
            cleared: c.cleared.load(Ordering::Relaxed),
            stale: c.stale.load(Ordering::Relaxed),
            unknown: c.unknown.load(Ordering::Relaxed),
        }
    }

    /// Waits up to `timeout` for the fallback to take over.
    pub fn wait_fallback(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while !self.fallback.counters.active.load(Ordering::Acquire) {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }
}

impl Drop for LazyGuest {
    fn drop(&mut self) {
        let _ = self.stop.write(1);
        if let Some(w) = self.watcher.take() {
            if w.join().is_err() {
                warn!("the lazy-mode fallback thread panicked");
            }
        }
    }
}
