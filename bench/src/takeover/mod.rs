//! `hugemem bench takeover`: a daemon upgrade or restart by
//! `hugemem serve --takeover` (issue 20) against the plain stop and start
//! it replaces, the baseline, measured in the same run on the same settings.
//!
//! # Setup (the same for both modes, afresh for each)
//!
//! A private daemon (`hugemem serve` as a child process, its own socket in
//! a private directory, a config whose pool target and limit hold
//! everything) with `allocations` tenants, each an ALLOC of `alloc_bytes`
//! held on a connection of its own, mapped and written (a word per 4 KiB)
//! like a running VM, and `pool_bytes` of clean pool: regions of
//! `alloc_bytes` allocated, freed, and waited for until STATS shows them
//! clean and fully present (`not_present` 0, nothing pending or in
//! quarantine).
//!
//! # The switch
//!
//! While every tenant connection and `idle_clients` more send STATS in a
//! loop and one more thread opens connection after connection:
//!
//! * **takeover**: `hugemem serve --takeover` with the same config and
//!   socket is spawned; the old process must exit by itself.
//! * **stop-start** (the baseline): SIGTERM, wait for the exit, spawn a
//!   plain `hugemem serve`.
//!
//! From the switch's start (the spawn, or the SIGTERM) a prober connects
//! again and again until the **new** process answers (STATS `pid`), then
//! ALLOCs one pool region's size: `first_alloc_ms` ends at its reply, and
//! it was *warm* when STATS `counters.regions_pooled` went up by one and
//! `regions_fresh` did not. The prober then ALLOCs the rest of the old
//! pool's size (the next VMs): `pool_served_ms` ends when all of it was
//! served, warm when every region came from the pool.
//!
//! # What is reported, per mode and round
//!
//! * the longest stall any client saw: from a request sent to the next
//!   successful reply, failed attempts and reconnects included;
//! * failed requests, and connections refused (nothing listening);
//! * bytes zeroed by the new daemon across the switch: `scrub.bytes` (the
//!   new process's own) + `counters.pages_detached` x page size +
//!   `counters.bytes_created` (regions created fresh, which the kernel
//!   zeroes), counter deltas against the old daemon's last STATS when the
//!   counters came over (takeover), else against 0 (a fresh process);
//! * allocations still known (tenant ids the new daemon's STATS lists) and
//!   free-able (each tenant's FREE on its own connection: the original one,
//!   or the one it had to open again after losing it);
//! * tenants whose memory still reads what they wrote.

mod clients;
mod report;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use backend::client::{Allocation, Client, ClientError};
use backend::diag::chain;
use backend::proto::{AllocRequest, ClearMode, PagePolicy, RegionInfo};
use guest_mem::vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use guest_mem::PageSize;
use hugemem_client::stats::Stats;

use crate::private_dir::PrivateDir;
use crate::serve_child::{ServeChild, ServeChildError, ServeOptions};
pub use clients::ClientRun;
pub use report::{Expectation, ModeRound, ModeSummary, Ratios, Spread, TakeoverReport};

/// Mixed into what the tenants write.
const MARKER: u64 = 0x4855_4754_414b_454f; // "HUGTAKEO"
/// Clients run this long before the switch, and after the first ALLOC.
const LEAD: Duration = Duration::from_millis(200);
/// Longest wait for a daemon state (clean pool, first ALLOC, an exit).
const WAIT: Duration = Duration::from_secs(60);

/// What to run.
#[derive(Debug, Clone)]
pub struct TakeoverConfig {
    /// Bytes of clean pool before the switch.
    pub pool_bytes: u64,
    /// Running allocations (tenants).
    pub allocations: usize,
    /// Bytes per allocation, and per pool region.
    pub alloc_bytes: u64,
    /// Huge page size: 2M or 1G.
    pub page_size: PageSize,
    /// Rounds; each runs both modes.
    pub rounds: usize,
    /// Connections that only send STATS, besides the tenants'.
    pub idle_clients: usize,
    /// The `hugemem` binary whose `serve` runs the daemons.
    pub launcher: PathBuf,
}

/// Errors of the benchmark.
#[derive(Debug, thiserror::Error)]
pub enum TakeoverError {
    /// Bad options.
    #[error("{0}")]
    Options(String),
    /// The huge pages could not be had.
    #[error("no huge pages could be had for the run: {0}")]
    NoPages(String),
    /// A daemon process did not start or answer.
    #[error("cannot run a private daemon")]
    Serve(#[from] ServeChildError),
    /// A request failed where it must not (setup, the new daemon's STATS).
    #[error("{what}")]
    Client {
        /// What was being done.
        what: String,
        /// The cause.
        #[source]
        source: ClientError,
    },
    /// Files and directories.
    #[error("{what}")]
    Io {
        /// What was being done.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The run could not go on (a wait timed out, memory not mappable).
    #[error("{0}")]
    Run(String),
}

fn client_err(what: impl Into<String>) -> impl FnOnce(ClientError) -> TakeoverError {
    let what = what.into();
    move |source| TakeoverError::Client { what, source }
}

/// How the daemon is switched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `hugemem serve --takeover`.
    Takeover,
    /// SIGTERM, then a fresh `hugemem serve`.
    StopStart,
}

impl Mode {
    /// The name in the report.
    pub fn name(self) -> &'static str {
        match self {
            Self::Takeover => "takeover",
            Self::StopStart => "stop-start",
        }
    }
}

/// A running VM's stand-in: its connection, allocation and mapping.
struct Tenant {
    conn: Option<Client>,
    id: u64,
    regions: Vec<RegionInfo>,
    mem: GuestMemoryMmap,
    salt: u64,
}

impl Tenant {
    fn word(&self, gpa: u64) -> u64 {
        MARKER ^ self.salt ^ gpa
    }

    /// The guest physical address of every 4 KiB of its memory.
    fn addresses(&self) -> impl Iterator<Item = u64> + '_ {
        self.regions
            .iter()
            .flat_map(|r| (r.guest_phys..r.guest_phys + r.size).step_by(4096))
    }

    fn write(&self) -> Result<(), TakeoverError> {
        for gpa in self.addresses() {
            self.mem
                .write_obj(self.word(gpa), GuestAddress(gpa))
                .map_err(|e| TakeoverError::Run(format!("tenant write at {gpa:#x}: {e}")))?;
        }
        Ok(())
    }

    fn intact(&self) -> bool {
        self.addresses().all(|gpa| {
            self.mem
                .read_obj::<u64>(GuestAddress(gpa))
                .is_ok_and(|w| w == self.word(gpa))
        })
    }
}

fn request(size: u64, page: PageSize) -> AllocRequest {
    AllocRequest {
        total_size: size,
        page_policy: match page {
            PageSize::Huge1G => PagePolicy::Huge1G,
            _ => PagePolicy::Huge2M,
        },
        clear_mode: ClearMode::Eager,
        lock: false,
        parts: Vec::new(),
        want_paths: false,
    }
}

fn stats(socket: &Path, what: &str) -> Result<Stats, TakeoverError> {
    let mut c = clients::connect(socket).map_err(client_err(format!("{what}: connect")))?;
    c.stats().map_err(client_err(format!("{what}: STATS")))
}

/// Polls STATS until `cond` holds.
fn wait_stats(
    socket: &Path,
    what: &str,
    cond: impl Fn(&Stats) -> bool,
) -> Result<Stats, TakeoverError> {
    let deadline = Instant::now() + WAIT;
    loop {
        let s = stats(socket, what)?;
        if cond(&s) {
            return Ok(s);
        }
        if Instant::now() >= deadline {
            return Err(TakeoverError::Run(format!(
                "timed out waiting until {what}: {s}"
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The pool holds `bytes` clean, every page present, nothing left to scrub.
fn pool_ready(s: &Stats, bytes: u64) -> bool {
    s.pool_sum(|p| p.clean_bytes) >= bytes
        && s.pool_sum(|p| p.dirty_bytes + p.quarantined_bytes) == 0
        && s.scrub.pending_bytes == 0
        && s.regions.as_ref().is_some_and(|r| {
            r.iter()
                .filter(|r| r.state == "clean")
                .all(|r| r.not_present.unwrap_or(0) == 0)
        })
}

/// The prober's first ALLOC from the new daemon.
struct Probe {
    client: Client,
    alloc: Allocation,
    first_alloc_ms: f64,
    alloc_call_ms: f64,
    warm: bool,
    pool_clean_bytes: u64,
}

/// Connects until the process `new` answers, then ALLOCs `req`; polls
/// `old` for its exit meanwhile (`old_exit` records when, from `t0`).
fn first_alloc(
    socket: &Path,
    t0: Instant,
    req: &AllocRequest,
    new: &mut ServeChild,
    mut old: Option<&mut ServeChild>,
    old_exit: &mut Option<Duration>,
) -> Result<Probe, TakeoverError> {
    let deadline = t0 + WAIT;
    let mut last = String::from("no answer yet");
    loop {
        if let Some(o) = old.as_deref_mut() {
            if old_exit.is_none() && o.try_wait().is_some() {
                *old_exit = Some(t0.elapsed());
            }
        }
        if let Some(status) = new.try_wait() {
            return Err(TakeoverError::Run(format!(
                "the new daemon exited with {status}"
            )));
        }
        if Instant::now() >= deadline {
            return Err(TakeoverError::Run(format!(
                "no ALLOC served by the new daemon within {WAIT:?}: {last}"
            )));
        }
        let attempt = (|| -> Result<Option<Probe>, ClientError> {
            let mut c = clients::connect(socket)?;
            let s0 = c.stats()?;
            if s0.pid != new.pid() {
                // Still the old process: not what is measured.
                return Ok(None);
            }
            let sent = Instant::now();
            let alloc = c.alloc(req.clone())?;
            let first_alloc_ms = t0.elapsed().as_secs_f64() * 1e3;
            let alloc_call_ms = sent.elapsed().as_secs_f64() * 1e3;
            let s1 = c.stats()?;
            let warm = s1.counters.regions_pooled == s0.counters.regions_pooled + 1
                && s1.counters.regions_fresh == s0.counters.regions_fresh;
            Ok(Some(Probe {
                client: c,
                alloc,
                first_alloc_ms,
                alloc_call_ms,
                warm,
                pool_clean_bytes: s0.pool_sum(|p| p.clean_bytes),
            }))
        })();
        match attempt {
            Ok(Some(p)) => return Ok(p),
            Ok(None) => {}
            Err(e) => last = chain(&e),
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The switch's outcome.
struct Switched {
    new: ServeChild,
    probe: Probe,
    /// The rest of the old pool's size, ALLOCated after the probe.
    rest: Vec<Allocation>,
    pool_served_ms: f64,
    pool_served_warm: bool,
    old_exit_ms: f64,
    old_exit_ok: bool,
}

fn switch(
    mode: Mode,
    launcher: &Path,
    opts: &ServeOptions,
    mut old: ServeChild,
    req: &AllocRequest,
    regions: u64,
) -> Result<Switched, TakeoverError> {
    let new_opts = ServeOptions {
        takeover: mode == Mode::Takeover,
        log: opts.log.as_ref().map(|p| p.with_extension("new.log")),
        ..opts.clone()
    };
    let t0 = Instant::now();
    let mut old_exit = None;
    let (mut new, probe) = match mode {
        Mode::Takeover => {
            let mut new = ServeChild::spawn(launcher, &new_opts)?;
            let probe = first_alloc(
                &opts.socket,
                t0,
                req,
                &mut new,
                Some(&mut old),
                &mut old_exit,
            )?;
            (new, probe)
        }
        Mode::StopStart => {
            old.terminate();
            old.wait();
            old_exit = Some(t0.elapsed());
            let mut new = ServeChild::spawn(launcher, &new_opts)?;
            let probe = first_alloc(&opts.socket, t0, req, &mut new, None, &mut old_exit)?;
            (new, probe)
        }
    };
    let deadline = t0 + WAIT;
    let status = loop {
        if let Some(s) = old.try_wait() {
            break s;
        }
        if Instant::now() >= deadline {
            return Err(TakeoverError::Run(format!(
                "the old daemon did not exit within {WAIT:?} of the takeover"
            )));
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    let old_exit = *old_exit.get_or_insert_with(|| t0.elapsed());
    if new.try_wait().is_some() {
        return Err(TakeoverError::Run("the new daemon exited".into()));
    }
    // The next VMs: as many ALLOCs as the old pool held, the probe's first.
    let mut probe = probe;
    let s0 = probe
        .client
        .stats()
        .map_err(client_err("the new daemon's STATS"))?;
    let mut rest = Vec::new();
    for _ in 1..regions {
        rest.push(
            probe
                .client
                .alloc(req.clone())
                .map_err(client_err("ALLOC after the switch"))?,
        );
    }
    let pool_served_ms = t0.elapsed().as_secs_f64() * 1e3;
    let s1 = probe
        .client
        .stats()
        .map_err(client_err("the new daemon's STATS"))?;
    let pool_served_warm = probe.warm
        && s1.counters.regions_pooled == s0.counters.regions_pooled + regions - 1
        && s1.counters.regions_fresh == s0.counters.regions_fresh;
    Ok(Switched {
        new,
        probe,
        rest,
        pool_served_ms,
        pool_served_warm,
        old_exit_ms: old_exit.as_secs_f64() * 1e3,
        old_exit_ok: status.success(),
    })
}

/// The tenants, mapped and written, then the clean pool.
fn setup(
    cfg: &TakeoverConfig,
    socket: &Path,
    req: &AllocRequest,
) -> Result<(Vec<Tenant>, Stats), TakeoverError> {
    // The running VMs first (fresh pages), then the pool (so the tenants
    // do not take it).
    let mut tenants = Vec::with_capacity(cfg.allocations);
    for i in 0..cfg.allocations {
        let mut c = clients::connect(socket).map_err(client_err("tenant: connect"))?;
        let a = c
            .alloc(req.clone())
            .map_err(client_err(format!("tenant {i}: ALLOC")))?;
        let mem = a
            .guest_memory()
            .map_err(|e| TakeoverError::Run(format!("tenant {i}: cannot map: {e}")))?;
        let t = Tenant {
            conn: Some(c),
            id: a.id,
            regions: a.regions.clone(),
            mem,
            salt: (i as u64) << 56,
        };
        t.write()?;
        tenants.push(t);
    }
    let mut c = clients::connect(socket).map_err(client_err("pool: connect"))?;
    let mut ids = Vec::new();
    for _ in 0..cfg.pool_bytes / cfg.alloc_bytes {
        // The Allocation (its fds) goes at once: no holder but the daemon.
        ids.push(c.alloc(req.clone()).map_err(client_err("pool: ALLOC"))?.id);
    }
    for id in ids {
        c.free(id).map_err(client_err("pool: FREE"))?;
    }
    drop(c);
    let before = wait_stats(socket, "the pool is clean and present", |s| {
        pool_ready(s, cfg.pool_bytes)
    })?;
    Ok((tenants, before))
}

/// One mode of one round: setup, switch under clients, the figures.
fn run_mode(
    cfg: &TakeoverConfig,
    mode: Mode,
    dir: &Path,
    config: &Path,
    round: usize,
) -> Result<ModeRound, TakeoverError> {
    let page = cfg.page_size.bytes();
    let opts = ServeOptions {
        socket: dir.join(format!("r{round}-{}.sock", mode.name())),
        config: Some(config.to_path_buf()),
        pool: None,
        takeover: false,
        log: Some(dir.join(format!("r{round}-{}.log", mode.name()))),
    };
    let socket = opts.socket.clone();
    let old = ServeChild::start(&cfg.launcher, &opts)?;
    let req = request(cfg.alloc_bytes, cfg.page_size);
    let (mut tenants, before) = setup(cfg, &socket, &req)?;

    let stop = AtomicBool::new(false);
    let (switched, tenant_runs, idle_runs, connector_run) = std::thread::scope(|s| {
        let (stop, socket) = (&stop, &socket);
        let tenant_threads: Vec<_> = tenants
            .drain(..)
            .map(|mut t| {
                s.spawn(move || {
                    let r = clients::ping(&mut t.conn, socket, stop);
                    (t, r)
                })
            })
            .collect();
        let idle_threads: Vec<_> = (0..cfg.idle_clients)
            .map(|_| {
                s.spawn(move || {
                    let mut conn = clients::connect(socket).ok();
                    clients::ping(&mut conn, socket, stop)
                })
            })
            .collect();
        let connector = s.spawn(move || clients::connector(socket, stop));
        std::thread::sleep(LEAD);
        let regions = cfg.pool_bytes / cfg.alloc_bytes;
        let switched = switch(mode, &cfg.launcher, &opts, old, &req, regions);
        if switched.is_ok() {
            std::thread::sleep(LEAD);
        }
        stop.store(true, Ordering::Relaxed);
        let tenant_runs: Vec<_> = tenant_threads
            .into_iter()
            .filter_map(|h| h.join().ok())
            .collect();
        let idle_runs: Vec<ClientRun> = idle_threads
            .into_iter()
            .filter_map(|h| h.join().ok())
            .collect();
        let connector_run = connector.join().unwrap_or_default();
        (switched, tenant_runs, idle_runs, connector_run)
    });
    let mut sw = switched?;
    if tenant_runs.len() != cfg.allocations {
        return Err(TakeoverError::Run("a tenant thread panicked".into()));
    }

    let after = sw
        .probe
        .client
        .stats()
        .map_err(client_err("the new daemon's STATS"))?;
    // Counters come over in a takeover's state document; a fresh process
    // starts them at 0. Scrub figures are per process in both modes.
    let base = |f: fn(&Stats) -> u64| match mode {
        Mode::Takeover => f(&before),
        Mode::StopStart => 0,
    };
    let scrub_bytes = after.scrub.bytes;
    let pages_detached = after
        .counters
        .pages_detached
        .saturating_sub(base(|s| s.counters.pages_detached));
    let bytes_created = after
        .counters
        .bytes_created
        .saturating_sub(base(|s| s.counters.bytes_created));
    // The bench's own ALLOCs after the switch are not tenants' (a fresh
    // daemon numbers from 1 again: the same ids).
    let ours: BTreeSet<u64> = std::iter::once(sw.probe.alloc.id)
        .chain(sw.rest.iter().map(|a| a.id))
        .collect();
    let known_ids: BTreeSet<u64> = after
        .regions
        .iter()
        .flatten()
        .filter_map(|r| r.alloc_id)
        .filter(|id| !ours.contains(id))
        .collect();

    let mut clients = ClientRun::default();
    let mut tenant_total = ClientRun::default();
    let (mut known, mut freeable, mut intact) = (0, 0, 0);
    for (mut t, r) in tenant_runs {
        tenant_total.merge(&r);
        known += usize::from(known_ids.contains(&t.id));
        intact += usize::from(t.intact());
        let id = t.id;
        // The mapping goes before FREE, as a VM's does when it ends.
        drop(t.mem);
        if let Some(c) = t.conn.as_mut() {
            freeable += usize::from(c.free(id).is_ok());
        }
    }
    clients.merge(&tenant_total);
    for r in &idle_runs {
        clients.merge(r);
    }
    for id in ours {
        let _ = sw.probe.client.free(id);
    }
    drop(sw.probe.alloc);
    drop(sw.rest);
    sw.new.stop();

    Ok(ModeRound {
        round: round + 1,
        first_alloc_ms: sw.probe.first_alloc_ms,
        first_alloc_call_ms: sw.probe.alloc_call_ms,
        first_alloc_warm: sw.probe.warm,
        pool_served_ms: sw.pool_served_ms,
        pool_served_warm: sw.pool_served_warm,
        pool_clean_bytes_before: before.pool_sum(|p| p.clean_bytes),
        pool_clean_bytes_at_first_alloc: sw.probe.pool_clean_bytes,
        old_exit_ms: sw.old_exit_ms,
        old_exit_ok: sw.old_exit_ok,
        max_stall_ms: clients.max_stall_ms.max(connector_run.max_stall_ms),
        tenant_max_stall_ms: tenant_total.max_stall_ms,
        failed_requests: clients.failed + connector_run.failed,
        refused_connections: connector_run.refused,
        connect_attempts: connector_run.requests,
        requests: clients.requests,
        reconnects: clients.reconnects,
        scrub_bytes,
        pages_detached,
        bytes_created,
        bytes_zeroed: scrub_bytes + pages_detached * page + bytes_created,
        allocations_active: after.allocations.active,
        allocations_known: known,
        allocations_freeable: freeable,
        tenant_memory_intact: intact,
    })
}

/// Runs `rounds` rounds of both modes; `progress` gets a line per mode run.
///
/// # Errors
///
/// [`TakeoverError`].
pub fn run(
    cfg: &TakeoverConfig,
    progress: &mut dyn FnMut(&str),
) -> Result<TakeoverReport, TakeoverError> {
    let page = cfg.page_size.bytes();
    if !cfg.page_size.is_huge() {
        return Err(TakeoverError::Options(
            "--page-size must be 2M or 1G".into(),
        ));
    }
    if cfg.rounds == 0
        || cfg.alloc_bytes == 0
        || cfg.pool_bytes == 0
        || !cfg.alloc_bytes.is_multiple_of(page)
        || !cfg.pool_bytes.is_multiple_of(cfg.alloc_bytes)
    {
        return Err(TakeoverError::Options(format!(
            "--rounds, --pool-gib and --alloc-mib must be non-zero, the allocation size a multiple of {}, the pool a multiple of the allocation size",
            cfg.page_size
        )));
    }
    // Everything held at once, plus one allocation's worth of room (the
    // probe of a stop-start, pages on their way back to the kernel).
    let hold = cfg
        .pool_bytes
        .saturating_add(cfg.alloc_bytes.saturating_mul(cfg.allocations as u64 + 1));
    let pages = hold / page;
    let reservation = guest_mem::Reservation::for_run(cfg.page_size, pages)
        .map_err(|e| TakeoverError::NoPages(e.to_string()))?;
    if !reservation.report().met {
        return Err(TakeoverError::NoPages(format!(
            "{pages} x {} needed, {} free",
            cfg.page_size,
            reservation.report().free
        )));
    }
    let dir = PrivateDir::create("hugemem-takeover").map_err(|source| TakeoverError::Io {
        what: "cannot create a private directory".into(),
        source,
    })?;
    let config = dir.path().join("hugemem.toml");
    // Target and limit hold everything: nothing is trimmed or given back
    // because of them. Refill stays off (its default): a fresh daemon's
    // empty pool is what a stop and start leaves.
    std::fs::write(
        &config,
        format!("[pool]\ntarget = {hold}\nlimit = {hold}\n"),
    )
    .map_err(|source| TakeoverError::Io {
        what: format!("cannot write {}", config.display()),
        source,
    })?;
    progress(&format!(
        "takeover: {} clean pool, {} x {} running, {} pages, {} round(s)",
        guest_mem::size::format_size(cfg.pool_bytes),
        cfg.allocations,
        guest_mem::size::format_size(cfg.alloc_bytes),
        cfg.page_size,
        cfg.rounds
    ));
    let mut takeover = Vec::new();
    let mut stop_start = Vec::new();
    for round in 0..cfg.rounds {
        for mode in [Mode::Takeover, Mode::StopStart] {
            let r = run_mode(cfg, mode, dir.path(), &config, round)?;
            progress(&format!(
                "round {}/{} {}: first ALLOC {:.1} ms ({}), stall {:.1} ms, {} failed, {} refused, {} zeroed, {}/{} known, {}/{} free-able",
                round + 1,
                cfg.rounds,
                mode.name(),
                r.first_alloc_ms,
                if r.first_alloc_warm { "warm" } else { "not from the pool" },
                r.max_stall_ms,
                r.failed_requests,
                r.refused_connections,
                guest_mem::size::format_size(r.bytes_zeroed),
                r.allocations_known,
                cfg.allocations,
                r.allocations_freeable,
                cfg.allocations,
            ));
            match mode {
                Mode::Takeover => takeover.push(r),
                Mode::StopStart => stop_start.push(r),
            }
        }
    }
    drop(reservation);
    Ok(TakeoverReport::new(cfg, takeover, stop_start))
}
