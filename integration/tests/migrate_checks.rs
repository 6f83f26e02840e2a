//! The in-guest checks of `integration::checks` in their one-node form, on
//! the host: a move to the node the pages are on runs everything but the
//! copy, and on a one-node host every check that needs two nodes says so.
//! The multi-node form runs in the QEMU guest (`numa_guest_tests.rs`).
//!
//! 2 MiB pages are reserved with `test_support::hugepages::reserve_2m`; a
//! test that cannot get them skips with the reason.

use guest_mem::PageSize;
use integration::checks;
use numa::Topology;
use test_support::hugepages::reserve_2m;

const M2: u64 = 2 << 20;

#[test]
fn in_guest_checks_in_their_one_node_form() {
    if !reserve_2m(8, "in_guest_checks") {
        return;
    }
    let line = checks::check_move_region(PageSize::Huge2M, 8 * M2, 0, 0).expect("check on node 0");
    assert!(line.contains("(TCG emulation)"), "{line}");
    assert!(line.contains("8 already there"), "{line}");
    println!("{line}");
    let line =
        checks::check_move_region(PageSize::Base4K, 4 << 20, 0, 0).expect("4K check on node 0");
    println!("{line}");

    let topology = Topology::detect().expect("topology");
    if migrate::memory_nodes(&topology).len() < 2 {
        for result in [
            checks::check_move_region_between_nodes(PageSize::Huge2M, 4 * M2),
            checks::check_move_to_full_node(PageSize::Huge1G, 1 << 30),
            checks::check_rate_limited_move(PageSize::Huge2M, 4 * M2, 64 << 20),
            checks::bench_migrate(4 * M2),
        ] {
            let err = result.expect_err("one node");
            assert!(
                err.starts_with("needs two NUMA nodes with memory; this machine has [0]"),
                "{err}"
            );
        }
    }
}
