//! The few statistics every bench reports: best, median and the ratio
//! against a baseline, and GB/s.

/// The best (smallest) of `samples`; `+inf` for none.
pub(crate) fn best(samples: &[f64]) -> f64 {
    samples.iter().copied().fold(f64::INFINITY, f64::min)
}

/// The median of `samples`; 0 for none.
pub(crate) fn median(samples: &[f64]) -> f64 {
    let mut v = samples.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The median of `a[i] - b[i]`: two series measured side by side (sample
/// `i` of each in the same repetition), compared without what moved the
/// whole repetition. `None` unless both have the same, non-zero length.
pub(crate) fn paired_median(a: &[f64], b: &[f64]) -> Option<f64> {
    paired_differences(a, b).map(|d| median(&d))
}

/// `a[i] - b[i]` for every `i`; `None` unless both have the same, non-zero
/// length.
fn paired_differences(a: &[f64], b: &[f64]) -> Option<Vec<f64>> {
    (a.len() == b.len() && !a.is_empty()).then(|| a.iter().zip(b).map(|(x, y)| x - y).collect())
}

/// A distribution-free 95 % confidence interval of the median of
/// `a[i] - b[i]` (paired as in [`paired_median`]): the `j`-th smallest and
/// `j`-th largest difference, `j` the largest rank for which a sign test
/// leaves at most 2.5 % on each side (P(Binomial(n, 1/2) < j) ≤ 0.025).
/// It assumes nothing about how the noise is distributed, only that the
/// repetitions are independent. `None` under 6 pairs, where even the whole
/// range covers less than 95 %.
pub(crate) fn paired_median_ci95(a: &[f64], b: &[f64]) -> Option<[f64; 2]> {
    let mut d = paired_differences(a, b).filter(|d| d.len() >= 6)?;
    d.sort_by(f64::total_cmp);
    let n = d.len();
    // P(X = k) for X ~ Binomial(n, 1/2), summed from k = 0 while it stays
    // within 2.5 %: the count of ranks cut from each end.
    let mut p_k = 0.5f64.powi(i32::try_from(n).ok()?);
    let mut below = 0.0;
    let mut j = 0;
    while j < n / 2 && below + p_k <= 0.025 {
        below += p_k;
        j += 1;
        p_k *= (n - j + 1) as f64 / j as f64;
    }
    // j ranks cut from each end leave d[j - 1] .. d[n - j] (0-based) at 95 %.
    (j >= 1).then(|| [d[j - 1], d[n - j]])
}

/// The 95 % interval of the median of `samples` (the sign test of
/// [`paired_median_ci95`], against nothing). `None` under 6 samples.
pub(crate) fn median_ci95(samples: &[f64]) -> Option<[f64; 2]> {
    paired_median_ci95(samples, &vec![0.0; samples.len()])
}

/// `a / b`, or 0 when `b` is not positive (a missing baseline).
pub(crate) fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

pub(crate) use guest_mem::size::gb_per_s as gbps;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sign_test_interval_cuts_the_ranks_a_binomial_allows() {
        let zero = [0.0; 30];
        let d: Vec<f64> = (1..=30).map(f64::from).collect();
        // n = 30: P(X <= 9) = 0.0214, P(X <= 10) = 0.0494, so the 10th
        // smallest and the 10th largest (ranks 10 and 21).
        assert_eq!(paired_median_ci95(&d, &zero), Some([10.0, 21.0]));
        // n = 6: P(X = 0) = 1/64 <= 0.025: the whole range.
        let six: Vec<f64> = (1..=6).map(f64::from).collect();
        assert_eq!(paired_median_ci95(&six, &zero[..6]), Some([1.0, 6.0]));
        // n = 10: P(X <= 1) = 11/1024 = 0.0107, P(X <= 2) = 0.0547: ranks 2 and 9.
        let ten: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(paired_median_ci95(&ten, &zero[..10]), Some([2.0, 9.0]));
        assert_eq!(paired_median_ci95(&d[..5], &zero[..5]), None);
        assert_eq!(paired_median_ci95(&d, &zero[..29]), None);
    }

    #[test]
    fn best_median_and_ratio() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
        assert_eq!(best(&[3.0, 1.0, 2.0]), 1.0);
        assert_eq!(ratio(2.0, 0.5), 4.0);
        assert_eq!(ratio(2.0, 0.0), 0.0);
    }

    #[test]
    fn paired_median_pairs_by_repetition() {
        // Medians 5 and 4 differ by 1; the repetitions differ by -1, -1, +9.
        assert_eq!(
            paired_median(&[4.0, 5.0, 13.0], &[5.0, 6.0, 4.0]),
            Some(-1.0)
        );
        assert_eq!(paired_median(&[1.0], &[1.0, 2.0]), None);
        assert_eq!(paired_median(&[], &[]), None);
    }
}
