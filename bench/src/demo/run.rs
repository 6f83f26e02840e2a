//! The demo end to end: pages, a private daemon, and the steps against it.

use std::time::Instant;

use backend::client::{Allocation, Client};
use backend::daemon::{Daemon, DaemonHandle};
use backend::proto::AllocRequest;
use guest_mem::size::format_size;
use guest_mem::PageSize;
use hugemem_client::stats::Stats;
use tracing::{info, warn};

use super::config::DemoConfig;
use super::error::DemoError;
use super::guest::{ms, run_guest, run_guest_on_resident_memfd};
use super::pages::reserve;
use super::pool_watch::{pools, scrub_seconds, scrubbed_bytes, wait_clean};
use super::report::{DemoReport, GuestFigures};
use crate::harness;
use crate::harness::pool::wait_refaulted;
use crate::private_dir::PrivateDir;

/// Marker mixed into what guest #1 writes.
const MARKER: u64 = 0x4845_4d4f_4445_4d4f; // "HEMODEMO"

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

    // The outer host of a virtual machine backs never-touched memory lazily
    // (docs/platform.md#first-touch): populate and free the size once, so
    // that the fresh ALLOC below shows the kernel's zeroing, not that.
    progress(&format!(
        "warm-up: populating and freeing {} once (the host's first touch)…",
        format_size(size)
    ));
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    let host_first_touch_s = crate::alloc::cloud_hypervisor_style(
        size,
        page,
        crate::alloc::cloud_hypervisor_threads(cpus, size, page.bytes()),
    )
    .map_err(|e| DemoError::WarmUp(format!("{e:#}")))?;
    progress(&format!("warm-up: {:.1} ms", host_first_touch_s * 1e3));
    let kernel_zeroing_all_cpus_s = crate::alloc::cloud_hypervisor_style(size, page, cpus)
        .map_err(|e| DemoError::WarmUp(format!("{e:#}")))?;
    progress(&format!(
        "the kernel zeroing {} on {cpus} CPUs, no daemon (the fresh ALLOC's limit): {:.1} ms",
        format_size(size),
        kernel_zeroing_all_cpus_s * 1e3
    ));
    let guest_floor = if guest_skipped.is_none() {
        let g = run_guest_on_resident_memfd(size, page, MARKER)?;
        progress(&format!(
            "the floor: the guest on a resident memfd, no daemon: first instruction {:.1} ms after the mapping began",
            g.alloc_to_first_instruction_ms
        ));
        Some(g)
    } else {
        None
    };

    let dir = PrivateDir::create("hugemem-demo").map_err(|source| DemoError::SocketDir {
        path: std::env::temp_dir(),
        source,
    })?;
    // Keep the freed VM in the pool, and look for other holders often. The
    // demo shows the pool's round trip on every page size, 4K included,
    // which a daemon does not pool by default (`pool.limit_4k` = 0: shmem
    // costs nothing to recreate): lift that limit here.
    let mut config = harness::daemon::holding(dir.path().join("hugemem.sock"), size, 20);
    config.pool.limit_4k = None;
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
    d.host_first_touch_s = host_first_touch_s;
    d.kernel_zeroing_all_cpus_s = kernel_zeroing_all_cpus_s;
    d.cpus = cpus;
    d.guest_floor = guest_floor;
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
    let request = crate::harness::daemon::eager_request(size, page);
    let (alloc, fresh) = alloc_fresh(&mut client, &request, page, with_guest, progress)?;
    let scrub = free_and_scrub(daemon, &mut client, alloc, page, size, progress)?;
    let pooled = alloc_pooled(
        daemon,
        &mut client,
        request,
        &scrub.after,
        fresh.alloc_s,
        with_guest,
        progress,
    )?;
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
        host_first_touch_s: 0.0,
        kernel_zeroing_all_cpus_s: 0.0,
        cpus: 0,
        guest_floor: None,
        alloc_fresh_s: fresh.alloc_s,
        alloc_fresh_gbps: fresh.gbps,
        guest_fresh: fresh.guest,
        free_to_clean_s: scrub.free_to_clean_s,
        scrubbed_bytes: scrub.scrubbed_bytes,
        detached_bytes: scrub.detached_bytes,
        scrub_gbps: scrub.gbps,
        alloc_pooled_s: pooled.alloc_s,
        alloc_pooled_resident_bytes: pooled.resident_bytes,
        alloc_pooled_hole_bytes: pooled.hole_bytes,
        alloc_pooled_from_pool: pooled.from_pool,
        pooled_speedup: pooled.speedup,
        guest_pooled: pooled.guest,
        guest_skipped: None,
        pool_end: pools(&end),
        total_s: 0.0,
    })
}

/// Step 3 (and 4): the fresh ALLOC, and the guest on it.
struct Fresh {
    alloc_s: f64,
    gbps: f64,
    guest: Option<GuestFigures>,
}

fn alloc_fresh(
    client: &mut Client,
    request: &AllocRequest,
    page: PageSize,
    with_guest: bool,
    progress: &mut dyn FnMut(&str),
) -> Result<(Allocation, Fresh), DemoError> {
    let size = request.total_size;
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
    Ok((
        alloc,
        Fresh {
            alloc_s: alloc_fresh.as_secs_f64(),
            gbps: alloc_fresh_gbps,
            guest: guest_fresh,
        },
    ))
}

/// Step 5: FREE, and the pool's scrub until the region is clean and
/// resident again.
struct Scrub {
    /// The daemon's STATS once it is.
    after: Stats,
    free_to_clean_s: f64,
    scrubbed_bytes: u64,
    detached_bytes: u64,
    gbps: f64,
}

fn free_and_scrub(
    daemon: &DaemonHandle,
    client: &mut Client,
    alloc: Allocation,
    page: PageSize,
    size: u64,
    progress: &mut dyn FnMut(&str),
) -> Result<Scrub, DemoError> {
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
    Ok(Scrub {
        after,
        free_to_clean_s: free_to_clean.as_secs_f64(),
        scrubbed_bytes,
        detached_bytes,
        gbps: scrub_gbps,
    })
}

/// Step 6: the ALLOC from the pool, and the guest on it; FREE.
struct Pooled {
    alloc_s: f64,
    resident_bytes: u64,
    hole_bytes: u64,
    from_pool: bool,
    speedup: f64,
    guest: Option<GuestFigures>,
}

fn alloc_pooled(
    daemon: &DaemonHandle,
    client: &mut Client,
    request: AllocRequest,
    after: &Stats,
    alloc_fresh_s: f64,
    with_guest: bool,
    progress: &mut dyn FnMut(&str),
) -> Result<Pooled, DemoError> {
    // 6. From the pool.
    let pooled_before = after.counters.regions_pooled;
    let t = Instant::now();
    let alloc = client.alloc(request)?;
    let alloc_pooled = t.elapsed();
    let (resident_bytes, hole_bytes) = crate::alloc::resident_and_holes(&alloc)
        .map_err(|e| DemoError::HandOut(format!("{e:#}")))?;
    let stats = daemon.stats();
    let from_pool = stats.counters.regions_pooled >= pooled_before + alloc.regions.len() as u64;
    if !from_pool {
        warn!("the second ALLOC was not served from the pool");
    }
    let pooled_speedup = alloc_fresh_s / alloc_pooled.as_secs_f64().max(1e-9);
    progress(&format!(
        "ALLOC from the pool: {:.3} ms, {pooled_speedup:.0}x the fresh ALLOC's {:.1} ms; {} backed, {} holes{}",
        ms(alloc_pooled),
        alloc_fresh_s * 1e3,
        format_size(resident_bytes),
        format_size(hole_bytes),
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
    Ok(Pooled {
        alloc_s: alloc_pooled.as_secs_f64(),
        resident_bytes,
        hole_bytes,
        from_pool,
        speedup: pooled_speedup,
        guest: guest_pooled,
    })
}
