//! The monotonic event counts of a STATS document: the daemon's
//! [`Counters`], one fault service's [`FaultStats`] with its
//! [`LatencySummary`], and the list of every fault counter with its name and
//! meaning that an exporter publishes.

use serde::{Deserialize, Serialize};

/// `counters`: monotonic event counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Counters {
    /// Connections accepted (and allowed).
    pub sessions_total: u64,
    /// Live sessions (a gauge, not monotonic).
    pub sessions_active: u64,
    /// Connections refused by the uid check.
    pub peers_refused: u64,
    /// Connections closed on a protocol or transport error.
    pub connection_errors: u64,
    /// ALLOC requests that succeeded.
    pub allocs_ok: u64,
    /// ALLOC requests that failed.
    pub allocs_failed: u64,
    /// Regions handed out from the clean pool.
    pub regions_pooled: u64,
    /// Regions handed out after clearing a dirty pooled region on the ALLOC path.
    pub regions_recleared: u64,
    /// Regions handed out after growing a smaller clean pooled region.
    pub regions_grown: u64,
    /// ALLOC parts `best` served on a smaller page size because the larger
    /// pages existed nowhere.
    pub downgrades: u64,
    /// Released regions found damaged by their tenant and given back unscrubbed.
    pub regions_discarded: u64,
    /// Bytes of detached regions handed out while still holes (the kernel
    /// zeroes each at the guest's first touch).
    pub hole_bytes_handed_out: u64,
    /// Of `regions_discarded`: regions whose pages a pin kept at the detach's
    /// punch, on a host with no page to spare for their holes.
    pub regions_pinned: u64,
    /// Released regions given back because the host could not fill their
    /// holes after the detach's punch though every page came back (taken by
    /// another process, or the pool shrunk); no tenant is blamed.
    pub regions_short: u64,
    /// Pages punched out of released regions and refaulted fresh before reuse.
    pub pages_detached: u64,
    /// Released regions found withheld (another open description of the
    /// file exists); counted once per release.
    pub regions_withheld: u64,
    /// Region files of an earlier daemon instance found at start and unlinked.
    pub leftover_files_released: u64,
    /// Their bytes.
    pub leftover_bytes_released: u64,
    /// Regions created fresh from the kernel.
    pub regions_fresh: u64,
    /// FREE requests that succeeded.
    pub frees: u64,
    /// Bytes of regions created fresh.
    pub bytes_created: u64,
    /// Bytes of regions given back to the kernel.
    pub bytes_released: u64,
    /// Quarantine scans of `/proc`.
    pub quarantine_scans: u64,
    /// REATTACH requests that took an orphaned allocation back (after a
    /// daemon restart).
    pub reattach_ok: u64,
    /// REATTACH requests refused: unknown id, an allocation that is not
    /// orphaned, another uid's, a wrong token (one answer for all).
    pub reattach_refused: u64,
    /// Allocations released (FREE, a closing connection, an undelivered
    /// reply, an orphan nobody re-attached): `allocs_ok − allocs_released`
    /// equals `allocations.active`.
    #[serde(default)]
    pub allocs_released: u64,
    /// Starts that took the pool over from a running predecessor
    /// (`hugemem serve --takeover`).
    #[serde(default)]
    pub takeovers: u64,
    /// Starts that restored the pool from systemd's fd store.
    #[serde(default)]
    pub fd_store_restores: u64,
    /// HANDOFF requests that moved a live allocation to its VMM's successor
    /// connection.
    #[serde(default)]
    pub handoff_ok: u64,
    /// HANDOFF requests refused for an unknown id, another uid's allocation
    /// or a wrong token (one answer for all).
    #[serde(default)]
    pub handoff_refused: u64,
    /// PARK requests that parked a cloud-hypervisor VM.
    #[serde(default)]
    pub parks: u64,
    /// PARK requests refused.
    #[serde(default)]
    pub parks_refused: u64,
    /// RESTORE requests that handed a parked VM to a new cloud-hypervisor.
    #[serde(default)]
    pub restores: u64,
    /// RESTORE requests refused or failed (the VM stayed parked).
    #[serde(default)]
    pub restores_refused: u64,
    /// Bytes PARK copied into pool memory (memory not from this daemon).
    #[serde(default)]
    pub park_copied_bytes: u64,
    /// Bytes PARK's copy zeroed (holes, uncovered bytes) on pool memory
    /// not known to be zero: 0 when it took clean memory.
    #[serde(default)]
    pub park_zeroed_bytes: u64,
    /// Bytes a park from a saved VM's files checked against its manifest.
    #[serde(default)]
    pub park_verified_bytes: u64,
    /// EXPORT requests that sent a parked VM to a saver (`unpark --save`).
    #[serde(default)]
    pub exports: u64,
    /// EXPORT requests refused or failed (the VM stayed parked).
    #[serde(default)]
    pub exports_refused: u64,
    /// CLONE requests that sent a template to a clone's launcher.
    #[serde(default)]
    pub clones: u64,
    /// CLONE requests refused or failed.
    #[serde(default)]
    pub clones_refused: u64,
}

/// Percentiles of the fault-latency histogram, in nanoseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LatencySummary {
    /// Samples.
    pub count: u64,
    /// Mean.
    pub mean_ns: u64,
    /// Median.
    pub p50_ns: u64,
    /// 90th percentile.
    pub p90_ns: u64,
    /// 99th percentile.
    pub p99_ns: u64,
    /// Largest sample.
    pub max_ns: u64,
}

/// One fault service's counters (the daemon's `FaultMetrics` snapshot; STATS
/// `lazy[].faults`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultStats {
    /// Page-fault events read.
    pub faults: u64,
    /// Of which MINOR (the page was in the page cache).
    pub minor: u64,
    /// Of which MISSING (no page in the page cache; served with zeros).
    pub missing: u64,
    /// Faults whose page the service cleared first.
    pub served_cleared: u64,
    /// Faults on a page that was already clean (scrubbed ahead): mapped only.
    pub served_clean: u64,
    /// Faults on a page already mapped (a racing vCPU, or a zapped PTE): re-installed or woken.
    pub served_mapped: u64,
    /// Faults on a page the pool never populated (the guest's own kernel-zeroed page): adopted without clearing.
    pub served_adopted: u64,
    /// Faults on a page another thread was clearing: its owner installs the page and wakes the range.
    pub coalesced: u64,
    /// Fill ioctls that answered `EAGAIN` and were retried.
    pub retries: u64,
    /// Faults outside every range the service was given (never served).
    pub unknown_address: u64,
    /// Faults that could not be served (ioctl errors).
    pub errors: u64,
    /// Bytes cleared on the fault path.
    pub fault_bytes_cleared: u64,
    /// Pages cleared by the background scrubbers.
    pub scrub_pages: u64,
    /// Bytes cleared by the background scrubbers.
    pub scrub_bytes: u64,
    /// Pages installed ahead of any fault (`UFFDIO_CONTINUE` after a scrub).
    pub precontinued: u64,
    /// Non-cooperative events: REMOVE.
    pub remove_events: u64,
    /// Non-cooperative events: UNMAP.
    pub unmap_events: u64,
    /// Non-cooperative events: REMAP.
    pub remap_events: u64,
    /// Other events (FORK, unknown).
    pub other_events: u64,
    /// Read-to-wake latency of served faults.
    pub latency: LatencySummary,
}

impl FaultStats {
    /// Every counter (not the latency summary) with its name and meaning,
    /// for an exporter: the names are the STATS keys.
    pub fn counters(&self) -> [(&'static str, &'static str, u64); 19] {
        [
            ("faults", "Page-fault events read.", self.faults),
            (
                "minor",
                "MINOR faults (page in the page cache).",
                self.minor,
            ),
            (
                "missing",
                "MISSING faults (served with zeros).",
                self.missing,
            ),
            (
                "served_cleared",
                "Faults whose page the service cleared first.",
                self.served_cleared,
            ),
            (
                "served_clean",
                "Faults on a page already clean (mapped only).",
                self.served_clean,
            ),
            (
                "served_mapped",
                "Faults on a page already mapped (re-installed or woken).",
                self.served_mapped,
            ),
            (
                "served_adopted",
                "Faults on a page the pool never populated (adopted uncleared).",
                self.served_adopted,
            ),
            (
                "coalesced",
                "Faults on a page another thread was clearing.",
                self.coalesced,
            ),
            (
                "retries",
                "Fill ioctls that answered EAGAIN and were retried.",
                self.retries,
            ),
            (
                "unknown_address",
                "Faults outside every range the service was given.",
                self.unknown_address,
            ),
            ("errors", "Faults that could not be served.", self.errors),
            (
                "fault_bytes_cleared",
                "Bytes cleared on the fault path.",
                self.fault_bytes_cleared,
            ),
            (
                "scrub_pages",
                "Pages cleared by the services' background scrubbers.",
                self.scrub_pages,
            ),
            (
                "scrub_bytes",
                "Bytes cleared by the services' background scrubbers.",
                self.scrub_bytes,
            ),
            (
                "precontinued",
                "Pages installed ahead of any fault.",
                self.precontinued,
            ),
            (
                "remove_events",
                "Non-cooperative REMOVE events.",
                self.remove_events,
            ),
            (
                "unmap_events",
                "Non-cooperative UNMAP events.",
                self.unmap_events,
            ),
            (
                "remap_events",
                "Non-cooperative REMAP events.",
                self.remap_events,
            ),
            (
                "other_events",
                "Other userfaultfd events (FORK, unknown).",
                self.other_events,
            ),
        ]
    }
}
