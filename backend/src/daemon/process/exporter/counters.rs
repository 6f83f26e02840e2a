//! The daemon's own counters as the exposition carries them: each STATS
//! `counters` key with its help text, grouped by what they count.

use crate::daemon::counters::metrics::Metrics;

/// The daemon's own counters: name (STATS `counters` key), help, value.
pub(super) fn daemon_counters(m: &Metrics) -> Vec<(&'static str, &'static str, u64)> {
    let g = Metrics::get;
    let mut counters = vec![
        (
            "sessions_accepted",
            "Connections accepted (and allowed); STATS counters.sessions_total.",
            g(&m.sessions_total),
        ),
        (
            "peers_refused",
            "Connections refused by the uid check.",
            g(&m.peers_refused),
        ),
        (
            "connection_errors",
            "Connections closed on a protocol or transport error, or for want of a slot.",
            g(&m.connection_errors),
        ),
        (
            "allocs_ok",
            "ALLOC requests that succeeded.",
            g(&m.allocs_ok),
        ),
        (
            "allocs_failed",
            "ALLOC requests that failed.",
            g(&m.allocs_failed),
        ),
        (
            "regions_pooled",
            "Regions handed out from the clean pool.",
            g(&m.regions_pooled),
        ),
        (
            "regions_recleared",
            "Regions handed out after clearing a dirty pooled region on the ALLOC path.",
            g(&m.regions_recleared),
        ),
        (
            "regions_grown",
            "Regions handed out after growing a smaller clean pooled region.",
            g(&m.regions_grown),
        ),
        (
            "downgrades",
            "ALLOC parts served on a smaller page size than the largest allowed.",
            g(&m.downgrades),
        ),
        (
            "regions_discarded",
            "Released regions found damaged and given back to the kernel unscrubbed.",
            g(&m.regions_discarded),
        ),
        (
            "hole_bytes_handed_out",
            "Bytes of detached regions handed out while still holes (kernel-zeroed at first touch).",
            g(&m.hole_bytes_handed_out),
        ),
        (
            "regions_pinned",
            "Of regions_discarded: regions whose pages a pin kept at the detach's punch, on a host with none to spare.",
            g(&m.regions_pinned),
        ),
        (
            "regions_short",
            "Released regions given back because the host could not fill their holes after the detach's punch (no tenant blamed).",
            g(&m.regions_short),
        ),
        (
            "pages_detached",
            "Pages punched out of released regions and refaulted fresh before reuse.",
            g(&m.pages_detached),
        ),
    ];
    counters.extend(release_counters(m));
    counters.extend(park_counters(m));
    counters
}

/// The counters of PARK, RESTORE, EXPORT and what parks read and
/// checked: name, help, value.
fn park_counters(m: &Metrics) -> Vec<(&'static str, &'static str, u64)> {
    let g = Metrics::get;
    vec![
        (
            "parks",
            "PARK requests that parked a cloud-hypervisor VM (its memory moved, or copied when it was not this daemon's).",
            g(&m.parks),
        ),
        (
            "parks_refused",
            "PARK requests refused (a snapshot that failed its checks, a name in use, another tenant's memory, no memory for a copy).",
            g(&m.parks_refused),
        ),
        (
            "restores",
            "RESTORE requests that handed a parked VM to a new cloud-hypervisor.",
            g(&m.restores),
        ),
        (
            "restores_refused",
            "RESTORE requests refused or failed (the VM stayed parked).",
            g(&m.restores_refused),
        ),
        (
            "park_copied_bytes",
            "Bytes of guest memory PARK copied into pool memory (memory that did not come from this daemon).",
            g(&m.park_copied_bytes),
        ),
        (
            "park_zeroed_bytes",
            "Bytes PARK's copy zeroed (holes of the files, bytes no mapping covers) on pool memory not known to be zero.",
            g(&m.park_zeroed_bytes),
        ),
        (
            "park_verified_bytes",
            "Bytes a park from a saved VM's files checked against its manifest, at park time or as they were read on demand.",
            g(&m.park_verified_bytes),
        ),
        (
            "exports",
            "EXPORT requests that sent a parked VM to a saver (hugemem unpark --save).",
            g(&m.exports),
        ),
        (
            "exports_refused",
            "EXPORT requests refused or failed (the VM stayed parked).",
            g(&m.exports_refused),
        ),
        (
            "clones",
            "CLONE requests that sent a parked VM (the template) to a clone's launcher.",
            g(&m.clones),
        ),
        (
            "clones_refused",
            "CLONE requests refused or failed (the headroom, a device that needs shared memory, no such VM).",
            g(&m.clones_refused),
        ),
    ]
}

/// The counters of released regions and the pool's life, and of
/// REATTACH: name, help, value.
fn release_counters(m: &Metrics) -> Vec<(&'static str, &'static str, u64)> {
    let g = Metrics::get;
    vec![
        (
            "regions_withheld",
            "Released regions found withheld (an open description of the file exists).",
            g(&m.regions_withheld),
        ),
        (
            "leftover_files_released",
            "Region files of an earlier daemon instance unlinked at start.",
            g(&m.leftover_files_released),
        ),
        (
            "leftover_bytes_released",
            "Bytes those files held.",
            g(&m.leftover_bytes_released),
        ),
        (
            "regions_fresh",
            "Regions created fresh from the kernel.",
            g(&m.regions_fresh),
        ),
        ("frees", "FREE requests that succeeded.", g(&m.frees)),
        (
            "bytes_created",
            "Bytes of regions created fresh.",
            g(&m.bytes_created),
        ),
        (
            "bytes_released",
            "Bytes of regions given back to the kernel.",
            g(&m.bytes_released),
        ),
        (
            "quarantine_scans",
            "Quarantine scans of /proc.",
            g(&m.quarantine_scans),
        ),
        (
            "reattach_ok",
            "REATTACH requests that took an orphaned allocation back after a daemon restart.",
            g(&m.reattach_ok),
        ),
        (
            "reattach_refused",
            "REATTACH requests refused (unknown id, not orphaned, another uid's, wrong token).",
            g(&m.reattach_refused),
        ),
        (
            "allocs_released",
            "Allocations released (FREE, a closing connection, an undelivered reply, an orphan nobody re-attached).",
            g(&m.allocs_released),
        ),
        (
            "takeovers",
            "Starts that took the pool over from a running predecessor (hugemem serve --takeover).",
            g(&m.takeovers),
        ),
        (
            "fd_store_restores",
            "Starts that restored the pool from systemd's fd store (a restart or a crash).",
            g(&m.fd_store_restores),
        ),
        (
            "handoff_ok",
            "HANDOFF requests that moved a live allocation to its VMM's successor connection.",
            g(&m.handoff_ok),
        ),
        (
            "handoff_refused",
            "HANDOFF requests refused (unknown id, another uid's, wrong token).",
            g(&m.handoff_refused),
        ),
    ]
}
