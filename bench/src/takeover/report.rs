//! `bench takeover`'s report: per round and mode, the summary of each mode,
//! the ratios of takeover against stop-start, and the expectations
//! checked against what was measured.

use serde::Serialize;

use super::TakeoverConfig;
use guest_mem::size::format_size;

/// One mode's figures in one round.
#[derive(Debug, Clone, Serialize)]
pub struct ModeRound {
    /// 1-based.
    pub round: usize,
    /// Switch start (spawn or SIGTERM) to the reply of the first ALLOC the
    /// new process served, ms.
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
    /// Switch start to the old process's exit, ms.
    pub old_exit_ms: f64,
    /// The old process exited with status 0.
    pub old_exit_ok: bool,
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
}

/// One mode over all rounds.
#[derive(Debug, Clone, Serialize)]
pub struct ModeSummary {
    /// `takeover` or `stop-start`.
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
    /// See [`ModeRound::old_exit_ms`].
    pub old_exit_ms: Spread,
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
            old_exit_ms: Spread::of(&rounds, |r| r.old_exit_ms),
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

/// Takeover against stop-start.
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
    ) -> Self {
        let t = ModeSummary::of("takeover", takeover);
        let s = ModeSummary::of("stop-start", stop_start);
        let ratio = crate::stats::ratio;
        let ratios = Ratios {
            first_alloc_speedup: ratio(s.first_alloc_ms.median, t.first_alloc_ms.median),
            first_alloc_worst_speedup: ratio(s.first_alloc_ms.worst, t.first_alloc_ms.worst),
            pool_served_speedup: ratio(s.pool_served_ms.median, t.pool_served_ms.median),
            bytes_zeroed_ratio: ratio(t.bytes_zeroed.median, s.bytes_zeroed.median),
            stall_ratio: ratio(t.max_stall_ms.worst, s.max_stall_ms.worst),
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
            ratios,
            expectations,
        }
    }

    /// The text table.
    pub fn to_table(&self) -> String {
        let mut out = format!(
            "bench takeover: {} clean pool ({} regions), {} x {} running, {} pages, {} idle clients, {} round(s); median (worst)\n\n",
            format_size(self.pool_bytes),
            self.pool_regions,
            self.allocations,
            format_size(self.alloc_bytes),
            self.page_size,
            self.idle_clients,
            self.rounds
        );
        out += &format!(
            "{:<44} {:>22} {:>22}\n",
            "", "takeover", "stop-start (baseline)"
        );
        let row = |label: &str, f: &dyn Fn(&ModeSummary) -> String| {
            format!(
                "{label:<44} {:>22} {:>22}\n",
                f(&self.takeover),
                f(&self.stop_start)
            )
        };
        let spread = |s: Spread, d: usize| format!("{:.d$} ({:.d$})", s.median, s.worst);
        out += &row("switch -> first ALLOC served, ms", &|m| {
            spread(m.first_alloc_ms, 1)
        });
        out += &row("first ALLOC from the clean pool (rounds)", &|m| {
            format!("{}/{}", m.first_alloc_warm_rounds, m.rounds.len())
        });
        out += &row("switch -> old pool's size served, ms", &|m| {
            spread(m.pool_served_ms, 1)
        });
        out += &row("... all from the clean pool (rounds)", &|m| {
            format!("{}/{}", m.pool_served_warm_rounds, m.rounds.len())
        });
        out += &row("clean pool at the first ALLOC (fewest)", &|m| {
            format_size(m.pool_clean_bytes_at_first_alloc_min)
        });
        out += &row("switch -> old process exited, ms", &|m| {
            spread(m.old_exit_ms, 1)
        });
        out += &row("longest client stall, ms", &|m| spread(m.max_stall_ms, 1));
        out += &row("failed requests (all rounds)", &|m| {
            m.failed_requests.to_string()
        });
        out += &row("refused connections / tried (all rounds)", &|m| {
            format!("{} / {}", m.refused_connections, m.connect_attempts)
        });
        out += &row("bytes zeroed again", &|m| {
            format!(
                "{} ({})",
                format_size(m.bytes_zeroed.median as u64),
                format_size(m.bytes_zeroed.worst as u64)
            )
        });
        let n = self.allocations;
        out += &row("allocations still known (fewest)", &|m| {
            format!("{}/{n}", m.allocations_known_min)
        });
        out += &row("allocations free-able (fewest)", &|m| {
            format!("{}/{n}", m.allocations_freeable_min)
        });
        out += &row("tenant memory intact (fewest)", &|m| {
            format!("{}/{n}", m.tenant_memory_intact_min)
        });
        out += &format!(
            "\nfirst ALLOC {:.2}x sooner with takeover (worst round {:.2}x); old pool's size served {:.2}x sooner; bytes zeroed takeover / stop-start: {:.3}\n",
            self.ratios.first_alloc_speedup,
            self.ratios.first_alloc_worst_speedup,
            self.ratios.pool_served_speedup,
            self.ratios.bytes_zeroed_ratio
        );
        for e in &self.expectations {
            out += &format!(
                "{} {}: expected {}, measured {}\n",
                if e.met { "met    " } else { "NOT MET" },
                e.what,
                e.expected,
                e.measured
            );
        }
        out
    }
}
