//! Pins that outlive every fd and mapping (issue 11): a tenant keeps a
//! reference to its pages that no `/proc` scan, write lease or
//! `/proc/kpagecount` sees — a pipe after `vmsplice`, an io_uring fixed
//! buffer (with its ring fd visible, or hidden with `IORING_REGISTER_RING_FDS`
//! and closed), as VFIO and RDMA pin — closes and unmaps everything, FREEs,
//! and reads its pinned pages after the next tenant wrote. With
//! `pool.detach_pages` (the default) it must see only its own old bytes; each
//! case also runs with detaching off, where the same tenant does read the
//! next tenant's secret, so the attack is shown to be real on this kernel.

use test_support::prelude::{
    hugepages_2m, map_raw as map, reserve_2m, serial, unmap_raw as unmap, wait_until, TestDaemon,
};
use test_support::tenant::{
    alloc_2m, assert_hugepages_balanced, fill_secret, in_child, memfd_2m, read_u64, secret_tenant,
    B_SECRET, MIB, SECRET,
};

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// Bytes of the region the tenant pins (at its start).
const PINNED: usize = 64 * 1024;

/// How tenant A keeps its pages.
#[derive(Debug, Clone, Copy)]
enum Pin {
    /// `vmsplice` into a pipe; read back from the pipe.
    Vmsplice,
    /// `IORING_REGISTER_BUFFERS`; read back with `IORING_OP_WRITE_FIXED`
    /// into a plain file.
    IoUring,
    /// As `IoUring`, with the ring fd registered (`IORING_REGISTER_RING_FDS`)
    /// and its fd closed, so no fd of the process names the ring.
    IoUringHiddenRing,
}

/// What tenant A read back through its pin.
#[derive(Debug, PartialEq, Eq)]
enum Seen {
    /// Only its own old bytes.
    OwnBytes,
    /// At least one byte of B's secret.
    NextTenantsSecret,
    /// Something else (zeros: a pinned page was cleared in place).
    Other,
}

/// A pin held across FREE, readable afterwards.
enum Held {
    Pipe(OwnedFd),
    /// The ring, the registered buffer's address, and the ring's index in
    /// the task's registered rings when its fd was hidden.
    Ring(Box<io_uring::IoUring>, *const u8, Option<u32>),
}

/// `IORING_REGISTER_RING_FDS` (kernel `include/uapi/linux/io_uring.h`).
const IORING_REGISTER_RING_FDS: libc::c_uint = 20;
/// `IORING_ENTER_GETEVENTS`.
const IORING_ENTER_GETEVENTS: libc::c_uint = 1;
/// `IORING_ENTER_REGISTERED_RING`.
const IORING_ENTER_REGISTERED_RING: libc::c_uint = 1 << 4;

/// `struct io_uring_rsrc_update`.
#[repr(C)]
struct RsrcUpdate {
    offset: u32,
    resv: u32,
    data: u64,
}

/// Registers `ring`'s fd with the task (`IORING_REGISTER_RING_FDS`) and
/// returns its index. (The io-uring crate remembers the index only in a
/// `Submitter` that borrows the ring, which cannot be kept across FREE.)
fn register_ring_fd(ring: &io_uring::IoUring) -> Result<u32, i32> {
    let mut up = RsrcUpdate {
        offset: u32::MAX,
        resv: 0,
        data: u64::try_from(ring.as_raw_fd()).map_err(|_| 22)?,
    };
    // SAFETY: io_uring_register on a live ring fd with a pointer to one
    // rsrc_update that lives across the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_io_uring_register,
            ring.as_raw_fd(),
            IORING_REGISTER_RING_FDS,
            std::ptr::addr_of_mut!(up),
            1,
        )
    };
    if r != 1 {
        return Err(22);
    }
    Ok(up.offset)
}

/// Pins the first `PINNED` bytes at `p` (a live mapping).
fn pin(kind: Pin, p: *mut u8) -> Result<Held, i32> {
    match kind {
        Pin::Vmsplice => {
            let (r, w) = nix::unistd::pipe().map_err(|_| 13)?;
            let iov = libc::iovec {
                iov_base: p.cast(),
                iov_len: PINNED,
            };
            // SAFETY: vmsplice reads the iovec (our live mapping) and makes
            // the pipe reference those pages; no memory of ours is written.
            let n = unsafe { libc::vmsplice(w.as_raw_fd(), &iov, 1, 0) };
            if usize::try_from(n) != Ok(PINNED) {
                return Err(14);
            }
            Ok(Held::Pipe(r))
        }
        Pin::IoUring | Pin::IoUringHiddenRing => {
            let ring = io_uring::IoUring::new(4).map_err(|_| 20)?;
            let iov = libc::iovec {
                iov_base: p.cast(),
                iov_len: PINNED,
            };
            // SAFETY: the buffer is our live mapping; the kernel pins its
            // pages and keeps them until the ring goes, which is the attack.
            unsafe { ring.submitter().register_buffers(&[iov]) }.map_err(|_| 21)?;
            if matches!(kind, Pin::IoUringHiddenRing) {
                let index = register_ring_fd(&ring)?;
                // Close the ring's fd number by putting /dev/null in its
                // place: the process keeps the ring only through the
                // registration (and `IoUring`'s drop closes /dev/null).
                let null = std::fs::File::open("/dev/null").map_err(|_| 23)?;
                // SAFETY: dup2 onto the ring's own fd number, which only
                // `ring` uses (and then only to close it on drop).
                if unsafe { libc::dup2(null.as_raw_fd(), ring.as_raw_fd()) } < 0 {
                    return Err(24);
                }
                return Ok(Held::Ring(Box::new(ring), p.cast_const(), Some(index)));
            }
            Ok(Held::Ring(Box::new(ring), p.cast_const(), None))
        }
    }
}

/// Reads the pinned bytes back.
fn read_pinned(held: Held) -> Result<Vec<u8>, i32> {
    let mut out = vec![0u8; PINNED];
    match held {
        Held::Pipe(r) => {
            let mut got = 0;
            while got < PINNED {
                match nix::unistd::read(&r, &mut out[got..]) {
                    Ok(0) | Err(_) => return Err(16),
                    Ok(n) => got += n,
                }
            }
        }
        Held::Ring(mut ring, addr, hidden) => {
            let name = std::ffi::CString::new("pinned-copy").map_err(|_| 25)?;
            // SAFETY: memfd_create with a valid C string; a new fd or -1.
            let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
            if raw < 0 {
                return Err(25);
            }
            // SAFETY: just created, owned by nobody else.
            let file = unsafe { OwnedFd::from_raw_fd(raw) };
            let len = u32::try_from(PINNED).map_err(|_| 26)?;
            // The address is that of the registered buffer: the kernel
            // resolves it against the registration, not the (gone) mapping.
            let sqe = io_uring::opcode::WriteFixed::new(
                io_uring::types::Fd(file.as_raw_fd()),
                addr,
                len,
                0,
            )
            .offset(0)
            .build();
            // SAFETY: the SQE names a registered buffer and a live fd.
            unsafe { ring.submission().push(&sqe) }.map_err(|_| 27)?;
            match hidden {
                None => {
                    ring.submit_and_wait(1).map_err(|_| 28)?;
                }
                Some(index) => {
                    // SAFETY: io_uring_enter through the task's registered
                    // ring index; no argument pointer.
                    let r = unsafe {
                        libc::syscall(
                            libc::SYS_io_uring_enter,
                            index,
                            1,
                            1,
                            IORING_ENTER_GETEVENTS | IORING_ENTER_REGISTERED_RING,
                            std::ptr::null::<libc::c_void>(),
                            0,
                        )
                    };
                    if r != 1 {
                        return Err(28);
                    }
                }
            }
            let cqe = ring.completion().next().ok_or(29)?;
            if cqe.result() != i32::try_from(PINNED).map_err(|_| 26)? {
                return Err(40);
            }
            let n = nix::sys::uio::pread(&file, &mut out, 0).map_err(|_| 41)?;
            if n != PINNED {
                return Err(42);
            }
        }
    }
    Ok(out)
}

/// One run of the attack; returns what A saw.
fn pinned_attack(kind: Pin, detach: bool) -> Seen {
    let size = 4 * MIB;
    let free_before = hugepages_2m("free_hugepages");
    let d = TestDaemon::start(|c| c.pool.detach_pages = detach);
    let (freed_r, freed_w) = nix::unistd::pipe().expect("pipe");
    let (go_r, go_w) = nix::unistd::pipe().expect("pipe");
    let socket = d.socket();
    let tenant = std::thread::spawn(move || {
        in_child(None, move || {
            let (mut c, a, p) = match secret_tenant(&socket, size) {
                Ok(t) => t,
                Err(code) => return code,
            };
            let held = match pin(kind, p) {
                Ok(h) => h,
                Err(code) => return code,
            };
            unmap(p, size);
            let id = a.id;
            drop(a);
            if c.free(id).is_err() {
                return 15;
            }
            let _ = nix::unistd::write(&freed_w, &0u64.to_le_bytes());
            let mut b = [0u8; 1];
            let _ = nix::unistd::read(&go_r, &mut b);
            let pinned = match read_pinned(held) {
                Ok(v) => v,
                Err(code) => return code,
            };
            if pinned.contains(&B_SECRET) {
                30
            } else if pinned.iter().all(|&x| x == SECRET) {
                0
            } else {
                31
            }
        })
    });
    read_u64(&freed_r);
    wait_until(
        "A's region is clean in the pool",
        Duration::from_secs(10),
        || d.stats().pool_sum(|p| p.clean_bytes) == size,
    );
    let detached = d.stats().counters.pages_detached;
    if detach {
        assert!(detached >= 2, "{}", d.stats());
    } else {
        assert_eq!(detached, 0);
    }
    let mut b = d.client();
    let alloc = b.alloc(alloc_2m(size, false)).expect("B allocates");
    assert_eq!(
        d.stats().counters.regions_pooled,
        1,
        "B got A's region from the pool"
    );
    let p = map(alloc.fds[0].as_raw_fd(), size);
    assert!(!p.is_null());
    // SAFETY: B's live mapping of `size` bytes.
    let bytes = unsafe { std::slice::from_raw_parts_mut(p, size as usize) };
    assert!(bytes.iter().all(|&x| x == 0), "B's memory is not clean");
    bytes.fill(B_SECRET);
    let _ = nix::unistd::write(&go_w, b"g");
    let code = tenant.join().expect("tenant A thread");
    unmap(p, size);
    let id = alloc.id;
    drop(alloc);
    b.free(id).expect("B frees");
    drop(b);
    assert_hugepages_balanced(d, free_before);
    match code {
        0 => Seen::OwnBytes,
        30 => Seen::NextTenantsSecret,
        31 => Seen::Other,
        other => panic!("tenant A failed with code {other} ({kind:?})"),
    }
}

fn pinned_case(kind: Pin, test: &str) {
    let _g = serial();
    if !reserve_2m(8, test) {
        return;
    }
    assert_eq!(
        pinned_attack(kind, true),
        Seen::OwnBytes,
        "{kind:?}: with detach_pages A must see only its own old bytes"
    );
    // The control: without detaching, the pinned pages stay in the file and
    // A reads what B wrote. If this stops holding, the kernel changed and
    // the test no longer shows anything.
    assert_eq!(
        pinned_attack(kind, false),
        Seen::NextTenantsSecret,
        "{kind:?}: with detach_pages off the pin should reach B's secret (the attack)"
    );
}

#[test]
fn a_vmsplice_pin_never_holds_the_next_tenants_data() {
    pinned_case(
        Pin::Vmsplice,
        "a_vmsplice_pin_never_holds_the_next_tenants_data",
    );
}

/// io_uring may be disabled (`kernel.io_uring_disabled`) or missing.
fn io_uring_or_skip(test: &str) -> bool {
    match io_uring::IoUring::new(2) {
        Ok(_) => true,
        Err(e) => {
            test_support::skip!("{test}: io_uring unavailable: {e}");
            false
        }
    }
}

#[test]
fn an_io_uring_fixed_buffer_never_holds_the_next_tenants_data() {
    let test = "an_io_uring_fixed_buffer_never_holds_the_next_tenants_data";
    if io_uring_or_skip(test) {
        pinned_case(Pin::IoUring, test);
    }
}

#[test]
fn an_io_uring_pin_behind_a_hidden_ring_never_holds_the_next_tenants_data() {
    let test = "an_io_uring_pin_behind_a_hidden_ring_never_holds_the_next_tenants_data";
    if io_uring_or_skip(test) {
        pinned_case(Pin::IoUringHiddenRing, test);
    }
}

/// What detaching costs the pool, against the scrubber's clear of the same
/// mapping, in the same run (single thread each, median of 5): the punch
/// (quarantine thread) and the refault of the holes (the node's scrubbers:
/// the kernel allocates and zeroes each page). Reports the ratio of
/// punch + refault to a plain scrub; asserts the refaulted pages are zero.
#[test]
fn detach_cost_against_a_plain_scrub() {
    let _g = serial();
    let pages = 64u64;
    if !reserve_2m(pages + 2, "detach_cost_against_a_plain_scrub") {
        return;
    }
    let Some(fd) = memfd_2m() else {
        test_support::skip!("no 2 MiB hugetlb memfd");
        return;
    };
    let len = pages * 2 * MIB;
    assert_eq!(
        // SAFETY: ftruncate on our own memfd.
        unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) },
        0
    );
    let p = map(fd.as_raw_fd(), len);
    assert!(!p.is_null());
    let n = usize::try_from(len).expect("len");
    let (mut scrub, mut punch, mut refault) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..5 {
        fill_secret(p, len);
        let t = std::time::Instant::now();
        // SAFETY: our own live mapping of `n` bytes, nobody else uses it.
        unsafe { clearing::clear_raw(clearing::ClearKernel::default_kernel(), p, n) };
        scrub.push(t.elapsed().as_secs_f64());
        fill_secret(p, len);
        let t = std::time::Instant::now();
        // SAFETY: fallocate on our own memfd with integer arguments.
        let r = unsafe {
            libc::fallocate(
                fd.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                0,
                len as libc::off_t,
            )
        };
        assert_eq!(r, 0, "punch: {}", std::io::Error::last_os_error());
        punch.push(t.elapsed().as_secs_f64());
        let t = std::time::Instant::now();
        backend::sys::populate_write(p, n).expect("refault");
        refault.push(t.elapsed().as_secs_f64());
        // SAFETY: our own live mapping of `n` bytes.
        let bytes = unsafe { std::slice::from_raw_parts(p, n) };
        assert!(bytes.iter().all(|&x| x == 0), "refaulted pages are zero");
    }
    unmap(p, len);
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (s, pu, re) = (median(&mut scrub), median(&mut punch), median(&mut refault));
    let gib = len as f64 / f64::from(1u32 << 30);
    // Straight to fd 2 (libtest captures eprintln! in test threads).
    let line = format!(
        "detach cost, {pages} x 2 MiB, median of 5: scrub {:.3} s/GiB; punch {:.3} s/GiB + refault {:.3} s/GiB, ratio {:.2}\n",
        s / gib,
        pu / gib,
        re / gib,
        (pu + re) / s
    );
    let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
    assert!(s > 0.0 && pu > 0.0 && re > 0.0);
}
