//! Raw syscalls the client side needs, each behind a small safe function.
//!
//! * [`recv_with_fds`]: `recvmsg` that takes every `SCM_RIGHTS` fd the kernel
//!   installed, even from a truncated control buffer. It lives in
//!   `ch_migration::sys` (cloud-hypervisor's migration socket needs it too,
//!   and that crate does not depend on this one); one copy serves both
//!   protocols and the daemon.
//! * [`AlignedBuf`]: a 4 KiB-aligned buffer for `O_DIRECT`.
//!
//! [`recv_with_fds`]: crate::sys::recv_with_fds
//! [`AlignedBuf`]: crate::sys::AlignedBuf

use std::io;

pub use ch_migration::sys::{recv_with_fds, Received};

/// A zeroed heap buffer aligned to 4 KiB: what `O_DIRECT` reads and writes
/// need (Rust's `Vec<u8>` promises no alignment beyond 1).
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    layout: std::alloc::Layout,
}

// SAFETY: the buffer is plain owned memory with no thread affinity; access
// goes through `&`/`&mut self` like a `Vec<u8>`.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// Alignment of every [`AlignedBuf`].
    pub const ALIGN: usize = 4096;

    /// `len` zero bytes (at least one), aligned to [`AlignedBuf::ALIGN`].
    ///
    /// # Errors
    ///
    /// `OutOfMemory`, or a length that overflows a layout.
    pub fn zeroed(len: usize) -> io::Result<Self> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), Self::ALIGN)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = std::ptr::NonNull::new(raw)
            .ok_or_else(|| io::Error::from(io::ErrorKind::OutOfMemory))?;
        Ok(Self { ptr, layout })
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr points to layout.size() initialized (zeroed, then only
        // written through as_mut_slice) bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice, and &mut self makes this the only borrow.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: ptr was allocated with exactly this layout and is freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}
