//! Memory mappings for tests: [`Map`] (unmapped on drop), the raw
//! [`map_raw`]/[`unmap_raw`] that forked children use, and the fd count.

use std::os::fd::RawFd;

/// This process's open fds: the fd table of a daemon running in it.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .count()
}

/// `mmap(MAP_SHARED)` of `len` bytes of `fd`, or null. Raw rather than a
/// [`Map`]: forked tenant children use it, and they report a failure through
/// their exit code instead of panicking.
pub fn map_raw(fd: RawFd, len: u64) -> *mut u8 {
    let Ok(n) = usize::try_from(len) else {
        return std::ptr::null_mut();
    };
    // SAFETY: a fresh shared mapping chosen by the kernel; aliases nothing.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            n,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        std::ptr::null_mut()
    } else {
        p.cast()
    }
}

/// Unmaps what [`map_raw`] mapped.
pub fn unmap_raw(p: *mut u8, len: u64) {
    let Ok(n) = usize::try_from(len) else {
        return;
    };
    // SAFETY: `p` is a mapping of `len` bytes made by `map_raw`, unmapped once.
    unsafe { libc::munmap(p.cast(), n) };
}

/// A read-write mapping used as guest RAM or the daemon's view of it in the
/// userfaultfd and lazy-mode tests, unmapped on drop.
pub struct Map {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; accesses go
// through raw pointers with volatile or bulk reads and writes, and unmapping
// happens once, in drop, after every `Arc` holder is gone.
unsafe impl Send for Map {}
// SAFETY: as for Send; `&Map` only hands out the address and reads/writes
// through raw pointers.
unsafe impl Sync for Map {}

impl Map {
    fn mapped(p: *mut libc::c_void, len: usize) -> std::sync::Arc<Map> {
        assert_ne!(
            p,
            libc::MAP_FAILED,
            "mmap: {}",
            std::io::Error::last_os_error()
        );
        std::sync::Arc::new(Map { ptr: p.cast(), len })
    }

    /// `MAP_SHARED` read-write mapping of `len` bytes of `fd`.
    pub fn shared(fd: std::os::fd::BorrowedFd<'_>, len: usize) -> std::sync::Arc<Map> {
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh mapping chosen by the kernel (no MAP_FIXED), so it
        // aliases nothing; `fd` is open for the call.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        Self::mapped(p, len)
    }

    /// Private anonymous read-write mapping of `len` bytes.
    pub fn anon(len: usize) -> std::sync::Arc<Map> {
        // SAFETY: a fresh anonymous private mapping with no fd; aliases nothing.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        Self::mapped(p, len)
    }

    /// The mapping's address.
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// The mapping's length in bytes.
    #[allow(clippy::len_without_is_empty)] // a mapping is never empty
    pub fn len(&self) -> usize {
        self.len
    }

    /// Writes `byte` over `[off, off + len)`. Must not hit an unserved
    /// registered page (it would block the caller).
    pub fn fill(&self, off: usize, len: usize, byte: u8) {
        assert!(off + len <= self.len);
        // SAFETY: in bounds of this live read-write mapping (checked above).
        unsafe { std::ptr::write_bytes(self.ptr.wrapping_add(off), byte, len) };
    }

    /// The byte at `off` (a volatile read).
    pub fn read(&self, off: usize) -> u8 {
        assert!(off < self.len);
        // SAFETY: in bounds of this live mapping; volatile because another
        // mapping or process may change it.
        unsafe { self.ptr.wrapping_add(off).read_volatile() }
    }

    /// Writes `byte` at `off` (a volatile write).
    pub fn write(&self, off: usize, byte: u8) {
        assert!(off < self.len);
        // SAFETY: in bounds of this live read-write mapping.
        unsafe { self.ptr.wrapping_add(off).write_volatile(byte) }
    }

    /// The whole mapping as bytes, for reading while no one writes it.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the whole of this live mapping; the slice borrows `self`,
        // so it cannot outlive the unmap in drop.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// Writes `marker` repeated over the whole mapping (a tenant's secret).
    pub fn poison(&self, marker: &[u8]) {
        self.stamp(marker.len(), marker);
    }

    /// Writes `marker` at the start of every `stride` bytes: evidence in each
    /// page without writing all of it.
    pub fn stamp(&self, stride: usize, marker: &[u8]) {
        assert!(!marker.is_empty() && marker.len() <= stride);
        for off in (0..self.len).step_by(stride) {
            let n = marker.len().min(self.len - off);
            // SAFETY: `[off, off + n)` lies inside this live read-write
            // mapping (`off + n <= len`); `marker` is other memory.
            unsafe {
                std::ptr::copy_nonoverlapping(marker.as_ptr(), self.ptr.wrapping_add(off), n)
            };
        }
    }

    /// Fails the test, naming `what` and the first non-zero byte, unless the
    /// whole mapping reads zero.
    pub fn assert_zero(&self, what: &str) {
        if let Some(i) = self.bytes().iter().position(|&b| b != 0) {
            panic!(
                "{what}: byte {i} of {} is {:#x}, not zero",
                self.len,
                self.bytes()[i]
            );
        }
    }

    /// True when every byte of `[off, off + len)` is `byte`.
    pub fn all(&self, off: usize, len: usize, byte: u8) -> bool {
        assert!(off + len <= self.len);
        // SAFETY: in bounds of this live mapping; read only while no one writes.
        let s = unsafe { std::slice::from_raw_parts(self.ptr.wrapping_add(off), len) };
        s.iter().all(|b| *b == byte)
    }

    /// True when no byte of `[off, off + len)` is `byte` (reads fault pages in).
    pub fn none_is(&self, off: usize, len: usize, byte: u8) -> bool {
        assert!(off + len <= self.len);
        // SAFETY: in bounds of this live mapping; nobody writes it meanwhile.
        let s = unsafe { std::slice::from_raw_parts(self.ptr.wrapping_add(off), len) };
        !s.contains(&byte)
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly the mapping this value created, and
        // this is its only unmap.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::Map;

    #[test]
    fn stamp_marks_each_stride_and_poison_covers_everything() {
        let m = Map::anon(2 * 4096 + 100);
        m.stamp(4096, b"AB");
        for (off, byte) in [(0, b'A'), (1, b'B'), (4096, b'A'), (8193, b'B')] {
            assert_eq!(m.read(off), byte, "offset {off}");
        }
        assert!(m.all(2, 4094, 0) && m.all(8194, 98, 0));
        m.poison(b"XYZ");
        assert!(m.bytes().chunks(3).all(|c| b"XYZ".starts_with(c)));
        m.fill(0, m.len(), 0);
        m.assert_zero("after fill");
    }

    #[test]
    #[should_panic(expected = "byte 5 of 4096 is 0x7")]
    fn assert_zero_names_the_first_nonzero_byte() {
        let m = Map::anon(4096);
        m.write(5, 7);
        m.assert_zero("a page");
    }
}
