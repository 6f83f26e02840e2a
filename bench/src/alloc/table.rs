//! `hugemem bench alloc`'s report as a table for operators.

use guest_mem::size::format_size;

use super::AllocBenchReport;

impl AllocBenchReport {
    /// A human-readable table.
    pub fn to_table(&self) -> String {
        use std::fmt::Write;
        let mut t = String::new();
        let _ = writeln!(
            t,
            "hugemem bench alloc: {} on {} pages, {} CPUs, {} node(s), best of {}",
            format_size(self.size_bytes),
            self.page_size,
            self.cpus,
            self.nodes,
            self.reps
        );
        if let Some(n) = &self.note {
            let _ = writeln!(t, "  note: {n}");
        }
        let _ = writeln!(t, "  {:<44} {:>10} {:>10}", "", "best s", "median s");
        let row = |t: &mut String, name: &str, best: f64, median: f64, extra: String| {
            let _ = writeln!(t, "  {name:<44} {best:>10.4} {median:>10.4}  {extra}");
        };
        let m = &self.medians;
        row(
            &mut t,
            "fresh eager (daemon-less, node-local)",
            self.fresh_eager_s,
            m.fresh_eager_s,
            format!("{:.2} GB/s", self.fresh_eager_gbps),
        );
        row(
            &mut t,
            "fresh eager via the daemon",
            self.fresh_eager_daemon_s,
            m.fresh_eager_daemon_s,
            String::new(),
        );
        row(
            &mut t,
            "FREE -> pool clean (scrub)",
            self.free_to_clean_s,
            m.free_to_clean_s,
            format!("{:.3} CPU-s/GiB", self.scrub_cpu_s_per_gib),
        );
        row(
            &mut t,
            "pooled eager (clean pool hand-out)",
            self.pooled_eager_s,
            m.pooled_eager_s,
            String::new(),
        );
        row(
            &mut t,
            &format!(
                "cloud-hypervisor style ({} thread(s))",
                self.cloud_hypervisor_style_threads
            ),
            self.cloud_hypervisor_style_s,
            m.cloud_hypervisor_style_s,
            format!("{:.2} GB/s", self.cloud_hypervisor_style_gbps),
        );
        let r = &self.ratios;
        let _ = writeln!(
            t,
            "  ratios: cloud-hypervisor style / fresh eager = {:.2}",
            r.cloud_hypervisor_style_over_fresh_eager
        );
        let _ = writeln!(
            t,
            "          cloud-hypervisor style / pooled eager = {:.0}",
            r.cloud_hypervisor_style_over_pooled_eager
        );
        let _ = writeln!(
            t,
            "          fresh via daemon / pooled eager = {:.0}",
            r.fresh_eager_daemon_over_pooled_eager
        );
        let _ = writeln!(
            t,
            "          fresh via daemon / fresh daemon-less = {:.2}",
            r.fresh_eager_daemon_over_fresh_eager
        );
        if !self.scaling.is_empty() {
            let _ = writeln!(
                t,
                "  fresh eager populate by node-local workers (best / median s, GB/s, vs first):"
            );
            for p in &self.scaling {
                let _ = writeln!(
                    t,
                    "    {:>3} worker(s) {:>10.4} {:>10.4}  {:>6.2} GB/s  {:.2}x",
                    p.threads, p.best_s, p.median_s, p.gbps, p.speedup
                );
            }
        }
        t
    }
}
