//! Checks and operations on a released region's file, before it may be
//! reused: proofs that nobody else can reach it, that it is whole, and the
//! detachment of its pages from any pin.

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

/// Proves a released region is whole before any page of it is touched: its
/// file has exactly the region's size (a tenant can grow a memfd, whose seals
/// allow growing, or truncate a hugetlbfs file), and every page is present or
/// can be allocated (`MADV_POPULATE_WRITE` fills holes a tenant punched with
/// fresh zeroed pages, and fails where a store would raise `SIGBUS`).
/// Blocking (it may fault in a whole region): call it off the executor.
///
/// # Errors
///
/// A message saying what is wrong; the region must then be discarded
/// ([`Pool::discard`]), never scrubbed.
pub fn check_released(region: &Region) -> Result<(), String> {
    let size = crate::sys::file_size(region.fd()).map_err(|e| format!("fstat: {e}"))?;
    if size != region.len() {
        return Err(format!(
            "file size is {size} bytes, the region has {}",
            region.len()
        ));
    }
    let len = usize::try_from(region.len()).map_err(|_| "region too large".to_string())?;
    crate::sys::populate_write(region.as_ptr(), len).map_err(|e| {
        format!("pages cannot be populated (a hole the host cannot fill, or a truncation): {e}")
    })
}

/// Proves that no open file description of a released region's file exists
/// but the daemon's own: a write lease (`F_SETLEASE`) on the daemon's
/// description is granted only then, and it counts what the `/proc` holder
/// scan cannot see: descriptions in flight in unreceived `SCM_RIGHTS`
/// messages, and those behind mappings. For a memfd the lease is taken on a
/// fresh reopen (the original `memfd_create` description, which the daemon
/// maps and keeps, is not counted by the kernel and is never handed out);
/// for a hugetlbfs file on the daemon's own description. Every tenant got
/// its own description ([`crate::sys::reopen`]), so a tenant's copy always
/// counts. Blocking; call it off the executor.
///
/// # Errors
///
/// A message when the proof fails (refused, or leases unavailable): the
/// region must then never be reused.
pub fn prove_unreachable(region: &Region) -> Result<(), String> {
    let granted = match region.path() {
        Some(_) => crate::sys::write_lease_free(region.fd()),
        None => crate::sys::reopen(region.fd())
            .and_then(|own| crate::sys::write_lease_free(std::os::fd::AsFd::as_fd(&own))),
    };
    match granted {
        Ok(true) => Ok(()),
        Ok(false) => Err(
            "another open file description exists that no process shows (in flight in an \
             unreceived SCM_RIGHTS message, or behind a mapping): it can never be proved free"
                .into(),
        ),
        Err(e) => Err(format!(
            "write lease unavailable ({e}): cannot prove it free"
        )),
    }
}

/// Detaches every page of a released region from any pin: punches the
/// whole file (`FALLOC_FL_PUNCH_HOLE`) and faults fresh kernel-zeroed pages
/// in through the daemon's own mapping (`MADV_POPULATE_WRITE`, so the
/// region's NUMA policy applies), in parallel on the region's node's CPUs
/// (pinned workers of `clearing::run_jobs`: the kernel zeroes each new page
/// in the faulting thread, so one thread zeroes at one core's speed). A
/// pinned page stays with its pinner; the file never sees it again. Every
/// page is zero afterwards. Returns the pages detached. Blocking.
///
/// # Errors
///
/// A message when the punch or the refault fails (the host has no page to
/// give: a pinner still holds the old ones); the region must be discarded.
pub fn detach_pages(region: &Region, topology: &numa::Topology) -> Result<u64, String> {
    crate::sys::punch_hole(region.fd(), 0, region.len()).map_err(|e| format!("punch: {e}"))?;
    let len = usize::try_from(region.len()).map_err(|_| "region too large".to_string())?;
    let page = usize::try_from(region.page_size().bytes()).unwrap_or(usize::MAX);
    let job = clearing::Job {
        start: 0,
        len,
        align: page,
        min_chunk: page,
        max_threads: usize::MAX,
        node: region.node(),
    };
    clearing::run_jobs(
        topology,
        &[job],
        &clearing::RunOptions::default(),
        |c: &clearing::Chunk| {
            // In bounds: chunks lie inside the job, which is the region.
            crate::sys::populate_write(region.as_ptr().wrapping_add(c.start), c.len)
        },
    )
    .map_err(|e| format!("refault after punch: {e}"))?;
    Ok(region.len() / region.page_size().bytes())
}
