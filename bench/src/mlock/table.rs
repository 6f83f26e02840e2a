//! The mlock bench's text table: per backing and path the lock and unlock
//! times, the stalls, and the lock over the kernel's populate limit.

use super::{BackingFigures, BackingRatios, MlockBenchReport};
use guest_mem::size::format_size;

impl MlockBenchReport {
    /// A small table for people.
    pub fn to_table(&self) -> String {
        let mut out = format!(
            "hugemem bench mlock: {} per region, {} batches, best time / median worst stall of {} rep(s) \
             ({} CPUs, {} node(s), {} worker(s) per node)\n",
            format_size(self.size_bytes),
            self.chunk_bytes.map_or("default".to_string(), |c| format_size(c as u64)),
            self.reps,
            self.cpus,
            self.nodes,
            self.threads_per_node
        );
        out += "backing     path     lock s  unlock s  max stall ms (worst)  quiet lock s  unlock s  calls  lock / populate limit (quiet)\n";
        let mut backing = |name: &str, f: &BackingFigures, r: &BackingRatios| {
            let name = format!("{name} {}", f.page_size);
            out += &format!(
                "{name:<11} single  {:>7.3}  {:>8.3}  {:>12.1} ({:>6.1})  {:>12.3}  {:>8.3}  {:>5}  {:>6.2}x ({:.2}x)\n",
                f.single_lock_s,
                f.single_unlock_s,
                f.single_max_stall_ms,
                f.single_max_stall_worst_ms,
                f.single_lock_quiet_s,
                f.single_unlock_quiet_s,
                1,
                r.single_lock_over_limit,
                r.single_lock_quiet_over_limit
            );
            out += &format!(
                "{:<11} batched {:>7.3}  {:>8.3}  {:>12.1} ({:>6.1})  {:>12.3}  {:>8.3}  {:>5}  {:>6.2}x ({:.2}x)\n",
                "",
                f.batched_lock_s,
                f.batched_unlock_s,
                f.batched_max_stall_ms,
                f.batched_max_stall_worst_ms,
                f.batched_lock_quiet_s,
                f.batched_unlock_quiet_s,
                f.batched_calls,
                r.batched_lock_over_limit,
                r.batched_lock_quiet_over_limit
            );
            out += &format!(
                "{:<11} stall {:.1}x shorter, total time {:+.1}% ({:+.1}% quiet), idle probe {:.2} ms, \
                 populate limit {:.3} s: expectation {}\n",
                "",
                r.stall_reduction,
                r.total_time_overhead * 100.0,
                r.total_time_overhead_quiet * 100.0,
                f.idle_max_stall_ms,
                f.populate_limit_s,
                if r.meets_expectation { "met" } else { "NOT met" }
            );
        };
        backing("shmem", &self.shmem_4k, &self.ratios.shmem_4k);
        match (&self.hugetlb, &self.ratios.hugetlb) {
            (Some(f), Some(r)) => backing("hugetlb", f, r),
            _ => out += "hugetlb   not measured\n",
        }
        if let Some(note) = &self.hugetlb_note {
            out += &format!("note: {note}\n");
        }
        out
    }
}
