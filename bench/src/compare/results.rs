//! The comparison's figures: per variant, the ratios against the
//! baseline, and the report.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::stats::{best, median};

/// Best and median of the repetitions, seconds.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Figure {
    /// The smallest.
    pub best: f64,
    /// The median.
    pub median: f64,
}

impl Figure {
    pub(super) fn of(samples: &[f64]) -> Option<Self> {
        (!samples.is_empty()).then(|| Self {
            best: best(samples),
            median: median(samples),
        })
    }
}

/// Every repetition of one variant, seconds, in order.
#[derive(Debug, Clone, Default, Serialize)]
pub struct VariantSamples {
    /// Launch to guest RAM ready.
    pub ready_s: Vec<f64>,
    /// Launch to the first guest instruction.
    pub first_instruction_s: Vec<f64>,
    /// Launch to the guest's all-pages-touched mark (where seen).
    pub touched_s: Vec<f64>,
    /// Launch to the VMM's exit after power-off.
    pub poweroff_s: Vec<f64>,
    /// The hugemem ALLOC (empty for VMM-owned memory).
    pub alloc_s: Vec<f64>,
}

/// One variant's figures.
#[derive(Debug, Clone, Serialize)]
pub struct VariantReport {
    /// JSON key, e.g. `qemu_prealloc`.
    pub key: &'static str,
    /// Description.
    pub label: &'static str,
    /// Whether it was not run.
    pub skipped: bool,
    /// Why it was skipped, or what to know about its figures.
    pub note: Option<String>,
    /// Launch to guest RAM ready.
    pub ready_s: Option<Figure>,
    /// Launch to the first guest instruction.
    pub first_instruction_s: Option<Figure>,
    /// Launch to the guest having touched every page (its `|` mark on port
    /// 0x3f0; for the client, `microguest::run`'s all-touched time).
    pub touched_s: Option<Figure>,
    /// Launch to the VMM's exit after power-off.
    pub poweroff_s: Option<Figure>,
    /// The hugemem ALLOC.
    pub alloc_s: Option<Figure>,
    /// Size / best ready time, GiB/s.
    pub gib_per_s: Option<f64>,
    /// The guest's serial report of the last repetition.
    pub guest_report: Option<String>,
    /// Every repetition.
    pub samples: VariantSamples,
}

/// A variant against the baseline.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Ratio {
    /// Baseline best `ready_s` / this variant's best `ready_s`.
    pub ready: f64,
    /// Baseline best `poweroff_s` / this variant's best `poweroff_s`.
    pub poweroff: f64,
}

/// A variant beside its VMM's floor (the same VMM and guest on a resident
/// memfd, no daemon), same run.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct OverFloor {
    /// The floor variant's key.
    pub floor: &'static str,
    /// This variant's best `ready_s` minus the floor's, milliseconds.
    pub ready_ms: f64,
    /// This variant's best `poweroff_s` minus the floor's, milliseconds.
    pub poweroff_ms: f64,
    /// The same of the medians of `ready_s`, milliseconds.
    pub ready_median_ms: f64,
    /// The same of the medians of `poweroff_s`, milliseconds.
    pub poweroff_median_ms: f64,
    /// This variant's best `touched_s` minus the floor's, milliseconds
    /// (`None` where either mark was not seen).
    pub touched_ms: Option<f64>,
    /// The same of the medians of `touched_s`.
    pub touched_median_ms: Option<f64>,
    /// The median over the repetitions of this variant's `ready_s` minus
    /// the floor's in the same repetition, milliseconds: each repetition
    /// runs both within moments of each other, so this difference leaves
    /// out what moves the whole repetition (`None` when the two do not have
    /// one sample per repetition each).
    pub ready_paired_median_ms: Option<f64>,
    /// The same of `touched_s`.
    pub touched_paired_median_ms: Option<f64>,
    /// A 95 % confidence interval of `ready_paired_median_ms` (sign test on
    /// the repetitions' differences, no assumption on the noise), ms;
    /// `None` under 6 repetitions.
    pub ready_paired_ci95_ms: Option<[f64; 2]>,
    /// The same of `touched_paired_median_ms`.
    pub touched_paired_ci95_ms: Option<[f64; 2]>,
}

/// The report; `--json` prints it as one object.
#[derive(Debug, Clone, Serialize)]
pub struct CompareReport {
    /// Guest RAM per VM.
    pub size_bytes: u64,
    /// Page size every variant used.
    pub page_size: String,
    /// Fallbacks and other things to know (`null` when none).
    pub note: Option<String>,
    /// Repetitions.
    pub reps: usize,
    /// Online CPUs.
    pub cpus: usize,
    /// QEMU's `prealloc-threads`.
    pub prealloc_threads: usize,
    /// Distance between the guest's touches, bytes.
    pub stride_bytes: u64,
    /// `qemu --version`, first line (`null`: not found).
    pub qemu_version: Option<String>,
    /// `cloud-hypervisor --version` (`null`: not given or not found).
    pub cloud_hypervisor_version: Option<String>,
    /// The baseline's key.
    pub baseline: &'static str,
    /// Every variant, skipped ones included, in a fixed order.
    pub variants: Vec<VariantReport>,
    /// Each measured variant against the baseline, by key (empty when the
    /// baseline was skipped).
    pub ratios: BTreeMap<&'static str, Ratio>,
    /// Each measured variant against its VMM's floor, by key (absent where
    /// the floor was not measured).
    pub over_floor: BTreeMap<&'static str, OverFloor>,
    /// FREE to the pool showing the region clean (the background scrub that
    /// pays for the pool variants).
    pub pool_scrub_s: Option<Figure>,
    /// What the pool variants were handed: `resident` (the bench waited
    /// until the freed region was refaulted) or `holes` (`--pool-holes`:
    /// the ALLOC the moment the pool showed it clean).
    pub pool_hand_out: &'static str,
    /// The daemon faulted released regions' holes in behind the FREE
    /// (`pool.refault_ahead`); `false` with `--no-refault-ahead`.
    pub refault_ahead: bool,
    /// FREE to the pool's region refaulted, every page resident again: what
    /// the pool variants waited for before their ALLOC.
    pub pool_resident_s: Option<Figure>,
}
