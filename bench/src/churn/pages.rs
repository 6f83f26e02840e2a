//! The page sizes a churn can expect, from the host's pages (and a live
//! daemon's pool) at the start.

use backend::client::Client;
use backend::proto::PagePolicy;
use guest_mem::{PageSize, PoolCounts};
use hugemem_client::stats::Stats;

use super::error::ChurnError;
use super::options::ChurnConfig;

/// Pages of `page` the host has for new allocations: free in the kernel,
/// plus idle (not in use) in the daemon's pools per `stats`.
fn pages_on_hand(page: PageSize, stats: Option<&Stats>) -> u64 {
    let free = PoolCounts::read(page, None)
        .ok()
        .flatten()
        .map_or(0, |c| c.available());
    let idle: u64 = stats.map_or(0, |s| {
        s.pools
            .iter()
            .filter(|p| p.page_size == page.to_string())
            .map(|p| p.clean_bytes + p.dirty_bytes + p.quarantined_bytes)
            .sum()
    });
    free + idle / page.bytes()
}

/// The largest page the policy allows (and that divides the size) of which
/// the host has enough for `parallel` launches; 4K when none.
fn expected_page(cfg: &ChurnConfig, stats: Option<&Stats>) -> PageSize {
    let candidates: Vec<PageSize> = match cfg.page_policy {
        PagePolicy::Best => vec![PageSize::Huge1G, PageSize::Huge2M],
        PagePolicy::Huge1G => return PageSize::Huge1G,
        PagePolicy::Huge2M => return PageSize::Huge2M,
        PagePolicy::Base4K => return PageSize::Base4K,
    };
    let want = |p: PageSize| cfg.size / p.bytes() * cfg.parallel as u64;
    candidates
        .into_iter()
        .filter(|p| cfg.size.is_multiple_of(p.bytes()))
        .find(|&p| pages_on_hand(p, stats) >= want(p))
        .unwrap_or(PageSize::Base4K)
}

/// The page sizes a run can expect, from the host's (or the live daemon's)
/// pages at the start.
pub(super) struct PagesAtStart {
    /// What the hugemem side should get.
    pub(super) expected: PageSize,
    /// What the baseline preallocates.
    pub(super) baseline: PageSize,
    /// How many of these VMs the pages hold: 1 is an exact fit, 2 or more
    /// leaves pages to spare.
    pub(super) host_vm_fits: u64,
}

impl PagesAtStart {
    pub(super) fn of(cfg: &ChurnConfig) -> Result<Self, ChurnError> {
        let live_stats = match &cfg.socket {
            Some(s) => Some(Client::connect(s)?.stats()?),
            None => None,
        };
        let expected = expected_page(cfg, live_stats.as_ref());
        let host_vm_fits = if expected.is_huge() {
            pages_on_hand(expected, live_stats.as_ref()) / (cfg.size / expected.bytes()).max(1)
        } else {
            0
        };
        let baseline = match (expected, cfg.page_policy) {
            (PageSize::Base4K, _) | (_, PagePolicy::Base4K) => {
                return Err(ChurnError::Missing(format!(
                    "the baseline preallocates huge pages, and the host has neither {} x 1G nor {} x 2M free for {} launch(es) at once",
                    cfg.size >> 30,
                    cfg.size >> 21,
                    cfg.parallel
                )))
            }
            (p, _) => p,
        };
        Ok(Self {
            expected,
            baseline,
            host_vm_fits,
        })
    }
}
