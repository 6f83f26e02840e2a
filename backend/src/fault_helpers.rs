//! Fault helpers: processes of their own that fault a region's holes in,
//! so that the daemon's own address space, and its `mmap_lock`, is never
//! held by the kernel's zeroing of a huge page.
//!
//! Each helper is a fork of the daemon that keeps only the region's fd and
//! two pipes (`crate::sys::helper::spawn_fault_helper`), pins itself to the
//! region's node, runs under `SCHED_IDLE` (a tenant's runnable thread on
//! the same CPU always goes first), binds its faults to the node, maps the
//! region shared and faults each range it is given in with
//! `MADV_POPULATE_WRITE`. The kernel allocates each missing page and zeroes
//! it in the helper; a page already present (a guest touched it first) is
//! left as it is. Every helper of a set reads the same `todo` pipe, so the
//! ranges are taken in the order they were sent: the caller sends the
//! lowest guest address first.
//!
//! Why processes and not `fallocate` on the file, which takes no
//! `mmap_lock` at all: hugetlbfs's `fallocate` holds the file's inode lock
//! for the whole call, so two threads on one region run one after the
//! other (measured by `hugemem bench refault`, docs/benchmarks.md).
//!
//! A helper counts as a holder of its region for the quarantine's holder
//! scan (it maps it), so a released region is never detached while a
//! helper still faults it (its refault would look like pages a pin kept);
//! not for the re-scan of a clean region before it is handed out again
//! (`holders::scan_for_reuse`), which a helper may go on faulting.
//! The quarantine stops such a helper at once ([`stop_own_helper`](crate::fault_helpers::stop_own_helper)) and
//! its exit wakes the next scan. The descriptors a helper inherits for the
//! moment between its fork and its first system call are the daemon's own
//! descriptions, which the scan does not count.

use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crate::sys::helper::{FaultHelperSpec, FAULT_DONE_BYTES, FAULT_READY, FAULT_WORK_BYTES};

/// What the registry knows of one helper.
#[derive(Debug, Clone, Copy)]
struct HelperOf {
    /// The set it belongs to (one set per region being faulted in).
    set: u64,
    /// The file that set maps: (device, inode).
    file: (u64, u64),
}

/// Every helper of this process not yet exited.
static HELPERS: Mutex<BTreeMap<libc::pid_t, HelperOf>> = Mutex::new(BTreeMap::new());
static SETS: AtomicU64 = AtomicU64::new(1);

fn registry() -> MutexGuard<'static, BTreeMap<libc::pid_t, HelperOf>> {
    HELPERS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Whether `pid` is a fault helper of this process (an unreaped child:
/// the pid is still its own; a helper forked at this moment is in the
/// registry first, as the fork happens under its lock).
pub fn is_own_helper(pid: i32) -> bool {
    registry().contains_key(&pid)
}

/// Kills `pid` and the other helpers of its set (they all map the same
/// region) if it is a fault helper of this process; whether it was. Under
/// the registry's lock, which a helper leaves before it is reaped, so each
/// pid is still the helper's when the signal goes (and a helper forked at
/// this moment is in the registry: the fork happens under it).
pub fn stop_own_helper(pid: i32) -> bool {
    let reg = registry();
    let Some(&HelperOf { set, .. }) = reg.get(&pid) else {
        return false;
    };
    for (&helper, _) in reg.iter().filter(|(_, h)| h.set == set) {
        crate::sys::helper::kill_child(helper);
    }
    true
}

/// A fault helper of this process that maps the file `(dev, ino)` and has
/// not exited yet, if any. A helper killed a moment ago may no longer show
/// the mapping in `/proc` while the kernel still tears its address space
/// down: the pages it faulted are freed only at the end of that, and its
/// reference to the file may outlive the mapping. Until its exit the file
/// is neither free nor detachable, and the helper, not a tenant, is why.
pub fn helper_of_file(dev: u64, ino: u64) -> Option<libc::pid_t> {
    registry()
        .iter()
        .find(|(_, h)| h.file == (dev, ino))
        .map(|(&pid, _)| pid)
}

/// One answer of a helper.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Faulted {
    /// First byte of the range.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// `Ok` when every page of the range is present, else the error.
    pub result: Result<(), i32>,
    /// Time the helper spent on it.
    pub spent: Duration,
}

/// What [`FaultHelpers::next`] saw.
#[derive(Debug)]
pub enum Next {
    /// A helper answered.
    Faulted(Faulted),
    /// The stop descriptor became readable.
    Stopped,
    /// Every helper is gone (none is left to answer).
    Gone,
}

/// What [`FaultHelpers::wait_ready`] saw.
#[derive(Debug)]
pub enum Ready {
    /// Every helper is past its setup and waits for work.
    Ready,
    /// A helper's setup failed, or it exited first.
    Failed(io::Error),
    /// The stop descriptor became readable.
    Stopped,
}

/// A set of fault helpers over one region (see the module docs).
#[derive(Debug)]
pub struct FaultHelpers {
    pids: Vec<libc::pid_t>,
    /// One per helper, readable once it exits: the end of `done` cannot
    /// say it where another fork of this process holds the pipe too.
    exits: Vec<OwnedFd>,
    todo: Option<OwnedFd>,
    done: OwnedFd,
}

impl FaultHelpers {
    /// Forks `count` helpers over the first `len` bytes of `region`, on
    /// `cpus` (every CPU when empty), bound to `node` when given.
    ///
    /// # Errors
    ///
    /// Pipe or fork errors (helpers already forked are killed and reaped).
    pub fn spawn(
        region: BorrowedFd<'_>,
        len: u64,
        cpus: &[usize],
        node: Option<u32>,
        count: usize,
    ) -> io::Result<Self> {
        let len = usize::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let (todo_r, todo_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        let (done_r, done_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        let spec = FaultHelperSpec::new(region, len, todo_r.as_fd(), done_w.as_fd(), cpus, node)?;
        let mut me = Self {
            pids: Vec::with_capacity(count),
            exits: Vec::with_capacity(count),
            todo: Some(todo_w),
            done: done_r,
        };
        let set = SETS.fetch_add(1, Ordering::Relaxed);
        let st = nix::sys::stat::fstat(region)?;
        // st_dev and st_ino are u64 on every Linux target we build for.
        #[allow(clippy::useless_conversion)]
        let file = (u64::from(st.st_dev), u64::from(st.st_ino));
        for _ in 0..count.max(1) {
            let mut reg = registry();
            let pid = crate::sys::helper::spawn_fault_helper(&spec)?;
            reg.insert(pid, HelperOf { set, file });
            drop(reg);
            me.pids.push(pid);
            me.exits.push(crate::pidfd::pidfd_open(pid)?);
        }
        // The helpers hold their own ends; with these closed, the end of
        // `done` means every helper is gone.
        drop((todo_r, done_w));
        Ok(me)
    }

    /// Waits until every helper is past its setup (pinned, bound, mapped,
    /// `SCHED_IDLE`), or `stop` becomes readable.
    ///
    /// # Errors
    ///
    /// `poll` or `read` errors.
    pub fn wait_ready(&self, stop: BorrowedFd<'_>) -> io::Result<Ready> {
        for _ in 0..self.pids.len() {
            match self.next_record(stop)? {
                Next::Faulted(f) if f.offset == FAULT_READY => {
                    if let Err(errno) = f.result {
                        return Ok(Ready::Failed(io::Error::from_raw_os_error(errno)));
                    }
                }
                Next::Faulted(_) => {
                    return Ok(Ready::Failed(io::Error::other("an answer before ready")));
                }
                Next::Stopped => return Ok(Ready::Stopped),
                Next::Gone => return Ok(Ready::Failed(io::Error::other("a fault helper exited"))),
            }
        }
        Ok(Ready::Ready)
    }

    /// The helpers' pids (for `/proc` checks).
    pub fn pids(&self) -> &[libc::pid_t] {
        &self.pids
    }

    /// Sends `len` bytes at `offset` to be faulted in; the first idle
    /// helper takes it, in the order sent.
    ///
    /// # Errors
    ///
    /// `EPIPE` when every helper is gone; `BrokenPipe` after [`Self::close`].
    pub fn send(&self, offset: u64, len: u64) -> io::Result<()> {
        let todo = self
            .todo
            .as_ref()
            .ok_or_else(|| io::Error::from(io::ErrorKind::BrokenPipe))?;
        let mut rec = [0u8; FAULT_WORK_BYTES];
        rec[..8].copy_from_slice(&offset.to_ne_bytes());
        rec[8..].copy_from_slice(&len.to_ne_bytes());
        crate::sys::helper::write_record(todo.as_fd(), &rec)
    }

    /// Waits for the next answer, for `stop` to become readable, or for a
    /// helper to exit (killed: [`Next::Gone`]; answers already written
    /// come first).
    ///
    /// # Errors
    ///
    /// `poll` or `read` errors.
    pub fn next(&self, stop: BorrowedFd<'_>) -> io::Result<Next> {
        loop {
            match self.next_record(stop)? {
                // Left over when the caller did not wait for them.
                Next::Faulted(f) if f.offset == FAULT_READY && f.result.is_ok() => {}
                Next::Faulted(f) if f.offset == FAULT_READY => {
                    return Err(io::Error::from_raw_os_error(
                        f.result.err().unwrap_or(libc::EIO),
                    ));
                }
                other => return Ok(other),
            }
        }
    }

    fn next_record(&self, stop: BorrowedFd<'_>) -> io::Result<Next> {
        let mut fds = vec![self.done.as_fd(), stop];
        fds.extend(self.exits.iter().map(AsFd::as_fd));
        let ready = crate::sys::helper::wait_readable(&fds)?;
        if ready[1] {
            return Ok(Next::Stopped);
        }
        if !ready[0] {
            return Ok(Next::Gone);
        }
        let mut rec = [0u8; FAULT_DONE_BYTES];
        if !crate::sys::helper::read_record(self.done.as_fd(), &mut rec)? {
            return Ok(Next::Gone);
        }
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&rec[i * 8..i * 8 + 8]);
            u64::from_ne_bytes(w)
        };
        let error = i32::try_from(word(2)).unwrap_or(libc::EIO);
        Ok(Next::Faulted(Faulted {
            offset: word(0),
            len: word(1),
            result: if error == 0 { Ok(()) } else { Err(error) },
            spent: Duration::from_nanos(word(3)),
        }))
    }

    /// Sends no more work: each helper exits once the work sent is done.
    pub fn close(&mut self) {
        self.todo = None;
    }

    /// Ends the helpers once every piece of work sent was answered (they
    /// wait on an empty pipe then) and reaps them.
    pub fn finish(self) {
        drop(self);
    }
}

fn reap(pid: libc::pid_t) {
    // In the registry until it has exited (its file references are gone
    // then: `helper_of_file`), out of it before the reap: once reaped, the
    // pid may be anyone's.
    if let Err(e) = crate::sys::helper::wait_exited(pid) {
        tracing::warn!(pid, error = %e, "cannot wait for a fault helper's exit");
    }
    registry().remove(&pid);
    if let Err(e) = crate::sys::helper::reap_child(pid) {
        tracing::warn!(pid, error = %e, "cannot reap a fault helper");
    }
}

impl Drop for FaultHelpers {
    /// Kills the helpers (work in flight is abandoned: its pages are
    /// present or still holes, never anything else) and reaps them. Not by
    /// closing the work pipe: another fork of this process (a test's
    /// tenant) may hold its write end.
    fn drop(&mut self) {
        self.todo = None;
        for pid in std::mem::take(&mut self.pids) {
            crate::sys::helper::kill_child(pid);
            reap(pid);
        }
    }
}
