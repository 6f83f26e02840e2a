//! Operations on a released region's file done under the pool's own rules
//! (the proofs before reuse are in `crate::daemon::background::quarantine::reuse`).

use guest_mem::Region;

/// Gives a path-backed region's file back to the daemon's uid, mode 0600.
pub(super) fn reclaim_path(region: &Region) -> std::io::Result<()> {
    if region.path().is_none() {
        return Ok(());
    }
    // SAFETY: geteuid/getegid have no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    // SAFETY: as above.
    let gid = unsafe { libc::getegid() };
    std::os::unix::fs::fchown(region.fd(), Some(uid), Some(gid))?;
    nix::sys::stat::fchmod(region.fd(), nix::sys::stat::Mode::from_bits_truncate(0o600))
        .map_err(std::io::Error::from)
}
