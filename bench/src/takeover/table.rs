//! `bench takeover`'s text table: takeover, stop-start and the floor (no
//! switch) side by side, the ratios, and the expectations.

use guest_mem::size::format_size;

use super::report::{ModeSummary, Spread, TakeoverReport};

/// One figure of each mode, in a row.
type Cell<'a> = &'a dyn Fn(&ModeSummary) -> String;

impl TakeoverReport {
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
            "{:<44} {:>22} {:>22} {:>22}\n",
            "", "takeover", "stop-start (baseline)", "no switch (floor)"
        );
        out += &self.rows();
        out += &self.ratio_lines();
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

    fn rows(&self) -> String {
        let mut out = String::new();
        let mut row = |label: &str, f: Cell| {
            out += &format!(
                "{label:<44} {:>22} {:>22} {:>22}\n",
                f(&self.takeover),
                f(&self.stop_start),
                f(&self.floor)
            );
        };
        let spread = |s: Spread, d: usize| format!("{:.d$} ({:.d$})", s.median, s.worst);
        let rounds = |n: usize, m: &ModeSummary| format!("{n}/{}", m.rounds.len());
        row("switch -> first ALLOC served, ms", &|m| {
            spread(m.first_alloc_ms, 1)
        });
        row("first ALLOC from the clean pool (rounds)", &|m| {
            rounds(m.first_alloc_warm_rounds, m)
        });
        row("switch -> old pool's size served, ms", &|m| {
            spread(m.pool_served_ms, 1)
        });
        row("... all from the clean pool (rounds)", &|m| {
            rounds(m.pool_served_warm_rounds, m)
        });
        row("clean pool at the first ALLOC (fewest)", &|m| {
            format_size(m.pool_clean_bytes_at_first_alloc_min)
        });
        row("switch -> old process exited, ms", &|m| {
            m.old_exit_ms.map_or_else(|| "-".into(), |s| spread(s, 1))
        });
        row("longest client stall, ms", &|m| spread(m.max_stall_ms, 1));
        row("client window after the lead, ms", &|m| {
            spread(m.window_ms, 1)
        });
        row("failed requests (all rounds)", &|m| {
            m.failed_requests.to_string()
        });
        row("refused connections / tried (all rounds)", &|m| {
            format!("{} / {}", m.refused_connections, m.connect_attempts)
        });
        row("bytes zeroed again (floor: limit 0)", &|m| {
            format!(
                "{} ({})",
                format_size(m.bytes_zeroed.median as u64),
                format_size(m.bytes_zeroed.worst as u64)
            )
        });
        let n = self.allocations;
        row("allocations still known (fewest)", &|m| {
            format!("{}/{n}", m.allocations_known_min)
        });
        row("allocations free-able (fewest)", &|m| {
            format!("{}/{n}", m.allocations_freeable_min)
        });
        row("tenant memory intact (fewest)", &|m| {
            format!("{}/{n}", m.tenant_memory_intact_min)
        });
        out
    }

    fn ratio_lines(&self) -> String {
        let r = &self.ratios;
        let (t, s) = (&r.takeover_over_floor, &r.stop_start_over_floor);
        format!(
            "\nfirst ALLOC {:.2}x sooner with takeover (worst round {:.2}x); old pool's size served {:.2}x sooner; bytes zeroed takeover / stop-start: {:.3}\n\
             over no switch (floor), takeover / stop-start: first ALLOC {:.2}x / {:.2}x, old pool's size served {:.2}x / {:.2}x, longest stall {:.2}x / {:.2}x\n",
            r.first_alloc_speedup,
            r.first_alloc_worst_speedup,
            r.pool_served_speedup,
            r.bytes_zeroed_ratio,
            t.first_alloc,
            s.first_alloc,
            t.pool_served,
            s.pool_served,
            t.max_stall,
            s.max_stall
        )
    }
}
