//! The repetitions every bench runs around what it measures: one untimed
//! warm-up step, then N timed rounds, the sides it compares interleaved in
//! the same round, their order turning from round to round so that neither
//! side always runs first (after a quiet machine, or after the other side's
//! page cache or pool work).
//!
//! A bench writes its warm-up and one round; this module runs them:
//!
//! ```text
//! rounds::warm_up(progress, "populating and freeing the pages once", || touch(len))?;
//! let mut s = Samples::default();
//! rounds::each(reps, |round| {
//!     progress(&format!("repetition {round}"));
//!     round.both(&mut s, |s| baseline(s), |s| measured(s))
//! })?;
//! ```
//!
//! Samples go into the bench's own vectors, one per round, and from there
//! into `crate::stats` (best, median, paired differences by round).

use std::fmt;
use std::time::Instant;

/// One round of a series: its index and how many there are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Round {
    index: usize,
    count: usize,
}

impl Round {
    /// Its index, from 0.
    pub(crate) fn index(self) -> usize {
        self.index
    }

    /// Whether this round runs its sides in reverse order (every second
    /// round, from the second on).
    pub(crate) fn reversed(self) -> bool {
        self.index % 2 == 1
    }

    /// Runs both sides on `state`: `a` then `b` in even rounds, `b` then
    /// `a` in odd ones.
    pub(crate) fn both<S, E>(
        self,
        state: &mut S,
        a: impl FnOnce(&mut S) -> Result<(), E>,
        b: impl FnOnce(&mut S) -> Result<(), E>,
    ) -> Result<(), E> {
        if self.reversed() {
            b(state)?;
            a(state)
        } else {
            a(state)?;
            b(state)
        }
    }

    /// `items` in this round's order: as given in even rounds, reversed in
    /// odd ones.
    pub(crate) fn alternate<T>(self, mut items: Vec<T>) -> Vec<T> {
        if self.reversed() {
            items.reverse();
        }
        items
    }

    /// `items` rotated so that round `i` starts at item `i` (modulo their
    /// number): with more than two sides, each goes first in turn.
    pub(crate) fn rotate<T>(self, mut items: Vec<T>) -> Vec<T> {
        let n = items.len().max(1);
        items.rotate_left(self.index % n);
        items
    }
}

/// `i/N`, from 1: how progress lines name a round.
impl fmt::Display for Round {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.index + 1, self.count)
    }
}

/// Runs the untimed warm-up `step` once, after saying `warm-up: {what}`,
/// and gives back what it returned: what a first run pays once (the outer
/// host's first touch of memory, a VMM's first start, a cold page cache) and
/// no repetition should.
pub(crate) fn warm_up<T, E>(
    progress: &mut dyn FnMut(&str),
    what: &str,
    step: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    progress(&format!("warm-up: {what}"));
    step()
}

/// Runs `round` for each of `count` rounds in order, stopping at the first
/// error.
pub(crate) fn each<E>(
    count: usize,
    mut round: impl FnMut(Round) -> Result<(), E>,
) -> Result<(), E> {
    for index in 0..count {
        round(Round { index, count })?;
    }
    Ok(())
}

/// `count` rounds of `sample`, one value each, in order.
pub(crate) fn collect<T, E>(
    count: usize,
    mut sample: impl FnMut(Round) -> Result<T, E>,
) -> Result<Vec<T>, E> {
    let mut out = Vec::with_capacity(count);
    each(count, |round| {
        out.push(sample(round)?);
        Ok(())
    })?;
    Ok(out)
}

/// The seconds `step` took on the wall clock.
pub(crate) fn seconds<E>(step: impl FnOnce() -> Result<(), E>) -> Result<f64, E> {
    let start = Instant::now();
    step()?;
    Ok(start.elapsed().as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_alternate_and_rotate_their_sides() {
        let mut order = Vec::new();
        each::<()>(4, |round| {
            round.both(
                &mut order,
                |o| {
                    o.push(('a', round.index()));
                    Ok(())
                },
                |o| {
                    o.push(('b', round.index()));
                    Ok(())
                },
            )
        })
        .expect("rounds");
        let firsts: Vec<char> = order.chunks(2).map(|pair| pair[0].0).collect();
        assert_eq!(firsts, ['a', 'b', 'a', 'b']);
        let round = |index| Round { index, count: 3 };
        assert_eq!(round(1).alternate(vec![1, 2, 3]), [3, 2, 1]);
        assert_eq!(round(2).alternate(vec![1, 2, 3]), [1, 2, 3]);
        assert_eq!(round(2).rotate(vec![1, 2, 3]), [3, 1, 2]);
        assert_eq!(round(2).rotate(Vec::<u8>::new()), Vec::<u8>::new());
        assert_eq!(round(0).to_string(), "1/3");
    }

    #[test]
    fn rounds_stop_at_the_first_error_and_collect_one_sample_each() {
        let mut ran = 0;
        let r = each(5, |round| {
            ran += 1;
            if round.index() == 2 {
                Err("third")
            } else {
                Ok(())
            }
        });
        assert_eq!((r, ran), (Err("third"), 3));
        let v = collect::<_, ()>(3, |round| Ok(round.index() * 10)).expect("collect");
        assert_eq!(v, [0, 10, 20]);
        let mut said = Vec::new();
        let got = warm_up::<_, ()>(&mut |l| said.push(l.to_owned()), "once", || Ok(7));
        assert_eq!((got, said), (Ok(7), vec!["warm-up: once".to_owned()]));
    }
}
