//! What the soak's VMs hold, and the checks that a file holds exactly that.
//!
//! A tenant's own allocations hold its marker byte everywhere. The memory
//! it parks from elsewhere (a memfd, a file on disk) holds a *stamped*
//! image: the marker, with each 4 KiB page's first 8 bytes a word of the
//! page's own (so a page moved, repeated or taken from another VM shows)
//! and some pages left as holes (zero). Every check compares byte for
//! byte with what the image says, and a byte that is another tenant's
//! marker is named as such.

use std::os::fd::{AsFd, OwnedFd};

use crate::{marker, TENANTS};

/// The unit of a stamped image: one stamp word and one hole decision per page.
pub const STAMP_PAGE: u64 = 4096;
/// Bytes read or written at once.
const CHUNK: u64 = 1 << 20;

/// What one slot of a VM holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Image {
    /// The tenant's marker everywhere (its own allocation).
    Marker(u8),
    /// The marker or zero (an allocation it punched, or a kept file whose
    /// pages may have gone back to the kernel).
    MarkerOrZero(u8),
    /// The marker, stamped and with holes (memory from elsewhere).
    Stamped {
        /// The tenant's marker.
        own: u8,
        /// What makes this slot's stamps and holes its own.
        salt: u64,
    },
}

/// splitmix64's finalizer: spreads a salt and a page number.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

impl Image {
    /// True when page `page` of a stamped image is a hole.
    fn hole(salt: u64, page: u64) -> bool {
        mix(salt ^ page).is_multiple_of(5)
    }

    /// The image's bytes at `offset..offset + buf.len()` (`offset` a
    /// multiple of [`STAMP_PAGE`]); for [`Image::MarkerOrZero`] the marker.
    fn expected(&self, offset: u64, buf: &mut [u8]) {
        match *self {
            Image::Marker(m) | Image::MarkerOrZero(m) => buf.fill(m),
            Image::Stamped { own, salt } => {
                for (i, page) in buf.chunks_mut(STAMP_PAGE as usize).enumerate() {
                    let p = offset / STAMP_PAGE + i as u64;
                    if Self::hole(salt, p) {
                        page.fill(0);
                    } else {
                        page.fill(own);
                        let word = mix(salt.wrapping_add(p)).to_le_bytes();
                        let n = page.len().min(8);
                        page[..n].copy_from_slice(&word[..n]);
                    }
                }
            }
        }
    }

    /// The first byte of `got` (the image's bytes from `offset`) that the
    /// image does not allow: its index, the byte and what was expected.
    fn first_bad(&self, offset: u64, got: &[u8], scratch: &mut Vec<u8>) -> Option<(usize, u8, u8)> {
        if let Image::MarkerOrZero(m) = *self {
            return got
                .iter()
                .position(|&b| b != m && b != 0)
                .map(|i| (i, got[i], m));
        }
        scratch.resize(got.len(), 0);
        self.expected(offset, scratch);
        if got == scratch.as_slice() {
            return None;
        }
        let i = got.iter().zip(scratch.iter()).position(|(a, b)| a != b)?;
        Some((i, got[i], scratch[i]))
    }
}

/// Whose marker `byte` is, for a message.
pub fn whose(byte: u8) -> String {
    (0..TENANTS)
        .find(|&t| marker(t) == byte)
        .map_or("no tenant's marker".to_string(), |t| {
            format!("tenant {t}'s marker")
        })
}

/// Checks that `len` bytes of `fd` from `file_offset` are exactly `image`
/// (read with `pread`: memfds, hugetlbfs and disk files alike); `what`
/// names the check in the error.
pub fn check_fd(
    fd: &impl AsFd,
    file_offset: u64,
    len: u64,
    image: Image,
    what: &str,
) -> Result<(), String> {
    let mut buf = vec![0u8; CHUNK.min(len) as usize];
    let mut scratch = Vec::new();
    let mut at = 0;
    while at < len {
        let n = CHUNK.min(len - at) as usize;
        read_exact_at(fd, &mut buf[..n], file_offset + at).map_err(|e| format!("{what}: {e}"))?;
        if let Some((i, byte, want)) = image.first_bad(at, &buf[..n], &mut scratch) {
            return Err(format!(
                "{what}: byte {byte:#04x} ({}) at offset {:#x} where {want:#04x} belongs",
                whose(byte),
                at + i as u64
            ));
        }
        at += n as u64;
    }
    Ok(())
}

/// `pread` of all of `buf` from `offset`.
fn read_exact_at(fd: &impl AsFd, buf: &mut [u8], offset: u64) -> Result<(), String> {
    let mut got = 0;
    while got < buf.len() {
        let at = i64::try_from(offset + got as u64).map_err(|e| e.to_string())?;
        match nix::sys::uio::pread(fd.as_fd(), &mut buf[got..], at) {
            Ok(0) => return Err(format!("the file ends at {}", offset + got as u64)),
            Ok(n) => got += n,
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(format!("pread at {}: {e}", offset + got as u64)),
        }
    }
    Ok(())
}

/// Writes `image` (a stamped one: its holes are left unwritten) into
/// `len` bytes of `fd` from `file_offset`; the file must be large enough.
pub fn write_fd(fd: &impl AsFd, file_offset: u64, len: u64, image: Image) -> Result<(), String> {
    let mut buf = vec![0u8; CHUNK.min(len) as usize];
    let mut at = 0;
    while at < len {
        let n = CHUNK.min(len - at) as usize;
        image.expected(at, &mut buf[..n]);
        for (i, page) in buf[..n].chunks(STAMP_PAGE as usize).enumerate() {
            let p = (at / STAMP_PAGE) + i as u64;
            if matches!(image, Image::Stamped { salt, .. } if Image::hole(salt, p)) {
                continue;
            }
            let off = i64::try_from(file_offset + p * STAMP_PAGE).map_err(|e| e.to_string())?;
            let w =
                nix::sys::uio::pwrite(fd.as_fd(), page, off).map_err(|e| format!("pwrite: {e}"))?;
            if w != page.len() {
                return Err(format!("pwrite wrote {w} of {} bytes", page.len()));
            }
        }
        at += n as u64;
    }
    Ok(())
}

/// A memfd (4 KiB pages, sealable) of `size` bytes, all holes.
pub fn memfd(name: &str, size: u64) -> Result<OwnedFd, String> {
    use nix::sys::memfd::{memfd_create, MFdFlags};
    let fd = memfd_create(name, MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)
        .map_err(|e| format!("memfd_create: {e}"))?;
    let len = i64::try_from(size).map_err(|e| e.to_string())?;
    nix::unistd::ftruncate(&fd, len).map_err(|e| format!("ftruncate: {e}"))?;
    Ok(fd)
}

/// One slot of a VM the soak parks: where it is in the guest and in its
/// memory file, and what it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmSlot {
    /// cloud-hypervisor's slot number.
    pub slot: u32,
    /// Guest address.
    pub gpa: u64,
    /// Bytes.
    pub size: u64,
    /// Where its bytes start in the memory file sent for it.
    pub file_offset: u64,
    /// What it holds.
    pub image: Image,
}

/// A migration configuration for `slots` as cloud-hypervisor writes one:
/// `vm_config.memory` (a postcopy restore declares its zones hugetlb
/// there) and `memory_manager_data.guest_ram_mappings`.
pub fn config(slots: &[VmSlot]) -> Vec<u8> {
    let total: u64 = slots.iter().map(|s| s.size).sum();
    let mappings: Vec<serde_json::Value> = slots
        .iter()
        .map(|s| {
            serde_json::json!({
                "slot": s.slot, "gpa": s.gpa, "size": s.size, "file_offset": s.file_offset,
                "zone_id": "mem0", "virtio_mem": false
            })
        })
        .collect();
    serde_json::json!({
        "vm_config": {"cpus": {"boot_vcpus": 1}, "memory": {"size": total, "shared": true}},
        "memory_manager_data": {"guest_ram_mappings": mappings}
    })
    .to_string()
    .into_bytes()
}

/// The state of tenant `tenant`'s VM number `serial`: bytes only that VM has.
pub fn state(tenant: usize, serial: u64) -> Vec<u8> {
    format!("{{\"vcpus\":[\"tenant {tenant} vm {serial}\"],\"devices\":[]}}").into_bytes()
}
