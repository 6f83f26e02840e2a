//! A KVM micro-guest whose RAM is a hugemem region on 1 GiB pages, mapped
//! through the vm-memory adapter as a rust-vmm VMM would.
//!
//! The region is allocated (populated on node 0), poisoned, handed back dirty
//! and prepared again (cleared), so the guest's view proves both halves of
//! "never handed out dirty": it must read only zeros, and every page's marker
//! written by the guest must be visible from the host, through the vm-memory
//! `GuestMemory` API and through hugemem's own mapping of the same fd.
//!
//! Skips (printing `SKIP: ...`) where `/dev/kvm` cannot run a guest or no
//! 1 GiB page can be had.

#![allow(clippy::undocumented_unsafe_blocks)]

use clearing::RunOptions;
use guest_mem::vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};
use guest_mem::{guest_memory, PagePolicy, PageSize, Region, RegionError, RegionSpec};
use microguest::{pattern, stride_pages, GuestRam, RunConfig};
use numa::Topology;

const GIB: u64 = 1 << 30;
const STRIDE: u64 = 2 << 20;

#[test]
fn micro_guest_runs_on_a_1g_region() {
    if let Err(reason) = microguest::kvm_available() {
        test_support::skip!("no usable KVM: {reason}");
        return;
    }
    if !test_support::hugepages::reserve(
        PageSize::Huge1G,
        1,
        Some(0),
        "micro_guest_runs_on_a_1g_region",
    ) {
        return;
    }
    let topo = Topology::detect().expect("topology");
    let spec = RegionSpec::new("gm-test-kvm", GIB, Some(0))
        .with_policy(PagePolicy::Strict(PageSize::Huge1G));
    let region = match Region::allocate(&topo, &spec, &RunOptions::default()) {
        Ok((region, report)) => {
            println!(
                "populated 1 GiB page in {:.3} s ({:.2} GB/s)",
                report.seconds,
                report.gb_per_s()
            );
            region
        }
        Err(e @ RegionError::Unavailable { .. }) => {
            test_support::skip!("the reserved 1 GiB page was taken by another process: {e}");
            return;
        }
        Err(e) => panic!("allocate: {e:?}"),
    };

    // An earlier VM's data, then the pool takes the region back and prepares it.
    (unsafe { region.as_mut_slice() }).fill(0xAA);
    region.mark_all_dirty();
    let report = region
        .prepare_eager(&topo, &RunOptions::default())
        .expect("clear");
    assert_eq!(report.cleared, 1);
    println!(
        "cleared the reused 1 GiB page in {:.3} s ({:.2} GB/s)",
        report.seconds,
        report.gb_per_s()
    );
    let placement = region.verify_placement().expect("placement");
    assert!(placement.misplaced.is_empty(), "{placement:?}");

    // Hand it to the "VMM".
    region.mark_mapped().expect("clean");
    let mem = guest_memory(&[(GuestAddress(0), &region)]).expect("guest memory");
    let host = mem
        .get_host_address(GuestAddress(0))
        .expect("host address of GPA 0");
    // SAFETY: `host..host+1 GiB` is the adapter's own MAP_SHARED read-write
    // mapping of the region, alive while `mem` is; while the guest runs no
    // Rust reference to it exists (we only read it afterwards).
    let ram = [unsafe { GuestRam::from_raw_parts(host, GIB as usize, 0) }];
    let marker = 0x4855_4745_4d45_4d01;
    let cfg = RunConfig {
        stride: STRIDE,
        marker,
        ..RunConfig::default()
    };
    let run = microguest::run(&ram, &cfg).expect("guest run");
    println!(
        "guest: first instruction after {:?}, all {} pages touched after {:?}, {} exits, serial {:?}",
        run.first_instruction,
        run.pages_touched,
        run.all_touched,
        run.exits,
        run.serial.trim_end()
    );
    assert_eq!(run.pages_touched, GIB / STRIDE);
    assert!(
        !run.saw_nonzero,
        "the guest read non-zero memory: OR = {:#x}",
        run.or_accumulator
    );

    // Every marker landed: through the vm-memory API and through hugemem's
    // own mapping of the same fd.
    let mine = unsafe { region.as_slice() };
    let mut pages = 0;
    for gpa in stride_pages(0, GIB, STRIDE) {
        let want = pattern(marker, gpa);
        let got: u64 = mem.read_obj(GuestAddress(gpa)).expect("read_obj");
        assert_eq!(got, want, "marker at GPA {gpa:#x}");
        let offset = gpa as usize;
        let raw = u64::from_ne_bytes(mine[offset..offset + 8].try_into().expect("8 bytes"));
        assert_eq!(raw, want, "hugemem's mapping at {gpa:#x}");
        // Only the first 8 bytes of each page were written.
        let rest: u64 = mem.read_obj(GuestAddress(gpa + 8)).expect("read_obj");
        assert_eq!(rest, 0);
        pages += 1;
    }
    assert_eq!(pages, GIB / STRIDE);

    // VM gone: the region goes back to the pool dirty.
    drop(mem);
    assert_eq!(region.mark_all_dirty(), (1, 0));
}
