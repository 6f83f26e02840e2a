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
    (a.len() == b.len() && !a.is_empty()).then(|| {
        let differences: Vec<f64> = a.iter().zip(b).map(|(x, y)| x - y).collect();
        median(&differences)
    })
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
