//! Fault helpers: processes of their own that fault a region's holes in
//! (issue 27, item 4), so that the daemon's own address space, and its
//! `mmap_lock`, is never held by the kernel's zeroing of a huge page.
//!
//! Each helper is a fork of the daemon that keeps only the region's fd and
//! two pipes (`crate::sys::spawn_fault_helper`), pins itself to the
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
//! The holder scan of the quarantine skips the daemon's own helpers
//! ([`is_own_helper`]): a helper writes no data, and a pid stays in the
//! registry only while the process is an unreaped child of this one, so
//! the pid cannot name anyone else.

use std::collections::BTreeSet;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crate::sys::{FaultHelperSpec, FAULT_DONE_BYTES, FAULT_WORK_BYTES};

static HELPERS: Mutex<BTreeSet<libc::pid_t>> = Mutex::new(BTreeSet::new());

fn registry() -> MutexGuard<'static, BTreeSet<libc::pid_t>> {
    HELPERS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Whether `pid` is a fault helper of this process (an unreaped child).
/// A helper forked at this moment is in the registry before this returns:
/// the fork happens under the registry's lock.
pub fn is_own_helper(pid: i32) -> bool {
    registry().contains(&pid)
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

/// A set of fault helpers over one region (see the module docs).
#[derive(Debug)]
pub struct FaultHelpers {
    pids: Vec<libc::pid_t>,
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
            todo: Some(todo_w),
            done: done_r,
        };
        for _ in 0..count.max(1) {
            let mut reg = registry();
            let pid = crate::sys::spawn_fault_helper(&spec)?;
            reg.insert(pid);
            drop(reg);
            me.pids.push(pid);
        }
        // The helpers hold their own ends; with these closed, the end of
        // `done` means every helper is gone.
        drop((todo_r, done_w));
        Ok(me)
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
        crate::sys::write_record(todo.as_fd(), &rec)
    }

    /// Waits for the next answer, or for `stop` to become readable.
    ///
    /// # Errors
    ///
    /// `poll` or `read` errors.
    pub fn next(&self, stop: BorrowedFd<'_>) -> io::Result<Next> {
        let (done, stopped) = crate::sys::wait_readable(self.done.as_fd(), stop)?;
        if stopped {
            return Ok(Next::Stopped);
        }
        debug_assert!(done);
        let mut rec = [0u8; FAULT_DONE_BYTES];
        if !crate::sys::read_record(self.done.as_fd(), &mut rec)? {
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

    /// Closes the work pipe and reaps every helper once it has finished
    /// the work already sent.
    pub fn finish(mut self) {
        self.close();
        for pid in std::mem::take(&mut self.pids) {
            reap(pid);
        }
    }
}

fn reap(pid: libc::pid_t) {
    // Out of the registry before the reap: once reaped, the pid may be
    // anyone's.
    registry().remove(&pid);
    if let Err(e) = crate::sys::reap_child(pid) {
        tracing::warn!(pid, error = %e, "cannot reap a fault helper");
    }
}

impl Drop for FaultHelpers {
    /// Kills the helpers that are left (work in flight is abandoned: its
    /// pages are present or still holes, never anything else) and reaps them.
    fn drop(&mut self) {
        self.todo = None;
        for pid in std::mem::take(&mut self.pids) {
            crate::sys::kill_child(pid);
            reap(pid);
        }
    }
}
