//! `hugemem bench vmstart`'s report as a text table and as JSON.

use serde_json::Value;

use crate::vmstart::{ScenarioReport, VmstartReport};

impl ScenarioReport {
    /// A scenario's figures from its guest's run, which began `ready_ms`
    /// after the ALLOC was sent (no fault figures, nothing re-cleared).
    pub(crate) fn from_run(
        name: &'static str,
        flags: String,
        alloc_ms: f64,
        ready_ms: f64,
        run: &microguest::RunReport,
    ) -> Self {
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        Self {
            name,
            flags,
            alloc_ms,
            ready_ms,
            first_instruction_ms: ready_ms + ms(run.setup) + ms(run.first_instruction),
            all_touched_ms: ready_ms + ms(run.setup) + ms(run.all_touched),
            all_touched_vcpu_cpu_ms: ms(run.all_touched_vcpu_cpu),
            vm_setup_ms: ms(run.setup),
            kvm_exits: run.exits,
            saw_nonzero: run.saw_nonzero,
            faults: None,
            recleared: None,
        }
    }
}

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
            "{:<12} {:>6} {:>9} {:>9} {:>13} {:>12} {:>11} {:>8} {:>9} {:>9}\n",
            "scenario",
            "flags",
            "alloc ms",
            "ready ms",
            "first insn ms",
            "all pages ms",
            "vCPU cpu ms",
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
                "{:<12} {:>6} {:>9.1} {:>9.1} {:>13.1} {:>12.1} {:>11.1} {:>8} {:>9} {:>9}\n",
                s.name,
                s.flags,
                s.alloc_ms,
                s.ready_ms,
                s.first_instruction_ms,
                s.all_touched_ms,
                s.all_touched_vcpu_cpu_ms,
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
