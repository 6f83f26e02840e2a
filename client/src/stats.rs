//! The STATS reply as types (`docs/protocol.md`, "STATS").
//!
//! The daemon builds one [`Stats`] and sends it as JSON; [`crate::client::Client::stats`]
//! reads it back into the same structs, so the daemon, `hugemem status`, the
//! benches and the tests share one definition of every field.
//!
//! # Compatibility
//!
//! Reading is forgiving in both directions: fields this build does not know
//! are ignored (no `deny_unknown_fields`), and fields it knows but the
//! daemon did not send take their default (every struct is
//! `#[serde(default)]`), so a client one version apart still reads the
//! figures both know. Parts a tenant that is not an operator does not see
//! (`socket`, `hugetlbfs`, `quarantine`, `given_back`, `refill`,
//! `rebalance`), the per-connection `lazy` list and the per-region list
//! (dropped when the document would not fit one frame) are `Option`s and are
//! left out of the JSON when `None`; a JSON `null` in the document (for
//! example `holder_pid` when no holder is known) is an `Option` that is
//! written as `null`. Which fields are stable is said in `docs/protocol.md`.
//!
//! [`Stats`]: crate::stats::Stats

mod counters;

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize};

pub use counters::{Counters, FaultStats, LatencySummary};

/// The whole STATS document.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Stats {
    /// The daemon's version (`CARGO_PKG_VERSION`).
    pub version: String,
    /// The daemon's pid.
    pub pid: u32,
    /// Seconds since the daemon started.
    pub uptime_s: f64,
    /// The daemon's socket path (operators only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub socket: Option<String>,
    /// Page size (`2M`, `1G`) → hugetlbfs directory for path-backed regions
    /// (operators only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hugetlbfs: Option<BTreeMap<String, String>>,
    /// Connections.
    pub sessions: Sessions,
    /// This connection's lazy allocations (STATS over the socket only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lazy: Option<Vec<LazyAlloc>>,
    /// Live allocations.
    pub allocations: Allocations,
    /// One entry per (node, page size, backing) the pool has regions of.
    pub pools: Vec<PoolStats>,
    /// Regions waiting for their last holder (operators only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quarantine: Option<Vec<QuarantinedRegion>>,
    /// Every region (a tenant sees its own only); `None` when it was
    /// dropped so the document fits one frame (then `regions_omitted`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub regions: Option<Vec<RegionStats>>,
    /// True when `regions` was dropped to fit one frame.
    #[serde(skip_serializing_if = "is_false")]
    pub regions_omitted: bool,
    /// The last regions given back to the kernel, newest first (operators only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub given_back: Option<Vec<GivenBack>>,
    /// Background refill (operators only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refill: Option<RefillStats>,
    /// NUMA rebalancing (operators only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rebalance: Option<RebalanceStats>,
    /// The pool's scrubbers.
    pub scrub: ScrubStats,
    /// Bytes made and given back over the daemon's life.
    pub totals: Totals,
    /// Monotonic event counts.
    pub counters: Counters,
    /// VMs parked in the daemon (a tenant sees its own only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parked: Vec<ParkedVmStats>,
    /// VMs that were parked when the daemon last stopped and that this
    /// start could not bring back (a tenant sees its own only), until
    /// UNPARK of the name clears each.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lost_parked: Vec<LostParkedVm>,
}

/// `secs` since the epoch as a UTC date and time (`2026-01-01 00:00:00 UTC`).
pub fn utc_date(secs: u64) -> String {
    let [year, month, day, hour, minute, second] = utc_fields(secs);
    format!("{year:04}-{month:02}-{day:02} {hour:02}:{minute:02}:{second:02} UTC")
}

/// `secs` since the epoch as UTC `[year, month, day, hour, minute,
/// second]` (Howard Hinnant's civil-from-days algorithm, valid for every
/// date after 1970).
pub fn utc_fields(secs: u64) -> [u64; 6] {
    let days = secs / 86_400;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    [year, month, day, rem / 3600, rem / 60 % 60, rem % 60]
}

/// A parked VM a daemon start could not bring back, as STATS lists it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LostParkedVm {
    /// Its tenant's uid.
    pub uid: u32,
    /// Its name.
    pub name: String,
    /// Bytes of memory it had.
    pub bytes: u64,
    /// When it was parked, seconds since the epoch.
    pub parked_at: u64,
    /// When the start found it gone, seconds since the epoch.
    pub lost_at: u64,
    /// Why it is gone.
    pub reason: String,
}

/// A VM parked in the daemon (PARK), as STATS lists it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParkedVmStats {
    /// Its tenant's uid.
    pub uid: u32,
    /// Its name.
    pub name: String,
    /// The allocation that holds its memory.
    pub alloc: u64,
    /// Bytes of memory.
    pub bytes: u64,
    /// Bytes copied into pool memory when it was parked (0: moved).
    pub copied_bytes: u64,
    /// Memory slots.
    pub slots: usize,
    /// The largest page size of its memory, bytes.
    pub page_size: u64,
    /// When it was parked, seconds since the epoch.
    pub parked_at: u64,
    /// Shared clones that map it now (CLONE; each counts while its
    /// launcher's connection lasts): RESTORE and UNPARK wait for 0.
    #[serde(default)]
    pub shared_clones: u64,
    /// Bytes of huge pages those clones wrote (their own copies, smaps
    /// `Private_Hugetlb` of their cloud-hypervisors), from the kernel's
    /// free huge pages, not the pool.
    #[serde(default)]
    pub shared_clone_written_bytes: u64,
    /// The VMM it runs in: `qemu` or `cloud-hypervisor` (absent from
    /// daemons before it was listed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vmm: Option<String>,
    /// Copy clones whose memory the daemon is still filling from it now
    /// (RESTORE with COPY; with POSTCOPY the guest runs long before): a
    /// copy's fill ends when every page of it holds the template's bytes.
    /// RESTORE and UNPARK of it wait for 0.
    #[serde(default)]
    pub copy_clones_filling: u64,
}

impl Stats {
    /// Sum of one byte figure over every pool entry.
    pub fn pool_sum(&self, field: impl Fn(&PoolStats) -> u64) -> u64 {
        self.pools.iter().map(field).sum()
    }

    /// The region with this id, if the document lists it.
    pub fn region(&self, id: u64) -> Option<&RegionStats> {
        self.regions.as_deref()?.iter().find(|r| r.id == id)
    }
}

impl fmt::Display for Stats {
    /// The JSON document (for messages and logs).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match serde_json::to_string(self) {
            Ok(s) => f.write_str(&s),
            Err(_) => f.write_str("<stats>"),
        }
    }
}

// Serde's `skip_serializing_if` passes a reference.
#[allow(clippy::trivially_copy_pass_by_ref)]
fn is_false(b: &bool) -> bool {
    !*b
}

/// Reads a present field (`null` included) as `Some`, so `Option<Option<T>>`
/// tells a missing field (`None`) from a `null` one (`Some(None)`).
fn present<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    T::deserialize(d).map(Some)
}

/// `sessions`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Sessions {
    /// Connections open now.
    pub active: u64,
    /// Connections accepted since the start.
    pub total: u64,
    /// Connections refused (peer credentials).
    pub refused: u64,
}

/// `allocations`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Allocations {
    /// Live allocations.
    pub active: u64,
    /// Bytes of the regions in use by them.
    pub bytes: u64,
}

/// One `lazy[]` entry: a lazy allocation of this connection.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct LazyAlloc {
    /// Allocation id.
    pub alloc: u64,
    /// Whether a fault service runs for it (UFFD was sent).
    pub attached: bool,
    /// Pages of its regions still dirty.
    pub dirty_pages: u64,
    /// The fault service's counters; `null` before UFFD.
    pub faults: Option<FaultStats>,
}

/// One `pools[]` entry: a (node, page size, backing) pool.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PoolStats {
    /// NUMA node.
    pub node: u32,
    /// `4K`, `2M` or `1G`.
    pub page_size: String,
    /// `memfd` or `hugetlbfs`.
    pub backing: String,
    /// Bytes pooled clean.
    pub clean_bytes: u64,
    /// Bytes pooled dirty (waiting for or being scrubbed).
    pub dirty_bytes: u64,
    /// Bytes in quarantine (a holder still maps them or has their fd).
    pub quarantined_bytes: u64,
    /// Of the quarantined bytes, those withheld (an open description of the
    /// file exists that no process shows).
    pub withheld_bytes: u64,
    /// Bytes in use by allocations (reserved ones included).
    pub in_use_bytes: u64,
    /// Region counts per state.
    pub regions: RegionCounts,
    /// The node's pool target (`pool.target`), bytes.
    pub target_bytes: u64,
    /// The node's pool limit (`pool.limit`), bytes.
    pub limit_bytes: u64,
    /// The page size's own limit (`pool.limit_1g` / `limit_2m` /
    /// `limit_4k`); 2^64−1 when none.
    pub size_limit_bytes: u64,
}

/// `pools[].regions`: regions per state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct RegionCounts {
    /// Clean.
    pub clean: u64,
    /// Dirty.
    pub dirty: u64,
    /// Quarantined.
    pub quarantined: u64,
    /// In use (or reserved).
    pub in_use: u64,
}

/// One `quarantine[]` entry.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct QuarantinedRegion {
    /// Region id.
    pub region: u64,
    /// Its bytes.
    pub bytes: u64,
    /// Seconds in quarantine.
    pub seconds: f64,
    /// A process found holding it; `null` when none is known.
    pub holder_pid: Option<i32>,
    /// Why it is withheld; `null` when it is not.
    pub withheld: Option<Withheld>,
}

/// `quarantine[].withheld`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Withheld {
    /// Why, in words.
    pub reason: String,
    /// Seconds since it was withheld.
    pub seconds: f64,
    /// The tenant (uid) that held it.
    pub uid: Option<u32>,
}

/// One `regions[]` entry. The fields after `why` are there for regions in
/// use only (and only in STATS over the socket, which queries placement).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RegionStats {
    /// Region id.
    pub id: u64,
    /// The node recorded for it.
    pub node: u32,
    /// `4K`, `2M` or `1G`.
    pub page_size: String,
    /// Its bytes.
    pub bytes: u64,
    /// `clean`, `dirty`, `quarantined`, `reserved` or `in_use`.
    pub state: String,
    /// The inode of its memfd or hugetlbfs file.
    pub inode: u64,
    /// Its hugetlbfs path; `null` for a memfd.
    pub path: Option<String>,
    /// Why it is where it is, in words.
    pub why: String,
    /// In use: the allocation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alloc_id: Option<u64>,
    /// In use: the session holding it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session: Option<u64>,
    /// In use: its size in bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    /// In use: the node recorded for it (`Some(None)`: none, written as
    /// `null`).
    #[serde(skip_serializing_if = "Option::is_none", deserialize_with = "present")]
    pub bound_node: Option<Option<u32>>,
    /// In use: present pages per node (`Some(None)`: the query failed, see
    /// `placement_error`).
    #[serde(skip_serializing_if = "Option::is_none", deserialize_with = "present")]
    pub placement: Option<Option<BTreeMap<u32, u64>>>,
    /// In use: pages not present.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_present: Option<u64>,
    /// In use: pages whose node the kernel did not say.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unlocated: Option<u64>,
    /// In use: why the placement query failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub placement_error: Option<String>,
    /// In use: left on several nodes by a range move.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub split: Option<bool>,
    /// In use: a move of it is in progress.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub moving: Option<bool>,
    /// In use: ranges moved while split.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rebalanced: Option<Vec<MovedRange>>,
}

/// `regions[].rebalanced[]`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct MovedRange {
    /// Offset in the region, bytes.
    pub offset: u64,
    /// Length, bytes.
    pub len: u64,
    /// The node asked for.
    pub node: u32,
}

/// One `given_back[]` entry.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct GivenBack {
    /// Region id.
    pub region: u64,
    /// Its node.
    pub node: u32,
    /// `4K`, `2M` or `1G`.
    pub page_size: String,
    /// Its bytes.
    pub bytes: u64,
    /// `given back: ` and the reason.
    pub why: String,
    /// Seconds since.
    pub seconds_ago: f64,
}

/// `refill`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct RefillStats {
    /// `pool.refill`.
    pub enabled: bool,
    /// The region being made; `null` when idle.
    pub current: Option<RefillCurrent>,
    /// Regions made ahead of demand.
    pub regions: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Refills cancelled for an ALLOC.
    pub yielded: u64,
}

/// `refill.current`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct RefillCurrent {
    /// Node.
    pub node: u32,
    /// `2M` or `1G`.
    pub page_size: String,
    /// Bytes being made.
    pub bytes: u64,
    /// Of which done.
    pub done_bytes: u64,
}

/// `rebalance`: settings, moves in progress, the policy's view, counters.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RebalanceStats {
    /// `rebalance.policy`.
    pub policy: bool,
    /// `rebalance.interval_ms`.
    pub interval_ms: u64,
    /// `rebalance.threshold_pct`.
    pub threshold_pct: u32,
    /// `rebalance.persist`.
    pub persist: u32,
    /// `rebalance.cooldown`.
    pub cooldown: u32,
    /// `rebalance.rate_limit_mib_s` (0: unlimited).
    pub rate_limit_mib_s: u64,
    /// Uids acting as operators.
    pub operator_uids: Vec<u32>,
    /// Moves in progress.
    pub active: Vec<ActiveMove>,
    /// The policy's last look at every client (empty when the policy is off).
    pub clients: Vec<RebalanceClient>,
    /// Monotonic counts.
    pub counters: RebalanceCounters,
}

/// `rebalance.active[]`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ActiveMove {
    /// Region id.
    pub region: u64,
    /// Its allocation.
    pub alloc_id: u64,
    /// Target node.
    pub target: u32,
    /// Offset of the range moved, bytes.
    pub offset: u64,
    /// Length of the range moved, bytes.
    pub len: u64,
    /// Seconds since it started.
    pub seconds: f64,
    /// `request` (a REBALANCE) or `policy`.
    pub by: String,
    /// Whether it was cancelled (and is winding down).
    pub cancelled: bool,
}

/// `rebalance.clients[]`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RebalanceClient {
    /// Session id.
    pub session: u64,
    /// The client's pid; `null` when unknown.
    pub pid: Option<i32>,
    /// Threads watched for vCPUs.
    pub watched_pids: u64,
    /// vCPUs per node at the last sample; `null` before one.
    pub vcpus: Option<BTreeMap<u32, u64>>,
    /// The policy's last decision as the `migrate` crate writes it
    /// (`{"local": {"share": 0.9}}`, `"no_vcpus"`, ...); `null` before one.
    pub decision: Option<serde_json::Value>,
    /// A note (why the client is not sampled); `null` when none.
    pub note: Option<String>,
}

/// `rebalance.counters`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct RebalanceCounters {
    /// Moves that completed.
    pub moves_ok: u64,
    /// Moves that failed.
    pub moves_failed: u64,
    /// REBALANCE requests refused.
    pub moves_refused: u64,
    /// Moves the policy started.
    pub policy_moves: u64,
    /// Pages moved.
    pub pages_moved: u64,
    /// Pages that did not move.
    pub pages_failed: u64,
    /// Bytes moved.
    pub bytes_moved: u64,
}

/// `scrub`: the pool's scrubbers, summed and per node.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ScrubStats {
    /// The clearing kernel (`clearing::ClearKernel` name).
    pub kernel: String,
    /// Bytes cleared.
    pub bytes: u64,
    /// Seconds inside clearing kernels, summed over threads.
    pub seconds: f64,
    /// GB/s (10^9) per thread-second.
    pub gb_per_s: f64,
    /// Dirty bytes waiting.
    pub pending_bytes: u64,
    /// Per node.
    pub nodes: Vec<ScrubNode>,
}

/// `scrub.nodes[]`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ScrubNode {
    /// Node.
    pub node: u32,
    /// Scrubber threads.
    pub threads: u64,
    /// Bytes cleared.
    pub bytes: u64,
    /// Seconds inside clearing kernels, summed over threads.
    pub seconds: f64,
    /// GB/s (10^9) per thread-second.
    pub gb_per_s: f64,
    /// Kernel calls.
    pub batches: u64,
    /// Dirty bytes waiting on this node.
    pub pending_bytes: u64,
    /// Bytes of detached regions' holes faulted in ahead of their guests
    /// (the kernel zeroed them at the fault).
    pub refault_bytes: u64,
    /// Seconds spent faulting them in, summed over threads.
    pub refault_seconds: f64,
    /// GB/s (10^9) per thread-second of those faults.
    pub refault_gb_per_s: f64,
}

/// `totals`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Totals {
    /// Bytes of regions created.
    pub created_bytes: u64,
    /// Bytes of regions given back to the kernel.
    pub released_bytes: u64,
    /// Created − released, always: bytes the daemon holds.
    pub held_bytes: u64,
}

#[cfg(test)]
mod tests;
