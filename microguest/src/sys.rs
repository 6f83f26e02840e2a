//! The few raw syscalls the runner needs: an anonymous mapping for the
//! control slot, and a signal to kick a vCPU thread out of `KVM_RUN`.

use std::io;
use std::ptr::NonNull;
use std::sync::OnceLock;

/// A private anonymous mapping, unmapped on drop.
#[derive(Debug)]
pub(crate) struct AnonMapping {
    ptr: NonNull<u8>,
    len: usize,
}

impl AnonMapping {
    /// Maps `len` zeroed bytes, readable and writable.
    pub fn new(len: usize) -> io::Result<Self> {
        // SAFETY: a new private anonymous mapping with no fd and no MAP_FIXED
        // aliases no existing memory; the result is checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr =
            NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap gave NULL"))?;
        Ok(AnonMapping { ptr, len })
    }

    /// Start of the mapping.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The mapping as bytes.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is a live mapping of `len` readable and writable bytes
        // owned by `self`; `&mut self` makes this the only reference to it.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The mapping as bytes, read-only.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: as in `as_mut_slice`; the shared borrow of `self` prevents
        // writers through this object while the slice lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AnonMapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` describe a mapping this object created and owns;
        // no slice of it outlives `self`.
        let ret = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        if ret != 0 {
            tracing::warn!(error = %io::Error::last_os_error(), "munmap of the control slot failed");
        }
    }
}

extern "C" fn kick_handler(_: libc::c_int) {}

/// Installs (once per process) a no-op handler for the real-time signal used
/// to interrupt `KVM_RUN`, and returns the signal number.
///
/// `KVM_RUN` returns `EINTR` when a signal with a handler arrives; without a
/// handler a real-time signal would kill the process. `SA_RESTART` is left out
/// so nothing restarts the ioctl. If the process already has a handler for the
/// signal it is kept: any handler that returns has the same effect.
pub(crate) fn kick_signal() -> io::Result<libc::c_int> {
    static SIGNAL: OnceLock<Result<libc::c_int, i32>> = OnceLock::new();
    let result = SIGNAL.get_or_init(|| {
        // Cloud-hypervisor and Firecracker kick vCPUs with SIGRTMIN + 0; this
        // crate stays off it in case it shares a process with such a VMM.
        let sig = libc::SIGRTMIN() + 2;
        // SAFETY: an all-zero sigaction is a valid value (no handler, no flags).
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: querying the current disposition (act = NULL) writes only `old`.
        if unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) } != 0 {
            return Err(io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EINVAL));
        }
        if old.sa_sigaction != libc::SIG_DFL && old.sa_sigaction != libc::SIG_IGN {
            return Ok(sig);
        }
        // SAFETY: as above, an all-zero sigaction is valid; fields are set below.
        let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
        act.sa_sigaction = kick_handler as extern "C" fn(libc::c_int) as libc::sighandler_t;
        act.sa_flags = 0;
        // SAFETY: `act.sa_mask` is a valid sigset_t to initialise.
        unsafe { libc::sigemptyset(&mut act.sa_mask) };
        // SAFETY: installs an async-signal-safe handler (it does nothing);
        // `act` is fully initialised.
        if unsafe { libc::sigaction(sig, &act, std::ptr::null_mut()) } != 0 {
            return Err(io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EINVAL));
        }
        Ok(sig)
    });
    (*result).map_err(io::Error::from_raw_os_error)
}

/// CPU time the calling thread has used (`CLOCK_THREAD_CPUTIME_ID`).
pub(crate) fn thread_cpu_time() -> std::time::Duration {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes only `t`; this clock always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    std::time::Duration::new(
        u64::try_from(t.tv_sec).unwrap_or(0),
        u32::try_from(t.tv_nsec).unwrap_or(0),
    )
}

/// The calling thread's pthread id.
pub(crate) fn current_thread() -> libc::pthread_t {
    // SAFETY: pthread_self has no preconditions and cannot fail.
    unsafe { libc::pthread_self() }
}

/// Sends `sig` to `thread`.
///
/// The caller must make sure `thread` is still running (the runner joins its
/// watchdog before the vCPU thread leaves `run`).
pub(crate) fn kick(thread: libc::pthread_t, sig: libc::c_int) -> io::Result<()> {
    // SAFETY: `thread` is a live thread of this process (see above), and the
    // signal has a handler installed by `kick_signal`.
    let ret = unsafe { libc::pthread_kill(thread, sig) };
    if ret != 0 {
        return Err(io::Error::from_raw_os_error(ret));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anon_mapping_is_zeroed_and_writable() {
        let mut m = AnonMapping::new(8192).expect("mmap");
        assert!(m.as_slice().iter().all(|&b| b == 0));
        m.as_mut_slice()[8191] = 7;
        assert_eq!(m.as_slice()[8191], 7);
        assert_eq!(m.as_ptr() as usize % 4096, 0);
    }

    #[test]
    fn kick_signal_is_harmless_to_self() {
        let sig = kick_signal().expect("install");
        assert_eq!(kick_signal().expect("again"), sig);
        kick(current_thread(), sig).expect("kick self");
    }
}
