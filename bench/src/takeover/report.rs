//! `bench takeover`'s report: per round and mode, the summary of each mode,
//! the ratios of takeover against stop-start and of both against the floor
//! (no switch), and the expectations checked against what was
//! measured. The text table is in `table.rs`.

use serde::Serialize;

use super::config::TakeoverConfig;
use guest_mem::size::format_size;

/// One mode's figures in one round.
#[derive(Debug, Clone, Serialize)]
pub struct ModeRound {
    /// 1-based.
    pub round: usize,
    /// Switch start (spawn or SIGTERM; for the floor, the moment a switch
    /// would start) to the reply of the first ALLOC the new process (the
    /// floor: the steady one) served, ms.
    pub first_alloc_ms: f64,
    /// That ALLOC's own round trip, ms.
    pub first_alloc_call_ms: f64,
    /// It came from the clean pool (`regions_pooled` + 1, no fresh region).
    pub first_alloc_warm: bool,
    /// Switch start to as many ALLOCs as the old pool held served
    /// (the first one's included), ms.
    pub pool_served_ms: f64,
    /// Every one of them came from the clean pool.
    pub pool_served_warm: bool,
    /// Clean pool bytes before the switch.
    pub pool_clean_bytes_before: u64,
    /// Clean pool bytes the new process had when the first ALLOC was sent.
    pub pool_clean_bytes_at_first_alloc: u64,
    /// Switch start to the old process's exit, ms; `null` with no switch.
    pub old_exit_ms: Option<f64>,
    /// The old process exited with status 0; `null` with no switch.
    pub old_exit_ok: Option<bool>,
    /// Switch start to the end of the step (the ALLOCs served; for the
    /// floor at least the round's longer switch), ms: the clients ran
    /// this long plus the lead before and after.
    pub window_ms: f64,
    /// Longest stall any client saw, ms.
    pub max_stall_ms: f64,
    /// Of which on the tenants' connections, ms.
    pub tenant_max_stall_ms: f64,
    /// Requests that failed (error or connection lost).
    pub failed_requests: u64,
    /// New connections refused (nothing listening).
    pub refused_connections: u64,
    /// New connections tried.
    pub connect_attempts: u64,
    /// STATS requests sent by the pingers.
    pub requests: u64,
    /// Connections the pingers had to open again.
    pub reconnects: u64,
    /// The new process's `scrub.bytes`.
    pub scrub_bytes: u64,
    /// `counters.pages_detached` across the switch.
    pub pages_detached: u64,
    /// `counters.bytes_created` across the switch.
    pub bytes_created: u64,
    /// scrub + detached pages + created: bytes zeroed again.
    pub bytes_zeroed: u64,
    /// STATS `allocations.active` after the switch (the probe's included).
    pub allocations_active: u64,
    /// Tenant allocations the new process lists.
    pub allocations_known: usize,
    /// Tenant FREEs that succeeded.
    pub allocations_freeable: usize,
    /// Tenants whose memory read back what they wrote.
    pub tenant_memory_intact: usize,
}

/// Median and worst of a figure over the rounds.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Spread {
    /// Median.
    pub median: f64,
    /// Worst (largest).
    pub worst: f64,
}

impl Spread {
    fn of(rounds: &[ModeRound], f: impl Fn(&ModeRound) -> f64) -> Self {
        let v: Vec<f64> = rounds.iter().map(f).collect();
        Self {
            median: crate::stats::median(&v),
            worst: v.iter().copied().fold(0.0, f64::max),
        }
    }

    /// `None` unless every round has the figure.
    fn of_all(rounds: &[ModeRound], f: impl Fn(&ModeRound) -> Option<f64>) -> Option<Self> {
        let v: Option<Vec<f64>> = rounds.iter().map(f).collect();
        v.filter(|v| !v.is_empty()).map(|v| Self {
            median: crate::stats::median(&v),
            worst: v.iter().copied().fold(0.0, f64::max),
        })
    }
}

/// One mode over all rounds.
#[derive(Debug, Clone, Serialize)]
pub struct ModeSummary {
    /// `takeover`, `stop-start` or `floor`.
    pub mode: &'static str,
    /// See [`ModeRound::first_alloc_ms`].
    pub first_alloc_ms: Spread,
    /// Rounds whose first ALLOC came from the clean pool.
    pub first_alloc_warm_rounds: usize,
    /// See [`ModeRound::pool_served_ms`].
    pub pool_served_ms: Spread,
    /// Rounds whose ALLOCs of the old pool's size all came from the pool.
    pub pool_served_warm_rounds: usize,
    /// Fewest clean pool bytes the new process had at its first ALLOC.
    pub pool_clean_bytes_at_first_alloc_min: u64,
    /// See [`ModeRound::old_exit_ms`]; `null` with no switch.
    pub old_exit_ms: Option<Spread>,
    /// See [`ModeRound::window_ms`].
    pub window_ms: Spread,
    /// See [`ModeRound::max_stall_ms`].
    pub max_stall_ms: Spread,
    /// Summed over the rounds.
    pub failed_requests: u64,
    /// Summed over the rounds.
    pub refused_connections: u64,
    /// Summed over the rounds.
    pub connect_attempts: u64,
    /// Summed over the rounds.
    pub reconnects: u64,
    /// See [`ModeRound::bytes_zeroed`].
    pub bytes_zeroed: Spread,
    /// Fewest over the rounds.
    pub allocations_known_min: usize,
    /// Fewest over the rounds.
    pub allocations_freeable_min: usize,
    /// Fewest over the rounds.
    pub tenant_memory_intact_min: usize,
    /// Every round.
    pub rounds: Vec<ModeRound>,
}

impl ModeSummary {
    fn of(mode: &'static str, rounds: Vec<ModeRound>) -> Self {
        let min = |f: fn(&ModeRound) -> usize| rounds.iter().map(f).min().unwrap_or(0);
        let sum = |f: fn(&ModeRound) -> u64| rounds.iter().map(f).sum();
        Self {
            mode,
            first_alloc_ms: Spread::of(&rounds, |r| r.first_alloc_ms),
            first_alloc_warm_rounds: rounds.iter().filter(|r| r.first_alloc_warm).count(),
            pool_served_ms: Spread::of(&rounds, |r| r.pool_served_ms),
            pool_served_warm_rounds: rounds.iter().filter(|r| r.pool_served_warm).count(),
            pool_clean_bytes_at_first_alloc_min: rounds
                .iter()
                .map(|r| r.pool_clean_bytes_at_first_alloc)
                .min()
                .unwrap_or(0),
            old_exit_ms: Spread::of_all(&rounds, |r| r.old_exit_ms),
            window_ms: Spread::of(&rounds, |r| r.window_ms),
            max_stall_ms: Spread::of(&rounds, |r| r.max_stall_ms),
            failed_requests: sum(|r| r.failed_requests),
            refused_connections: sum(|r| r.refused_connections),
            connect_attempts: sum(|r| r.connect_attempts),
            reconnects: sum(|r| r.reconnects),
            bytes_zeroed: Spread::of(&rounds, |r| r.bytes_zeroed as f64),
            allocations_known_min: min(|r| r.allocations_known),
            allocations_freeable_min: min(|r| r.allocations_freeable),
            tenant_memory_intact_min: min(|r| r.tenant_memory_intact),
            rounds,
        }
    }
}

/// One switch against no switch (the floor): its time over the floor's.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct OverFloor {
    /// Median time to the first ALLOC served over the floor's median.
    pub first_alloc: f64,
    /// Median time to the old pool's size served over the floor's median.
    pub pool_served: f64,
    /// Worst client stall over the floor's worst.
    pub max_stall: f64,
}

impl OverFloor {
    fn of(m: &ModeSummary, floor: &ModeSummary) -> Self {
        let ratio = crate::stats::ratio;
        Self {
            first_alloc: ratio(m.first_alloc_ms.median, floor.first_alloc_ms.median),
            pool_served: ratio(m.pool_served_ms.median, floor.pool_served_ms.median),
            max_stall: ratio(m.max_stall_ms.worst, floor.max_stall_ms.worst),
        }
    }
}

/// Takeover against stop-start, and both against the floor.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Ratios {
    /// Stop-start's median time to the first ALLOC over takeover's (x
    /// sooner).
    pub first_alloc_speedup: f64,
    /// The same for the worst round.
    pub first_alloc_worst_speedup: f64,
    /// Stop-start's median time to the old pool's size served over
    /// takeover's.
    pub pool_served_speedup: f64,
    /// Takeover's median bytes zeroed over stop-start's (0: none).
    pub bytes_zeroed_ratio: f64,
    /// Takeover's worst stall over stop-start's.
    pub stall_ratio: f64,
    /// Takeover over the floor (x the time with no switch).
    pub takeover_over_floor: OverFloor,
    /// Stop-start over the floor.
    pub stop_start_over_floor: OverFloor,
}

/// One of the expectations, and whether the run met it.
#[derive(Debug, Clone, Serialize)]
pub struct Expectation {
    /// What.
    pub what: &'static str,
    /// What the issue expects.
    pub expected: String,
    /// What takeover did (worst round).
    pub measured: String,
    /// Met in every round.
    pub met: bool,
}

/// The whole run.
#[derive(Debug, Clone, Serialize)]
pub struct TakeoverReport {
    /// `2M` or `1G`.
    pub page_size: String,
    /// Clean pool before each switch.
    pub pool_bytes: u64,
    /// Pool regions (each `alloc_bytes`).
    pub pool_regions: u64,
    /// Running allocations.
    pub allocations: usize,
    /// Bytes per allocation.
    pub alloc_bytes: u64,
    /// Connections that only send STATS.
    pub idle_clients: usize,
    /// Rounds (each ran both modes).
    pub rounds: usize,
    /// `hugemem serve --takeover`.
    pub takeover: ModeSummary,
    /// SIGTERM and a fresh `hugemem serve`: the baseline.
    pub stop_start: ModeSummary,
    /// No switch, the same setup and clients on the steady daemon: the
    /// floor.
    pub floor: ModeSummary,
    /// Takeover against the baseline.
    pub ratios: Ratios,
    /// The expectations for takeover.
    pub expectations: Vec<Expectation>,
}

impl TakeoverReport {
    pub(super) fn new(
        cfg: &TakeoverConfig,
        takeover: Vec<ModeRound>,
        stop_start: Vec<ModeRound>,
        floor: Vec<ModeRound>,
    ) -> Self {
        let t = ModeSummary::of("takeover", takeover);
        let s = ModeSummary::of("stop-start", stop_start);
        let floor = ModeSummary::of("floor", floor);
        let ratio = crate::stats::ratio;
        let ratios = Ratios {
            first_alloc_speedup: ratio(s.first_alloc_ms.median, t.first_alloc_ms.median),
            first_alloc_worst_speedup: ratio(s.first_alloc_ms.worst, t.first_alloc_ms.worst),
            pool_served_speedup: ratio(s.pool_served_ms.median, t.pool_served_ms.median),
            bytes_zeroed_ratio: ratio(t.bytes_zeroed.median, s.bytes_zeroed.median),
            stall_ratio: ratio(t.max_stall_ms.worst, s.max_stall_ms.worst),
            takeover_over_floor: OverFloor::of(&t, &floor),
            stop_start_over_floor: OverFloor::of(&s, &floor),
        };
        let m = cfg.allocations;
        let rounds = t.rounds.len();
        let expectations = vec![
            Expectation {
                what: "bytes re-zeroed",
                expected: "0".into(),
                measured: format_size(t.bytes_zeroed.worst as u64),
                met: t.bytes_zeroed.worst == 0.0,
            },
            Expectation {
                what: "allocations still known",
                expected: format!("{m} of {m}"),
                measured: format!("{} of {m}", t.allocations_known_min),
                met: t.allocations_known_min == m,
            },
            Expectation {
                what: "allocations free-able",
                expected: format!("{m} of {m}"),
                measured: format!("{} of {m}", t.allocations_freeable_min),
                met: t.allocations_freeable_min == m,
            },
            Expectation {
                what: "first ALLOC after the switch served warm from the pool",
                expected: format!("{rounds} of {rounds} rounds"),
                measured: format!("{} of {rounds} rounds", t.first_alloc_warm_rounds),
                met: t.first_alloc_warm_rounds == rounds,
            },
            Expectation {
                what: "longest client stall",
                expected: "< 100 ms".into(),
                measured: format!("{:.1} ms", t.max_stall_ms.worst),
                met: t.max_stall_ms.worst < 100.0,
            },
            Expectation {
                what: "refused connections",
                expected: "0".into(),
                measured: t.refused_connections.to_string(),
                met: t.refused_connections == 0,
            },
            Expectation {
                what: "failed requests",
                expected: "0".into(),
                measured: t.failed_requests.to_string(),
                met: t.failed_requests == 0,
            },
        ];
        Self {
            page_size: cfg.page_size.to_string(),
            pool_bytes: cfg.pool_bytes,
            pool_regions: cfg.pool_bytes / cfg.alloc_bytes.max(1),
            allocations: m,
            alloc_bytes: cfg.alloc_bytes,
            idle_clients: cfg.idle_clients,
            rounds,
            takeover: t,
            stop_start: s,
            floor,
            ratios,
            expectations,
        }
    }
}
