use guest_mem::PageSize;
use numa::Topology;

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
