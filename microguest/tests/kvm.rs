//! Runs the micro-guest under KVM and checks, from the host, what it wrote.
//!
//! Every test that cannot run here (no usable /dev/kvm, no 1 GiB huge page)
//! prints `SKIP: <reason>` to stderr and returns.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::ptr::NonNull;
use std::time::Duration;

use microguest::{
    pattern, pvh_elf, run, run_pvh, stride_pages, Error, GuestRam, PvhConfig, RunConfig,
};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Returns `true` (after printing the reason) when KVM is unusable.
fn skip_without_kvm() -> bool {
    match microguest::kvm_available() {
        Ok(()) => false,
        Err(reason) => {
            test_support::skip!("{reason}");
            true
        }
    }
}

/// A test-owned mapping: anonymous, or a hugetlb memfd as hugemem uses.
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

impl Mapping {
    fn anonymous(len: usize) -> io::Result<Self> {
        // SAFETY: a fresh private anonymous mapping aliases nothing.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        Self::from_mmap(p, len)
    }

    /// `len` bytes of a `MFD_HUGETLB | MFD_HUGE_1GB` memfd, mapped shared
    /// (hugemem's guest RAM).
    fn hugetlb_1g(len: usize) -> io::Result<Self> {
        // SAFETY: the name is a NUL-terminated literal; flags are valid.
        let fd = unsafe {
            libc::memfd_create(
                c"microguest-test".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_HUGETLB | libc::MFD_HUGE_1GB,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by memfd_create (checked >= 0) and
        // nothing else owns it.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        let file = std::fs::File::from(fd);
        file.set_len(len as u64)?;
        // SAFETY: maps the memfd we own; MAP_SHARED of a fresh file aliases
        // no Rust memory. The mapping keeps the file alive after `file` drops.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        Self::from_mmap(p, len)
    }

    fn from_mmap(p: *mut libc::c_void, len: usize) -> io::Result<Self> {
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast()).ok_or_else(|| io::Error::other("mmap returned NULL"))?;
        Ok(Mapping { ptr, len })
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is live, read/write, `len` bytes, owned by self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    fn view(&self) -> &[u8] {
        // SAFETY: the mapping is live, `len` bytes, owned by self; callers
        // read it only while no vCPU runs.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn read_u64(&self, offset: usize) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.view()[offset..offset + 8]);
        u64::from_le_bytes(b)
    }

    fn write_u64(&mut self, offset: usize, value: u64) {
        self.bytes()[offset..offset + 8].copy_from_slice(&value.to_le_bytes());
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping this object created.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Checks every touched page holds the pattern and the next 8 bytes still
/// hold `fill` (the guest wrote nothing else).
fn verify(map: &Mapping, gpa: u64, start_gpa: u64, stride: u64, marker: u64, fill: u64) -> u64 {
    let mut n = 0;
    for page in stride_pages(gpa.max(start_gpa), gpa + map.len as u64, stride) {
        let off = (page - gpa) as usize;
        assert_eq!(
            map.read_u64(off),
            pattern(marker, page),
            "page at gpa {page:#x}"
        );
        if off + 16 <= map.len {
            assert_eq!(
                map.read_u64(off + 8),
                fill,
                "bytes after the pattern at {page:#x}"
            );
        }
        n += 1;
    }
    n
}

fn report(name: &str, r: &microguest::RunReport) {
    eprintln!(
        "{name}: setup {:?}, first instruction {:?}, all touched {:?}, total {:?}, pages {}, \
         nonzero {}, exits {}, 1 GiB mappings {}",
        r.setup,
        r.first_instruction,
        r.all_touched,
        r.total,
        r.pages_touched,
        r.saw_nonzero,
        r.exits,
        r.huge_1g_mappings
    );
}

#[test]
fn anonymous_64m_2m_stride_zeroed() {
    if skip_without_kvm() {
        return;
    }
    let mut map = Mapping::anonymous((64 * MIB) as usize).expect("mmap");
    let cfg = RunConfig {
        stride: 2 * MIB,
        marker: 0x1111_2222_3333_4444,
        timeout: Duration::from_secs(10),
        ..Default::default()
    };
    let r = {
        let ram = [GuestRam::new(map.bytes(), 0)];
        run(&ram, &cfg).expect("run")
    };
    report("anonymous 64 MiB / 2 MiB", &r);
    assert_eq!(r.pages_touched, 32);
    assert!(!r.saw_nonzero);
    assert_eq!(r.or_accumulator, 0);
    assert!(r.first_instruction <= r.all_touched && r.all_touched <= r.total);
    assert_eq!(r.serial, "HUGEMEM-GUEST pages=32 nonzero=0 status=0\n");
    assert_eq!(verify(&map, 0, 0, cfg.stride, cfg.marker, 0), 32);
    // Between the touched pages nothing changed.
    assert_eq!(map.read_u64((MIB + 16) as usize), 0);
}

#[test]
fn dirty_memory_is_seen() {
    if skip_without_kvm() {
        return;
    }
    let mut map = Mapping::anonymous((64 * MIB) as usize).expect("mmap");
    map.bytes().fill(0xa5);
    // One page holds a distinct value to check the OR.
    map.write_u64((6 * MIB) as usize, 0x5a00_0000_0000_0000);
    let cfg = RunConfig {
        stride: 2 * MIB,
        marker: 0xdead_beef,
        timeout: Duration::from_secs(10),
        ..Default::default()
    };
    let r = {
        let ram = [GuestRam::new(map.bytes(), 16 * MIB)];
        run(&ram, &cfg).expect("run")
    };
    report("dirty 64 MiB / 2 MiB", &r);
    assert!(r.saw_nonzero);
    assert_eq!(
        r.or_accumulator,
        0xa5a5_a5a5_a5a5_a5a5 | 0x5a00_0000_0000_0000
    );
    assert_eq!(r.serial, "HUGEMEM-GUEST pages=32 nonzero=1 status=0\n");
    assert_eq!(
        verify(
            &map,
            16 * MIB,
            0,
            cfg.stride,
            cfg.marker,
            0xa5a5_a5a5_a5a5_a5a5
        ),
        32
    );
}

#[test]
fn several_slots_start_gpa_and_small_stride() {
    if skip_without_kvm() {
        return;
    }
    // Two slots with a hole, listed out of order; pages below 9 MiB skipped.
    let mut low = Mapping::anonymous((8 * MIB) as usize).expect("mmap");
    let mut high = Mapping::anonymous((4 * MIB) as usize).expect("mmap");
    let cfg = RunConfig {
        stride: 64 * 1024,
        marker: 7,
        start_gpa: 9 * MIB,
        timeout: Duration::from_secs(10),
        ..Default::default()
    };
    let r = {
        let ram = [
            GuestRam::new(high.bytes(), 4 * GIB),
            GuestRam::new(low.bytes(), 4 * MIB),
        ];
        run(&ram, &cfg).expect("run")
    };
    report("two slots, 64 KiB stride", &r);
    // low covers [4, 12) MiB: [9, 12) MiB = 48 pages; high: 64 pages.
    assert_eq!(r.pages_touched, 48 + 64);
    assert_eq!(
        verify(&low, 4 * MIB, cfg.start_gpa, cfg.stride, cfg.marker, 0),
        48
    );
    assert_eq!(
        verify(&high, 4 * GIB, cfg.start_gpa, cfg.stride, cfg.marker, 0),
        64
    );
    assert_eq!(low.read_u64(0), 0, "below start_gpa");
}

#[test]
fn ram_over_the_control_slot_is_refused() {
    let mut map = Mapping::anonymous((4 * MIB) as usize).expect("mmap");
    let ram = [GuestRam::new(map.bytes(), microguest::DEFAULT_CONTROL_GPA)];
    let err = run(&ram, &RunConfig::default()).expect_err("must refuse");
    assert!(
        matches!(
            err,
            Error::Config(microguest::ConfigError::ControlOverlap { index: 0, .. })
        ),
        "{err:?}"
    );
    // Moving the control slot makes it work.
    if skip_without_kvm() {
        return;
    }
    let cfg = RunConfig {
        control_gpa: 0x10_0000,
        ..Default::default()
    };
    let r = run(&ram, &cfg).expect("run with a moved control slot");
    assert_eq!(r.pages_touched, 2);
}

#[test]
fn pvh_image_boots_in_our_pvh_loader() {
    if skip_without_kvm() {
        return;
    }
    // RAM at [0, 64 MiB): the image loads at 1 MiB, start info goes to the
    // control slot.
    let mut map = Mapping::anonymous((64 * MIB) as usize).expect("mmap");
    map.bytes().fill(0x01);
    let cfg = PvhConfig {
        stride: 2 * MIB,
        marker: 0xabcd,
        ..Default::default()
    };
    let elf = pvh_elf(&cfg).expect("elf");
    let r = {
        let ram = [GuestRam::new(map.bytes(), 0)];
        run_pvh(&ram, &elf, Duration::from_secs(10)).expect("PVH run")
    };
    report("PVH 64 MiB / 2 MiB", &r);
    assert_eq!(r.pages_touched, 32);
    assert!(r.saw_nonzero);
    assert_eq!(r.serial, "HUGEMEM-GUEST pages=32 nonzero=1 status=0\n");
    assert_eq!(
        verify(&map, 0, 0, cfg.stride, cfg.marker, 0x0101_0101_0101_0101),
        32
    );
}

#[test]
fn pvh_4k_stride_skips_own_image() {
    if skip_without_kvm() {
        return;
    }
    let mut map = Mapping::anonymous((4 * MIB) as usize).expect("mmap");
    let cfg = PvhConfig {
        stride: 4096,
        marker: 0x55,
        ..Default::default()
    };
    let elf = pvh_elf(&cfg).expect("elf");
    let r = {
        let ram = [GuestRam::new(map.bytes(), 0)];
        run_pvh(&ram, &elf, Duration::from_secs(10)).expect("PVH run")
    };
    // 1024 pages of 4 KiB minus the 8 pages of the image at 1 MiB.
    assert_eq!(r.pages_touched, 1024 - 8);
    assert!(!r.saw_nonzero);
}

#[test]
fn hung_guest_times_out() {
    if skip_without_kvm() {
        return;
    }
    // The PVH image with `jmp .` patched over its entry: it never signals.
    let mut elf = pvh_elf(&PvhConfig::default()).expect("elf");
    elf[0x100..0x102].copy_from_slice(&[0xeb, 0xfe]);
    let mut map = Mapping::anonymous((4 * MIB) as usize).expect("mmap");
    let ram = [GuestRam::new(map.bytes(), 0)];
    let start = std::time::Instant::now();
    let err = run_pvh(&ram, &elf, Duration::from_millis(300)).expect_err("must time out");
    let took = start.elapsed();
    assert!(
        matches!(
            err,
            Error::Timeout {
                stage: "before the first instruction",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(5),
        "{took:?}"
    );
}

#[test]
fn halting_guest_is_a_fault() {
    if skip_without_kvm() {
        return;
    }
    let mut elf = pvh_elf(&PvhConfig::default()).expect("elf");
    elf[0x100] = 0xf4; // hlt
    let mut map = Mapping::anonymous((4 * MIB) as usize).expect("mmap");
    let ram = [GuestRam::new(map.bytes(), 0)];
    let err = run_pvh(&ram, &elf, Duration::from_secs(5)).expect_err("must fail");
    assert!(matches!(err, Error::GuestFault { .. }), "{err:?}");
}

#[test]
fn hugetlb_1g_pages_two_slots() {
    if skip_without_kvm() {
        return;
    }
    // Two 1 GiB slots, the second above 4 GiB, when two pages can be had;
    // one otherwise. The pool goes back to its size when `pool` drops.
    use test_support::hugepages::hold;
    use test_support::hugepages::PageSize::Huge1G;
    let (pool, slots) = match hold(Huge1G, 2)
        .map(|p| (p, 2))
        .or_else(|_| hold(Huge1G, 1).map(|p| (p, 1)))
    {
        Ok(held) => held,
        Err(why) => {
            test_support::skip!("hugetlb_1g_pages_two_slots: {why}");
            return;
        }
    };
    let mut maps = Vec::new();
    for _ in 0..slots {
        match Mapping::hugetlb_1g(GIB as usize) {
            Ok(m) => maps.push(m),
            Err(e) => {
                test_support::skip!("cannot map a 1 GiB hugetlb page: {e}");
                return;
            }
        }
    }
    let gpas = [GIB, 4 * GIB];
    for (m, dirty) in maps.iter_mut().zip([0u64, 0x77]) {
        m.write_u64(0, dirty);
    }
    let cfg = RunConfig {
        stride: GIB,
        marker: 0x4855_4745_0000_0000,
        timeout: Duration::from_secs(60),
        ..Default::default()
    };
    let r = {
        let ram: Vec<GuestRam<'_>> = maps
            .iter_mut()
            .zip(gpas)
            .map(|(m, gpa)| GuestRam::new(m.bytes(), gpa))
            .collect();
        run(&ram, &cfg).expect("run on 1 GiB pages")
    };
    report(&format!("hugetlb {slots} x 1 GiB / 1 GiB"), &r);
    assert_eq!(r.pages_touched, slots);
    assert_eq!(r.saw_nonzero, slots == 2);
    for (m, gpa) in maps.iter().zip(gpas) {
        assert_eq!(verify(m, gpa, 0, GIB, cfg.marker, 0), 1);
    }
    drop(maps);
    drop(pool);
}
