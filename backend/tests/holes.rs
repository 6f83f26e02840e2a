//! Holes handed out (issue 19): a released region whose pages were detached
//! (punched out of its file, the holes reserved again at once) is clean
//! before a single page is faulted back in, and is handed to the next
//! tenant as it is. These tests prove what makes that safe: the next tenant
//! reads zeros, and nobody else on the host can take the pages its holes
//! are owed, so no guest ever faults a hole into `SIGBUS`.

use std::os::fd::{AsRawFd, OwnedFd};
use std::time::Duration;

use test_support::hugepages::{available_2m, exactly, hugepages_2m, PageSize};
use test_support::prelude::{map_raw as map, serial, unmap_raw as unmap, wait_until, TestDaemon};
use test_support::tenant::{alloc_2m, fill_secret, memfd_2m, root_or_skip, tenant_a, MIB};

const SETTLE: Duration = Duration::from_secs(30);

/// Whether the forked child `touch` ended by a signal (`SIGBUS` on a hole
/// with no page for it), and which.
fn touched_without_signal(touch: impl FnOnce() -> i32) -> Result<i32, String> {
    use nix::sys::wait::{waitpid, WaitStatus};
    use nix::unistd::{fork, ForkResult};
    // SAFETY: the child only touches memory and leaves with `_exit`.
    match unsafe { fork() }.expect("fork") {
        ForkResult::Child => {
            let code = touch();
            // SAFETY: ends the child without running the parent's destructors.
            unsafe { libc::_exit(code) }
        }
        ForkResult::Parent { child } => match waitpid(child, None).expect("waitpid") {
            WaitStatus::Exited(_, code) => Ok(code),
            WaitStatus::Signaled(_, sig, _) => Err(format!("{sig:?}")),
            other => Err(format!("{other:?}")),
        },
    }
}

/// Anonymous hugetlb memory of `pages` 2 MiB pages, populated: what any
/// other process on the host can take. `None` when the kernel refuses.
fn take_free_pages(pages: u64) -> Option<(*mut u8, u64)> {
    let len = pages * 2 * MIB;
    // SAFETY: a fresh anonymous mapping; aliases nothing.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB | libc::MAP_POPULATE,
            -1,
            0,
        )
    };
    (p != libc::MAP_FAILED).then_some((p.cast(), len))
}

/// Tenant A's part: its secret over all `size` bytes of its allocation.
fn write_secret(size: u64) -> impl FnOnce(&backend::client::Allocation) -> i32 {
    move |a| {
        let p = map(a.fds[0].as_raw_fd(), size);
        if p.is_null() {
            return 20;
        }
        fill_secret(p, size);
        unmap(p, size);
        0
    }
}

/// With the holes left for the guest (`pool.refault_ahead` off), the next
/// tenant is handed a region that is all holes, and every byte it reads is
/// zero; STATS counts the bytes handed out as holes.
#[test]
fn a_hole_handed_out_reads_zeros() {
    let _g = serial();
    if !root_or_skip() {
        return;
    }
    let size = 64 * MIB;
    let Some(_pages) = exactly(
        PageSize::Huge2M,
        size / (2 * MIB),
        "a_hole_handed_out_reads_zeros",
    ) else {
        return;
    };
    let d = TestDaemon::start(|c| c.pool.refault_ahead = false);
    assert_eq!(
        tenant_a(&d, None, size, false, write_secret(size)),
        0,
        "tenant A"
    );
    wait_until("A's region is clean in the pool", SETTLE, || {
        d.stats().pools.iter().any(|p| p.clean_bytes == size)
    });
    let mut b = d.client();
    let a = b.alloc(alloc_2m(size, false)).expect("B allocates");
    let s = d.stats();
    assert_eq!(s.counters.hole_bytes_handed_out, size, "B got holes: {s}");
    assert_eq!(
        s.counters.regions_pooled, 1,
        "B's region came from the pool: {s}"
    );
    let p = map(a.fds[0].as_raw_fd(), size);
    assert!(!p.is_null());
    // SAFETY: B's live mapping of `size` bytes.
    let bytes = unsafe { std::slice::from_raw_parts(p, size as usize) };
    let non_zero = bytes.iter().filter(|&&x| x != 0).count();
    unmap(p, size);
    assert_eq!(
        non_zero, 0,
        "B read {non_zero} bytes of A's through the holes"
    );
    let id = a.id;
    drop(a);
    b.free(id).expect("free");
    d.shutdown();
}

/// Bytes the daemon's scrubbers or fault helpers have faulted in ahead of
/// guests, all nodes (STATS `scrub.nodes[].refault_bytes`).
fn refaulted_bytes(d: &TestDaemon) -> u64 {
    d.stats().scrub.nodes.iter().map(|n| n.refault_bytes).sum()
}

/// With `pool.refault_ahead` (the default), the node's scrubbers fault the
/// holes in ahead of the next tenant: STATS shows the bytes refaulted and
/// their rate, and the region is resident when the next tenant comes.
#[test]
fn holes_are_refaulted_ahead_by_the_nodes_workers() {
    let _g = serial();
    if !root_or_skip() {
        return;
    }
    let size = 64 * MIB;
    let Some(_pages) = exactly(
        PageSize::Huge2M,
        size / (2 * MIB),
        "holes_are_refaulted_ahead_by_the_nodes_workers",
    ) else {
        return;
    };
    let d = TestDaemon::start(|_| {});
    assert_eq!(
        tenant_a(&d, None, size, false, write_secret(size)),
        0,
        "tenant A"
    );
    wait_until("the holes are refaulted", SETTLE, || {
        refaulted_bytes(&d) == size
    });
    let s = d.stats();
    assert!(
        s.scrub.nodes.iter().any(|n| n.refault_gb_per_s > 0.0),
        "{s}"
    );
    let mut b = d.client();
    let a = b.alloc(alloc_2m(size, false)).expect("B allocates");
    assert_eq!(d.stats().counters.hole_bytes_handed_out, 0, "no hole left");
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

/// No guest faults a hole into `SIGBUS` because another process took the
/// free pages after the punch: the holes are reserved, so a process that
/// tries to take every free page of the host gets none of them, and the
/// next tenant touches every page of its holes. The control, in the same
/// run: a memfd punched *without* the reservation loses its pages to the
/// same taker, and a touch of the hole is `SIGBUS`.
#[test]
fn nobody_can_take_the_pages_a_hole_is_owed() {
    let _g = serial();
    if !root_or_skip() {
        return;
    }
    let size = 16 * MIB;
    let pages = size / (2 * MIB);
    let Some(_pages) = exactly(
        PageSize::Huge2M,
        pages,
        "nobody_can_take_the_pages_a_hole_is_owed",
    ) else {
        return;
    };
    // The control: the kernel's behaviour without the re-reservation.
    let Some(fd) = memfd_2m() else {
        test_support::skip!("no 2 MiB hugetlb memfd");
        return;
    };
    control_without_reservation(&fd, size);

    let d = TestDaemon::start(|c| c.pool.refault_ahead = false);
    assert_eq!(
        tenant_a(&d, None, size, false, write_secret(size)),
        0,
        "tenant A"
    );
    wait_until("A's region is clean in the pool, all holes", SETTLE, || {
        d.stats().pools.iter().any(|p| p.clean_bytes == size)
    });
    // The region's pages are free (punched) and owed to it: not one page
    // of the host is available to anyone else.
    assert!(hugepages_2m("resv_hugepages") >= pages);
    assert_eq!(available_2m(), 0);
    assert!(
        take_free_pages(1).is_none(),
        "another process took a page a hole is owed"
    );
    let mut b = d.client();
    let a = b.alloc(alloc_2m(size, false)).expect("B allocates");
    assert_eq!(d.stats().counters.hole_bytes_handed_out, size);
    let fd = a.fds[0].as_raw_fd();
    let touched = touched_without_signal(|| {
        let p = map(fd, size);
        if p.is_null() {
            return 20;
        }
        // SAFETY: the child's live mapping of `size` bytes.
        let bytes = unsafe { std::slice::from_raw_parts_mut(p, size as usize) };
        for page in bytes.chunks_mut(2 * MIB as usize) {
            if page[0] != 0 {
                return 30;
            }
            page[0] = 1;
        }
        0
    });
    assert_eq!(touched, Ok(0), "B touched every hole");
    let id = a.id;
    drop(a);
    b.free(id).expect("free");
    d.shutdown();
}

/// A memfd of `size` bytes, populated and punched with no reservation
/// taken again: another process takes its pages, and the next touch of the
/// hole is `SIGBUS`.
fn control_without_reservation(fd: &OwnedFd, size: u64) {
    // SAFETY: ftruncate on our own memfd.
    let sized = unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) };
    assert_eq!(sized, 0);
    let p = map(fd.as_raw_fd(), size);
    assert!(!p.is_null());
    fill_secret(p, size);
    // SAFETY: fallocate on our own memfd with integer arguments.
    let r = unsafe {
        libc::fallocate(
            fd.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            0,
            size as libc::off_t,
        )
    };
    assert_eq!(r, 0, "punch");
    let pages = size / (2 * MIB);
    let taken = take_free_pages(pages).expect("control: the punched pages are free for anyone");
    let touched = touched_without_signal(|| {
        // SAFETY: the live mapping of `size` bytes made above.
        unsafe { p.write_volatile(1) };
        0
    });
    assert_eq!(
        touched,
        Err("SIGBUS".to_string()),
        "control: a hole whose pages were taken must SIGBUS on this kernel"
    );
    unmap(taken.0, taken.1);
    unmap(p, size);
}

/// A lazy ALLOC on an empty pool gets a fresh region, unpopulated (the
/// kernel zeroes each page at its first fault); with `pool.refault_ahead`
/// the node's fault helpers fault it in ahead of the guest, as they do a
/// detached region's holes: with nobody touching it, the region becomes
/// resident (the fd's blocks), STATS counts the bytes refaulted, and every
/// byte reads zero.
#[test]
fn a_lazy_allocs_fresh_region_is_faulted_in_ahead() {
    let _g = serial();
    if !root_or_skip() {
        return;
    }
    let size = 64 * MIB;
    let Some(_pages) = exactly(
        PageSize::Huge2M,
        size / (2 * MIB),
        "a_lazy_allocs_fresh_region_is_faulted_in_ahead",
    ) else {
        return;
    };
    let d = TestDaemon::start(|_| {});
    let mut client = d.client();
    let a = client
        .alloc(backend::proto::AllocRequest {
            clear_mode: backend::proto::ClearMode::Lazy,
            ..alloc_2m(size, false)
        })
        .expect("lazy ALLOC");
    assert!(
        a.note.starts_with("lazy:"),
        "a fresh region for kernel demand faults: {}",
        a.note
    );
    wait_until("the fresh region is faulted in", SETTLE, || {
        refaulted_bytes(&d) == size
    });
    let st = nix::sys::stat::fstat(&a.fds[0]).expect("fstat");
    assert_eq!(
        u64::try_from(st.st_blocks).expect("blocks") * 512,
        size,
        "resident before any touch of the tenant"
    );
    let p = map(a.fds[0].as_raw_fd(), size);
    assert!(!p.is_null());
    // SAFETY: the tenant's live mapping of `size` bytes.
    let bytes = unsafe { std::slice::from_raw_parts(p, size as usize) };
    assert!(bytes.iter().all(|&x| x == 0), "kernel-zeroed pages");
    unmap(p, size);
    let id = a.id;
    drop(a);
    client.free(id).expect("free");
    d.shutdown();
}
