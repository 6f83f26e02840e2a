//! What the demo is asked to show.

use guest_mem::PageSize;

/// Default VM size.
pub const DEFAULT_SIZE: u64 = 2 << 30;

/// What to run.
#[derive(Debug, Clone)]
pub struct DemoConfig {
    /// VM size (default [`DEFAULT_SIZE`]); may shrink, said out loud, when
    /// fewer huge pages can be had.
    pub size: u64,
    /// Skip the guest even when KVM works.
    pub no_guest: bool,
    /// Page size; `None` = 1 GiB, then 2 MiB, then 4 KiB (said out loud).
    pub page_size: Option<PageSize>,
}

impl Default for DemoConfig {
    fn default() -> Self {
        Self {
            size: DEFAULT_SIZE,
            no_guest: false,
            page_size: None,
        }
    }
}
