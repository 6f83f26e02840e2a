//! What the alloc bench is asked to measure.

use guest_mem::PageSize;

/// What to measure.
#[derive(Debug, Clone)]
pub struct AllocBenchConfig {
    /// VM size.
    pub size: u64,
    /// Repetitions; the best of each is reported.
    pub reps: usize,
    /// Page size; `None` = 1 GiB, then 2 MiB (said out loud).
    pub page_size: Option<PageSize>,
    /// Worker counts for the fresh-populate scaling run; empty = 1..=all CPUs.
    pub threads: Vec<usize>,
}
