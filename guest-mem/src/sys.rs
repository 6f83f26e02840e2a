//! Raw memory and file syscalls of this crate (`mmap`, `munmap`, `madvise`,
//! `mlock`, `munlock`, `mlock2`, `memfd_create`, `ftruncate`, `fstat`, and
//! for the fill engine `pread`, `lseek` `SEEK_DATA`/`SEEK_HOLE`,
//! `posix_fadvise`, `statx`, `cachestat` and the reopen for `O_DIRECT`); the
//! only place in `guest-mem` that calls into libc for them.

use std::io;

/// `MADV_POPULATE_WRITE` (Linux 5.14); not in every libc version we build with.
pub(crate) const MADV_POPULATE_WRITE: libc::c_int = 23;
/// `MADV_POPULATE_READ` (Linux 5.14): map pages without writing them.
pub(crate) const MADV_POPULATE_READ: libc::c_int = 22;

/// `mmap(NULL, len, prot, flags, fd, offset)`, returning the address.
pub(crate) fn mmap(
    len: usize,
    prot: libc::c_int,
    flags: libc::c_int,
    fd: libc::c_int,
    offset: libc::off_t,
) -> io::Result<*mut u8> {
    // SAFETY: a NULL hint without MAP_FIXED lets the kernel pick a fresh range,
    // so no existing mapping (and no Rust object) can be replaced or aliased.
    let addr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd, offset) };
    if addr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(addr.cast())
}

/// `munmap(addr, len)`.
///
/// # Safety
/// `addr..addr+len` must be a mapping owned by the caller that nothing will
/// touch afterwards.
pub(crate) unsafe fn munmap(addr: *mut u8, len: usize) -> io::Result<()> {
    // SAFETY: the caller owns the mapping and promises it is no longer used.
    if unsafe { libc::munmap(addr.cast(), len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `madvise(addr, len, advice)` for advice that does not change contents
/// (populate, hugepage hints).
///
/// # Safety
/// `addr..addr+len` must lie in a mapping owned by the caller.
pub(crate) unsafe fn madvise(addr: *mut u8, len: usize, advice: libc::c_int) -> io::Result<()> {
    // SAFETY: the range is the caller's mapping and the advice values used in
    // this crate only fault pages in; they never discard data.
    if unsafe { libc::madvise(addr.cast(), len, advice) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `madvise(addr, len, MADV_DONTFORK)`: a child the process forks does not
/// inherit the range.
///
/// # Safety
/// `addr..addr+len` must be a mapping owned by the caller.
pub(crate) unsafe fn dont_fork(addr: *mut u8, len: usize) -> io::Result<()> {
    // SAFETY: the caller's own mapping; DONTFORK changes only what fork
    // copies, never the contents or the mapping in this process.
    if unsafe { libc::madvise(addr.cast(), len, libc::MADV_DONTFORK) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `mlock(addr, len)`: populates the range and pins its pages in RAM.
///
/// # Safety
/// `addr..addr+len` must lie in a mapping owned by the caller that nobody
/// unmaps or remaps while the call runs (locking faults every page in).
pub(crate) unsafe fn mlock(addr: *const u8, len: usize) -> io::Result<()> {
    // SAFETY: the range is the caller's live mapping; mlock only faults pages
    // in and sets VM_LOCKED, it never changes the contents.
    if unsafe { libc::mlock(addr.cast(), len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `mlock2(addr, len, MLOCK_ONFAULT)` (Linux 4.4): marks the range locked
/// without populating it; each page is pinned when it is first faulted in.
///
/// # Safety
/// As [`mlock`].
pub(crate) unsafe fn mlock_onfault(addr: *const u8, len: usize) -> io::Result<()> {
    // SAFETY: the range is the caller's live mapping; MLOCK_ONFAULT only sets
    // VM_LOCKED|VM_LOCKONFAULT on it and faults nothing in.
    if unsafe { libc::mlock2(addr.cast(), len, libc::MLOCK_ONFAULT) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `munlock(addr, len)`. Unlocking pages that are not locked is not an error.
///
/// # Safety
/// `addr..addr+len` must lie in a mapping owned by the caller that nobody
/// unmaps or remaps while the call runs.
pub(crate) unsafe fn munlock(addr: *const u8, len: usize) -> io::Result<()> {
    // SAFETY: the range is the caller's live mapping; munlock only clears
    // VM_LOCKED and the pages' mlocked state, never the contents.
    if unsafe { libc::munlock(addr.cast(), len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `memfd_create(name, flags)`; `MFD_CLOEXEC` is always added.
pub(crate) fn memfd_create(
    name: &std::ffi::CStr,
    flags: libc::c_uint,
) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: `name` is a valid NUL-terminated string that outlives the call;
    // the kernel only reads it.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), flags | libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by memfd_create, is open, and nothing
    // else owns it.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// `ftruncate(fd, len)`.
pub(crate) fn ftruncate(fd: std::os::fd::BorrowedFd<'_>, len: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let len = libc::off_t::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
    // SAFETY: the borrowed fd is open for the duration of the call; ftruncate
    // touches no memory of this process.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `HUGETLBFS_MAGIC` from `<linux/magic.h>`: `statfs.f_type` of a hugetlbfs file.
pub(crate) const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;

/// `fstatfs(fd)`: the file system type and block size of an open file. On
/// hugetlbfs the block size is the huge page size of the mount.
pub(crate) fn fstatfs_type_and_block_size(
    fd: std::os::fd::BorrowedFd<'_>,
) -> io::Result<(i64, u64)> {
    use std::os::fd::AsRawFd;
    let mut buf = std::mem::MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: the borrowed fd is open for the duration of the call and `buf`
    // is a writable `statfs` the kernel fills in; nothing else aliases it.
    if unsafe { libc::fstatfs(fd.as_raw_fd(), buf.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fstatfs returned 0, so it wrote the whole struct (and it was
    // zero-initialised before in any case).
    let st = unsafe { buf.assume_init() };
    #[allow(clippy::unnecessary_cast)] // the field types differ between libc targets
    Ok((st.f_type as i64, st.f_bsize as u64))
}

/// `fcntl(fd, F_ADD_SEALS, seals)` on a memfd created with `MFD_ALLOW_SEALING`.
pub(crate) fn add_seals(fd: std::os::fd::BorrowedFd<'_>, seals: libc::c_int) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: the borrowed fd is open for the duration of the call; F_ADD_SEALS
    // takes an int and touches no memory of this process.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `fcntl(fd, F_GET_SEALS)`: the seals of a memfd (0 for other files).
pub(crate) fn seals(fd: std::os::fd::BorrowedFd<'_>) -> io::Result<libc::c_int> {
    use std::os::fd::AsRawFd;
    // SAFETY: the borrowed fd is open for the duration of the call;
    // F_GET_SEALS takes no argument and touches no memory of this process.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 {
        let e = io::Error::last_os_error();
        // Files that cannot be sealed (hugetlbfs files opened by path) have none.
        if e.raw_os_error() == Some(libc::EINVAL) {
            return Ok(0);
        }
        return Err(e);
    }
    Ok(seals)
}

/// `fstat(fd)`.
fn fstat(fd: std::os::fd::BorrowedFd<'_>) -> io::Result<libc::stat> {
    use std::os::fd::AsRawFd;
    let mut buf = std::mem::MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: the borrowed fd is open for the duration of the call and `buf`
    // is a writable `stat` the kernel fills in; nothing else aliases it.
    if unsafe { libc::fstat(fd.as_raw_fd(), buf.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fstat returned 0, so it wrote the whole struct (and it was
    // zero-initialised before in any case).
    Ok(unsafe { buf.assume_init() })
}

/// `fstat(fd).st_size`: the size of an open file.
pub(crate) fn file_size(fd: std::os::fd::BorrowedFd<'_>) -> io::Result<u64> {
    let st = fstat(fd)?;
    u64::try_from(st.st_size).map_err(|_| io::Error::from_raw_os_error(libc::EOVERFLOW))
}

/// `fstat(fd).st_mode & S_IFMT` and `st_size`: the file type and size of an
/// open file.
pub(crate) fn file_type_and_size(
    fd: std::os::fd::BorrowedFd<'_>,
) -> io::Result<(libc::mode_t, u64)> {
    let st = fstat(fd)?;
    let size =
        u64::try_from(st.st_size).map_err(|_| io::Error::from_raw_os_error(libc::EOVERFLOW))?;
    Ok((st.st_mode & libc::S_IFMT, size))
}

/// `pread(fd, dst, len, offset)`, retried on `EINTR`: the bytes read (0 at
/// end of file; fewer than `len` when the file ends sooner).
///
/// # Safety
/// `dst..dst+len` must be writable memory of this process (a hugetlb mapping
/// also backed, or the kernel's copy fails with `EFAULT`) that no Rust
/// reference covers and no other thread reads or writes during the call.
pub(crate) unsafe fn pread(
    fd: std::os::fd::BorrowedFd<'_>,
    dst: *mut u8,
    len: usize,
    offset: u64,
) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    let offset =
        libc::off_t::try_from(offset).map_err(|_| io::Error::from_raw_os_error(libc::EOVERFLOW))?;
    loop {
        // SAFETY: the caller promises dst..dst+len is writable and not
        // accessed by anyone else; the kernel writes at most `len` bytes.
        let n = unsafe { libc::pread(fd.as_raw_fd(), dst.cast(), len, offset) };
        if n >= 0 {
            // Non-negative and at most `len`, so it fits usize.
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// `lseek(fd, offset, SEEK_DATA)` (`data: true`) or `SEEK_HOLE`: the next
/// offset at or after `offset` that is data, or a hole (end of file counts
/// as one). `Ok(None)` for `ENXIO`: no data at or after `offset`, or
/// `offset` is at or past the end of the file.
///
/// The file's position changes; this crate only reads with `pread`, which
/// does not use it (a peer's own use of a shared position is the peer's
/// business: reading into its memory never depended on it).
pub(crate) fn seek(
    fd: std::os::fd::BorrowedFd<'_>,
    offset: u64,
    data: bool,
) -> io::Result<Option<u64>> {
    use std::os::fd::AsRawFd;
    let offset =
        libc::off_t::try_from(offset).map_err(|_| io::Error::from_raw_os_error(libc::EOVERFLOW))?;
    let whence = if data {
        libc::SEEK_DATA
    } else {
        libc::SEEK_HOLE
    };
    // SAFETY: the borrowed fd is open for the duration of the call; lseek
    // touches no memory of this process.
    let at = unsafe { libc::lseek(fd.as_raw_fd(), offset, whence) };
    if at < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENXIO) {
            return Ok(None);
        }
        return Err(e);
    }
    // Non-negative.
    Ok(Some(at as u64))
}

/// `posix_fadvise(fd, offset, len, advice)`: a read-ahead hint; it never
/// changes a file's contents.
pub(crate) fn fadvise(
    fd: std::os::fd::BorrowedFd<'_>,
    offset: u64,
    len: u64,
    advice: libc::c_int,
) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let offset =
        libc::off_t::try_from(offset).map_err(|_| io::Error::from_raw_os_error(libc::EOVERFLOW))?;
    let len =
        libc::off_t::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EOVERFLOW))?;
    // SAFETY: the borrowed fd is open for the duration of the call;
    // posix_fadvise touches no memory of this process.
    let rc = unsafe { libc::posix_fadvise(fd.as_raw_fd(), offset, len, advice) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    Ok(())
}

/// `cachestat(2)`'s number (Linux 6.5): 451 in the common table every
/// architecture shares since 5.1; the `libc` crate names it on some only.
const SYS_CACHESTAT: libc::c_long = 451;

/// `struct cachestat_range` (include/uapi/linux/mman.h).
#[repr(C)]
struct CachestatRange {
    off: u64,
    len: u64,
}

/// `struct cachestat` (include/uapi/linux/mman.h).
#[repr(C)]
#[derive(Default)]
struct Cachestat {
    nr_cache: u64,
    nr_dirty: u64,
    nr_writeback: u64,
    nr_evicted: u64,
    nr_recently_evicted: u64,
}

/// Base pages of `fd`'s file in `offset..offset+len` that are in the page
/// cache (`cachestat`, Linux 6.5; `len` 0: to the end of the file).
pub(crate) fn cached_pages(
    fd: std::os::fd::BorrowedFd<'_>,
    offset: u64,
    len: u64,
) -> io::Result<u64> {
    use std::os::fd::AsRawFd;
    let range = CachestatRange { off: offset, len };
    let mut stat = Cachestat::default();
    // SAFETY: the borrowed fd is open for the call; `range` is read and
    // `stat` written by the kernel, both live, properly laid out (#[repr(C)]
    // copies of the uapi structs) and aliased by nothing else.
    let rc = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            fd.as_raw_fd(),
            &range as *const CachestatRange,
            &mut stat as *mut Cachestat,
            0u32,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(stat.nr_cache)
}

/// The alignment `O_DIRECT` reads of `fd`'s file need, as (memory, file
/// offset and length) bytes (`statx` `STATX_DIOALIGN`, Linux 6.1); `None`
/// where the file takes no direct I/O or the kernel does not say.
pub(crate) fn direct_io_alignment(
    fd: std::os::fd::BorrowedFd<'_>,
) -> io::Result<Option<(u64, u64)>> {
    use std::os::fd::AsRawFd;
    let mut buf = std::mem::MaybeUninit::<libc::statx>::zeroed();
    // SAFETY: an empty C string with AT_EMPTY_PATH names the borrowed fd
    // itself, open for the call; `buf` is a writable `statx` the kernel
    // fills in, aliased by nothing else.
    let rc = unsafe {
        libc::statx(
            fd.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            buf.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: statx returned 0 and the struct was zero-initialised before.
    let st = unsafe { buf.assume_init() };
    let (mem, offset) = (st.stx_dio_mem_align, st.stx_dio_offset_align);
    if st.stx_mask & libc::STATX_DIOALIGN == 0 || mem == 0 || offset == 0 {
        return Ok(None);
    }
    Ok(Some((u64::from(mem), u64::from(offset))))
}

/// `(st_dev, st_ino)` of an open file.
pub(crate) fn file_identity(fd: std::os::fd::BorrowedFd<'_>) -> io::Result<(u64, u64)> {
    let st = fstat(fd)?;
    Ok((st.st_dev, st.st_ino))
}

/// A second open file description of `fd`'s file, read-only with
/// `O_DIRECT`, through `/proc/self/fd/N`.
///
/// The open runs with this process's rights, not those the fd was opened
/// with: it is refused (`EBADF`) unless `fd` itself is open for reading
/// (not `O_WRONLY`, not `O_PATH`), so it grants no access the fd did not,
/// and the result must be the same file (`EXDEV` otherwise).
pub(crate) fn reopen_for_direct_reads(
    fd: std::os::fd::BorrowedFd<'_>,
) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::{AsRawFd, FromRawFd};
    // SAFETY: F_GETFL on a borrowed fd that is open for the call; no memory
    // is passed.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    if flags & libc::O_PATH != 0 || flags & libc::O_ACCMODE == libc::O_WRONLY {
        return Err(io::Error::from_raw_os_error(libc::EBADF));
    }
    let path = std::ffi::CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: a valid C string; open touches no other memory of ours.
    let raw = unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECT | libc::O_CLOEXEC | libc::O_NOCTTY,
        )
    };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` was just returned by open; nothing else owns it.
    let reopened = unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) };
    use std::os::fd::AsFd;
    if file_identity(reopened.as_fd())? != file_identity(fd)? {
        return Err(io::Error::from_raw_os_error(libc::EXDEV));
    }
    Ok(reopened)
}
