//! Small diagnostics helpers every part of the crate uses: an error's whole
//! chain on one line, and a rate limit for log lines a peer can trigger in
//! a loop. A leaf module: it imports nothing of the crate.

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
