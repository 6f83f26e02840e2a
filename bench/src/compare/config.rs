//! What the comparison runs: its options, and the fixed parameters of
//! the guest and of the waits.

use std::ffi::OsString;
use std::time::Duration;

use guest_mem::PageSize;

/// Default VM size.
pub const DEFAULT_SIZE: u64 = 4 << 30;

/// Distance between the guest's touches: every 2 MiB, so every page of
/// either huge-page size is touched.
pub(super) const STRIDE: u64 = 2 << 20;
/// Under QEMU the first 8 bytes of GPA 0 hold the firmware's real-mode
/// interrupt vector table; the guest starts touching at 1 MiB.
pub(super) const START_GPA: u64 = 1 << 20;
/// Mixed into what the guest writes.
pub(super) const MARKER: u64 = 0x4845_4d43_4f4d_5052; // "HEMCOMPR"
/// Longest a VMM may run before it is killed.
pub(super) const VMM_DEADLINE: Duration = Duration::from_secs(120);
/// Longest wait for a FREE to come back clean.
pub(super) const CLEAN_DEADLINE: Duration = Duration::from_secs(120);
/// How often the pool is looked at while waiting.
pub(super) const CLEAN_POLL: Duration = Duration::from_millis(1);

/// What to run.
#[derive(Debug, Clone)]
pub struct CompareConfig {
    /// VM size (never changed; only the page size falls back).
    pub size: u64,
    /// Repetitions; best and median are reported.
    pub reps: usize,
    /// Page size; `None` = 1 GiB, then 2 MiB (said out loud).
    pub page_size: Option<PageSize>,
    /// The QEMU binary.
    pub qemu: OsString,
    /// The cloud-hypervisor binary (`None`: its variants are skipped).
    pub cloud_hypervisor: Option<OsString>,
    /// QEMU's `prealloc-threads` (`None`: online CPUs).
    pub prealloc_threads: Option<usize>,
    /// Pool variants ALLOC the moment the pool shows the freed region clean
    /// (punched holes being refaulted behind it) instead of once it is
    /// resident again.
    pub pool_holes: bool,
    /// The daemon's `pool.refault_ahead`: its helpers fault a released
    /// region's holes in behind the FREE (`false` only with `pool_holes`:
    /// the VMM then faults every page in itself).
    pub refault_ahead: bool,
}

impl Default for CompareConfig {
    fn default() -> Self {
        Self {
            size: DEFAULT_SIZE,
            reps: 3,
            page_size: None,
            qemu: "qemu-system-x86_64".into(),
            cloud_hypervisor: None,
            prealloc_threads: None,
            pool_holes: false,
            refault_ahead: true,
        }
    }
}
