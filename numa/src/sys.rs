//! Raw syscalls of this crate; nothing else in the crate calls `libc::syscall`.
//!
//! Every wrapper has the same shape: check the arguments the kernel would read
//! or write through a pointer (so the wrapper is safe to call with any input),
//! make the one unsafe call, turn a negative return into
//! `io::Error::last_os_error()`, and hand back owned results. Mapping errno to
//! the typed errors of `policy`/`pin` happens in those modules, not here.
//!
//! The kernel ABI constants live in [`abi`], apart from the wrappers.
//!
//! glibc has no wrappers for the memory-policy calls (they are in libnuma,
//! which does not build here), so they go through `libc::syscall`. That
//! function is variadic and glibc reads every argument as a `long`, so each
//! argument is widened to `c_long`/`c_ulong` or passed as a pointer here: a
//! 32-bit `int` in a variadic call may leave the upper half of the register
//! undefined, and `mbind` takes its mode and flags as `unsigned long`.

use std::ffi::CString;
use std::io;
use std::mem::size_of;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::ptr;

use libc::{c_int, c_long, c_uint, c_ulong, c_void};

/// Kernel ABI numbers from `include/uapi/linux/mempolicy.h`.
pub(crate) mod abi {
    use libc::c_int;

    /// `MPOL_DEFAULT`.
    pub(crate) const MPOL_DEFAULT: c_int = 0;
    /// `MPOL_PREFERRED`.
    pub(crate) const MPOL_PREFERRED: c_int = 1;
    /// `MPOL_BIND`.
    pub(crate) const MPOL_BIND: c_int = 2;
    /// `MPOL_INTERLEAVE`.
    pub(crate) const MPOL_INTERLEAVE: c_int = 3;
    /// `MPOL_LOCAL`.
    pub(crate) const MPOL_LOCAL: c_int = 4;
    /// `MPOL_PREFERRED_MANY` (5.15+); only ever read back, never set by us.
    pub(crate) const MPOL_PREFERRED_MANY: c_int = 5;
    /// `MPOL_WEIGHTED_INTERLEAVE` (6.9+); only ever read back, never set by us.
    pub(crate) const MPOL_WEIGHTED_INTERLEAVE: c_int = 6;

    /// Mode flags the kernel ORs into the mode `get_mempolicy` reports
    /// (`MPOL_F_STATIC_NODES | MPOL_F_RELATIVE_NODES | MPOL_F_NUMA_BALANCING`).
    pub(crate) const MPOL_MODE_FLAGS: c_int = (1 << 15) | (1 << 14) | (1 << 13);

    /// `get_mempolicy` flag: report a node id instead of the policy.
    pub(crate) const MPOL_F_NODE: libc::c_ulong = 1 << 0;
    /// `get_mempolicy` flag: look up the policy of the VMA at `addr`.
    pub(crate) const MPOL_F_ADDR: libc::c_ulong = 1 << 1;

    /// `mbind` flag: fail with EIO if existing pages do not follow the policy.
    pub(crate) const MPOL_MF_STRICT: libc::c_uint = 1 << 0;
    /// `mbind`/`move_pages` flag: move pages mapped only by this process.
    pub(crate) const MPOL_MF_MOVE: libc::c_uint = 1 << 1;
    /// `mbind`/`move_pages` flag: move shared pages too (CAP_SYS_NICE).
    pub(crate) const MPOL_MF_MOVE_ALL: libc::c_uint = 1 << 2;

    // The numbers libc knows must agree with ours.
    const _: () = assert!(MPOL_DEFAULT == libc::MPOL_DEFAULT);
    const _: () = assert!(MPOL_PREFERRED == libc::MPOL_PREFERRED);
    const _: () = assert!(MPOL_BIND == libc::MPOL_BIND);
    const _: () = assert!(MPOL_INTERLEAVE == libc::MPOL_INTERLEAVE);
    const _: () = assert!(MPOL_LOCAL == libc::MPOL_LOCAL);
    const _: () = assert!(
        MPOL_MODE_FLAGS
            == libc::MPOL_F_STATIC_NODES
                | libc::MPOL_F_RELATIVE_NODES
                | libc::MPOL_F_NUMA_BALANCING
    );
}

// Node masks are `&[u64]` on our side and `unsigned long *` on the kernel's;
// that is the same memory layout only where `unsigned long` is 64 bits.
// hugemem targets 64-bit hosts only (1 GiB pages), so refuse to build elsewhere
// rather than pass a mis-sized mask.
const _: () = assert!(size_of::<c_ulong>() == size_of::<u64>());
// `move_pages` takes `void **pages`; we pass `&[usize]`.
const _: () = assert!(size_of::<usize>() == size_of::<*mut c_void>());

/// Largest node mask the kernel accepts, in 64-bit words: `get_nodes()` refuses
/// `maxnode - 1 > PAGE_SIZE * 8` bits (4 KiB pages on x86_64) and
/// `copy_nodes_to_user()` refuses to write more than a page.
pub(crate) const MAX_MASK_WORDS: usize = 4096 / size_of::<u64>();

/// Node-mask arguments for `mbind`, `set_mempolicy` and `migrate_pages`.
///
/// Kernel quirk: those calls take `maxnode` and `get_nodes()` starts with
/// `--maxnode`, so only `maxnode - 1` bits are read. Passing the number of bits
/// in the buffer would silently drop the highest node (the kernel has done this
/// since 2.6 and keeps it for compatibility; cloud-hypervisor and numactl both
/// pass one more). So we pass `bits + 1`; the kernel then reads exactly
/// `BITS_TO_LONGS(bits)` = `mask.len()` words, never past the slice.
///
/// An empty mask is passed as `(NULL, 0)`, which the kernel reads as "no nodes".
fn mask_arg(mask: &[u64]) -> io::Result<(*const c_ulong, c_ulong)> {
    if mask.is_empty() {
        return Ok((ptr::null(), 0));
    }
    if mask.len() > MAX_MASK_WORDS {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    // Cannot overflow: at most 512 words * 64 bits + 1.
    let bits = mask.len() * 64 + 1;
    Ok((mask.as_ptr().cast::<c_ulong>(), bits as c_ulong))
}

/// Turns a raw syscall return into `io::Result`, keeping non-negative values.
fn check(ret: c_long) -> io::Result<c_long> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// A non-negative syscall result as a count.
fn count(n: c_long) -> usize {
    // `check` lets only n >= 0 through, and c_long fits usize on 64-bit hosts.
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// `mbind(addr, len, mode, mask, maxnode, flags)`.
///
/// Safe for any `addr`/`len`: the kernel validates the range, and `mbind` only
/// changes which node backs the pages (migration copies contents), never what
/// the process can read or write.
pub(crate) fn mbind(
    addr: usize,
    len: usize,
    mode: c_int,
    mask: &[u64],
    flags: c_uint,
) -> io::Result<()> {
    let (mask_ptr, maxnode) = mask_arg(mask)?;
    let mode = c_ulong::try_from(mode).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: `mask_ptr` is NULL with maxnode 0, or points at `mask.len()` words
    // and `maxnode - 1` = 64 * mask.len() bits, so the kernel reads only inside
    // the borrowed slice (see `mask_arg`). `addr`/`len` are plain integers the
    // kernel checks against our VMAs; mbind does not change memory contents.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            addr as c_ulong,
            len as c_ulong,
            mode,
            mask_ptr,
            maxnode,
            c_ulong::from(flags),
        )
    };
    check(ret).map(drop)
}

/// `set_mempolicy(mode, mask, maxnode)` for the calling thread.
pub(crate) fn set_mempolicy(mode: c_int, mask: &[u64]) -> io::Result<()> {
    let (mask_ptr, maxnode) = mask_arg(mask)?;
    // SAFETY: as in `mbind`, the kernel reads at most `mask.len()` words from
    // `mask_ptr` (or nothing when it is NULL); the call only changes the
    // calling thread's allocation policy.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_set_mempolicy,
            c_long::from(mode),
            mask_ptr,
            maxnode,
        )
    };
    check(ret).map(drop)
}

/// `get_mempolicy(&mode, mask, maxnode, addr, flags)`; returns the `int` the
/// kernel wrote (the mode, or a node id with `MPOL_F_NODE`).
///
/// With `mask = Some(buf)` the kernel gets `maxnode = 64 * buf.len()` and writes
/// `ALIGN(maxnode - 1, 64) / 8` = `8 * buf.len()` bytes (`copy_nodes_to_user`),
/// exactly the buffer. Unlike the setters there is no +1 here: the kernel only
/// requires `maxnode >= nr_node_ids`, else EINVAL.
pub(crate) fn get_mempolicy(
    mask: Option<&mut [u64]>,
    addr: usize,
    flags: c_ulong,
) -> io::Result<c_int> {
    let (mask_ptr, maxnode) = match mask {
        Some(buf) if !buf.is_empty() => {
            if buf.len() > MAX_MASK_WORDS {
                return Err(io::Error::from_raw_os_error(libc::EINVAL));
            }
            (
                buf.as_mut_ptr().cast::<c_ulong>(),
                (buf.len() * 64) as c_ulong,
            )
        }
        _ => (ptr::null_mut(), 0),
    };
    let mut out: c_int = 0;
    // SAFETY: `out` is a live local `int` the kernel writes once; `mask_ptr` is
    // NULL or an exclusively borrowed buffer of exactly the size the kernel
    // writes for this `maxnode` (see above). `addr` is only looked up, never
    // dereferenced by us; with MPOL_F_ADDR|MPOL_F_NODE the kernel may fault the
    // page in for reading, which does not change its contents.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            ptr::addr_of_mut!(out),
            mask_ptr,
            maxnode,
            addr as c_ulong,
            flags,
        )
    };
    check(ret).map(|_| out)
}

/// `move_pages(pid, count, pages, nodes, status, flags)`; returns the kernel's
/// non-negative result (0, or since 4.17 the number of pages it could not move).
///
/// `nodes = None` passes NULL: only report where each page is.
pub(crate) fn move_pages(
    pid: libc::pid_t,
    pages: &[usize],
    nodes: Option<&[c_int]>,
    status: &mut [c_int],
    flags: c_uint,
) -> io::Result<usize> {
    // The kernel reads `count` entries of `pages` and `nodes` and writes `count`
    // entries of `status`: all three must have that length.
    if status.len() != pages.len() || nodes.is_some_and(|n| n.len() != pages.len()) {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    let nodes_ptr = nodes.map_or(ptr::null(), <[c_int]>::as_ptr);
    // SAFETY: `pages` (count addresses, same size as `void *` by the const
    // assert above), `nodes` (count ints, or NULL) and `status` (count ints,
    // exclusively borrowed) all have exactly `count` = `pages.len()` entries,
    // checked just above. The addresses are only looked up by the kernel, and
    // migration preserves page contents.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_move_pages,
            c_long::from(pid),
            pages.len() as c_ulong,
            pages.as_ptr().cast::<*mut c_void>(),
            nodes_ptr,
            status.as_mut_ptr(),
            c_ulong::from(flags),
        )
    };
    check(ret).map(count)
}

/// `migrate_pages(pid, maxnode, old, new)`; returns the number of pages that
/// could not be moved.
///
/// Both masks are read with the same `maxnode`, so the shorter one is padded
/// with zero words to the longer one's length first.
pub(crate) fn migrate_pages(pid: libc::pid_t, old: &[u64], new: &[u64]) -> io::Result<usize> {
    let words = old.len().max(new.len());
    let pad = |m: &[u64]| {
        let mut v = m.to_vec();
        v.resize(words, 0);
        v
    };
    let (old, new) = (pad(old), pad(new));
    let (old_ptr, maxnode) = mask_arg(&old)?;
    let (new_ptr, _) = mask_arg(&new)?;
    // SAFETY: `old` and `new` are local vectors of the same length `words`, and
    // `maxnode - 1` = 64 * words bits (the +1 quirk, see `mask_arg`), so the
    // kernel reads only inside them (or nothing when both are empty and NULL).
    // migrate_pages moves pages between nodes and preserves their contents.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_migrate_pages,
            c_long::from(pid),
            maxnode,
            old_ptr,
            new_ptr,
        )
    };
    check(ret).map(count)
}

/// The number of CPUs a `cpu_set_t` can hold (`CPU_SETSIZE`, 1024 with glibc).
pub(crate) const CPU_SETSIZE: usize = libc::CPU_SETSIZE.unsigned_abs() as usize;

/// An empty `cpu_set_t`.
fn empty_cpu_set() -> libc::cpu_set_t {
    // SAFETY: `cpu_set_t` is a plain array of integers; all-zero bits is a
    // valid value and means "no CPUs" (what CPU_ZERO produces).
    unsafe { std::mem::zeroed() }
}

/// `sched_setaffinity(0, cpus)`: pins the calling thread.
///
/// CPUs at or above [`CPU_SETSIZE`] give EINVAL (callers check first and
/// report a typed error).
pub(crate) fn sched_setaffinity(cpus: &[usize]) -> io::Result<()> {
    let mut set = empty_cpu_set();
    for &cpu in cpus {
        if cpu >= CPU_SETSIZE {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        // SAFETY: CPU_SET only indexes `set.bits`; `cpu < CPU_SETSIZE` (checked
        // above) keeps the index inside the array.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    // SAFETY: `set` is a live, initialised `cpu_set_t` and we pass its exact
    // size, so the kernel reads only inside it. pid 0 = the calling thread.
    let ret = unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) };
    check(c_long::from(ret)).map(drop)
}

/// `sched_getaffinity(0)`: the CPUs the calling thread may run on, ascending.
pub(crate) fn sched_getaffinity() -> io::Result<Vec<usize>> {
    let mut set = empty_cpu_set();
    // SAFETY: the kernel writes at most `size_of::<cpu_set_t>()` bytes into
    // `set`, a live local of exactly that size. pid 0 = the calling thread.
    let ret = unsafe { libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) };
    check(c_long::from(ret))?;
    let mut cpus = Vec::new();
    for cpu in 0..CPU_SETSIZE {
        // SAFETY: CPU_ISSET only reads `set.bits[cpu / 64]`; `cpu < CPU_SETSIZE`
        // keeps that inside the array.
        if unsafe { libc::CPU_ISSET(cpu, &set) } {
            cpus.push(cpu);
        }
    }
    Ok(cpus)
}

/// `getcpu(&cpu, &node, NULL)`: the CPU and node the calling thread runs on.
pub(crate) fn getcpu() -> io::Result<(c_uint, c_uint)> {
    let mut cpu: c_uint = 0;
    let mut node: c_uint = 0;
    // SAFETY: the kernel writes one `unsigned int` each through the two
    // pointers, which point at live locals; the third argument (the unused
    // `tcache`) is NULL, which the kernel ignores.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_getcpu,
            ptr::addr_of_mut!(cpu),
            ptr::addr_of_mut!(node),
            ptr::null_mut::<c_void>(),
        )
    };
    check(ret).map(|_| (cpu, node))
}

/// `mount("hugetlbfs", target, "hugetlbfs", 0, options)`: mounts a new
/// hugetlbfs instance at `target` with `options` (e.g. `pagesize=2M,mode=1770`).
///
/// Safe for any input: a path or option string holding a NUL byte is refused
/// with EINVAL before the call, and the kernel checks everything else (EPERM
/// without `CAP_SYS_ADMIN`, ENOENT for a missing `target`).
pub(crate) fn mount_hugetlbfs(target: &Path, options: &str) -> io::Result<()> {
    let einval = |_| io::Error::from_raw_os_error(libc::EINVAL);
    let target = CString::new(target.as_os_str().as_bytes()).map_err(einval)?;
    let options = CString::new(options).map_err(einval)?;
    // SAFETY: the source, target, fstype and data pointers are NUL-terminated
    // C strings that live until the call returns (two literals and two owned
    // `CString`s); the kernel only reads them (hugetlbfs parses `data` as a
    // text option string), and flags 0 asks for a plain new mount.
    let ret = unsafe {
        libc::mount(
            c"hugetlbfs".as_ptr(),
            target.as_ptr(),
            c"hugetlbfs".as_ptr(),
            0,
            options.as_ptr().cast::<c_void>(),
        )
    };
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mask_arg_adds_one_bit() {
        let (p, n) = mask_arg(&[]).expect("empty mask");
        assert!(p.is_null());
        assert_eq!(n, 0);
        let (p, n) = mask_arg(&[1, 0]).expect("two words");
        assert!(!p.is_null());
        assert_eq!(n, 129);
        let too_big = vec![0u64; MAX_MASK_WORDS + 1];
        let err = mask_arg(&too_big).expect_err("wider than a page");
        assert_eq!(err.raw_os_error(), Some(libc::EINVAL));
    }

    #[test]
    fn move_pages_rejects_length_mismatch_without_syscall() {
        let mut status = [0; 1];
        let err = move_pages(0, &[0, 4096], None, &mut status, 0).expect_err("mismatch");
        assert_eq!(err.raw_os_error(), Some(libc::EINVAL));
        let mut status = [0; 2];
        let err = move_pages(0, &[0, 4096], Some(&[0]), &mut status, 0).expect_err("mismatch");
        assert_eq!(err.raw_os_error(), Some(libc::EINVAL));
    }

    #[test]
    fn setaffinity_rejects_cpu_beyond_set() {
        let err = sched_setaffinity(&[CPU_SETSIZE]).expect_err("out of range");
        assert_eq!(err.raw_os_error(), Some(libc::EINVAL));
    }

    #[test]
    fn mount_refuses_nul_bytes_without_syscall() {
        let err = mount_hugetlbfs(Path::new("/tmp/a\0b"), "pagesize=2M").expect_err("NUL");
        assert_eq!(err.raw_os_error(), Some(libc::EINVAL));
        let err = mount_hugetlbfs(Path::new("/tmp"), "pagesize=2M\0").expect_err("NUL");
        assert_eq!(err.raw_os_error(), Some(libc::EINVAL));
    }
}
