//! Counters and the STATS JSON's counter part.
//!
//! # Design
//!
//! Counters are lock-free `AtomicU64`s with `Relaxed` ordering grouped in one
//! struct (as Firecracker's metrics): the scrubbers bump them from their own
//! threads without touching the pool lock. Gauges that describe the pool
//! (bytes per node, size and state) are not kept as counters at all: they
//! are computed from the pool's entries when asked, so they cannot drift
//! from the truth.
//!
//! The Prometheus endpoint that exports them is [`crate::daemon::process::exporter`].

use std::sync::atomic::{AtomicU64, Ordering};

use numa::NodeId;

/// Daemon-wide counters (monotonic unless noted).
#[derive(Debug, Default)]
pub struct Metrics {
    /// Connections accepted (and allowed).
    pub sessions_total: AtomicU64,
    /// Live sessions (gauge).
    pub sessions_active: AtomicU64,
    /// Connections refused by the uid check.
    pub peers_refused: AtomicU64,
    /// Connections closed because of a protocol or transport error
    /// (malformed frame, handshake timeout, reply not deliverable).
    pub connection_errors: AtomicU64,
    /// ALLOC requests that succeeded.
    pub allocs_ok: AtomicU64,
    /// ALLOC requests that failed.
    pub allocs_failed: AtomicU64,
    /// Regions handed out from the clean pool.
    pub regions_pooled: AtomicU64,
    /// Regions handed out after clearing a dirty pooled region on the ALLOC path.
    pub regions_recleared: AtomicU64,
    /// Regions handed out after growing a smaller clean pooled region.
    pub regions_grown: AtomicU64,
    /// ALLOC parts that `best` served on a smaller page size than the
    /// largest allowed because the larger pages did not exist (neither free
    /// nor pooled).
    pub downgrades: AtomicU64,
    /// Released regions found damaged by their tenant (file size changed,
    /// holes that cannot be filled) and given back to the kernel unscrubbed.
    pub regions_discarded: AtomicU64,
    /// Bytes of detached regions handed out while still holes (each faults
    /// in a page the kernel zeroes at the guest's first touch).
    pub hole_bytes_handed_out: AtomicU64,
    /// Of `regions_discarded`: released regions whose pages a pin the daemon
    /// cannot see kept at the detach's punch, on a host with no page to
    /// spare for their holes.
    pub regions_pinned: AtomicU64,
    /// Released regions given back to the kernel because the host had too
    /// few pages to fill their holes after the detach's punch, though every
    /// page came back (another process took them, or the pool was shrunk).
    /// Nobody's tenant is blamed; not in `regions_discarded`.
    pub regions_short: AtomicU64,
    /// Pages punched out of released regions and refaulted fresh before
    /// reuse (`pool.detach_pages`), so that no pin keeps a reused page.
    pub pages_detached: AtomicU64,
    /// Released regions found withheld: no process holds them, yet another
    /// open description of the file exists (an fd in flight). They stay
    /// quarantined and are re-checked; counted once per release.
    pub regions_withheld: AtomicU64,
    /// Region files of an earlier daemon instance found at start and unlinked.
    pub leftover_files_released: AtomicU64,
    /// Bytes those files held.
    pub leftover_bytes_released: AtomicU64,
    /// Regions created fresh from the kernel.
    pub regions_fresh: AtomicU64,
    /// FREE requests that succeeded.
    pub frees: AtomicU64,
    /// Bytes of regions created fresh.
    pub bytes_created: AtomicU64,
    /// Bytes of regions given back to the kernel.
    pub bytes_released: AtomicU64,
    /// Quarantine scans of `/proc`.
    pub quarantine_scans: AtomicU64,
    /// REATTACH requests that took an orphaned allocation back.
    pub reattach_ok: AtomicU64,
    /// REATTACH requests refused (unknown id, not orphaned, another uid's,
    /// wrong token: one answer for all).
    pub reattach_refused: AtomicU64,
    /// Allocations released (FREE, a closing connection, an undelivered
    /// reply, an orphan nobody re-attached): `allocs_ok − allocs_released`
    /// is the number of live allocations.
    pub allocs_released: AtomicU64,
    /// Starts that took the pool over from a running predecessor
    /// (`hugemem serve --takeover`, a package upgrade's reload).
    pub takeovers: AtomicU64,
    /// Starts that restored the pool from systemd's fd store (a restart or
    /// a crash).
    pub fd_store_restores: AtomicU64,
    /// Successful ALLOCs, by how long they took (request to reply), for
    /// latency quantiles; not carried across a takeover (Prometheus sees a
    /// reset).
    pub alloc_latency: crate::daemon::counters::latency::Latency,
    /// HANDOFF requests that moved an allocation to another connection.
    pub handoff_ok: AtomicU64,
    /// HANDOFF requests refused (unknown id, another uid's, wrong token).
    pub handoff_refused: AtomicU64,
    /// PARKs that parked a VM (moved or copied).
    pub parks: AtomicU64,
    /// PARKs refused (a snapshot that failed its checks, a name in use,
    /// another tenant's memory, no memory for a copy).
    pub parks_refused: AtomicU64,
    /// RESTOREs that handed a parked VM to a new cloud-hypervisor.
    pub restores: AtomicU64,
    /// RESTOREs refused or failed (the VM stayed parked).
    pub restores_refused: AtomicU64,
    /// Bytes of guest memory PARK copied into pool memory (memory that did
    /// not come from this daemon).
    pub park_copied_bytes: AtomicU64,
    /// Bytes PARK's copy zeroed: holes of the files and bytes no mapping
    /// covers, on pool memory not known to be zero (0 when it was clean).
    pub park_zeroed_bytes: AtomicU64,
    /// Bytes a park from a saved VM's files checked against its manifest
    /// (PARK with VERIFY), at park time or as they were read on demand.
    pub park_verified_bytes: AtomicU64,
    /// EXPORTs that sent a parked VM to a saver.
    pub exports: AtomicU64,
    /// EXPORTs refused or failed.
    pub exports_refused: AtomicU64,
    /// CLONEs that sent a template to a clone's launcher.
    pub clones: AtomicU64,
    /// CLONEs refused or failed.
    pub clones_refused: AtomicU64,
    /// REATTACH and HANDOFF refusals by kind and uid (`/metrics` only).
    pub token_refusals: crate::daemon::peers::refusals::TokenRefusals,
}

impl Metrics {
    /// Every counter by name.
    fn named(&self) -> [(&'static str, &AtomicU64); 41] {
        [
            ("sessions_total", &self.sessions_total),
            ("sessions_active", &self.sessions_active),
            ("peers_refused", &self.peers_refused),
            ("connection_errors", &self.connection_errors),
            ("allocs_ok", &self.allocs_ok),
            ("allocs_failed", &self.allocs_failed),
            ("regions_pooled", &self.regions_pooled),
            ("regions_recleared", &self.regions_recleared),
            ("regions_grown", &self.regions_grown),
            ("downgrades", &self.downgrades),
            ("regions_discarded", &self.regions_discarded),
            ("hole_bytes_handed_out", &self.hole_bytes_handed_out),
            ("regions_pinned", &self.regions_pinned),
            ("regions_short", &self.regions_short),
            ("pages_detached", &self.pages_detached),
            ("regions_withheld", &self.regions_withheld),
            ("leftover_files_released", &self.leftover_files_released),
            ("leftover_bytes_released", &self.leftover_bytes_released),
            ("regions_fresh", &self.regions_fresh),
            ("frees", &self.frees),
            ("bytes_created", &self.bytes_created),
            ("bytes_released", &self.bytes_released),
            ("quarantine_scans", &self.quarantine_scans),
            ("reattach_ok", &self.reattach_ok),
            ("reattach_refused", &self.reattach_refused),
            ("allocs_released", &self.allocs_released),
            ("takeovers", &self.takeovers),
            ("fd_store_restores", &self.fd_store_restores),
            ("handoff_ok", &self.handoff_ok),
            ("handoff_refused", &self.handoff_refused),
            ("parks", &self.parks),
            ("parks_refused", &self.parks_refused),
            ("restores", &self.restores),
            ("restores_refused", &self.restores_refused),
            ("park_copied_bytes", &self.park_copied_bytes),
            ("park_zeroed_bytes", &self.park_zeroed_bytes),
            ("park_verified_bytes", &self.park_verified_bytes),
            ("exports", &self.exports),
            ("exports_refused", &self.exports_refused),
            ("clones", &self.clones),
            ("clones_refused", &self.clones_refused),
        ]
    }

    /// Every counter by name, for a successor daemon (`crate::daemon::restart::takeover`).
    pub fn to_map(&self) -> std::collections::BTreeMap<String, u64> {
        let mut map: std::collections::BTreeMap<String, u64> = self
            .named()
            .iter()
            .map(|(n, c)| ((*n).to_string(), Self::get(c)))
            .collect();
        self.token_refusals.to_map(&mut map);
        map
    }

    /// Takes over a predecessor's counters (unknown names are ignored;
    /// `sessions_active` is the successor's own count of live sessions).
    pub fn restore_map(&self, map: &std::collections::BTreeMap<String, u64>) {
        for (name, counter) in self.named() {
            if name == "sessions_active" {
                continue;
            }
            if let Some(v) = map.get(name) {
                counter.store(*v, Ordering::Relaxed);
            }
        }
        self.token_refusals.restore_map(map);
    }

    /// Adds `n` to a counter.
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Reads a counter.
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// Per-node scrubber counters.
#[derive(Debug)]
pub struct ScrubCounters {
    /// The node.
    pub node: NodeId,
    /// Scrubber threads.
    pub threads: usize,
    /// Bytes cleared.
    pub bytes: AtomicU64,
    /// Nanoseconds spent inside clearing kernels, summed over threads.
    pub nanos: AtomicU64,
    /// Kernel calls (batches).
    pub batches: AtomicU64,
    /// Bytes of detached regions' holes faulted in ahead of their guests
    /// (the kernel zeroes them at the fault).
    pub refault_bytes: AtomicU64,
    /// Nanoseconds spent faulting them in, summed over threads.
    pub refault_nanos: AtomicU64,
}

impl ScrubCounters {
    /// New, zeroed.
    pub fn new(node: NodeId, threads: usize) -> Self {
        Self {
            node,
            threads,
            bytes: AtomicU64::new(0),
            nanos: AtomicU64::new(0),
            batches: AtomicU64::new(0),
            refault_bytes: AtomicU64::new(0),
            refault_nanos: AtomicU64::new(0),
        }
    }

    /// Bytes per second of clearing time, in GB/s (10^9).
    pub fn gb_per_s(&self) -> f64 {
        gb_per_s(Metrics::get(&self.bytes), Metrics::get(&self.nanos))
    }
}

/// GB/s (10^9) from bytes and nanoseconds; 0 without time.
pub fn gb_per_s(bytes: u64, nanos: u64) -> f64 {
    guest_mem::size::gb_per_s(bytes, std::time::Duration::from_nanos(nanos).as_secs_f64())
}
