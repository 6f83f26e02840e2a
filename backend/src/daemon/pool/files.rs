//! Who may open a region's file again, by its inode's owner and mode.
//!
//! Any process that holds an fd of a region (a memfd or a hugetlbfs file)
//! can open the file again through `/proc/self/fd/N`, and the kernel
//! checks that open against the inode's owner and mode, not against the
//! fd it went through: a read-only fd gives a writable one when the mode
//! allows it. So every region's file has the owner and mode of who may
//! use it now ([`Access`]): its tenant while the tenant uses it, the
//! daemon alone once it is released, and, while it holds a parked VM (a
//! template that clones map), the daemon with read permission only, so
//! that a clone's VMM can open it read-only and nothing but root can open
//! it for writing. docs/security.md, "Who may open a region's file".

use guest_mem::Region;
use nix::sys::stat::Mode;

/// Who may open a region's file, and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// In use by tenant `uid` (group `gid`): owned by it, mode 0600, so a
    /// VMM running as that uid can open it again for writing (QEMU opens
    /// `mem-path=/proc/self/fd/N`). A root tenant passes any mode: the
    /// file stays the daemon's, as [`Access::Daemon`].
    Tenant {
        /// The tenant's uid.
        uid: u32,
        /// Its gid.
        gid: u32,
    },
    /// Released, quarantined or pooled: the daemon's, mode 0600.
    Daemon,
    /// Parked (a template): the daemon's, mode 0444. A process that is not
    /// root can open it read-only only, and cannot change the mode.
    Template,
}

impl Access {
    /// The file's mode for this access.
    fn mode(self) -> Mode {
        match self {
            Access::Tenant { .. } | Access::Daemon => Mode::from_bits_truncate(0o600),
            Access::Template => Mode::from_bits_truncate(0o444),
        }
    }
}

/// Gives `region`'s file the owner and mode of `access`. The daemon's own
/// descriptions are unaffected (modes are checked at open).
///
/// # Errors
///
/// The `fchown` or `fchmod` error (the file may then have the new owner
/// and its old mode).
pub fn set_access(region: &Region, access: Access) -> std::io::Result<()> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let daemon_uid = unsafe { libc::geteuid() };
    // SAFETY: as above, getegid.
    let daemon_gid = unsafe { libc::getegid() };
    let (uid, gid) = match access {
        Access::Tenant { uid, gid } if uid != 0 => (uid, gid),
        _ => (daemon_uid, daemon_gid),
    };
    let fd = region.fd();
    if uid == daemon_uid {
        // Owner first: the tenant loses the right to change the mode
        // before the mode is set.
        std::os::unix::fs::fchown(fd, Some(uid), Some(gid))?;
        nix::sys::stat::fchmod(fd, access.mode()).map_err(std::io::Error::from)
    } else {
        // Mode first: between the two only the daemon may open it.
        nix::sys::stat::fchmod(fd, access.mode()).map_err(std::io::Error::from)?;
        std::os::unix::fs::fchown(fd, Some(uid), Some(gid))
    }
}

/// Sets `access` on every region of `regions`; on the first error, tries
/// to give the ones already changed `undo` again.
///
/// # Errors
///
/// The first region's error, with its index.
pub fn set_access_all<'a>(
    regions: impl IntoIterator<Item = &'a Region>,
    access: Access,
    undo: Access,
) -> Result<(), (usize, std::io::Error)> {
    let mut done: Vec<&Region> = Vec::new();
    for (i, r) in regions.into_iter().enumerate() {
        if let Err(e) = set_access(r, access) {
            for d in done {
                if let Err(e) = set_access(d, undo) {
                    tracing::warn!(region = d.name(), error = %e, "a region's file keeps the owner and mode it was being given");
                }
            }
            return Err((i, e));
        }
        done.push(r);
    }
    Ok(())
}
