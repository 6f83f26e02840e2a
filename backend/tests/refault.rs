//! The refault of punched pages by fault helpers (issue 27, item 4):
//! processes of the daemon's own, outside its address space, on the node's
//! CPUs at idle priority, faulting the lowest offset first.
//!
//! Every check here waits on an event (a helper's answer, a STATS figure
//! reached), never on a timer.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::time::Duration;

use backend::fault_helpers::{FaultHelpers, Faulted, Next, Ready};
use nix::sys::eventfd::EventFd;
use test_support::hugepages::{exactly, PageSize};
use test_support::prelude::{map_raw as map, serial, unmap_raw as unmap, wait_until, TestDaemon};
use test_support::tenant::{alloc_2m, fill_secret, memfd_2m, root_or_skip, tenant_a, MIB};

const SETTLE: Duration = Duration::from_secs(30);
const PAGE: u64 = 2 * MIB;

/// A 2 MiB hugetlb memfd of `len` bytes, every page a hole.
fn region(len: u64) -> Option<OwnedFd> {
    let fd = memfd_2m()?;
    // SAFETY: ftruncate on our own fd.
    let r = unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) };
    (r == 0).then_some(fd)
}

/// The next answer of `helpers`; panics on anything else.
fn answer(helpers: &FaultHelpers, never: &EventFd) -> Faulted {
    match helpers.next(never.as_fd()).expect("next") {
        Next::Faulted(f) => f,
        other => panic!("expected an answer, got {other:?}"),
    }
}

/// Field `n` (1-based, as proc(5) numbers them) of `/proc/<pid>/stat`.
fn stat_field(pid: i32, n: usize) -> String {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    // The command name may hold spaces; fields 3.. follow its ')'.
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    rest.split(' ').nth(n - 3).expect("field").to_string()
}

fn status_line(pid: i32, key: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .expect("status line")
        .trim()
        .to_string()
}

/// Each helper runs under `SCHED_IDLE` (policy 5 in `/proc/<pid>/stat`,
/// field 41), only on the CPUs it was given, named `hm-refault`, holding
/// no descriptor but its two pipes and the standard three (the region's
/// fd closed once mapped, every other fd of the parent closed at once).
#[test]
fn fault_helpers_run_at_idle_priority_on_the_nodes_cpus() {
    let _g = serial();
    if !root_or_skip() {
        return;
    }
    let len = 8 * PAGE;
    let Some(_pages) = exactly(
        PageSize::Huge2M,
        len / PAGE,
        "fault_helpers_run_at_idle_priority_on_the_nodes_cpus",
    ) else {
        return;
    };
    let Some(fd) = region(len) else {
        test_support::skip!("no 2 MiB hugetlb memfd");
        return;
    };
    let topology = numa::Topology::detect().expect("topology");
    let cpus = topology.nodes()[0].cpus.clone();
    let helpers = FaultHelpers::spawn(fd.as_fd(), len, &cpus, Some(topology.nodes()[0].id), 2)
        .expect("spawn");
    let never = EventFd::new().expect("eventfd");
    assert!(matches!(
        helpers.wait_ready(never.as_fd()),
        Ok(Ready::Ready)
    ));
    for i in 0..2 {
        helpers.send(i * PAGE, PAGE).expect("send");
    }
    for _ in 0..2 {
        assert_eq!(answer(&helpers, &never).result, Ok(()));
    }
    for &pid in helpers.pids() {
        assert_eq!(stat_field(pid, 41), "5", "helper {pid}: policy SCHED_IDLE");
        assert_eq!(
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .expect("comm")
                .trim(),
            "hm-refault"
        );
        assert_eq!(
            numa::parse_cpulist(&status_line(pid, "Cpus_allowed_list:")).expect("cpu list"),
            cpus,
            "helper {pid}: the node's CPUs"
        );
        let fds: Vec<_> = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .expect("fd dir")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().parse::<i32>().expect("fd"))
            .filter(|&n| n > 2)
            .collect();
        assert_eq!(fds.len(), 2, "helper {pid} holds only its pipes: {fds:?}");
    }
    helpers.finish();
}

/// Whether the 4 KiB page at `vaddr` of process `pid` is present
/// (`/proc/<pid>/pagemap`, bit 63).
fn present(pagemap: &std::fs::File, vaddr: u64) -> bool {
    use std::os::unix::fs::FileExt;
    let mut entry = [0u8; 8];
    pagemap
        .read_exact_at(&mut entry, vaddr / 4096 * 8)
        .expect("pagemap");
    u64::from_ne_bytes(entry) >> 63 == 1
}

/// The start of `pid`'s mapping of the file with inode `ino`.
fn mapping_of(pid: i32, ino: u64) -> u64 {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
    maps.lines()
        .find(|l| l.split_whitespace().nth(4) == Some(&ino.to_string()))
        .and_then(|l| u64::from_str_radix(l.split('-').next()?, 16).ok())
        .expect("the helper maps the region")
}

/// Sent lowest offset first (as the daemon sends them), the pages fill in
/// that order: at each answer, the pages present in the helper's mapping
/// are a prefix of the region that covers the range answered, and the
/// answers come in order. At the end every page is present and zero.
#[test]
fn fault_helpers_fill_the_lowest_offset_first() {
    let _g = serial();
    if !root_or_skip() {
        return;
    }
    let pages = 16;
    let len = pages * PAGE;
    let Some(_pages) = exactly(
        PageSize::Huge2M,
        pages,
        "fault_helpers_fill_the_lowest_offset_first",
    ) else {
        return;
    };
    let Some(fd) = region(len) else {
        test_support::skip!("no 2 MiB hugetlb memfd");
        return;
    };
    let helpers = FaultHelpers::spawn(fd.as_fd(), len, &[], None, 1).expect("spawn");
    let pid = helpers.pids()[0];
    let never = EventFd::new().expect("eventfd");
    for p in 0..pages {
        helpers.send(p * PAGE, PAGE).expect("send");
    }
    let ino = nix::sys::stat::fstat(fd.as_fd()).expect("fstat").st_ino;
    let pagemap = std::fs::File::open(format!("/proc/{pid}/pagemap")).expect("pagemap");
    let mut base = None;
    for p in 0..pages {
        let f = answer(&helpers, &never);
        assert_eq!(
            (f.offset, f.len, f.result),
            (p * PAGE, PAGE, Ok(())),
            "answer {p}"
        );
        let base = *base.get_or_insert_with(|| mapping_of(pid, ino));
        let resident: Vec<bool> = (0..pages)
            .map(|q| present(&pagemap, base + q * PAGE))
            .collect();
        let prefix = resident.iter().take_while(|&&r| r).count();
        assert!(prefix as u64 > p, "after answer {p}: {resident:?}");
        assert!(
            resident[prefix..].iter().all(|&r| !r),
            "not a prefix: {resident:?}"
        );
    }
    helpers.finish();
    assert_eq!(
        backend::sys::file_allocated_bytes(fd.as_fd()).expect("blocks"),
        len
    );
    let p = map(fd.as_raw_fd(), len);
    assert!(!p.is_null());
    // SAFETY: our live mapping of `len` bytes.
    let bytes = unsafe { std::slice::from_raw_parts(p, len as usize) };
    assert!(
        bytes.iter().all(|&b| b == 0),
        "a refaulted page is not zero"
    );
    unmap(p, len);
}

/// Through the daemon, with its defaults (fault helpers, one per CPU): a
/// released region's holes are faulted in ahead of the next tenant, who
/// gets every page present (the file's blocks) and zero, and no hole.
#[test]
fn a_released_region_is_refaulted_by_the_helpers_and_reads_zero() {
    let _g = serial();
    if !root_or_skip() {
        return;
    }
    let size = 64 * MIB;
    let test = "a_released_region_is_refaulted_by_the_helpers_and_reads_zero";
    let Some(_pages) = exactly(PageSize::Huge2M, size / PAGE, test) else {
        return;
    };
    let d = TestDaemon::start(|c| assert!(c.scrub.refault_helpers));
    let secret = |a: &backend::client::Allocation| {
        let p = map(a.fds[0].as_raw_fd(), size);
        if p.is_null() {
            return 20;
        }
        fill_secret(p, size);
        unmap(p, size);
        0
    };
    assert_eq!(tenant_a(&d, None, size, false, secret), 0, "tenant A");
    wait_until("the holes are refaulted", SETTLE, || {
        d.stats()
            .scrub
            .nodes
            .iter()
            .map(|n| n.refault_bytes)
            .sum::<u64>()
            == size
    });
    let mut b = d.client();
    let a = b.alloc(alloc_2m(size, false)).expect("B allocates");
    assert_eq!(d.stats().counters.hole_bytes_handed_out, 0, "no hole left");
    assert_eq!(
        backend::sys::file_allocated_bytes(a.fds[0].as_fd()).expect("blocks"),
        size,
        "every page present before B touches one"
    );
    let p = map(a.fds[0].as_raw_fd(), size);
    assert!(!p.is_null());
    // SAFETY: B's live mapping of `size` bytes.
    let bytes = unsafe { std::slice::from_raw_parts(p, size as usize) };
    assert!(bytes.iter().all(|&x| x == 0), "B read A's bytes");
    unmap(p, size);
    let id = a.id;
    drop(a);
    b.free(id).expect("free");
    d.shutdown();
}
