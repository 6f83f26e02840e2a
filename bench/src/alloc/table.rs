//! `hugemem bench alloc`'s report as a table for operators.

use guest_mem::size::format_size;

use super::{AllocBenchReport, HandOut};

/// "resident 2G, holes 0" of a hand-out.
pub(super) fn held(h: &HandOut) -> String {
    format!(
        "resident {}, holes {}",
        format_size(h.resident_bytes),
        format_size(h.hole_bytes)
    )
}

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
            "pooled eager (ALLOC right after clean)",
            self.pooled_eager_s,
            m.pooled_eager_s,
            held(&self.pooled_eager),
        );
        row(
            &mut t,
            "pooled resident (refaulted before ALLOC)",
            self.pooled_resident_s,
            m.pooled_resident_s,
            held(&self.pooled_resident),
        );
        row(
            &mut t,
            "  ... every page touched (1 thread)",
            self.pooled_resident_touched_s,
            m.pooled_resident_touched_s,
            String::new(),
        );
        row(
            &mut t,
            "pooled with holes (refault_ahead = false)",
            self.pooled_holes_s,
            m.pooled_holes_s,
            held(&self.pooled_holes),
        );
        row(
            &mut t,
            "  ... every page touched (1 thread)",
            self.pooled_holes_touched_s,
            m.pooled_holes_touched_s,
            format!(
                "{:.2}x the kernel's zeroing on 1 thread",
                self.ratios.pooled_holes_touched_over_kernel_zeroing
            ),
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
        self.limits_and_ratios(&mut t);
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

    /// The limits measured in the same run, and every ratio.
    fn limits_and_ratios(&self, t: &mut String) {
        use std::fmt::Write;
        let l = &self.limits;
        let _ = writeln!(
            t,
            "  limits (same run): kernel fault-time zeroing {:.4} s / {:.2} GB/s on {} thread, {:.4} s / {:.2} GB/s on {} CPUs; memory bandwidth ({} clear, all CPUs) {:.2} GB/s",
            l.kernel_zeroing_touch_threads_s,
            l.kernel_zeroing_touch_threads_gbps,
            l.touch_threads,
            l.kernel_zeroing_all_cpus_s,
            l.kernel_zeroing_all_cpus_gbps,
            l.all_cpus,
            l.memory_bandwidth_kernel,
            l.memory_bandwidth_gbps
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
        let _ = writeln!(
            t,
            "          fresh via daemon / pooled resident = {:.0}",
            r.fresh_eager_daemon_over_pooled_resident
        );
        let _ = writeln!(
            t,
            "          cloud-hypervisor style / pooled resident, touched = {:.2}; / pooled with holes, touched = {:.2}",
            r.cloud_hypervisor_style_over_pooled_resident_touched,
            r.cloud_hypervisor_style_over_pooled_holes_touched
        );
        let _ = writeln!(
            t,
            "          fresh eager / kernel zeroing on all CPUs = {:.2}; cloud-hypervisor style / kernel zeroing with its threads = {:.2}",
            r.fresh_eager_over_kernel_zeroing,
            r.cloud_hypervisor_style_over_kernel_zeroing
        );
    }
}
