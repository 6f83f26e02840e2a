//! The demo's report: its figures, and the human timeline.

use guest_mem::size::format_size;
use serde::Serialize;

/// One micro-guest run.
#[derive(Debug, Clone, Serialize)]
pub struct GuestFigures {
    /// VM creation and memory-slot registration, ms.
    pub vm_setup_ms: f64,
    /// vCPU start to the guest's first instruction, ms.
    pub first_instruction_ms: f64,
    /// ALLOC request sent to the guest's first instruction (ALLOC, mapping,
    /// VM setup, vCPU start), ms.
    pub alloc_to_first_instruction_ms: f64,
    /// vCPU start to all pages touched, ms.
    pub all_touched_ms: f64,
    /// Pages (2 MiB strides) the guest read and marked.
    pub pages_touched: u64,
    /// Whether any read returned non-zero (must be false).
    pub saw_nonzero: bool,
}

/// Pool state of one (node, page size).
#[derive(Debug, Clone, Serialize)]
pub struct PoolFigures {
    /// Node.
    pub node: u64,
    /// Page size.
    pub page_size: String,
    /// Clean bytes ready to hand out.
    pub clean_bytes: u64,
    /// Dirty bytes waiting for the scrubbers.
    pub dirty_bytes: u64,
    /// Bytes held back while another process still holds the fd.
    pub quarantined_bytes: u64,
    /// Bytes handed out.
    pub in_use_bytes: u64,
}

/// The demo's report.
#[derive(Debug, Clone, Serialize)]
pub struct DemoReport {
    /// VM size used.
    pub size_bytes: u64,
    /// Page size used.
    pub page_size: String,
    /// What was reserved, and every fallback, in words.
    pub notes: Vec<String>,
    /// Daemon start (socket listening), seconds.
    pub daemon_start_s: f64,
    /// The warm-up before anything is timed: `size` bytes of the same page
    /// size populated (`MADV_POPULATE_WRITE`) and freed once, seconds. On a
    /// virtual machine whose host backs never-touched memory lazily this is
    /// the outer host's first touch (docs/platform.md#first-touch), which
    /// the fresh ALLOC below no longer pays.
    pub host_first_touch_s: f64,
    /// The limit of the fresh ALLOC: the kernel zeroing `size` bytes of
    /// the same page size at fault time on every CPU (`cpus` threads, each
    /// `MADV_POPULATE_WRITE` of its share of a fresh memfd, no daemon),
    /// after the warm-up, seconds.
    pub kernel_zeroing_all_cpus_s: f64,
    /// CPUs of that figure.
    pub cpus: usize,
    /// The guests' floor: the micro-guest on a hugetlb memfd of the same
    /// size and page size populated before its clock, mapped the same way,
    /// no daemon (`None`: no KVM). Its "ALLOC sent" is the mapping's start.
    pub guest_floor: Option<GuestFigures>,
    /// First ALLOC (fresh pages, populated and zeroed by the kernel), after
    /// the warm-up, seconds.
    pub alloc_fresh_s: f64,
    /// Population/clearing rate of the first ALLOC, GB/s (10^9).
    pub alloc_fresh_gbps: f64,
    /// Micro-guest on the fresh memory (`None`: no KVM).
    pub guest_fresh: Option<GuestFigures>,
    /// FREE to the pool showing the region clean, seconds.
    pub free_to_clean_s: f64,
    /// Bytes the scrubbers cleared for it.
    pub scrubbed_bytes: u64,
    /// Bytes punched and refaulted kernel-zeroed before reuse
    /// (`pool.detach_pages`, the default; the region is then clean without
    /// a scrub).
    pub detached_bytes: u64,
    /// The scrubbers' rate (bytes over time inside clearing kernels), GB/s.
    pub scrub_gbps: f64,
    /// Second ALLOC (from the clean pool, once the freed region is clean and
    /// refaulted), seconds.
    pub alloc_pooled_s: f64,
    /// Bytes of the second ALLOC's fds backed by pages when they arrived
    /// (`fstat` `st_blocks`): a resident hand-out has all of them.
    pub alloc_pooled_resident_bytes: u64,
    /// Bytes of the second ALLOC's fds that were holes when they arrived
    /// (each zeroed by the kernel at the guest's first touch).
    pub alloc_pooled_hole_bytes: u64,
    /// Whether the second ALLOC was served from the pool (the daemon's counters).
    pub alloc_pooled_from_pool: bool,
    /// `alloc_fresh_s / alloc_pooled_s`.
    pub pooled_speedup: f64,
    /// Micro-guest on the pooled memory: it must read zeros where guest #1 wrote.
    pub guest_pooled: Option<GuestFigures>,
    /// Why the guest did not run, when it did not.
    pub guest_skipped: Option<String>,
    /// Pool state at the end (after the second FREE).
    pub pool_end: Vec<PoolFigures>,
    /// Whole demo, seconds.
    pub total_s: f64,
}

impl DemoReport {
    /// What the pooled ALLOC handed out, in words.
    pub fn handed_out(&self) -> String {
        if self.alloc_pooled_hole_bytes == 0 {
            format!(
                "resident ({} backed, no holes)",
                format_size(self.alloc_pooled_resident_bytes)
            )
        } else {
            format!(
                "with holes ({} backed, {} holes the guest's first touch faults in)",
                format_size(self.alloc_pooled_resident_bytes),
                format_size(self.alloc_pooled_hole_bytes)
            )
        }
    }

    /// One guest's two rows of the timeline (or why it did not run);
    /// `since`: what its clock started with.
    fn guest_rows(&self, s: &mut String, label: &str, since: &str, g: &Option<GuestFigures>) {
        match g {
            Some(g) => {
                row(
                    s,
                    &format!("{label}: first instruction"),
                    format!(
                        "{:>10.2} ms   after vCPU start (VM setup {:.2} ms; {:.1} ms after {since})",
                        g.first_instruction_ms, g.vm_setup_ms, g.alloc_to_first_instruction_ms
                    ),
                );
                row(
                    s,
                    &format!("{label}: all pages read"),
                    format!(
                        "{:>10.2} ms   {} x 2M pages, {}",
                        g.all_touched_ms,
                        g.pages_touched,
                        if g.saw_nonzero {
                            "NON-ZERO memory seen"
                        } else {
                            "all zero"
                        }
                    ),
                );
            }
            None => row(
                s,
                label,
                format!(
                    "{:>10}      {}",
                    "-",
                    self.guest_skipped.as_deref().unwrap_or("skipped")
                ),
            ),
        }
    }

    /// The human timeline.
    pub fn to_table(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "hugemem demo: a {} VM on {} pages",
            format_size(self.size_bytes),
            self.page_size
        );
        for n in &self.notes {
            let _ = writeln!(s, "  note: {n}");
        }
        row(
            &mut s,
            "daemon start",
            format!("{:>10.1} ms", self.daemon_start_s * 1e3),
        );
        row(
            &mut s,
            "warm-up: the host's first touch",
            format!(
                "{:>10.1} ms   {} populated and freed once before timing (docs/platform.md#first-touch)",
                self.host_first_touch_s * 1e3,
                format_size(self.size_bytes)
            ),
        );
        row(
            &mut s,
            "ALLOC, fresh pages",
            format!(
                "{:>10.1} ms   {:.2} GB/s populated and zeroed by the kernel (after the warm-up)",
                self.alloc_fresh_s * 1e3,
                self.alloc_fresh_gbps
            ),
        );
        row(
            &mut s,
            "the fresh ALLOC's limit",
            format!(
                "{:>10.1} ms   the kernel zeroing {} on all {} CPUs, no daemon",
                self.kernel_zeroing_all_cpus_s * 1e3,
                format_size(self.size_bytes),
                self.cpus
            ),
        );
        self.guest_rows(
            &mut s,
            "the floor (resident memfd)",
            "its mapping began",
            &self.guest_floor,
        );
        self.guest_rows(&mut s, "guest #1", "ALLOC was sent", &self.guest_fresh);
        row(
            &mut s,
            "FREE -> pool clean and resident",
            format!(
                "{:>10.1} ms   {} detached (kernel-zeroed), {} scrubbed at {:.2} GB/s",
                self.free_to_clean_s * 1e3,
                format_size(self.detached_bytes),
                format_size(self.scrubbed_bytes),
                self.scrub_gbps
            ),
        );
        row(
            &mut s,
            "ALLOC, from the clean pool",
            format!(
                "{:>10.3} ms   {}, {:.0}x the fresh ALLOC's {:.1} ms{}",
                self.alloc_pooled_s * 1e3,
                self.handed_out(),
                self.pooled_speedup,
                self.alloc_fresh_s * 1e3,
                if self.alloc_pooled_from_pool {
                    ""
                } else {
                    " (NOT served from the pool)"
                }
            ),
        );
        self.guest_rows(&mut s, "guest #2", "ALLOC was sent", &self.guest_pooled);
        for p in &self.pool_end {
            row(
                &mut s,
                &format!("pool at the end, node {} {}", p.node, p.page_size),
                format!(
                    "clean {}, dirty {}, quarantined {}, in use {}",
                    format_size(p.clean_bytes),
                    format_size(p.dirty_bytes),
                    format_size(p.quarantined_bytes),
                    format_size(p.in_use_bytes)
                ),
            );
        }
        row(&mut s, "total", format!("{:>10.1} ms", self.total_s * 1e3));
        s
    }
}

/// One row of the timeline: `what` padded, then `value`.
fn row(s: &mut String, what: &str, value: String) {
    use std::fmt::Write;
    let _ = writeln!(s, "  {what:<34} {value}");
}
