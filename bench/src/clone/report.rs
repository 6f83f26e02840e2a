//! What `bench clone` reports (its `--json`): every start measured, the
//! templates' digests, cloud-hypervisor's own restores, and what the plan
//! left out. The table is `report/tables/clone.rs`'s, made from this JSON,
//! so that the terminal and docs/benchmarks.md show the same.

use serde::Serialize;

use super::plan::{CloneConfig, LeftOut};

/// Samples (ms) with their p50 and p95 (nearest rank).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Series {
    /// Every sample, in the order taken.
    pub samples: Vec<f64>,
    /// The median (nearest rank).
    pub p50: f64,
    /// The 95th percentile (nearest rank).
    pub p95: f64,
}

/// The `q` quantile of `samples` by nearest rank; 0 for none.
pub fn nearest_rank(samples: &[f64], q: f64) -> f64 {
    let mut v = samples.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return 0.0;
    }
    let rank = (q * v.len() as f64).ceil().max(1.0) as usize;
    v[rank.min(v.len()) - 1]
}

impl Series {
    /// Adds samples and updates the percentiles.
    pub fn extend(&mut self, more: impl IntoIterator<Item = f64>) {
        self.samples.extend(more);
        self.p50 = nearest_rank(&self.samples, 0.5);
        self.p95 = nearest_rank(&self.samples, 0.95);
    }
}

/// One kind of start at one combination, over the repetitions.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StartResult {
    /// `2M` or `1G`.
    pub page_size: String,
    /// Template size, bytes.
    pub size: u64,
    /// VMs started.
    pub count: usize,
    /// `shared` or `copy` (clones), `park` (restores from the park: the floor).
    pub mode: String,
    /// `one_at_a_time` (each after the one before runs) or `at_once`.
    pub start: String,
    /// Each VM's request (its `hugemem launch` spawned) to its guest
    /// counting, ms.
    pub running_ms: Series,
    /// At once: the first request to the last VM running, per repetition, ms.
    pub batch_ms: Series,
    /// Pool bytes in use per VM while all ran (STATS `in_use_bytes`), the
    /// largest over the repetitions.
    pub pool_bytes_per_vm: u64,
    /// Huge pages the kernel handed out per VM while all ran
    /// (`free_hugepages` before less during), bytes, the largest.
    pub kernel_taken_bytes_per_vm: u64,
    /// Huge pages the kernel reserved for them per VM (`resv_hugepages`
    /// during less before), bytes, the largest.
    pub kernel_reserved_bytes_per_vm: u64,
    /// Their cloud-hypervisors' private huge pages per VM (smaps
    /// `Private_Hugetlb`: what a shared clone wrote), bytes, the largest.
    pub private_hugetlb_bytes_per_vm: u64,
    /// 4 KiB pages in the guest's own area (image, stack, spin block) that
    /// differ from the template's, the most of one clone: what it wrote.
    pub own_pages_written_max: u64,
    /// 4 KiB pages outside it that differ from the template's, summed over
    /// every clone checked: stale or foreign (0 expected).
    pub stale_pages: u64,
    /// Clones compared page by page with the template.
    pub clones_checked: usize,
    /// The guests' own count of pages that did not hold their pattern.
    pub guest_bad: u64,
}

/// A template's digest before its clones and after.
#[derive(Debug, Clone, Serialize)]
pub struct TemplateCheck {
    /// `2M` or `1G`.
    pub page_size: String,
    /// Its size, bytes.
    pub size: u64,
    /// The phase it served: `shared` or `copy` (with the restores from the park).
    pub phase: String,
    /// Digest of its whole memory before the first clone, hex.
    pub digest_before: String,
    /// And after the last one ended.
    pub digest_after: String,
    /// The two are the same.
    pub unchanged: bool,
}

/// cloud-hypervisor's own restore of the same VM from its `file://`
/// snapshot, one restore mode.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChRestoreResult {
    /// `2M` or `1G`.
    pub page_size: String,
    /// Guest size, bytes.
    pub size: u64,
    /// The `--restore` options beside `source_url` and `resume=true`.
    pub mode: String,
    /// The process's start to the guest counting, ms.
    pub running_ms: Series,
    /// The guests' own count of bad pages.
    pub guest_bad: u64,
    /// Why it stopped, if it did (a mode this build or host refuses).
    pub note: Option<String>,
}

/// QEMU's own save and restore of the same VM, one kind (`--vmm qemu`,
/// `qemu_own.rs`).
#[derive(Debug, Clone, Default, Serialize)]
pub struct QemuRestoreResult {
    /// `2M` or `1G`.
    pub page_size: String,
    /// Guest size, bytes.
    pub size: u64,
    /// `floor` (`x-ignore-shared` on the same memory) or `migrate` (all
    /// RAM through the file).
    pub kind: String,
    /// `migrate` until `completed`, ms.
    pub save_ms: Series,
    /// The new QEMU's start to the guest counting, ms.
    pub running_ms: Series,
    /// The file's size, the largest, bytes.
    pub file_bytes: u64,
    /// RAM the stream carried (`query-migrate` `ram.transferred`), bytes.
    pub ram_transferred_bytes: u64,
    /// The guests' own count of bad pages.
    pub guest_bad: u64,
    /// Why it stopped, if it did.
    pub note: Option<String>,
}

/// The bench's report.
#[derive(Debug, Clone, Serialize)]
pub struct CloneReport {
    /// The options.
    #[serde(flatten)]
    pub config: CloneConfig,
    /// Huge-page bytes the plan could use, per page size.
    pub budget: Vec<(String, u64)>,
    /// Combinations left out, and why.
    pub left_out: Vec<LeftOut>,
    /// Every kind of start measured.
    pub starts: Vec<StartResult>,
    /// The templates before and after.
    pub templates: Vec<TemplateCheck>,
    /// cloud-hypervisor's own restores (`--vmm cloud-hypervisor`).
    pub ch_restore: Vec<ChRestoreResult>,
    /// QEMU's own saves and restores (`--vmm qemu`).
    pub qemu_restore: Vec<QemuRestoreResult>,
    /// Phases that failed, and why (a template the launcher cannot clone).
    pub notes: Vec<String>,
}

impl CloneReport {
    /// The table `hugemem bench report` makes of this report's JSON.
    pub fn to_table(&self) -> String {
        let mut v = serde_json::to_value(self).unwrap_or_default();
        v["bench"] = "clone".into();
        crate::report::tables::block("clone", &v)
    }
}
