//! The ways to fault a punched region back in, each as one pass over the
//! whole region, lowest offset first, in chunks.

use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, Ordering};

use backend::fault_helpers::{FaultHelpers, Next, Ready};
use guest_mem::Region;
use nix::sys::eventfd::EventFd;

use super::error::RefaultBenchError;

/// Chunks of `chunk` bytes over `len`, lowest first.
pub(super) fn chunks(len: u64, chunk: u64) -> impl Iterator<Item = (u64, u64)> {
    (0..len.div_ceil(chunk)).map(move |i| (i * chunk, chunk.min(len - i * chunk)))
}

/// Punches every page of `region` out of its file (the state a released,
/// detached region is in, minus the reservation: the pages are free).
pub(super) fn punch(region: &Region) -> Result<(), RefaultBenchError> {
    backend::sys::punch_hole(region.fd(), 0, region.len()).map_err(RefaultBenchError::Io)
}

/// A set of fault helpers over `region`, ready.
pub(super) fn helpers(
    region: &Region,
    cpus: &[usize],
    count: usize,
    stop: &EventFd,
) -> Result<FaultHelpers, RefaultBenchError> {
    let h = FaultHelpers::spawn(region.fd(), region.len(), cpus, region.node(), count)
        .map_err(RefaultBenchError::Io)?;
    match h.wait_ready(stop.as_fd()).map_err(RefaultBenchError::Io)? {
        Ready::Ready => Ok(h),
        Ready::Failed(e) => Err(RefaultBenchError::Io(e)),
        Ready::Stopped => Err(RefaultBenchError::Stopped),
    }
}

/// One pass by `helpers`: every chunk sent, lowest first, two per helper
/// in flight (as the daemon does), until all are answered or `stop` fires;
/// the bytes faulted in.
pub(super) fn helpers_pass(
    helpers: &FaultHelpers,
    len: u64,
    chunk: u64,
    stop: &EventFd,
) -> Result<u64, RefaultBenchError> {
    let depth = 2 * helpers.pids().len();
    let mut todo = chunks(len, chunk);
    let mut in_flight = 0;
    let mut done = 0;
    loop {
        while in_flight < depth {
            let Some((off, n)) = todo.next() else { break };
            helpers.send(off, n).map_err(RefaultBenchError::Io)?;
            in_flight += 1;
        }
        if in_flight == 0 {
            return Ok(done);
        }
        match helpers.next(stop.as_fd()).map_err(RefaultBenchError::Io)? {
            Next::Faulted(f) => {
                if let Err(errno) = f.result {
                    return Err(RefaultBenchError::Io(std::io::Error::from_raw_os_error(
                        errno,
                    )));
                }
                in_flight -= 1;
                done += f.len;
            }
            Next::Stopped => return Ok(done),
            Next::Gone => return Err(RefaultBenchError::Io(std::io::Error::other("helpers gone"))),
        }
    }
}

/// One pass by `threads` threads of this process through its own mapping
/// (the way before the fault helpers: the daemon's scrubbers), chunks claimed in
/// order from a shared counter; stops between chunks when `stop` says so.
/// The bytes faulted in.
pub(super) fn threads_pass(
    region: &Region,
    threads: usize,
    chunk: u64,
    stop: &(dyn Fn() -> bool + Sync),
) -> Result<u64, RefaultBenchError> {
    let next = AtomicU64::new(0);
    let done = AtomicU64::new(0);
    let len = region.len();
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads.max(1))
            .map(|_| {
                s.spawn(|| -> Result<(), RefaultBenchError> {
                    loop {
                        let off = next.fetch_add(chunk, Ordering::Relaxed);
                        if off >= len || stop() {
                            return Ok(());
                        }
                        let n = chunk.min(len - off);
                        // Offsets are inside the region, whose length fits usize.
                        let ptr = region.as_ptr().wrapping_add(off as usize);
                        backend::sys::populate_write(ptr, n as usize)
                            .map_err(RefaultBenchError::Io)?;
                        done.fetch_add(n, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|w| w.join().unwrap_or(Err(RefaultBenchError::Panicked)))
    })?;
    Ok(done.into_inner())
}

/// One pass by `threads` threads calling `fallocate` on the region's file
/// (no mapping, no `mmap_lock`), chunks claimed in order.
pub(super) fn fallocate_pass(
    region: &Region,
    threads: usize,
    chunk: u64,
) -> Result<(), RefaultBenchError> {
    let next = AtomicU64::new(0);
    let len = region.len();
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads.max(1))
            .map(|_| {
                s.spawn(|| -> Result<(), RefaultBenchError> {
                    loop {
                        let off = next.fetch_add(chunk, Ordering::Relaxed);
                        if off >= len {
                            return Ok(());
                        }
                        backend::sys::allocate(region.fd(), off, chunk.min(len - off))
                            .map_err(RefaultBenchError::Io)?;
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|w| w.join().unwrap_or(Err(RefaultBenchError::Panicked)))
    })
}
