//! One figure of a bench over its repetitions.

use serde::Serialize;

use crate::stats::median;

/// One figure over the repetitions: each sample and their median.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Figure {
    /// Median of `samples`.
    pub median: f64,
    /// One per repetition, in order.
    pub samples: Vec<f64>,
}

impl Figure {
    /// Adds a repetition's sample and updates the median.
    pub(crate) fn push(&mut self, v: f64) {
        self.samples.push(v);
        self.median = median(&self.samples);
    }
}
