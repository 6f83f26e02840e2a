//! Tests of the STATS document: its JSON shape, its text and its counters.

use super::*;
use serde_json::json;

fn round_trip(v: &serde_json::Value) -> serde_json::Value {
    let s: Stats = serde_json::from_value(v.clone()).expect("reads");
    serde_json::to_value(&s).expect("writes")
}

#[test]
fn unknown_keys_are_ignored_and_missing_ones_default() {
    // A newer daemon's document: keys this build does not know, at the
    // top and inside parts, and a key of a part missing.
    let s: Stats = serde_json::from_value(json!({
        "version": "9.9.9",
        "pid": 7,
        "a_new_part": {"x": 1},
        "pools": [{"node": 1, "page_size": "2M", "clean_bytes": 4, "new_figure": 5}],
        "counters": {"allocs_ok": 3, "new_counter": 1},
    }))
    .expect("a newer document reads");
    assert_eq!((s.pid, s.counters.allocs_ok), (7, 3));
    assert_eq!(s.pools[0].clean_bytes, 4);
    assert_eq!(s.pools[0].dirty_bytes, 0);
    assert_eq!(s.counters.frees, 0);
    assert!(s.socket.is_none() && s.regions.is_none() && s.lazy.is_none());
}

#[test]
fn absent_and_null_survive_a_round_trip() {
    let doc = serde_json::to_value(Stats::default()).expect("writes");
    // The operator-only parts and the per-connection parts are absent,
    // not null, when they are None.
    for k in [
        "socket",
        "hugetlbfs",
        "quarantine",
        "regions",
        "lazy",
        "refill",
    ] {
        assert!(doc.get(k).is_none(), "{k}: {doc}");
    }
    assert!(doc.get("regions_omitted").is_none(), "{doc}");
    let v = json!({
        "version": "0.1.0", "pid": 1, "uptime_s": 1.5,
        "sessions": {"active": 1, "total": 1, "refused": 0},
        "allocations": {"active": 1, "bytes": 2097152},
        "pools": [],
        "regions": [
            {"id": 1, "node": 0, "page_size": "2M", "bytes": 2097152, "state": "in_use",
             "inode": 9, "path": null, "why": "in use: allocation 3",
             "alloc_id": 3, "session": 2, "size": 2097152, "bound_node": null, "split": false,
             "moving": false, "placement": null, "placement_error": "EPERM", "rebalanced": []},
            {"id": 2, "node": 0, "page_size": "2M", "bytes": 2097152, "state": "clean",
             "inode": 10, "path": "/dev/hugepages/r2", "why": "pooled: clean, within target"}
        ],
        "regions_omitted": true,
        "quarantine": [{"region": 4, "bytes": 1, "seconds": 0.5, "holder_pid": null,
                        "withheld": null}],
        "refill": {"enabled": false, "current": null, "regions": 0, "bytes": 0, "yielded": 0},
        "lazy": [{"alloc": 3, "attached": false, "dirty_pages": 0, "faults": null}],
        "scrub": {"kernel": "rep_stosb", "bytes": 0, "seconds": 0.0, "gb_per_s": 0.0,
                  "pending_bytes": 0, "nodes": []},
        "totals": {"created_bytes": 0, "released_bytes": 0, "held_bytes": 0},
        "counters": serde_json::to_value(Counters::default()).expect("counters"),
    });
    assert_eq!(round_trip(&v), v);
    let s: Stats = serde_json::from_value(v).expect("reads");
    let r = s.region(1).expect("region 1");
    assert_eq!(
        (r.placement.clone(), r.bound_node),
        (Some(None), Some(None))
    );
    assert_eq!(s.region(2).map(|r| r.placement.clone()), Some(None));
}

#[test]
fn utc_dates() {
    use super::utc_date;
    assert_eq!(utc_date(0), "1970-01-01 00:00:00 UTC");
    assert_eq!(utc_date(1_767_225_600), "2026-01-01 00:00:00 UTC");
    assert_eq!(utc_date(951_825_600), "2000-02-29 12:00:00 UTC");
}
