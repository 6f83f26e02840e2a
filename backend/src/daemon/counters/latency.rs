//! A fixed-bucket latency histogram, lock-free like the counters: what the
//! Prometheus endpoint exports for ALLOC latency quantiles
//! (`hugemem_alloc_duration_seconds`, `histogram_quantile` in a dashboard).
//!
//! The buckets span what an ALLOC can take: a hand-out from the clean pool
//! (well under a millisecond), a fresh populate (a few hundred ms per GiB
//! with one thread), and a wait for pages (`pool.max_alloc_wait_ms`, 60 s).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the buckets, seconds; one more bucket (+Inf) follows.
pub const ALLOC_BUCKETS_S: [f64; 16] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
];

/// Counts per bucket (not cumulative) and the sum of all samples.
#[derive(Debug, Default)]
pub struct Latency {
    counts: [AtomicU64; ALLOC_BUCKETS_S.len() + 1],
    sum_ns: AtomicU64,
}

impl Latency {
    /// Counts one sample.
    pub fn record(&self, d: Duration) {
        let s = d.as_secs_f64();
        let i = ALLOC_BUCKETS_S
            .iter()
            .position(|&bound| s <= bound)
            .unwrap_or(ALLOC_BUCKETS_S.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// Sum (seconds), count, and each bucket's upper bound with its own
    /// count (the last bound is +Inf), as the exposition encoder takes them.
    pub fn snapshot(&self) -> (f64, u64, Vec<(f64, u64)>) {
        let buckets: Vec<(f64, u64)> = ALLOC_BUCKETS_S
            .iter()
            .copied()
            .chain(std::iter::once(f64::INFINITY))
            .zip(self.counts.iter().map(|c| c.load(Ordering::Relaxed)))
            .collect();
        let count = buckets.iter().map(|(_, n)| n).sum();
        let sum = Duration::from_nanos(self.sum_ns.load(Ordering::Relaxed)).as_secs_f64();
        (sum, count, buckets)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_land_in_the_first_bucket_that_holds_them() {
        let h = Latency::default();
        h.record(Duration::from_micros(200)); // ≤ 0.5 ms
        h.record(Duration::from_micros(500)); // on the bound: ≤ 0.5 ms
        h.record(Duration::from_millis(30)); // ≤ 50 ms
        h.record(Duration::from_secs(100)); // +Inf
        let (sum, count, buckets) = h.snapshot();
        assert_eq!(count, 4);
        assert!((sum - 100.0307).abs() < 1e-9, "{sum}");
        assert_eq!(buckets.len(), ALLOC_BUCKETS_S.len() + 1);
        assert_eq!(buckets[0], (0.0005, 2));
        let at = |bound: f64| buckets.iter().find(|(b, _)| *b == bound).map(|(_, n)| *n);
        assert_eq!(at(0.05), Some(1));
        assert_eq!(buckets.last(), Some(&(f64::INFINITY, 1)));
        assert_eq!(buckets.iter().map(|(_, n)| n).sum::<u64>(), 4);
    }
}
