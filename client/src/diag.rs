//! Small diagnostics helpers every part of the crate uses: an error's whole
//! chain on one line, and rate limits for log lines a peer can trigger in
//! a loop (one for the whole process, one per key such as a peer's uid).
//! A leaf module: it imports nothing of the crate.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The error and its sources, `: `-joined.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// Rate limiter for log lines a peer can trigger in a loop: at most one line
/// per period; `check` says how many were suppressed since the last one.
#[derive(Debug)]
pub struct RateLimit {
    last: Mutex<Option<Instant>>,
    suppressed: AtomicU64,
    every: Duration,
}

impl RateLimit {
    /// At most one line per `every`.
    pub const fn new(every: Duration) -> Self {
        Self {
            last: Mutex::new(None),
            suppressed: AtomicU64::new(0),
            every,
        }
    }

    /// `Some(suppressed)` when a line may be logged now.
    pub fn check(&self) -> Option<u64> {
        let mut last = self
            .last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = Instant::now();
        if last.is_some_and(|t| now.duration_since(t) < self.every) {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        *last = Some(now);
        Some(self.suppressed.swap(0, Ordering::Relaxed))
    }
}

/// [`RateLimit`] kept per key (a peer's uid), so that one key's flood does
/// not silence another key's lines. Each key has a bucket of `burst` lines
/// that refills by one line per `every`: a short burst (a VMM starting) is
/// logged whole, a flood gets one line per `every`. `check` says how many
/// of that key's lines were suppressed since its last one.
///
/// At most `max_keys` keys are remembered (keys come from peers: the map
/// must stay bounded whatever they send). A new key beyond that evicts the
/// key seen longest ago; suppressed lines it had not reported yet are added
/// to the next count `check` returns, for whichever key, so that lines
/// logged plus the counts returned always equal the calls made.
#[derive(Debug)]
pub struct KeyedRateLimit<K> {
    every: Duration,
    burst: u32,
    max_keys: usize,
    state: Mutex<Keyed<K>>,
}

#[derive(Debug)]
struct Keyed<K> {
    buckets: BTreeMap<K, Bucket>,
    /// Suppressed lines of evicted keys, not reported yet.
    evicted: u64,
}

/// One key's bucket.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    /// Lines that may be logged now.
    tokens: u32,
    /// When `tokens` was last brought up to date.
    refilled: Instant,
    /// When the key was last checked (eviction picks the oldest).
    seen: Instant,
    /// Lines suppressed since the last one let through.
    suppressed: u64,
}

impl Bucket {
    /// Adds the lines earned since `refilled`, at most `burst` in all.
    fn refill(&mut self, now: Instant, every: Duration, burst: u32) {
        let earned = match now
            .duration_since(self.refilled)
            .as_nanos()
            .checked_div(every.as_nanos())
        {
            Some(n) => u32::try_from(n).unwrap_or(u32::MAX),
            // A zero period: every line may be logged.
            None => burst,
        };
        self.tokens = self.tokens.saturating_add(earned).min(burst);
        if self.tokens == burst {
            self.refilled = now;
        } else {
            // Keep the part of a period already earned.
            self.refilled += every * earned;
        }
    }
}

impl<K: Ord + Copy> KeyedRateLimit<K> {
    /// At most `burst` lines (at least 1) per key at once, one more per
    /// `every`; at most `max_keys` keys (at least 1) remembered.
    pub const fn new(every: Duration, burst: u32, max_keys: usize) -> Self {
        Self {
            every,
            burst: if burst == 0 { 1 } else { burst },
            max_keys: if max_keys == 0 { 1 } else { max_keys },
            state: Mutex::new(Keyed {
                buckets: BTreeMap::new(),
                evicted: 0,
            }),
        }
    }

    /// `Some(suppressed)` when a line for `key` may be logged now.
    pub fn check(&self, key: K) -> Option<u64> {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Keyed { buckets, evicted } = &mut *state;
        let now = Instant::now();
        if let Some(b) = buckets.get_mut(&key) {
            b.seen = now;
            b.refill(now, self.every, self.burst);
            if b.tokens == 0 {
                b.suppressed += 1;
                return None;
            }
            b.tokens -= 1;
            return Some(std::mem::take(&mut b.suppressed) + std::mem::take(evicted));
        }
        if buckets.len() >= self.max_keys {
            let oldest = buckets.iter().min_by_key(|(_, b)| b.seen).map(|(k, _)| *k);
            if let Some(b) = oldest.and_then(|k| buckets.remove(&k)) {
                *evicted += b.suppressed;
            }
        }
        buckets.insert(
            key,
            Bucket {
                tokens: self.burst - 1,
                refilled: now,
                seen: now,
                suppressed: 0,
            },
        );
        Some(std::mem::take(evicted))
    }

    /// Keys remembered now (at most `max_keys`).
    pub fn keys(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .buckets
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_limit_suppresses_and_counts() {
        let r = RateLimit::new(Duration::from_secs(3600));
        assert_eq!(r.check(), Some(0));
        assert_eq!(r.check(), None);
        assert_eq!(r.check(), None);
        let r2 = RateLimit::new(Duration::ZERO);
        assert_eq!(r2.check(), Some(0));
        assert_eq!(r2.check(), Some(0));
    }

    #[test]
    fn keyed_rate_limit_keeps_each_key_apart() {
        let r = KeyedRateLimit::new(Duration::from_secs(3600), 2, 16);
        assert_eq!(r.check(1000), Some(0));
        assert_eq!(r.check(1000), Some(0));
        for _ in 0..5 {
            assert_eq!(r.check(1000), None);
        }
        // Another uid is not silenced by the first one's flood.
        assert_eq!(r.check(1001), Some(0));
        let every = KeyedRateLimit::new(Duration::ZERO, 1, 16);
        assert_eq!(every.check(7), Some(0));
        assert_eq!(every.check(7), Some(0));
    }

    #[test]
    fn keyed_rate_limit_reports_what_it_suppressed_once_a_line_is_earned() {
        let r = KeyedRateLimit::new(Duration::from_millis(30), 1, 16);
        assert_eq!(r.check(1), Some(0));
        assert_eq!(r.check(1), None);
        assert_eq!(r.check(1), None);
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(r.check(1), Some(2));
    }

    #[test]
    fn a_bucket_earns_one_line_per_period_up_to_its_burst() {
        let every = Duration::from_secs(1);
        let t0 = Instant::now();
        let mut b = Bucket {
            tokens: 0,
            refilled: t0,
            seen: t0,
            suppressed: 0,
        };
        b.refill(t0 + every / 2, every, 4);
        assert_eq!(b.tokens, 0);
        b.refill(t0 + every * 3 / 2, every, 4);
        assert_eq!((b.tokens, b.refilled), (1, t0 + every));
        // The half period already earned counts.
        b.refill(t0 + every * 2, every, 4);
        assert_eq!(b.tokens, 2);
        b.refill(t0 + every * 100, every, 4);
        assert_eq!((b.tokens, b.refilled), (4, t0 + every * 100));
    }

    #[test]
    fn keyed_rate_limit_stays_bounded_and_loses_no_count() {
        let r = KeyedRateLimit::new(Duration::from_secs(3600), 1, 4);
        let (mut logged, mut counted, mut calls) = (0u64, 0u64, 0u64);
        for round in 0..3u32 {
            for key in 0..100u32 {
                for _ in 0..=round {
                    calls += 1;
                    if let Some(n) = r.check(key) {
                        logged += 1;
                        counted += n;
                    }
                }
                assert!(r.keys() <= 4);
            }
        }
        // What is not reported yet is still held: by a remembered key, or
        // as an evicted key's count for the next line.
        let held: u64 = r
            .state
            .lock()
            .map(|s| s.buckets.values().map(|b| b.suppressed).sum::<u64>() + s.evicted)
            .unwrap_or(0);
        assert_eq!(logged + counted + held, calls);
    }

    #[test]
    fn chain_joins_every_source() {
        let outer = Wrapped(std::io::Error::other("inner"));
        assert_eq!(chain(&outer), "wrapped: inner");
    }

    #[derive(Debug)]
    struct Wrapped(std::io::Error);

    impl std::fmt::Display for Wrapped {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("wrapped")
        }
    }

    impl std::error::Error for Wrapped {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }
}
