use guest_mem::PageSize;
use numa::Topology;

use super::daemon::through_daemon;
use super::limits::scaling_counts;
use super::populate::{
    cloud_hypervisor_style, cloud_hypervisor_threads, fresh_eager_workers, node_parts,
};

#[test]
fn cloud_hypervisor_thread_count() {
    const G: u64 = 1 << 30;
    // min(CPUs, 16, pages, size / 4 GiB), at least 1.
    assert_eq!(cloud_hypervisor_threads(2, 8 * G, G), 2);
    assert_eq!(cloud_hypervisor_threads(64, 8 * G, G), 2);
    assert_eq!(cloud_hypervisor_threads(64, 704 * G, G), 16);
    assert_eq!(cloud_hypervisor_threads(8, 2 * G, G), 1);
    assert_eq!(cloud_hypervisor_threads(8, 64 * G, 2 << 20), 8);
    assert_eq!(cloud_hypervisor_threads(1, 4 * G, G), 1);
}

#[test]
fn node_parts_share_pages_evenly() {
    let topology = Topology::detect().expect("topology");
    let parts = node_parts(&topology, 8 << 30, 1 << 30);
    assert_eq!(parts.iter().map(|p| p.size).sum::<u64>(), 8 << 30);
    assert!(parts.iter().all(|p| p.size % (1 << 30) == 0));
}

#[test]
fn node_local_workers_populate_every_part() {
    let topology = Topology::detect().expect("topology");
    // 4 KiB shmem stands in for hugetlb: the job split is the same code.
    let parts = node_parts(&topology, 8 << 20, 4096);
    for workers in [1, 3] {
        let secs =
            fresh_eager_workers(&topology, &parts, PageSize::Base4K, workers).expect("populate");
        assert!(secs >= 0.0);
    }
}

#[test]
fn prefault_threads_cover_every_page_once() {
    // 4 KiB shmem stands in for hugetlb: the split is the same code.
    let secs = cloud_hypervisor_style(8 << 20, PageSize::Base4K, 3).expect("prefault");
    assert!(secs >= 0.0);
}

#[test]
fn the_scaling_run_always_measures_the_limits_counts() {
    assert_eq!(scaling_counts(&[], 2, 1), [1, 2]);
    assert_eq!(scaling_counts(&[4], 2, 1), [4, 1, 2]);
    assert_eq!(scaling_counts(&[2, 1], 2, 2), [2, 1]);
    assert_eq!(scaling_counts(&[], 0, 0), [1]);
    assert_eq!(scaling_counts(&[2], 8, 3), [2, 1, 8, 3]);
}

#[test]
fn pooled_hand_outs_say_whether_they_were_resident_or_holes() {
    const SIZE: u64 = 4 << 20;
    if !test_support::hugepages::reserve_2m(
        2,
        "pooled_hand_outs_say_whether_they_were_resident_or_holes",
    ) {
        return;
    }
    let topology = Topology::detect().expect("topology");
    let parts = node_parts(&topology, SIZE, 2 << 20);
    let d = through_daemon(SIZE, &parts, PageSize::Huge2M).expect("through the daemons");
    // Refaulted before the ALLOC: every byte backed, no hole.
    assert_eq!(
        (d.resident.resident_bytes, d.resident.hole_bytes),
        (SIZE, 0),
        "{d:?}"
    );
    // Punched and not refaulted ahead: every byte a hole.
    assert_eq!(
        (d.holes.resident_bytes, d.holes.hole_bytes),
        (0, SIZE),
        "{d:?}"
    );
    // Right after clean, whatever the scrubbers had refaulted: it adds up.
    assert_eq!(d.pooled.resident_bytes + d.pooled.hole_bytes, SIZE);
    // The touch comes after its ALLOC; the untouched hand-out has none.
    assert!(d.resident.touched_s >= d.resident.alloc_s);
    assert!(d.holes.touched_s >= d.holes.alloc_s);
    assert!(d.pooled.touched_s == 0.0);
}

#[test]
fn a_touch_writes_one_byte_per_page_and_backs_every_hole() {
    use super::handout::touch_every_page;
    use guest_mem::SharedMapping;
    // 4 KiB shmem: a fresh memfd is all holes; one write per page fills it.
    let map = SharedMapping::memfd(16 * 4096, PageSize::Base4K).expect("memfd");
    let info = backend::proto::RegionInfo {
        region_id: 1,
        guest_phys: 0,
        size: 16 * 4096,
        page_size: 4096,
        node: 0,
        flags: 0,
    };
    let memory =
        backend::guest_memory::guest_memory_from_fds(&[info], &[map.fd()]).expect("mapping");
    let blocks = |m: &SharedMapping| nix::sys::stat::fstat(m.fd()).expect("fstat").st_blocks;
    assert_eq!(blocks(&map), 0);
    assert_eq!(touch_every_page(&memory, 4096).expect("touch"), 16);
    assert_eq!(blocks(&map) * 512, 16 * 4096);
}
