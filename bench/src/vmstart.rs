//! `hugemem bench vmstart`: how soon a VM runs on hugemem memory, and how
//! soon it has touched all of it.
//!
//! Each scenario times, from the moment the VMM sends ALLOC, (a) the
//! project's micro-guest executing its first instruction under KVM and (b)
//! the guest having read and written one byte in every huge page
//! (`microguest::run` with the huge page as stride). Guest RAM is laid out
//! as hugemem VMMs do: 0..3 GiB, then the rest from 4 GiB.
//!
//! | scenario | memory | what runs before the guest |
//! |---|---|---|
//! | `eager-fresh` | fresh pages | the daemon populates all of them (node-pinned workers) |
//! | `eager-clean` | a clean pooled region | nothing: the pool cleared it earlier |
//! | `lazy-dirty` | a dirty pooled region | UFFD hand-off only; pages are cleared at first touch by the fault service, and ahead by its scrubbers |
//! | `eager-dirty` | a dirty pooled region (the previous guest's, just out of quarantine) | the daemon clears it synchronously, on the node's workers, before it replies: what back-to-back launches hit |
//! | `lazy-fresh` | fresh, not populated | nothing: the kernel zeroes each page at its first fault, the guest's touch or the daemon's fault helpers faulting the region in ahead of it, lowest address first (lazy mode's fallback, `pool.refault_ahead`) |
//! | `prefault` | fresh, not populated (a lazy ALLOC, as `lazy-fresh`) | the VMM populates it, cloud-hypervisor style: `min(CPUs, 16, pages, size / 4 GiB)` unpinned threads, the daemon's fault helpers beside them |
//! | `floor` | a hugetlb memfd the bench populated before the clock, no daemon | nothing: the VMM's floor, the same mapping and guest on memory that needs no preparation |
//! | `fresh-floor` | a fresh hugetlb memfd, not populated, no daemon | nothing: the kernel zeroes each page at the guest's first touch; `lazy-fresh` without the daemon, its floor |
//!
//! `eager-dirty` checks the daemon's `regions_recleared` counter around its
//! ALLOC (`recleared` in the report): false means the pool's scrubbers had
//! finished the region before the ALLOC took it (said in `notes`).
//!
//! For `lazy-dirty` the fault service's own counters give the fault count and
//! the read-to-wake latency percentiles; the expectation is a first
//! instruction within milliseconds whatever the size, and a fault p99 close
//! to the time to clear one huge page (measured here with the same kernel
//! and reported as `one_page_clear_us`).
//!
//! Each scenario runs in a daemon of its own (in this process, socket in a
//! temporary directory), so at most one VM's worth of huge pages is held at a
//! time. The first scenario also warms the host: never-touched memory is
//! slow the first time on this kind of machine (docs/platform.md#first-touch), so
//! `eager-fresh` is run twice and only the second run is reported.

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use guest_mem::vm_memory::mmap::{MmapRegion, MmapRegionBuilder};
use guest_mem::vm_memory::FileOffset;
use guest_mem::PageSize;
use serde::Serialize;

use backend::client::{Allocation, Client};
use backend::daemon::{ByteSize, Config, Daemon, DaemonHandle};
use backend::lazy::{GuestMapping, LazyGuest, LazyOptions};
use backend::proto::{AllocRequest, ClearMode, PagePolicy, RegionInfo};

use crate::harness::rounds;

/// Where guest RAM restarts above the 32-bit hole.
const HIGH_RAM: u64 = 4 << 30;
/// End of low guest RAM.
const LOW_RAM_END: u64 = 3 << 30;
/// How long the pool may take to scrub or release a region between scenarios.
const POOL_DEADLINE: Duration = Duration::from_secs(300);

/// Errors of the benchmark.
#[derive(Debug, thiserror::Error)]
pub enum VmstartError {
    /// KVM cannot run the micro-guest here.
    #[error("KVM is not usable: {0}")]
    NoKvm(String),
    /// The size is zero or not a multiple of the page size.
    #[error("size must be a non-zero multiple of the {0} page size")]
    Size(PageSize),
    /// Huge pages could not be reserved.
    #[error("cannot reserve {pages} pages of {page}: {why}")]
    NoPages {
        /// Pages asked for.
        pages: u64,
        /// Page size.
        page: PageSize,
        /// Why.
        why: String,
    },
    /// The daemon could not start.
    #[error("cannot start a daemon for the benchmark")]
    Daemon(#[from] backend::daemon::DaemonError),
    /// A request to the daemon failed.
    #[error("a request to the daemon failed")]
    Client(#[from] backend::client::ClientError),
    /// Lazy mode could not be set up.
    #[error("lazy mode could not be set up")]
    Lazy(#[from] backend::lazy::LazyError),
    /// Mapping guest RAM failed.
    #[error("cannot map guest RAM")]
    Map(#[from] guest_mem::vm_memory::mmap::MmapRegionError),
    /// The guest run failed.
    #[error("the micro-guest run failed")]
    Guest(#[from] microguest::Error),
    /// The pool did not reach the state a scenario needs in time.
    #[error("the pool did not {0} within {POOL_DEADLINE:?}")]
    PoolTimeout(&'static str),
    /// A scenario did not get the memory it measures.
    #[error("scenario {0}: {1}")]
    Unexpected(&'static str, String),
    /// A helper thread panicked.
    #[error("a prefault thread panicked")]
    Panicked,
}

/// What to measure.
#[derive(Debug, Clone)]
pub struct VmstartConfig {
    /// Guest RAM bytes (a multiple of the page size).
    pub size: u64,
    /// Page size (2M or 1G).
    pub page_size: PageSize,
    /// Limit for one guest run.
    pub guest_timeout: Duration,
}

/// Fault-service figures of a lazy scenario.
#[derive(Debug, Clone, Serialize)]
pub struct FaultFigures {
    /// Page faults the service read.
    pub faults: u64,
    /// Of which it cleared the page first.
    pub cleared_on_fault: u64,
    /// Of which the page was already clean (scrubbed ahead, not yet installed).
    pub already_clean: u64,
    /// Of which another thread was clearing the page.
    pub coalesced: u64,
    /// Pages the scrubbers cleared and installed before any fault.
    pub scrubbed_ahead: u64,
    /// Read-to-wake latency percentiles, microseconds.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// Largest.
    pub max_us: f64,
}

/// One scenario's result.
#[derive(Debug, Clone, Serialize)]
pub struct ScenarioReport {
    /// Scenario name (see the module docs).
    pub name: &'static str,
    /// Region flags the ALLOC reply gave.
    pub flags: String,
    /// ALLOC sent → reply received, ms.
    pub alloc_ms: f64,
    /// ALLOC sent → memory mapped and ready to run (UFFD attached, or prefaulted), ms.
    pub ready_ms: f64,
    /// ALLOC sent → the guest's first instruction, ms.
    pub first_instruction_ms: f64,
    /// ALLOC sent → the guest touched every huge page, ms.
    pub all_touched_ms: f64,
    /// CPU time the vCPU thread used from its start to that touch, ms.
    pub all_touched_vcpu_cpu_ms: f64,
    /// VM creation and slot registration inside the runner, ms (part of both figures above).
    pub vm_setup_ms: f64,
    /// KVM exits during the run.
    pub kvm_exits: u64,
    /// Whether the guest read anything but zero (must be false).
    pub saw_nonzero: bool,
    /// Lazy scenarios: the fault service's figures.
    pub faults: Option<FaultFigures>,
    /// `eager-dirty`: whether the daemon cleared a dirty region for this
    /// ALLOC (its `regions_recleared` counter went up); `None` elsewhere.
    pub recleared: Option<bool>,
}

/// The benchmark's result.
#[derive(Debug, Clone, Serialize)]
pub struct VmstartReport {
    /// Guest RAM bytes.
    pub size: u64,
    /// Page size.
    pub page_size: String,
    /// The clearing kernel the daemon uses.
    pub kernel: &'static str,
    /// Time to clear one dirty huge page with that kernel, µs (best of 5):
    /// what a fault on a dirty page should cost.
    pub one_page_clear_us: f64,
    /// The same as GB/s.
    pub clear_gbps: f64,
    /// Threads the `prefault` scenario used.
    pub prefault_threads: usize,
    /// The kernel zeroing the whole size at fault time on one thread
    /// (`MADV_POPULATE_WRITE` of the `floor` scenario's fresh memfd, before
    /// its clock), ms: the limit of a one-vCPU guest's first touches of
    /// memory with holes (`lazy-fresh`'s all-touched figure).
    pub kernel_zeroing_1_thread_ms: f64,
    /// The same on all `cpus` CPUs, each populating its share of a fresh
    /// memfd, ms: the limit of a guest's touches with the daemon's fault
    /// helpers faulting the same memory in beside it (`lazy-fresh`).
    pub kernel_zeroing_all_cpus_ms: f64,
    /// CPUs of that figure.
    pub cpus: usize,
    /// Scenarios in the order run.
    pub scenarios: Vec<ScenarioReport>,
    /// Things the reader should know (fallbacks, warm-up).
    pub notes: Vec<String>,
}

/// Runs every scenario; `progress` gets one line per step.
///
/// # Errors
///
/// [`VmstartError`].
pub fn run(
    cfg: &VmstartConfig,
    progress: &mut dyn FnMut(&str),
) -> Result<VmstartReport, VmstartError> {
    microguest::kvm_available().map_err(|e| VmstartError::NoKvm(e.to_string()))?;
    let page = cfg.page_size.bytes();
    if cfg.size == 0 || !cfg.size.is_multiple_of(page) || !cfg.page_size.is_huge() {
        return Err(VmstartError::Size(cfg.page_size));
    }
    let pages = cfg.size / page;
    // Held for the run, given back afterwards.
    let reservation = guest_mem::Reservation::for_run(cfg.page_size, pages).map_err(|e| {
        VmstartError::NoPages {
            pages,
            page: cfg.page_size,
            why: e.to_string(),
        }
    })?;
    if !reservation.report().met {
        return Err(VmstartError::NoPages {
            pages,
            page: cfg.page_size,
            why: format!("{} free", reservation.report().free),
        });
    }
    let kernel = clearing::ClearKernel::default_kernel();
    let (one_page_clear_us, clear_gbps) = one_page_clear(cfg.page_size, kernel);
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    let prefault_threads = crate::alloc::cloud_hypervisor_threads(cpus, cfg.size, page);
    let mut notes = vec![format!(
        "eager-fresh ran twice; the first run (not reported) warmed the host's backing of {} bytes",
        cfg.size
    )];
    let mut scenarios = Vec::new();

    // Eager: fresh (warm-up, then measured), then clean from the pool.
    rounds::warm_up(progress, "eager-fresh, not reported", || {
        let d = Bench::start(cfg)?;
        let warm = d.alloc(ClearMode::Eager)?;
        d.free(warm)?;
        d.shutdown()
    })?;
    {
        let d = Bench::start(cfg)?;
        progress("eager-fresh");
        let r = d.scenario("eager-fresh", ClearMode::Eager, Prep::None)?;
        scenarios.push(r);
        d.wait_pool("become clean", |clean, pending| {
            clean >= cfg.size && pending == 0
        })?;
        progress("eager-clean");
        scenarios.push(d.scenario("eager-clean", ClearMode::Eager, Prep::None)?);
        // The region goes back dirty: the lazy scenario takes it while it is.
        progress("lazy-dirty");
        let r = d.scenario("lazy-dirty", ClearMode::Lazy, Prep::Attach)?;
        if r.flags != "LAZY" {
            notes.push("lazy-dirty: the pool's scrubbers cleaned the region before the lazy ALLOC; it was served clean".into());
        }
        scenarios.push(r);
        // And dirty again: an eager ALLOC clears it before replying.
        progress("eager-dirty");
        let r = d.scenario("eager-dirty", ClearMode::Eager, Prep::FromDirty)?;
        if r.recleared == Some(false) {
            notes.push("eager-dirty: the pool's scrubbers cleaned the region before the eager ALLOC took it; it was served clean".into());
        }
        scenarios.push(r);
        d.shutdown()?;
    }
    {
        let d = Bench::start(cfg)?;
        progress("lazy-fresh");
        scenarios.push(d.scenario("lazy-fresh", ClearMode::Lazy, Prep::None)?);
        d.shutdown()?;
    }
    {
        let d = Bench::start(cfg)?;
        progress("prefault");
        scenarios.push(d.scenario(
            "prefault",
            ClearMode::Lazy,
            Prep::Prefault(prefault_threads),
        )?);
        d.shutdown()?;
    }
    progress("floor");
    let (floor, kernel_zeroing_1_thread_ms) = floor(cfg)?;
    scenarios.push(floor);
    progress("fresh-floor");
    scenarios.push(fresh_floor(cfg)?);
    progress("kernel zeroing on every CPU");
    // The kernel zeroing the size at fault time on every CPU (a fresh
    // memfd, each thread populating its share, mapping included).
    let kernel_zeroing_all_cpus_ms =
        crate::alloc::cloud_hypervisor_style(cfg.size, cfg.page_size, cpus)
            .map_err(|e| VmstartError::Unexpected("kernel zeroing", format!("{e:#}")))?
            * 1e3;
    if scenarios.iter().any(|s| s.saw_nonzero) {
        notes.push("a guest read non-zero memory: a clearing bug".into());
    }
    Ok(VmstartReport {
        size: cfg.size,
        page_size: cfg.page_size.to_string(),
        kernel: kernel.name(),
        one_page_clear_us,
        clear_gbps,
        prefault_threads,
        kernel_zeroing_1_thread_ms,
        kernel_zeroing_all_cpus_ms,
        cpus,
        scenarios,
        notes,
    })
}

/// What the VMM does between ALLOC and starting the guest.
#[derive(Debug, Clone, Copy)]
enum Prep {
    /// Map only.
    None,
    /// Map, then hand a uffd to the daemon (lazy mode); the pool must hold
    /// the region dirty before the clock starts.
    Attach,
    /// Map only, but the pool must hold the region dirty before the clock
    /// starts (eager: the daemon clears it before replying).
    FromDirty,
    /// Map, then populate with this many threads (cloud-hypervisor prefault).
    Prefault(usize),
}

/// One in-process daemon and a client of it.
struct Bench {
    daemon: Option<DaemonHandle>,
    client: std::cell::RefCell<Client>,
    cfg: VmstartConfig,
    dir: std::path::PathBuf,
}

impl Bench {
    fn start(cfg: &VmstartConfig) -> Result<Self, VmstartError> {
        // A private 0700 directory per daemon for its socket.
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("hugemem-vmstart-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::os::unix::fs::DirBuilderExt::mode(&mut std::fs::DirBuilder::new(), 0o700)
            .create(&dir)
            .map_err(|e| VmstartError::Unexpected("setup", format!("{}: {e}", dir.display())))?;
        let mut dcfg = Config {
            socket: dir.join("hugemem.sock"),
            ..Config::default()
        };
        dcfg.pool.recheck_ms = 10;
        dcfg.pool.target = ByteSize(cfg.size);
        dcfg.pool.limit = ByteSize(cfg.size);
        // The lazy-dirty scenario measures dirty memory served lazily, which
        // the daemon grants only to uids it trusts with other tenants' data.
        dcfg.pool.lazy_dirty_uids = vec![backend::sys::euid()];
        // Dirty pooled memory exists only without detaching: a detached
        // region is refaulted kernel-zeroed and goes straight to clean. The
        // eager-dirty and lazy-dirty scenarios measure dirty memory.
        dcfg.pool.detach_pages = false;
        let daemon = Daemon::start(dcfg)?;
        let client = Client::connect(daemon.socket_path())?;
        client.set_timeout(Some(POOL_DEADLINE))?;
        Ok(Self {
            daemon: Some(daemon),
            client: std::cell::RefCell::new(client),
            cfg: cfg.clone(),
            dir,
        })
    }

    fn handle(&self) -> &DaemonHandle {
        self.daemon.as_ref().expect("running until shutdown")
    }

    fn alloc(&self, mode: ClearMode) -> Result<Allocation, VmstartError> {
        let page_policy = if self.cfg.page_size == PageSize::Huge1G {
            PagePolicy::Huge1G
        } else {
            PagePolicy::Huge2M
        };
        Ok(self.client.borrow_mut().alloc(AllocRequest {
            total_size: self.cfg.size,
            page_policy,
            clear_mode: mode,
            lock: false,
            parts: vec![],
            want_paths: false,
        })?)
    }

    fn free(&self, alloc: Allocation) -> Result<(), VmstartError> {
        let id = alloc.id;
        drop(alloc);
        Ok(self.client.borrow_mut().free(id)?)
    }

    /// Waits until `ok(clean bytes, dirty + quarantined bytes)`.
    fn wait_pool(
        &self,
        what: &'static str,
        ok: impl Fn(u64, u64) -> bool,
    ) -> Result<(), VmstartError> {
        let deadline = Instant::now() + POOL_DEADLINE;
        loop {
            let (clean, pending) = crate::harness::pool::pool_state(&self.handle().stats());
            if ok(clean, pending) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(VmstartError::PoolTimeout(what));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn scenario(
        &self,
        name: &'static str,
        mode: ClearMode,
        prep: Prep,
    ) -> Result<ScenarioReport, VmstartError> {
        // Lazy: the region must have left quarantine (dirty) before the clock starts.
        if matches!(prep, Prep::Attach | Prep::FromDirty) {
            self.wait_dirty()?;
        }
        let recleared_before = self.recleared();
        let t0 = Instant::now();
        let alloc = self.alloc(mode)?;
        let alloc_done = t0.elapsed();
        let recleared =
            (matches!(prep, Prep::FromDirty)).then(|| self.recleared() > recleared_before);
        let info = alloc
            .regions
            .first()
            .copied()
            .ok_or_else(|| VmstartError::Unexpected(name, "no region".into()))?;
        let flags = if info.flags & RegionInfo::FLAG_LAZY != 0 {
            "LAZY"
        } else {
            "CLEAN"
        }
        .to_string();
        let map = map_region(&alloc)?;
        let mut lazy = None;
        match prep {
            Prep::None | Prep::FromDirty => {}
            Prep::Attach if info.flags & RegionInfo::FLAG_LAZY != 0 => {
                let m = GuestMapping {
                    region_id: info.region_id,
                    region_offset: 0,
                    addr: map.as_ptr() as u64,
                    len: info.size,
                };
                lazy = Some(LazyGuest::attach(
                    &mut self.client.borrow_mut(),
                    &alloc,
                    &[m],
                    LazyOptions::default(),
                )?);
            }
            Prep::Attach => {}
            Prep::Prefault(threads) => prefault(&map, self.cfg.page_size.bytes(), threads)?,
        }
        let ready = t0.elapsed();
        let report = run_guest(&map, &self.cfg)?;
        let base = ready.as_secs_f64() * 1e3;
        let faults = lazy.as_ref().and_then(|_| fault_figures(alloc.id));
        let alloc_ms = alloc_done.as_secs_f64() * 1e3;
        let out = ScenarioReport {
            faults,
            recleared,
            ..ScenarioReport::from_run(name, flags, alloc_ms, base, &report)
        };
        drop(map);
        drop(lazy);
        self.free(alloc)?;
        Ok(out)
    }

    /// The daemon's `regions_recleared` counter (dirty regions an ALLOC cleared).
    fn recleared(&self) -> u64 {
        self.handle().stats().counters.regions_recleared
    }

    /// Waits until the region just freed is dirty in the pool (quarantine
    /// done, scrubbing not), or clean already (the scrubbers won the race:
    /// the scenario then reports being served clean).
    fn wait_dirty(&self) -> Result<(), VmstartError> {
        let deadline = Instant::now() + POOL_DEADLINE;
        loop {
            let stats = self.handle().stats();
            let dirty = stats.pool_sum(|p| p.dirty_bytes);
            let (clean, pending) = crate::harness::pool::pool_state(&stats);
            if dirty > 0 || (clean >= self.cfg.size && pending == 0) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(VmstartError::PoolTimeout("make the region dirty"));
            }
            std::thread::yield_now();
        }
    }

    fn shutdown(mut self) -> Result<(), VmstartError> {
        if let Some(d) = self.daemon.take() {
            d.shutdown()?;
        }
        Ok(())
    }
}

impl Drop for Bench {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The fault service of allocation `alloc` (label `alloc N`) in this process.
fn fault_figures(alloc: u64) -> Option<FaultFigures> {
    let label = format!("alloc {alloc}");
    let (_, m) = backend::fault::live_services()
        .into_iter()
        .find(|(l, _)| *l == label)?;
    let s = m.snapshot();
    let us = |ns: u64| ns as f64 / 1e3;
    Some(FaultFigures {
        faults: s.faults,
        cleared_on_fault: s.served_cleared,
        already_clean: s.served_clean,
        coalesced: s.coalesced,
        scrubbed_ahead: s.precontinued,
        p50_us: us(s.latency.p50_ns),
        p99_us: us(s.latency.p99_ns),
        max_us: us(s.latency.max_ns),
    })
}

/// The VMM's `MAP_SHARED` read-write mapping of the allocation's one region.
fn map_region(alloc: &Allocation) -> Result<MmapRegion, VmstartError> {
    let (info, fd) = alloc
        .regions
        .first()
        .zip(alloc.fds.first())
        .ok_or_else(|| VmstartError::Unexpected("map", "no region".into()))?;
    map_fd(info.size, fd.as_fd())
}

/// The `floor` scenario: the same mapping and guest on a hugetlb memfd the
/// bench populated (resident, zeroed by the kernel) before the clock
/// started, no daemon: the VMM's floor, what no preparation of the memory
/// can beat. Also returns how long the kernel took to populate (zero) that
/// memfd on this one thread, ms.
fn floor(cfg: &VmstartConfig) -> Result<(ScenarioReport, f64), VmstartError> {
    let (memory, zeroing) = crate::floor::FloorMemory::populated(cfg.size, cfg.page_size)
        .map_err(|e| VmstartError::Unexpected("floor", backend::diag::chain(&e)))?;
    let floor = guest_on_memfd(cfg, memory.fd(), "floor", "RESIDENT")?;
    Ok((floor, zeroing.as_secs_f64() * 1e3))
}

/// The `fresh-floor` scenario: the same mapping and guest on a fresh hugetlb
/// memfd, no daemon: the kernel zeroes each page at the guest's touch
/// through KVM's fault path (`lazy-fresh` without the daemon: its floor).
fn fresh_floor(cfg: &VmstartConfig) -> Result<ScenarioReport, VmstartError> {
    let len = usize::try_from(cfg.size)
        .map_err(|_| VmstartError::Unexpected("fresh-floor", "size".into()))?;
    let memory = guest_mem::SharedMapping::memfd(len, cfg.page_size)
        .map_err(|e| VmstartError::Unexpected("fresh-floor", e.to_string()))?;
    guest_on_memfd(cfg, memory.fd(), "fresh-floor", "FRESH")
}

/// The micro-guest on a mapping of its own of the hugetlb memfd `fd`, no
/// daemon: ready is the `mmap`.
fn guest_on_memfd(
    cfg: &VmstartConfig,
    fd: std::os::fd::BorrowedFd<'_>,
    name: &'static str,
    flags: &str,
) -> Result<ScenarioReport, VmstartError> {
    let t0 = Instant::now();
    let map = map_fd(cfg.size, fd)?;
    let ready = t0.elapsed();
    let report = run_guest(&map, cfg)?;
    let base = ready.as_secs_f64() * 1e3;
    Ok(ScenarioReport::from_run(
        name,
        flags.into(),
        0.0,
        base,
        &report,
    ))
}

/// A `MAP_SHARED` read-write mapping of `size` bytes of the hugetlb `fd`.
fn map_fd(size: u64, fd: std::os::fd::BorrowedFd<'_>) -> Result<MmapRegion, VmstartError> {
    let len =
        usize::try_from(size).map_err(|_| VmstartError::Unexpected("map", "too large".into()))?;
    let file = std::fs::File::from(
        fd.as_fd()
            .try_clone_to_owned()
            .map_err(|e| VmstartError::Unexpected("map", e.to_string()))?,
    );
    Ok(MmapRegionBuilder::new(len)
        .with_file_offset(FileOffset::new(file, 0))
        .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
        .with_mmap_flags(libc::MAP_SHARED)
        .with_hugetlbfs(true)
        .build()?)
}

/// Runs the micro-guest over the mapping, split at the 3 GiB hole.
fn run_guest(map: &MmapRegion, cfg: &VmstartConfig) -> Result<microguest::RunReport, VmstartError> {
    let len = map.size();
    let low = len.min(LOW_RAM_END as usize);
    // SAFETY: both slices lie inside `map`, a live read-write shared mapping
    // that outlives the run (borrowed for it); no Rust reference to its bytes
    // exists while the guest runs.
    let mut ram = vec![unsafe { microguest::GuestRam::from_raw_parts(map.as_ptr(), low, 0) }];
    if len > low {
        // SAFETY: as above; `low` is inside the mapping.
        let high = unsafe { map.as_ptr().add(low) };
        // SAFETY: as above: `high .. high + len - low` is the rest of `map`.
        ram.push(unsafe { microguest::GuestRam::from_raw_parts(high, len - low, HIGH_RAM) });
    }
    let rc = microguest::RunConfig {
        stride: cfg.page_size.bytes(),
        timeout: cfg.guest_timeout,
        ..microguest::RunConfig::default()
    };
    Ok(microguest::run(&ram, &rc)?)
}

/// cloud-hypervisor's prefault: `threads` unpinned threads, each writing the
/// first byte of its share of the huge pages (each write faults one whole
/// page in; the kernel zeroes it), before the guest starts.
fn prefault(map: &MmapRegion, page: u64, threads: usize) -> Result<(), VmstartError> {
    let page =
        usize::try_from(page).map_err(|_| VmstartError::Unexpected("prefault", "page".into()))?;
    let pages = map.size() / page;
    let threads = threads.clamp(1, pages.max(1));
    let base = map.as_ptr() as usize;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let first = t * (pages / threads) + t.min(pages % threads);
                let count = pages / threads + usize::from(t < pages % threads);
                s.spawn(move || {
                    for p in first..first + count {
                        let at = (base + p * page) as *mut u8;
                        // SAFETY: `at` is the first byte of page `p` < `pages`
                        // of the live read-write mapping `map`, borrowed for
                        // this scope; no Rust reference to it exists; writing
                        // 0 to a page the kernel has just zeroed changes nothing.
                        unsafe { at.write_volatile(0) };
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().map_err(|_| VmstartError::Panicked))
    })
}

/// Best of 5 clears of one dirty huge page with `kernel`: (µs, GB/s).
fn one_page_clear(page: PageSize, kernel: clearing::ClearKernel) -> (f64, f64) {
    let Ok(len) = usize::try_from(page.bytes()) else {
        return (0.0, 0.0);
    };
    let Ok(mut m) = guest_mem::AnonMapping::new(len, page) else {
        return (0.0, 0.0);
    };
    let mut best = f64::MAX;
    for _ in 0..5 {
        m.as_mut_slice().fill(0xEE);
        let t = Instant::now();
        clearing::clear_huge_page(kernel, m.as_mut_slice(), 0);
        best = best.min(t.elapsed().as_secs_f64());
    }
    (best * 1e6, crate::stats::gbps(page.bytes(), best))
}
