use backend::proto::PagePolicy;
use guest_mem::PageSize;
use hugemem_client::stats::Stats;

use super::pool_watch::{pools, scrub_seconds, scrubbed_bytes};
use crate::harness::daemon::policy;

#[test]
fn reads_the_stats_document() {
    let stats: Stats = serde_json::from_value(serde_json::json!({
        "pools": [{"node": 0, "page_size": "1G", "clean_bytes": 1u64 << 30, "dirty_bytes": 0,
                   "quarantined_bytes": 0, "in_use_bytes": 1u64 << 30}],
        "counters": {"regions_pooled": 3},
        "scrub": {"nodes": [{"node": 0, "bytes": 10, "seconds": 0.5}, {"node": 1, "bytes": 5, "seconds": 0.25}]},
    }))
    .expect("a partial STATS document reads");
    assert_eq!(scrubbed_bytes(&stats), 15);
    assert!((scrub_seconds(&stats) - 0.75).abs() < 1e-9);
    assert_eq!(stats.counters.regions_pooled, 3);
    let p = pools(&stats);
    assert_eq!(
        (p.len(), p[0].clean_bytes, p[0].page_size.as_str()),
        (1, 1 << 30, "1G")
    );
    assert!(pools(&Stats::default()).is_empty());
}

#[test]
fn policies_follow_the_page_size() {
    assert_eq!(policy(PageSize::Huge1G), PagePolicy::Huge1G);
    assert_eq!(policy(PageSize::Huge2M), PagePolicy::Huge2M);
    assert_eq!(policy(PageSize::Base4K), PagePolicy::Base4K);
}
