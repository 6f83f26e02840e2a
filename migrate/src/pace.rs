//! Rate limiting by deadline.
//!
//! A move with a rate limit of `r` bytes per second may start the batch that
//! follows `b` bytes no earlier than `b / r` seconds after the move began.
//! Waiting for that deadline, rather than sleeping a fixed time after each
//! batch, makes the average rate converge on the limit whatever the batches
//! cost: a batch that took longer than its share leaves no wait before the
//! next one, and the time the syscalls take counts towards the budget instead
//! of adding to it. A running guest keeps the rest of the memory bandwidth.
//!
//! The arithmetic is pure ([`deadline`], [`wait_before`]) so it is tested
//! without clocks; [`wait_until`] does the sleeping, in short slices so a
//! cancellation is seen within [`SLICE`].

use std::time::{Duration, Instant};

use clearing::CancelToken;

/// Longest single sleep while waiting for a deadline: how late a
/// cancellation can be noticed during a rate-limit wait.
pub(crate) const SLICE: Duration = Duration::from_millis(20);

/// When the batch after `bytes_done` bytes may start, from the start of the
/// move, at `rate` bytes per second (`rate > 0`). Saturates at `u64::MAX`
/// nanoseconds (584 years).
pub(crate) fn deadline(bytes_done: u64, rate: u64) -> Duration {
    let nanos = u128::from(bytes_done) * 1_000_000_000 / u128::from(rate.max(1));
    Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
}

/// How long to wait before the next batch, `elapsed` after the start, with
/// `bytes_done` bytes already sent; zero without a limit or when behind.
pub(crate) fn wait_before(elapsed: Duration, bytes_done: u64, rate: Option<u64>) -> Duration {
    rate.map_or(Duration::ZERO, |r| {
        deadline(bytes_done, r).saturating_sub(elapsed)
    })
}

/// Sleeps until `started + offset`, in slices of at most [`SLICE`]; returns
/// false as soon as `cancel` is cancelled.
pub(crate) fn wait_until(started: Instant, offset: Duration, cancel: Option<&CancelToken>) -> bool {
    let due = started.checked_add(offset);
    loop {
        if cancel.is_some_and(CancelToken::is_cancelled) {
            return false;
        }
        let now = Instant::now();
        let left = match due {
            Some(due) => due.saturating_duration_since(now),
            // A deadline beyond the clock's range: wait a slice at a time.
            None => SLICE,
        };
        if left.is_zero() {
            return true;
        }
        std::thread::sleep(left.min(SLICE));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn deadlines_follow_bytes_over_rate() {
        assert_eq!(deadline(0, 100 * MIB), Duration::ZERO);
        assert_eq!(deadline(100 * MIB, 100 * MIB), Duration::from_secs(1));
        assert_eq!(deadline(50 * MIB, 100 * MIB), Duration::from_millis(500));
        // 1 GiB pages at 1 GB/s: the third page may start after 2.147 s.
        assert_eq!(
            deadline(2 << 30, 1_000_000_000),
            Duration::from_nanos(2_147_483_648)
        );
        // Huge byte counts and a tiny rate saturate instead of overflowing.
        assert_eq!(deadline(u64::MAX, 1), Duration::from_nanos(u64::MAX));
        // A zero rate is refused by validation; here it acts as 1 B/s.
        assert_eq!(deadline(3, 0), Duration::from_secs(3));
    }

    #[test]
    fn waits_only_when_ahead_of_the_budget() {
        let rate = Some(100 * MIB);
        // No limit: never wait.
        assert_eq!(wait_before(Duration::ZERO, 1 << 40, None), Duration::ZERO);
        // 64 MiB sent after 100 ms: due at 640 ms, wait 540 ms.
        assert_eq!(
            wait_before(Duration::from_millis(100), 64 * MIB, rate),
            Duration::from_millis(540)
        );
        // Behind schedule (the batch took longer than its share): no wait,
        // and no debt carried: the deadline is absolute.
        assert_eq!(
            wait_before(Duration::from_secs(2), 64 * MIB, rate),
            Duration::ZERO
        );
        // The first batch never waits.
        assert_eq!(wait_before(Duration::ZERO, 0, rate), Duration::ZERO);
    }

    #[test]
    fn deadline_schedule_averages_to_the_rate() {
        // Simulated batches of 32 MiB that each take 50 ms of syscall time,
        // limited to 320 MiB/s (100 ms per batch): the waits fill the gap.
        let rate = 320 * MIB;
        let mut clock = Duration::ZERO;
        let mut sent = 0;
        for _ in 0..10 {
            clock += wait_before(clock, sent, Some(rate));
            clock += Duration::from_millis(50);
            sent += 32 * MIB;
        }
        // Batch k starts at k * 100 ms; the last ends 50 ms after its start.
        assert_eq!(clock, Duration::from_millis(950));
    }

    #[test]
    fn wait_until_returns_at_the_deadline_or_on_cancel() {
        let started = Instant::now();
        assert!(wait_until(started, Duration::from_millis(30), None));
        assert!(started.elapsed() >= Duration::from_millis(30));

        let cancel = CancelToken::new();
        cancel.cancel();
        let t = Instant::now();
        assert!(!wait_until(t, Duration::from_secs(3600), Some(&cancel)));
        assert!(t.elapsed() < Duration::from_secs(1));
    }
}
