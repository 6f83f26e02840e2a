//! `hugemem demo`: the whole data path in a few seconds, with a timeline.
//!
//! 1. Reserve huge pages for the run (1 GiB, else 2 MiB, else 4 KiB shmem;
//!    every fallback is said out loud), through `numa::hugepages` like the
//!    tests and operators (`hugemem hugepages`) do. The host pool is set back afterwards.
//! 2. Start a daemon on a private socket in a fresh 0700 directory.
//! 3. ALLOC the VM's RAM: fresh pages, populated (the kernel zeroes them) by
//!    workers pinned to the node.
//! 4. Map the fds like a rust-vmm VMM ([`backend::client::Allocation::guest_memory`])
//!    and run the project's micro-guest on them under KVM: it reads the first
//!    8 bytes of every 2 MiB, reports whether any was non-zero, and writes a
//!    marker there. Skipped with a note where KVM is not usable.
//! 5. FREE, and wait (with a deadline) until the daemon's pool shows the
//!    region clean: its scrubbers cleared the guest's markers.
//! 6. ALLOC again: served from the clean pool. The guest runs again and must
//!    read zeros where the first guest left markers.
//!
//! The report is a short human timeline or (`--json`) one object. Times are
//! wall-clock on this machine; the ratio of the two ALLOCs is the point.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use guest_mem::vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
use guest_mem::{PageSize, Reservation};
use hugemem_client::stats::Stats;
use serde::Serialize;
use tracing::{info, warn};

use crate::private_dir::PrivateDir;
use backend::client::{Client, ClientError};
use backend::daemon::config::PoolConfig;
use backend::daemon::{ByteSize, Config, Daemon, DaemonError, DaemonHandle};
use backend::guest_memory::GuestMemoryError;
use backend::proto::{AllocRequest, ClearMode, PagePolicy};
use guest_mem::size::format_size;

/// Default VM size.
pub const DEFAULT_SIZE: u64 = 2 << 30;
/// Distance between the guest's reads and markers.
const STRIDE: u64 = 2 << 20;
/// Marker mixed into what guest #1 writes.
const MARKER: u64 = 0x4845_4d4f_4445_4d4f; // "HEMODEMO"
/// Longest wait for the pool to show a freed region clean.
const CLEAN_DEADLINE: Duration = Duration::from_secs(60);
/// How often the pool is looked at while waiting.
const CLEAN_POLL: Duration = Duration::from_millis(2);

/// Errors of the demo.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// No page size at all could be used.
    #[error("no memory could be set aside for the demo: {0}")]
    NoPages(String),
    /// The size is not usable.
    #[error("demo size {0} must be a non-zero multiple of 2M")]
    Size(u64),
    /// Making the private socket directory failed.
    #[error("cannot create the demo's socket directory {path}")]
    SocketDir {
        /// The directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The daemon did not start.
    #[error("cannot start the daemon")]
    Daemon(#[from] DaemonError),
    /// A request to the daemon failed.
    #[error("request to the daemon failed")]
    Client(#[from] ClientError),
    /// Mapping the allocation failed.
    #[error("cannot map the allocation")]
    Map(#[from] GuestMemoryError),
    /// The guest run failed.
    #[error("the micro-guest run failed")]
    Guest(#[from] microguest::Error),
    /// The guest read memory that was not clean.
    #[error("guest #{0} read non-zero memory: the allocation was not clean")]
    NotClean(u32),
    /// The pool did not become clean in time.
    #[error("the pool did not show the freed memory clean within {0:?} (last stats: {1})")]
    CleanTimeout(Duration, String),
}

/// What to run.
#[derive(Debug, Clone)]
pub struct DemoConfig {
    /// VM size (default [`DEFAULT_SIZE`]); may shrink, said out loud, when
    /// fewer huge pages can be had.
    pub size: u64,
    /// Skip the guest even when KVM works.
    pub no_guest: bool,
    /// Page size; `None` = 1 GiB, then 2 MiB, then 4 KiB (said out loud).
    pub page_size: Option<PageSize>,
}

impl Default for DemoConfig {
    fn default() -> Self {
        Self {
            size: DEFAULT_SIZE,
            no_guest: false,
            page_size: None,
        }
    }
}

/// One micro-guest run.
#[derive(Debug, Clone, Serialize)]
pub struct GuestFigures {
    /// VM creation and memory-slot registration, ms.
    pub vm_setup_ms: f64,
    /// vCPU start to the guest's first instruction, ms.
    pub first_instruction_ms: f64,
    /// ALLOC request sent to the guest's first instruction (ALLOC, mapping,
    /// VM setup, vCPU start), ms.
    pub alloc_to_first_instruction_ms: f64,
    /// vCPU start to all pages touched, ms.
    pub all_touched_ms: f64,
    /// Pages (2 MiB strides) the guest read and marked.
    pub pages_touched: u64,
    /// Whether any read returned non-zero (must be false).
    pub saw_nonzero: bool,
}

/// Pool state of one (node, page size).
#[derive(Debug, Clone, Serialize)]
pub struct PoolFigures {
    /// Node.
    pub node: u64,
    /// Page size.
    pub page_size: String,
    /// Clean bytes ready to hand out.
    pub clean_bytes: u64,
    /// Dirty bytes waiting for the scrubbers.
    pub dirty_bytes: u64,
    /// Bytes held back while another process still holds the fd.
    pub quarantined_bytes: u64,
    /// Bytes handed out.
    pub in_use_bytes: u64,
}

/// The demo's report.
#[derive(Debug, Clone, Serialize)]
pub struct DemoReport {
    /// VM size used.
    pub size_bytes: u64,
    /// Page size used.
    pub page_size: String,
    /// What was reserved, and every fallback, in words.
    pub notes: Vec<String>,
    /// Daemon start (socket listening), seconds.
    pub daemon_start_s: f64,
    /// First ALLOC (fresh pages, populated and zeroed), seconds.
    pub alloc_fresh_s: f64,
    /// Population/clearing rate of the first ALLOC, GB/s (10^9).
    pub alloc_fresh_gbps: f64,
    /// Micro-guest on the fresh memory (`None`: no KVM).
    pub guest_fresh: Option<GuestFigures>,
    /// FREE to the pool showing the region clean, seconds.
    pub free_to_clean_s: f64,
    /// Bytes the scrubbers cleared for it.
    pub scrubbed_bytes: u64,
    /// Bytes punched and refaulted kernel-zeroed before reuse
    /// (`pool.detach_pages`, the default; the region is then clean without
    /// a scrub).
    pub detached_bytes: u64,
    /// The scrubbers' rate (bytes over time inside clearing kernels), GB/s.
    pub scrub_gbps: f64,
    /// Second ALLOC (from the clean pool), seconds.
    pub alloc_pooled_s: f64,
    /// Whether the second ALLOC was served from the pool (the daemon's counters).
    pub alloc_pooled_from_pool: bool,
    /// `alloc_fresh_s / alloc_pooled_s`.
    pub pooled_speedup: f64,
    /// Micro-guest on the pooled memory: it must read zeros where guest #1 wrote.
    pub guest_pooled: Option<GuestFigures>,
    /// Why the guest did not run, when it did not.
    pub guest_skipped: Option<String>,
    /// Pool state at the end (after the second FREE).
    pub pool_end: Vec<PoolFigures>,
    /// Whole demo, seconds.
    pub total_s: f64,
}

/// Picks the page size and reserves pages, shrinking the size when only
/// fewer huge pages can be had; every decision goes into `notes`.
fn reserve(
    size: u64,
    only: Option<PageSize>,
    notes: &mut Vec<String>,
) -> Result<(PageSize, u64, Option<Reservation>), DemoError> {
    if only == Some(PageSize::Base4K) {
        notes.push("4 KiB shmem pages, as asked".into());
        return Ok((PageSize::Base4K, size, None));
    }
    let candidates: Vec<PageSize> = match only {
        Some(p) => vec![p],
        None => vec![PageSize::Huge1G, PageSize::Huge2M],
    };
    for page in candidates {
        let want = size / page.bytes();
        if want == 0 || !size.is_multiple_of(page.bytes()) {
            notes.push(format!(
                "{} is not a multiple of {page} pages",
                format_size(size)
            ));
            continue;
        }
        match Reservation::for_run(page, want) {
            Ok(r) if r.report().met => {
                notes.push(format!(
                    "reserved {want} x {page} pages ({} free now)",
                    r.report().free
                ));
                return Ok((page, size, Some(r)));
            }
            Ok(r) if r.report().free > 0 => {
                let got = r.report().free.min(want);
                let smaller = got * page.bytes();
                notes.push(format!(
                    "asked for {want} x {page} pages, the kernel has {got} free: running with {} instead of {}",
                    format_size(smaller),
                    format_size(size)
                ));
                return Ok((page, smaller, Some(r)));
            }
            Ok(_) => notes.push(format!(
                "no {page} pages could be reserved (the kernel gave none)"
            )),
            Err(e) => notes.push(format!("cannot reserve {page} pages: {e}")),
        }
    }
    if let Some(p) = only {
        return Err(DemoError::NoPages(format!(
            "{p} pages were asked for: {}",
            notes.join("; ")
        )));
    }
    notes.push("falling back to 4 KiB shmem pages".into());
    Ok((PageSize::Base4K, size, None))
}

fn policy(page: PageSize) -> PagePolicy {
    match page {
        PageSize::Huge1G => PagePolicy::Huge1G,
        PageSize::Huge2M => PagePolicy::Huge2M,
        PageSize::Base4K => PagePolicy::Base4K,
    }
}

/// Bytes the pool's scrubbers cleared, over every node.
fn scrubbed_bytes(stats: &Stats) -> u64 {
    stats.scrub.nodes.iter().map(|n| n.bytes).sum()
}

/// Seconds the pool's scrubbers spent clearing, over every node.
fn scrub_seconds(stats: &Stats) -> f64 {
    stats.scrub.nodes.iter().map(|n| n.seconds).sum()
}

fn pools(stats: &Stats) -> Vec<PoolFigures> {
    stats
        .pools
        .iter()
        .map(|p| PoolFigures {
            node: u64::from(p.node),
            page_size: p.page_size.clone(),
            clean_bytes: p.clean_bytes,
            dirty_bytes: p.dirty_bytes,
            quarantined_bytes: p.quarantined_bytes,
            in_use_bytes: p.in_use_bytes,
        })
        .collect()
}

/// Waits until the pool holds at least `bytes` clean and nothing dirty or
/// quarantined.
fn wait_clean(daemon: &DaemonHandle, bytes: u64) -> Result<Stats, DemoError> {
    let deadline = Instant::now() + CLEAN_DEADLINE;
    loop {
        let stats = daemon.stats();
        let clean = stats.pool_sum(|p| p.clean_bytes);
        let pending = stats.pool_sum(|p| p.dirty_bytes + p.quarantined_bytes);
        if clean >= bytes && pending == 0 {
            return Ok(stats);
        }
        if Instant::now() >= deadline {
            return Err(DemoError::CleanTimeout(CLEAN_DEADLINE, stats.to_string()));
        }
        std::thread::sleep(CLEAN_POLL);
    }
}

/// Waits until the scrubbers have faulted `bytes` more of detached regions'
/// holes in than in `before`; `None` after the clean deadline.
fn wait_refaulted(daemon: &DaemonHandle, before: &Stats, bytes: u64) -> Option<Stats> {
    let refaulted = |s: &Stats| s.scrub.nodes.iter().map(|n| n.refault_bytes).sum::<u64>();
    let deadline = Instant::now() + CLEAN_DEADLINE;
    loop {
        let stats = daemon.stats();
        if refaulted(&stats).saturating_sub(refaulted(before)) >= bytes {
            return Some(stats);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(CLEAN_POLL);
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Maps the allocation and runs the micro-guest over it.
fn run_guest(
    alloc: &backend::client::Allocation,
    marker: u64,
    alloc_started: Instant,
) -> Result<GuestFigures, DemoError> {
    let mem = alloc.guest_memory()?;
    let mut ram = Vec::with_capacity(mem.num_regions());
    for r in mem.iter() {
        // A region's length fits usize: it was mapped.
        let len = usize::try_from(r.len()).map_err(|_| DemoError::Size(r.len()))?;
        // SAFETY: `r.as_ptr()..+len` is the live read-write shared mapping
        // vm-memory made for this region; `mem` outlives `ram` (both die at the
        // end of this function, `ram` first), and no Rust reference to the
        // memory exists while the guest runs.
        ram.push(unsafe {
            microguest::GuestRam::from_raw_parts(r.as_ptr(), len, r.start_addr().0)
        });
    }
    // `guest_memory()` leaves [3 GiB, 4 GiB) free, so the runner's default
    // control slot (4 GiB - 1 MiB) never overlaps guest RAM.
    let cfg = microguest::RunConfig {
        stride: STRIDE,
        marker,
        start_gpa: 0,
        ..Default::default()
    };
    let run_started = Instant::now();
    let report = microguest::run(&ram, &cfg)?;
    drop(ram);
    drop(mem);
    let before_run = run_started.duration_since(alloc_started);
    Ok(GuestFigures {
        vm_setup_ms: ms(report.setup),
        first_instruction_ms: ms(report.first_instruction),
        alloc_to_first_instruction_ms: ms(before_run + report.setup + report.first_instruction),
        all_touched_ms: ms(report.all_touched),
        pages_touched: report.pages_touched,
        saw_nonzero: report.saw_nonzero,
    })
}

/// Runs the demo; `progress` gets one line per step.
///
/// # Errors
///
/// See [`DemoError`]. A guest that reads non-zero memory is an error.
pub fn run(cfg: &DemoConfig, progress: &mut dyn FnMut(&str)) -> Result<DemoReport, DemoError> {
    let demo_started = Instant::now();
    if cfg.size == 0 || !cfg.size.is_multiple_of(2 << 20) {
        return Err(DemoError::Size(cfg.size));
    }
    let mut notes = Vec::new();
    let (page, size, _reservation) = reserve(cfg.size, cfg.page_size, &mut notes)?;
    for n in &notes {
        progress(n);
    }
    let guest_skipped = if cfg.no_guest {
        Some("--no-guest given".to_string())
    } else {
        microguest::kvm_available()
            .err()
            .map(|why| format!("no usable KVM: {why}"))
    };
    if let Some(why) = &guest_skipped {
        progress(&format!("the micro-guest will not run: {why}"));
    }

    let dir = PrivateDir::create("hugemem-demo").map_err(|source| DemoError::SocketDir {
        path: std::env::temp_dir(),
        source,
    })?;
    let defaults = Config::default();
    // Keep the freed VM in the pool, and look for other holders often. The
    // demo shows the pool's round trip on every page size, 4K included,
    // which a daemon does not pool by default (`pool.limit_4k` = 0: shmem
    // costs nothing to recreate): lift that limit here.
    let config = Config {
        socket: dir.path().join("hugemem.sock"),
        pool: PoolConfig {
            target: defaults.pool.target.max(ByteSize(size)),
            limit: defaults.pool.limit.max(ByteSize(size)),
            limit_4k: None,
            recheck_ms: 20,
            ..defaults.pool.clone()
        },
        ..defaults
    };
    let t = Instant::now();
    let daemon = Daemon::start(config)?;
    let daemon_start_s = t.elapsed().as_secs_f64();
    progress(&format!(
        "daemon listening on {} after {:.1} ms",
        daemon.socket_path().display(),
        daemon_start_s * 1e3
    ));
    let result = drive(&daemon, page, size, guest_skipped.is_none(), progress);
    if let Err(e) = daemon.shutdown() {
        warn!(error = %e, "daemon shutdown failed");
    }
    let mut d = result?;
    d.notes = notes;
    d.daemon_start_s = daemon_start_s;
    d.guest_skipped = guest_skipped;
    d.total_s = demo_started.elapsed().as_secs_f64();
    drop(dir);
    Ok(d)
}

/// Steps 3 to 6 against a running daemon.
fn drive(
    daemon: &DaemonHandle,
    page: PageSize,
    size: u64,
    with_guest: bool,
    progress: &mut dyn FnMut(&str),
) -> Result<DemoReport, DemoError> {
    let mut client = Client::connect(daemon.socket_path())?;
    let request = AllocRequest {
        total_size: size,
        page_policy: policy(page),
        clear_mode: ClearMode::Eager,
        lock: false,
        parts: Vec::new(),
        want_paths: false,
    };

    // 3. Fresh.
    progress(&format!(
        "ALLOC {} on {page} pages (fresh: the kernel populates and zeroes)…",
        format_size(size)
    ));
    let t = Instant::now();
    let alloc = client.alloc(request.clone())?;
    let alloc_fresh = t.elapsed();
    let alloc_fresh_gbps = guest_mem::size::gb_per_s(size, alloc_fresh.as_secs_f64());
    progress(&format!(
        "ALLOC fresh: {:.3} s, {:.2} GB/s",
        alloc_fresh.as_secs_f64(),
        alloc_fresh_gbps
    ));

    // 4. Guest on fresh memory.
    let guest_fresh = if with_guest {
        let g = run_guest(&alloc, MARKER, t)?;
        progress(&format!(
            "guest #1: first instruction {:.2} ms after vCPU start ({:.1} ms after ALLOC was sent), {} pages read, nonzero={}",
            g.first_instruction_ms, g.alloc_to_first_instruction_ms, g.pages_touched, g.saw_nonzero
        ));
        if g.saw_nonzero {
            return Err(DemoError::NotClean(1));
        }
        Some(g)
    } else {
        None
    };

    // 5. FREE and wait for the scrub. Our fds and mappings are gone first, so
    //    the daemon finds no other holder.
    let before = daemon.stats();
    let id = alloc.id;
    drop(alloc);
    let t = Instant::now();
    client.free(id)?;
    progress("FREE; waiting for the pool to scrub it…");
    let after = wait_clean(daemon, size)?;
    let detached_bytes = after
        .counters
        .pages_detached
        .saturating_sub(before.counters.pages_detached)
        .saturating_mul(page.bytes());
    // Detached pages are clean as holes at once; the scrubbers then fault
    // them in ahead of the next guest. Wait for that too, so that the next
    // ALLOC meets a resident region (in this one process, the daemon's
    // 1 GiB faults would otherwise hold the mmap_lock the client's mapping
    // needs).
    let after = wait_refaulted(daemon, &before, detached_bytes).unwrap_or(after);
    let free_to_clean = t.elapsed();
    let scrubbed_bytes = scrubbed_bytes(&after).saturating_sub(scrubbed_bytes(&before));
    let scrub_seconds = scrub_seconds(&after) - scrub_seconds(&before);
    let scrub_gbps = guest_mem::size::gb_per_s(scrubbed_bytes, scrub_seconds);
    progress(&format!(
        "pool clean and resident after {:.3} s: {} detached (kernel-zeroed), {} scrubbed at {:.2} GB/s",
        free_to_clean.as_secs_f64(),
        format_size(detached_bytes),
        format_size(scrubbed_bytes),
        scrub_gbps
    ));

    // 6. From the pool.
    let pooled_before = after.counters.regions_pooled;
    let t = Instant::now();
    let alloc = client.alloc(request)?;
    let alloc_pooled = t.elapsed();
    let stats = daemon.stats();
    let from_pool = stats.counters.regions_pooled >= pooled_before + alloc.regions.len() as u64;
    if !from_pool {
        warn!("the second ALLOC was not served from the pool");
    }
    let pooled_speedup = alloc_fresh.as_secs_f64() / alloc_pooled.as_secs_f64().max(1e-9);
    progress(&format!(
        "ALLOC from the pool: {:.3} ms ({pooled_speedup:.0}x faster than fresh){}",
        ms(alloc_pooled),
        if from_pool {
            ""
        } else {
            " — NOT from the pool"
        }
    ));
    let guest_pooled = if with_guest {
        let g = run_guest(&alloc, MARKER ^ 1, t)?;
        progress(&format!(
            "guest #2: first instruction {:.2} ms after vCPU start, {} pages read, nonzero={} (guest #1's markers were scrubbed)",
            g.first_instruction_ms, g.pages_touched, g.saw_nonzero
        ));
        if g.saw_nonzero {
            return Err(DemoError::NotClean(2));
        }
        Some(g)
    } else {
        None
    };
    let id = alloc.id;
    drop(alloc);
    client.free(id)?;
    let end = wait_clean(daemon, size).unwrap_or_else(|e| {
        warn!(error = %e, "pool not clean at the end");
        daemon.stats()
    });
    info!("demo done");
    Ok(DemoReport {
        size_bytes: size,
        page_size: page.to_string(),
        notes: Vec::new(),
        daemon_start_s: 0.0,
        alloc_fresh_s: alloc_fresh.as_secs_f64(),
        alloc_fresh_gbps,
        guest_fresh,
        free_to_clean_s: free_to_clean.as_secs_f64(),
        scrubbed_bytes,
        detached_bytes,
        scrub_gbps,
        alloc_pooled_s: alloc_pooled.as_secs_f64(),
        alloc_pooled_from_pool: from_pool,
        pooled_speedup,
        guest_pooled,
        guest_skipped: None,
        pool_end: pools(&end),
        total_s: 0.0,
    })
}

impl DemoReport {
    /// The human timeline.
    pub fn to_table(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "hugemem demo: a {} VM on {} pages",
            format_size(self.size_bytes),
            self.page_size
        );
        for n in &self.notes {
            let _ = writeln!(s, "  note: {n}");
        }
        let row = |s: &mut String, what: &str, value: String| {
            let _ = writeln!(s, "  {what:<34} {value}");
        };
        row(
            &mut s,
            "daemon start",
            format!("{:>10.1} ms", self.daemon_start_s * 1e3),
        );
        row(
            &mut s,
            "ALLOC, fresh pages",
            format!(
                "{:>10.1} ms   {:.2} GB/s populated and zeroed",
                self.alloc_fresh_s * 1e3,
                self.alloc_fresh_gbps
            ),
        );
        let guest = |s: &mut String, label: &str, g: &Option<GuestFigures>| match g {
            Some(g) => {
                row(
                    s,
                    &format!("{label}: first instruction"),
                    format!(
                        "{:>10.2} ms   after vCPU start (VM setup {:.2} ms; {:.1} ms after ALLOC was sent)",
                        g.first_instruction_ms, g.vm_setup_ms, g.alloc_to_first_instruction_ms
                    ),
                );
                row(
                    s,
                    &format!("{label}: all pages read"),
                    format!(
                        "{:>10.2} ms   {} x 2M pages, {}",
                        g.all_touched_ms,
                        g.pages_touched,
                        if g.saw_nonzero {
                            "NON-ZERO memory seen"
                        } else {
                            "all zero"
                        }
                    ),
                );
            }
            None => row(
                s,
                label,
                format!(
                    "{:>10}      {}",
                    "-",
                    self.guest_skipped.as_deref().unwrap_or("skipped")
                ),
            ),
        };
        guest(&mut s, "guest #1", &self.guest_fresh);
        row(
            &mut s,
            "FREE -> pool clean",
            format!(
                "{:>10.1} ms   {} detached (kernel-zeroed), {} scrubbed at {:.2} GB/s",
                self.free_to_clean_s * 1e3,
                format_size(self.detached_bytes),
                format_size(self.scrubbed_bytes),
                self.scrub_gbps
            ),
        );
        row(
            &mut s,
            "ALLOC, from the clean pool",
            format!(
                "{:>10.3} ms   {:.0}x faster than fresh{}",
                self.alloc_pooled_s * 1e3,
                self.pooled_speedup,
                if self.alloc_pooled_from_pool {
                    ""
                } else {
                    " (NOT served from the pool)"
                }
            ),
        );
        guest(&mut s, "guest #2", &self.guest_pooled);
        for p in &self.pool_end {
            row(
                &mut s,
                &format!("pool at the end, node {} {}", p.node, p.page_size),
                format!(
                    "clean {}, dirty {}, quarantined {}, in use {}",
                    format_size(p.clean_bytes),
                    format_size(p.dirty_bytes),
                    format_size(p.quarantined_bytes),
                    format_size(p.in_use_bytes)
                ),
            );
        }
        row(&mut s, "total", format!("{:>10.1} ms", self.total_s * 1e3));
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_stats_document() {
        let stats: Stats = serde_json::from_value(serde_json::json!({
            "pools": [{"node": 0, "page_size": "1G", "clean_bytes": 1u64 << 30, "dirty_bytes": 0,
                       "quarantined_bytes": 0, "in_use_bytes": 1u64 << 30}],
            "counters": {"regions_pooled": 3},
            "scrub": {"nodes": [{"node": 0, "bytes": 10, "seconds": 0.5}, {"node": 1, "bytes": 5, "seconds": 0.25}]},
        }))
        .expect("a partial STATS document reads");
        assert_eq!(scrubbed_bytes(&stats), 15);
        assert!((scrub_seconds(&stats) - 0.75).abs() < 1e-9);
        assert_eq!(stats.counters.regions_pooled, 3);
        let p = pools(&stats);
        assert_eq!(
            (p.len(), p[0].clean_bytes, p[0].page_size.as_str()),
            (1, 1 << 30, "1G")
        );
        assert!(pools(&Stats::default()).is_empty());
    }

    #[test]
    fn policies_follow_the_page_size() {
        assert_eq!(policy(PageSize::Huge1G), PagePolicy::Huge1G);
        assert_eq!(policy(PageSize::Huge2M), PagePolicy::Huge2M);
        assert_eq!(policy(PageSize::Base4K), PagePolicy::Base4K);
    }
}
