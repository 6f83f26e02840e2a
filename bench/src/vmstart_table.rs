//! `hugemem bench vmstart`'s report as a text table and as JSON.

use serde_json::Value;

use crate::vmstart::VmstartReport;

impl VmstartReport {
    /// A text table.
    pub fn to_table(&self) -> String {
        let mut out = format!(
            "vmstart: {} of {} pages; clearing kernel {} ({:.0} µs per page, {:.1} GB/s); prefault threads {}; kernel zeroing on 1 thread {:.1} ms, on {} CPUs {:.1} ms (the limits of lazy-fresh's touches without and with the fault helpers)\n",
            guest_mem::size::format_size(self.size),
            self.page_size,
            self.kernel,
            self.one_page_clear_us,
            self.clear_gbps,
            self.prefault_threads,
            self.kernel_zeroing_1_thread_ms,
            self.cpus,
            self.kernel_zeroing_all_cpus_ms
        );
        out.push_str(&format!(
            "{:<12} {:>6} {:>9} {:>9} {:>13} {:>12} {:>8} {:>9} {:>9}\n",
            "scenario",
            "flags",
            "alloc ms",
            "ready ms",
            "first insn ms",
            "all pages ms",
            "faults",
            "p50 µs",
            "p99 µs"
        ));
        for s in &self.scenarios {
            let (f, p50, p99) =
                s.faults
                    .as_ref()
                    .map_or(("-".into(), "-".into(), "-".into()), |f| {
                        (
                            f.faults.to_string(),
                            format!("{:.0}", f.p50_us),
                            format!("{:.0}", f.p99_us),
                        )
                    });
            out.push_str(&format!(
                "{:<12} {:>6} {:>9.1} {:>9.1} {:>13.1} {:>12.1} {:>8} {:>9} {:>9}\n",
                s.name,
                s.flags,
                s.alloc_ms,
                s.ready_ms,
                s.first_instruction_ms,
                s.all_touched_ms,
                f,
                p50,
                p99
            ));
        }
        for n in &self.notes {
            out.push_str(&format!("note: {n}\n"));
        }
        out
    }

    /// The report as JSON.
    pub fn to_json(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }
}
