//! `hugemem status`'s rendering (`hugemem::status::render_status`) of a live
//! daemon's typed STATS: the pool table, the scrub line and refill progress.
//! The daemon's own tests check the STATS document; this checks what an
//! operator reads from it.

use std::time::Duration;

use backend::daemon::ByteSize;
use hugemem::status::render_status;
use test_support::prelude::{alloc_2m_pages, reserve_2m, serial, wait_until, TestDaemon};

const MIB: u64 = 1 << 20;

#[test]
fn status_shows_pools_scrub_and_refill() {
    let _s = serial();
    if !reserve_2m(4, "status_shows_pools_scrub_and_refill") {
        return;
    }
    let target = 4 * MIB;
    let d = TestDaemon::start(|c| {
        c.pool.refill = true;
        c.pool.target = ByteSize(target);
        c.pool.recheck_ms = 20;
    });
    wait_until("refill reaches the target", Duration::from_secs(20), || {
        d.stats().pool_sum(|p| p.clean_bytes) >= target
    });
    let mut c = d.client();
    let a = alloc_2m_pages(&mut c, 1);
    let stats = c.stats().expect("STATS");
    let table = render_status(&stats);
    println!("{table}");
    // node, size, clean, dirty, quarantined, in use, target, limit
    let pool: Vec<&str> = table
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|cols| cols.len() == 8 && cols[0] == "0" && cols[1] == "2M")
        .unwrap_or_else(|| panic!("no pool line for node 0, 2M: {table}"));
    assert_eq!(pool[5], "2M", "in use: the page just allocated: {table}");
    assert_eq!(pool[6], "4M", "the refill target: {table}");
    assert!(table.contains("\nscrub ("), "{table}");
    assert!(table.contains("refill: "), "{table}");
    assert!(table.contains("sessions: 1 active"), "{table}");
    assert!(table.contains("allocations: 1 active (2M)"), "{table}");
    c.free(a.id).expect("free");
    d.shutdown();
}
