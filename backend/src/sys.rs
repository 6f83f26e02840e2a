//! Raw syscalls the daemon needs that `nix` does not wrap the way it must be
//! done, each behind a small safe function.
//!
//! * [`recv_with_fds`]: `recvmsg` that takes every `SCM_RIGHTS` fd the kernel
//!   installed into an [`OwnedFd`], **including when the control data was
//!   truncated** (`MSG_CTRUNC`). `nix`'s `RecvMsg::cmsgs` refuses to iterate a
//!   truncated buffer (`ENOBUFS`), but the kernel has already installed as
//!   many fds as fit into it (`scm_detach_fds`: the rest are dropped), so a
//!   caller that returns an error there leaks them: 64 per frame, from any
//!   peer, even a refused one.
//!
//! [`recv_with_fds`]: crate::sys::recv_with_fds
//! [`OwnedFd`]: std::os::fd::OwnedFd

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

pub use hugemem_client::sys::{recv_with_fds, Received};

/// The size of the file behind `fd` (`fstat`).
///
/// # Errors
///
/// The `fstat` error.
pub fn file_size(fd: BorrowedFd<'_>) -> io::Result<u64> {
    let st = nix::sys::stat::fstat(fd).map_err(io::Error::from)?;
    u64::try_from(st.st_size).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))
}

/// `madvise(MADV_POPULATE_WRITE)` over `len` bytes at `addr`: faults every
/// page in writable, allocating pages for holes, without writing any data.
/// Where a store would raise `SIGBUS` (the file was truncated below the
/// range, or a hole cannot get a page because the huge-page pool is empty)
/// it returns an error instead (`EFAULT`, `ENOMEM`, ...), which is what
/// makes the scrubber SIGBUS-proof: populate first, clear only on success.
///
/// Memory-safe for any range: the kernel validates it and changes no byte.
///
/// # Errors
///
/// The `madvise` error.
pub fn populate_write(addr: *const u8, len: usize) -> io::Result<()> {
    // SAFETY: MADV_POPULATE_WRITE only faults pages in (allocating zeroed
    // ones for holes); it writes no data and unmaps nothing, so no Rust
    // object can be affected; an invalid range is an error from the kernel.
    let r = unsafe { libc::madvise(addr.cast_mut().cast(), len, libc::MADV_POPULATE_WRITE) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)` over `len` bytes
/// at `offset` of `fd`: the pages leave the file (a pinned page stays with
/// its pinner, holding only what it held); the next fault gets a fresh
/// kernel-zeroed page.
///
/// # Errors
///
/// The `fallocate` error.
pub fn punch_hole(fd: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<()> {
    let off =
        libc::off_t::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let n = libc::off_t::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: fallocate on a valid fd with integer arguments; no memory of
    // ours is touched (mappings of the range fault fresh pages afterwards).
    let r = unsafe {
        libc::fallocate(
            fd.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            off,
            n,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `fallocate(0)` over `len` bytes at `offset` of `fd` (`FALLOC_FL_KEEP_SIZE`):
/// allocates (and, on hugetlbfs, zeroes) every missing page of the range
/// without mapping it, so no process's `mmap_lock` is taken. hugetlbfs holds
/// the file's inode lock for the whole call (measured by `hugemem bench
/// refault`: two threads on one file do not go faster than one).
///
/// # Errors
///
/// The `fallocate` error.
pub fn allocate(fd: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<()> {
    let off =
        libc::off_t::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let n = libc::off_t::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: fallocate on a valid fd with integer arguments; it adds pages
    // to the file and touches no memory of ours.
    let r = unsafe { libc::fallocate(fd.as_raw_fd(), libc::FALLOC_FL_KEEP_SIZE, off, n) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Bytes of the file behind `fd` that have pages (`st_blocks` x 512):
/// hugetlbfs counts each huge page in its file's blocks while it is in the
/// file, and stops at the punch or truncation that removes it.
///
/// # Errors
///
/// The `fstat` error.
pub fn file_allocated_bytes(fd: BorrowedFd<'_>) -> io::Result<u64> {
    let st = nix::sys::stat::fstat(fd).map_err(io::Error::from)?;
    u64::try_from(st.st_blocks)
        .map(|b| b.saturating_mul(512))
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidData))
}

/// Reserves huge pages for every hole in the first `len` bytes of the
/// hugetlb file behind `fd`, as a new shared mapping of it does
/// (`hugetlb_reserve_pages`), and unmaps again: the reservation of a shared
/// hugetlb mapping belongs to the file (its `resv_map`), not to the mapping,
/// so it stays until a punch or truncation removes those offsets, and the
/// next fault of any mapping of the file takes a reserved page.
///
/// # Errors
///
/// `ENOMEM` when the host has fewer free, unreserved pages than the file
/// has holes; other `mmap` errors.
pub fn reserve_holes(fd: BorrowedFd<'_>, len: usize) -> io::Result<()> {
    // SAFETY: a NULL hint without MAP_FIXED makes a new mapping that aliases
    // no Rust object; it is read-only, never touched, and unmapped below.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the mapping made just above, which nothing else knows of.
    if unsafe { libc::munmap(addr, len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A new open file description of the file behind `fd`, read-write
/// (`open("/proc/self/fd/N", O_RDWR | O_CLOEXEC)`), not a `dup`: the kernel
/// counts it as one more opener of the inode, which is what makes
/// [`write_lease_free`] see it. A memfd's original `memfd_create`
/// description is not counted that way, so the daemon never hands it out.
///
/// # Errors
///
/// The `open` error.
pub fn reopen(fd: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    reopen_as(fd, true)
}

/// [`reopen`], read-only (`O_RDONLY`): for a saver, which reads a parked
/// VM's memory and must not change it.
///
/// # Errors
///
/// The `open` error.
pub fn reopen_read_only(fd: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    reopen_as(fd, false)
}

fn reopen_as(fd: BorrowedFd<'_>, write: bool) -> io::Result<OwnedFd> {
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(write)
        .open(path)?;
    Ok(OwnedFd::from(file))
}

/// True when a write lease (`F_SETLEASE`, `F_WRLCK`) on `fd` is granted,
/// i.e. the kernel counts no open description of the inode but `fd`'s own
/// (other fds, fds in flight in unreceived `SCM_RIGHTS` messages, and the
/// descriptions behind shared mappings all count; `dup`s of `fd` do not).
/// The lease is released again at once (`F_UNLCK`). False on `EAGAIN`/`EBUSY`.
///
/// # Errors
///
/// Other `fcntl` errors (`EINVAL` where leases are unsupported or disabled).
pub fn write_lease_free(fd: BorrowedFd<'_>) -> io::Result<bool> {
    // SAFETY: F_SETLEASE on a valid fd takes an integer argument and touches
    // no memory of ours.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETLEASE, libc::F_WRLCK) };
    if r != 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::EAGAIN | libc::EBUSY) => Ok(false),
            _ => Err(e),
        };
    }
    // SAFETY: as above.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETLEASE, libc::F_UNLCK) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(true)
}

/// This process's effective uid.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// A new memfd that can be sealed (`MFD_CLOEXEC | MFD_ALLOW_SEALING`).
///
/// # Errors
///
/// The `memfd_create` error.
pub fn sealable_memfd(name: &std::ffi::CStr) -> io::Result<OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: `name` is a valid NUL-terminated string for the call.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: memfd_create returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Seals a memfd against every change: writes, size, further seals.
///
/// # Errors
///
/// The `fcntl` error.
pub fn seal_all(fd: BorrowedFd<'_>) -> io::Result<()> {
    let seals = libc::F_SEAL_WRITE | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: the borrowed fd is open for the call; F_ADD_SEALS takes an int.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The seals of a memfd (`F_GET_SEALS`; 0 for a file that cannot be sealed).
///
/// # Errors
///
/// The `fcntl` error.
pub fn seals(fd: BorrowedFd<'_>) -> io::Result<libc::c_int> {
    // SAFETY: the borrowed fd is open for the call; F_GET_SEALS takes no argument.
    let s = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if s < 0 {
        let e = io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::EINVAL) {
            Ok(0)
        } else {
            Err(e)
        };
    }
    Ok(s)
}

/// The owner uid and size of an open file (`fstat`).
///
/// # Errors
///
/// The `fstat` error.
pub fn owner_and_size(fd: BorrowedFd<'_>) -> io::Result<(u32, u64)> {
    let st = nix::sys::stat::fstat(fd).map_err(io::Error::from)?;
    Ok((st.st_uid, u64::try_from(st.st_size).unwrap_or(0)))
}

/// True when fd `their_fd` of process `pid` is the very open file
/// description that this process's `own_fd` is (`kcmp(KCMP_FILE)`): a
/// duplicate of the daemon's own, held by the service manager's fd store or
/// in flight to a successor, never a tenant's (tenants get descriptions of
/// their own, [`reopen`]). False when it is not, or cannot be told
/// (`kcmp` missing or not permitted): the caller then counts a holder.
pub fn same_description(pid: i32, their_fd: i32, own_fd: i32) -> bool {
    const KCMP_FILE: libc::c_long = 0;
    let me = libc::c_long::from(std::process::id() as i32);
    // SAFETY: kcmp takes integers only and touches no memory of this process.
    let r = unsafe {
        libc::syscall(
            libc::SYS_kcmp,
            me,
            libc::c_long::from(pid),
            KCMP_FILE,
            libc::c_long::from(own_fd),
            libc::c_long::from(their_fd),
        )
    };
    r == 0
}

/// What one fault helper process needs (see [`spawn_fault_helper`]),
/// prepared before the fork: the child allocates nothing and takes no lock,
/// so it may run after a fork of the multi-threaded daemon.
#[derive(Clone)]
pub struct FaultHelperSpec {
    region_fd: i32,
    len: usize,
    todo: i32,
    done: i32,
    cpus: libc::cpu_set_t,
    nodemask: Option<[libc::c_ulong; NODEMASK_WORDS]>,
}

const NODEMASK_WORDS: usize = 16;

impl std::fmt::Debug for FaultHelperSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultHelperSpec")
            .field("region_fd", &self.region_fd)
            .field("len", &self.len)
            .field("todo", &self.todo)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl FaultHelperSpec {
    /// A helper that maps the first `len` bytes of `region` (a hugetlb or
    /// shmem file) shared, reads work records from `todo` and answers each
    /// on `done` (see [`FAULT_WORK_BYTES`], [`FAULT_DONE_BYTES`]), runs on
    /// `cpus` (every CPU when empty) under `SCHED_IDLE`, and binds its
    /// faults to `node` (`MPOL_BIND`) when given.
    ///
    /// # Errors
    ///
    /// `InvalidInput` for a CPU or node number beyond what the kernel's
    /// masks hold.
    pub fn new(
        region: BorrowedFd<'_>,
        len: usize,
        todo: BorrowedFd<'_>,
        done: BorrowedFd<'_>,
        cpus: &[usize],
        node: Option<u32>,
    ) -> io::Result<Self> {
        // SAFETY: cpu_set_t is a plain bit array; all zero is the empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        let every = (0..libc::CPU_SETSIZE as usize).collect::<Vec<_>>();
        for &cpu in if cpus.is_empty() { &every } else { cpus } {
            if cpu >= libc::CPU_SETSIZE as usize {
                return Err(io::Error::from(io::ErrorKind::InvalidInput));
            }
            // SAFETY: `cpu` is below CPU_SETSIZE, inside the set's bits.
            unsafe { libc::CPU_SET(cpu, &mut set) };
        }
        let nodemask = match node {
            None => None,
            Some(n) => {
                let bits = libc::c_ulong::BITS as usize;
                let n = n as usize;
                if n >= NODEMASK_WORDS * bits {
                    return Err(io::Error::from(io::ErrorKind::InvalidInput));
                }
                let mut mask = [0; NODEMASK_WORDS];
                mask[n / bits] |= 1 << (n % bits);
                Some(mask)
            }
        };
        Ok(Self {
            region_fd: region.as_raw_fd(),
            len,
            todo: todo.as_raw_fd(),
            done: done.as_raw_fd(),
            cpus: set,
            nodemask,
        })
    }
}

/// Bytes of one work record on a helper's `todo` pipe: offset, length (two
/// native-endian `u64`). Each is written whole (below `PIPE_BUF`, so
/// atomic), so every read of this size by any helper takes exactly one.
pub const FAULT_WORK_BYTES: usize = 16;
/// Bytes of one answer on the `done` pipe: offset, length, errno (0 when
/// faulted in), nanoseconds the helper spent on it.
pub const FAULT_DONE_BYTES: usize = 32;

/// The offset of a helper's first answer, sent once its setup is over:
/// the pid in the length's place, the setup's errno (0: ready).
pub const FAULT_READY: u64 = u64::MAX;

/// Forks one fault helper (see [`FaultHelperSpec::new`]) and returns its
/// pid. The child, before it touches any work: asks for `SIGKILL` when the
/// forking thread dies (`PR_SET_PDEATHSIG`), names itself `hm-refault`,
/// closes every descriptor but the region's and its two pipes (so it holds
/// no other region and no socket), pins itself, switches to `SCHED_IDLE`,
/// binds its memory policy, maps the region and closes the region's fd.
/// Then it answers once with [`FAULT_READY`], and for each work record it faults the range in
/// (`MADV_POPULATE_WRITE`: the kernel allocates and zeroes each missing
/// page, writes no data into a present one) and answers; at the end of
/// `todo` it exits. A setup step that fails makes every answer carry its
/// errno. The caller must reap it (`waitpid`).
///
/// # Errors
///
/// The `fork` error.
pub fn spawn_fault_helper(spec: &FaultHelperSpec) -> io::Result<libc::pid_t> {
    // SAFETY: getpid has no preconditions.
    let parent = unsafe { libc::getpid() };
    // SAFETY: the child runs only `fault_helper_main`, which makes raw
    // system calls on data prepared before the fork (no allocation, no
    // lock, no Rust runtime state) and leaves with `_exit`, as a child of a
    // multi-threaded process must.
    match unsafe { libc::fork() } {
        -1 => Err(io::Error::last_os_error()),
        0 => fault_helper_main(spec, parent),
        pid => Ok(pid),
    }
}

fn errno() -> i32 {
    io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// Leaves a fault helper at once (no destructor of the parent's copy runs).
fn helper_exit(code: i32) -> ! {
    // SAFETY: `_exit` ends the process; nothing of it is used afterwards.
    unsafe { libc::_exit(code) }
}

/// Monotonic nanoseconds (the vDSO clock: safe after a fork).
fn monotonic_nanos() -> i128 {
    // SAFETY: all zero is a valid timespec.
    let mut t: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: clock_gettime writes only `t`.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    i128::from(t.tv_sec) * 1_000_000_000 + i128::from(t.tv_nsec)
}

/// Closes every descriptor from 3 up but those in `keep`.
fn close_all_but(keep: [i32; 3]) {
    let mut keep = keep;
    keep.sort_unstable();
    let mut from: libc::c_uint = 3;
    for k in keep {
        let k = k as libc::c_uint;
        if k > from {
            // SAFETY: close_range on integers; no descriptor Rust owns in
            // this process is used afterwards (the child runs only this).
            unsafe { libc::syscall(libc::SYS_close_range, from, k - 1, 0) };
        }
        from = from.max(k + 1);
    }
    // SAFETY: as above.
    unsafe { libc::syscall(libc::SYS_close_range, from, libc::c_uint::MAX, 0) };
}

/// The setup of a fault helper (see [`spawn_fault_helper`]): the mapping,
/// or the first errno.
fn fault_helper_setup(spec: &FaultHelperSpec, parent: libc::pid_t) -> Result<*mut u8, i32> {
    // SAFETY: prctl with integer arguments.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    // SAFETY: getppid has no preconditions.
    if unsafe { libc::getppid() } != parent {
        helper_exit(1);
    }
    // SAFETY: the name is a NUL-terminated static string the kernel copies.
    unsafe { libc::prctl(libc::PR_SET_NAME, c"hm-refault".as_ptr()) };
    close_all_but([spec.region_fd, spec.todo, spec.done]);
    let mut error = 0;
    // SAFETY: sched_setaffinity reads the set in `spec`.
    if unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &spec.cpus) }
        != 0
    {
        error = errno();
    }
    if let Some(mask) = &spec.nodemask {
        let max_node = (NODEMASK_WORDS * libc::c_ulong::BITS as usize) as libc::c_ulong;
        // SAFETY: set_mempolicy reads `max_node` bits of `mask`, which has them.
        let r = unsafe {
            libc::syscall(
                libc::SYS_set_mempolicy,
                libc::MPOL_BIND,
                mask.as_ptr(),
                max_node,
            )
        };
        if r != 0 && error == 0 {
            error = errno();
        }
    }
    // SAFETY: a new shared mapping of the region's file at an address the
    // kernel picks; it aliases nothing of this process.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            spec.len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            spec.region_fd,
            0,
        )
    };
    if map == libc::MAP_FAILED && error == 0 {
        error = errno();
    }
    // SAFETY: closes the child's copy of the region's fd (the mapping keeps the file).
    unsafe { libc::close(spec.region_fd) };
    let idle = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler reads `idle`.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &idle) } != 0 && error == 0 {
        error = errno();
    }
    if error == 0 {
        Ok(map.cast())
    } else {
        Err(error)
    }
}

/// Writes one answer whole, or leaves the helper.
fn helper_answer(done: i32, answer: &[u64; 4]) {
    loop {
        // SAFETY: write reads FAULT_DONE_BYTES (the four words) from `answer`.
        let w = unsafe { libc::write(done, answer.as_ptr().cast(), FAULT_DONE_BYTES) };
        if w == FAULT_DONE_BYTES as isize {
            return;
        }
        if w >= 0 || errno() != libc::EINTR {
            helper_exit(1);
        }
    }
}

/// The body of a fault helper process; see [`spawn_fault_helper`]. Only
/// raw system calls on integers and on buffers on this stack or in `spec`
/// (the child's copy of the parent's memory); no allocation, no lock.
fn fault_helper_main(spec: &FaultHelperSpec, parent: libc::pid_t) -> ! {
    let setup = fault_helper_setup(spec, parent);
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    let setup_error = setup.err().unwrap_or(0);
    helper_answer(spec.done, &[FAULT_READY, pid as u64, setup_error as u64, 0]);
    loop {
        let mut work = [0u64; 2];
        // SAFETY: read writes at most FAULT_WORK_BYTES (two words) into `work`.
        let n = unsafe { libc::read(spec.todo, work.as_mut_ptr().cast(), FAULT_WORK_BYTES) };
        if n < 0 && errno() == libc::EINTR {
            continue;
        }
        if n != FAULT_WORK_BYTES as isize {
            helper_exit(0);
        }
        let [offset, len] = work;
        let started = monotonic_nanos();
        let error = match setup {
            Err(e) => e,
            Ok(_)
                if offset
                    .checked_add(len)
                    .is_none_or(|end| end > spec.len as u64) =>
            {
                libc::EINVAL
            }
            // `offset + len` is within the mapping of `spec.len` bytes (checked above).
            Ok(map) => match populate_write(map.wrapping_add(offset as usize), len as usize) {
                Ok(()) => 0,
                Err(e) => e.raw_os_error().unwrap_or(libc::EIO),
            },
        };
        let nanos = u64::try_from(monotonic_nanos() - started).unwrap_or(0);
        helper_answer(spec.done, &[offset, len, error as u64, nanos]);
    }
}

/// Sends `SIGKILL` to `pid` (a child of this process not reaped yet, so the
/// pid is still its own).
pub fn kill_child(pid: libc::pid_t) {
    // SAFETY: kill with integer arguments; an unreaped child's pid cannot
    // name another process.
    unsafe { libc::kill(pid, libc::SIGKILL) };
}

/// Waits until child `pid` has exited, without reaping it: a zombie, whose
/// files and mappings are all released (the kernel drops them before the
/// exit is reported), and whose pid stays its own until [`reap_child`].
///
/// # Errors
///
/// The `waitid` error.
pub fn wait_exited(pid: libc::pid_t) -> io::Result<()> {
    let id = libc::id_t::try_from(pid).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    loop {
        // SAFETY: an all-zero `siginfo_t` is a valid value of the plain C
        // struct, which waitid only writes.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid with integer arguments writes only `info`.
        let r = unsafe { libc::waitid(libc::P_PID, id, &mut info, libc::WEXITED | libc::WNOWAIT) };
        if r == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

/// Waits for child `pid` to exit and reaps it; its exit status.
///
/// # Errors
///
/// The `waitpid` error.
pub fn reap_child(pid: libc::pid_t) -> io::Result<libc::c_int> {
    let mut status = 0;
    loop {
        // SAFETY: waitpid writes only `status`.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        if r == pid {
            return Ok(status);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

/// Reads one whole record of `buf.len()` bytes (at most `PIPE_BUF`) from
/// the pipe `fd`, retrying on `EINTR`; `Ok(false)` at the end of the pipe.
///
/// # Errors
///
/// The `read` error, or `UnexpectedEof` for a partial record.
pub fn read_record(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<bool> {
    loop {
        // SAFETY: read writes at most buf.len() bytes into buf.
        let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        match n {
            0 => return Ok(false),
            n if n == buf.len() as isize => return Ok(true),
            n if n > 0 => return Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
            _ => {
                let e = io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EINTR) {
                    return Err(e);
                }
            }
        }
    }
}

/// Writes one whole record (at most `PIPE_BUF` bytes, so atomic on a pipe).
///
/// # Errors
///
/// The `write` error (`EPIPE` when no reader is left).
pub fn write_record(fd: BorrowedFd<'_>, buf: &[u8]) -> io::Result<()> {
    loop {
        // SAFETY: write reads buf.len() bytes from buf.
        let n = unsafe { libc::write(fd.as_raw_fd(), buf.as_ptr().cast(), buf.len()) };
        if n == buf.len() as isize {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if n >= 0 {
            return Err(io::Error::from(io::ErrorKind::WriteZero));
        }
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

/// Waits until one of `fds` is readable (or hung up); which of them are.
///
/// # Errors
///
/// The `poll` error.
pub fn wait_readable(fds: &[BorrowedFd<'_>]) -> io::Result<Vec<bool>> {
    let mut polled: Vec<libc::pollfd> = fds
        .iter()
        .map(|fd| libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let n = libc::nfds_t::try_from(polled.len())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    loop {
        // SAFETY: poll writes only the revents of the `n` entries of `polled`.
        let r = unsafe { libc::poll(polled.as_mut_ptr(), n, -1) };
        if r > 0 {
            return Ok(polled.iter().map(|p| p.revents != 0).collect());
        }
        let e = io::Error::last_os_error();
        if r < 0 && e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}
