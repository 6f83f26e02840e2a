//! The switch itself: a new daemon by `serve --takeover` or by stop and
//! start (or none, the floor), the first ALLOC it serves, and the daemon
//! states waited for.

use std::path::Path;
use std::time::{Duration, Instant};

use backend::client::{Allocation, Client, ClientError};
use backend::diag::chain;
use backend::proto::AllocRequest;
use hugemem_client::stats::Stats;

use super::clients;
use super::config::Mode;
use super::error::{client_err, TakeoverError};
use crate::harness::serve::{ServeChild, ServeOptions};

/// Longest wait for a daemon state (clean pool, first ALLOC, an exit).
pub(super) const WAIT: Duration = Duration::from_secs(60);

pub(super) fn stats(socket: &Path, what: &str) -> Result<Stats, TakeoverError> {
    let mut c = clients::connect(socket).map_err(client_err(format!("{what}: connect")))?;
    c.stats().map_err(client_err(format!("{what}: STATS")))
}

/// Polls STATS until `cond` holds.
pub(super) fn wait_stats(
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
pub(super) fn pool_ready(s: &Stats, bytes: u64) -> bool {
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
pub(super) struct Probe {
    pub(super) client: Client,
    pub(super) alloc: Allocation,
    pub(super) first_alloc_ms: f64,
    pub(super) alloc_call_ms: f64,
    pub(super) warm: bool,
    pub(super) pool_clean_bytes: u64,
}

/// Connects until the process `new` answers, then ALLOCs `req`; polls
/// `old` for its exit meanwhile (`old_exit` records when, from `t0`).
pub(super) fn first_alloc(
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
pub(super) struct Switched {
    pub(super) new: ServeChild,
    pub(super) probe: Probe,
    /// The rest of the old pool's size, ALLOCated after the probe.
    pub(super) rest: Vec<Allocation>,
    pub(super) pool_served_ms: f64,
    pub(super) pool_served_warm: bool,
    /// Switch start to the old process's exit, ms, and whether it exited
    /// with status 0; `None` with no switch (the floor).
    pub(super) old_exit: Option<(f64, bool)>,
    /// Switch start to the end of the step (at least the window asked
    /// for), ms.
    pub(super) window_ms: f64,
}

/// Waits for the old process's exit; `seen` is when the prober saw it go.
fn old_exited(
    mut old: ServeChild,
    t0: Instant,
    seen: Option<Duration>,
) -> Result<(f64, bool), TakeoverError> {
    let Some(status) = old.wait_until(t0 + WAIT) else {
        return Err(TakeoverError::Run(format!(
            "the old daemon did not exit within {WAIT:?} of the takeover"
        )));
    };
    let exit = seen.unwrap_or_else(|| t0.elapsed());
    Ok((exit.as_secs_f64() * 1e3, status.success()))
}

/// Switches the daemon `old` by `mode` (or, for [`Mode::Floor`], keeps it),
/// then ALLOCs the old pool's size of `regions` from the daemon now
/// serving; with no switch the step lasts at least `window`, so the
/// clients see a window as long as a switch's.
pub(super) fn switch(
    mode: Mode,
    launcher: &Path,
    opts: &ServeOptions,
    mut old: ServeChild,
    req: &AllocRequest,
    regions: u64,
    window: Duration,
) -> Result<Switched, TakeoverError> {
    let new_opts = ServeOptions {
        takeover: mode == Mode::Takeover,
        log: opts.log.as_ref().map(|p| p.with_extension("new.log")),
        ..opts.clone()
    };
    let t0 = Instant::now();
    let mut seen = None;
    let (mut new, probe, old_exit) = match mode {
        Mode::Takeover => {
            let mut new = ServeChild::spawn(launcher, &new_opts)?;
            let probe = first_alloc(&opts.socket, t0, req, &mut new, Some(&mut old), &mut seen)?;
            (new, probe, Some(old_exited(old, t0, seen)?))
        }
        Mode::StopStart => {
            old.terminate();
            old.wait();
            seen = Some(t0.elapsed());
            let mut new = ServeChild::spawn(launcher, &new_opts)?;
            let probe = first_alloc(&opts.socket, t0, req, &mut new, None, &mut seen)?;
            (new, probe, Some(old_exited(old, t0, seen)?))
        }
        Mode::Floor => {
            // The steady daemon answers the same prober path (connect,
            // STATS, ALLOC) with nothing switched.
            let probe = first_alloc(&opts.socket, t0, req, &mut old, None, &mut seen)?;
            (old, probe, None)
        }
    };
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
    // A measuring window, not a wait for an event: the clients keep
    // running through it.
    std::thread::sleep(window.saturating_sub(t0.elapsed()));
    Ok(Switched {
        new,
        probe,
        rest,
        pool_served_ms,
        pool_served_warm,
        old_exit,
        window_ms: t0.elapsed().as_secs_f64() * 1e3,
    })
}
