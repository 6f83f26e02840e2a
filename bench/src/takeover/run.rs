//! The bench end to end: per round and mode, the tenants and the clean
//! pool, the switch (or, for the floor, none) under clients, and the
//! figures.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use backend::proto::AllocRequest;
use hugemem_client::stats::Stats;

use super::clients::{self, ClientRun};
use super::config::{Mode, TakeoverConfig};
use super::error::{client_err, TakeoverError};
use super::report::{ModeRound, TakeoverReport};
use super::switch::{pool_ready, switch, wait_stats, Switched};
use super::tenant::{request, Tenant};
use crate::harness::rounds;
use crate::harness::serve::{ServeChild, ServeOptions};
use crate::private_dir::PrivateDir;

/// Clients run this long before the switch, and after the first ALLOC.
const LEAD: Duration = Duration::from_millis(200);

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

/// One mode of one round: setup, switch under clients, the figures. With
/// no switch ([`Mode::Floor`]) the step lasts at least `window`.
fn run_mode(
    cfg: &TakeoverConfig,
    mode: Mode,
    dir: &Path,
    config: &Path,
    round: usize,
    window: Duration,
) -> Result<ModeRound, TakeoverError> {
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
    let (tenants, before) = setup(cfg, &socket, &req)?;

    let under = switch_under_clients(cfg, mode, window, &opts, old, &req, tenants);
    let sw = under.switched?;
    if under.seen.tenants.len() != cfg.allocations {
        return Err(TakeoverError::Run("a tenant thread panicked".into()));
    }
    figures(cfg, mode, round, &before, sw, under.seen)
}

/// What the clients saw while the daemon was switched.
struct UnderClients {
    switched: Result<Switched, TakeoverError>,
    seen: ClientsSeen,
}

/// The clients' runs.
struct ClientsSeen {
    /// Each tenant, back from its thread, with its run.
    tenants: Vec<(Tenant, ClientRun)>,
    idle: Vec<ClientRun>,
    connector: ClientRun,
}

/// Starts the clients (the tenants pinging on their connections, the idle
/// clients, a connector), switches the daemon after [`LEAD`] (for the
/// floor: keeps it for at least `window`), and stops them [`LEAD`] after
/// the switch's ALLOCs.
fn switch_under_clients(
    cfg: &TakeoverConfig,
    mode: Mode,
    window: Duration,
    opts: &ServeOptions,
    old: ServeChild,
    req: &AllocRequest,
    mut tenants: Vec<Tenant>,
) -> UnderClients {
    let socket = &opts.socket;
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
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
        let switched = switch(mode, &cfg.launcher, opts, old, req, regions, window);
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
        UnderClients {
            switched,
            seen: ClientsSeen {
                tenants: tenant_runs,
                idle: idle_runs,
                connector: connector_run,
            },
        }
    })
}

/// The round's figures from the new daemon's STATS and the clients' runs;
/// frees the tenants and the bench's own allocations, and stops the daemon.
fn figures(
    cfg: &TakeoverConfig,
    mode: Mode,
    round: usize,
    before: &Stats,
    mut sw: Switched,
    seen: ClientsSeen,
) -> Result<ModeRound, TakeoverError> {
    let page = cfg.page_size.bytes();
    let ClientsSeen {
        tenants: tenant_runs,
        idle: idle_runs,
        connector: connector_run,
    } = seen;
    let after = sw
        .probe
        .client
        .stats()
        .map_err(client_err("the new daemon's STATS"))?;
    // Counters come over in a takeover's state document; a fresh process
    // starts them at 0. Scrub figures are per process: the steady daemon's
    // (the floor) count from before the step.
    let base = |f: fn(&Stats) -> u64| match mode {
        Mode::Takeover | Mode::Floor => f(before),
        Mode::StopStart => 0,
    };
    let scrub_bytes = match mode {
        Mode::Floor => after.scrub.bytes.saturating_sub(before.scrub.bytes),
        Mode::Takeover | Mode::StopStart => after.scrub.bytes,
    };
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
        old_exit_ms: sw.old_exit.map(|(ms, _)| ms),
        old_exit_ok: sw.old_exit.map(|(_, ok)| ok),
        window_ms: sw.window_ms,
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
    let mut takeover: Vec<ModeRound> = Vec::new();
    let mut stop_start: Vec<ModeRound> = Vec::new();
    let mut floor = Vec::new();
    // The floor last in each round: its window is the round's longer switch.
    rounds::each(cfg.rounds, |round| {
        for mode in [Mode::Takeover, Mode::StopStart, Mode::Floor] {
            // The floor's clients run as long as this round's longer
            // switch kept them.
            let window = match mode {
                Mode::Floor => takeover
                    .iter()
                    .chain(&stop_start)
                    .filter(|r| r.round == round.index() + 1)
                    .map(|r| Duration::from_secs_f64(r.window_ms / 1e3))
                    .max()
                    .unwrap_or_default(),
                Mode::Takeover | Mode::StopStart => Duration::ZERO,
            };
            let r = run_mode(cfg, mode, dir.path(), &config, round.index(), window)?;
            progress(&format!(
                "round {round} {}: first ALLOC {:.1} ms ({}), stall {:.1} ms, {} failed, {} refused, {} zeroed, {}/{} known, {}/{} free-able",
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
                Mode::Floor => floor.push(r),
            }
        }
        Ok::<_, TakeoverError>(())
    })?;
    drop(reservation);
    Ok(TakeoverReport::new(cfg, takeover, stop_start, floor))
}
