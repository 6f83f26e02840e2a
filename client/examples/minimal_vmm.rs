//! A minimal rust-vmm VMM whose guest RAM comes from a hugemem daemon: the
//! reference for `docs/integrating.md`. It connects, ALLOCs, maps the
//! regions as a `vm-memory` guest memory, loads hugemem's micro-guest (a PVH
//! ELF kernel) with `linux-loader`, runs it on one KVM vCPU, checks its
//! report (it reads the first 8 bytes of every huge page and must see only
//! zeros), and FREEs. It uses only the client side of hugemem (`client`,
//! `lazy`, `proto`, `guest_memory::guest_layout`); no daemon code. Left out:
//! more vCPUs, devices, interrupts, and a watchdog that kicks a stuck vCPU
//! out of `KVM_RUN` with a signal (`microguest::runner` has one).
//!
//! `cargo run -p hugemem-client --example minimal_vmm -- [--socket PATH]
//! [--mode eager|lazy] [--size-mib N]`; exit status 0 only when the guest ran
//! on clean memory. `backend/tests/minimal_vmm.rs` runs [`run_vmm`] itself.
//!
//! **Updating itself under a running guest** (`--update exec`): a guest that
//! counts forever runs on the allocation; the VMM pauses its vCPU, saves
//! the vCPU state and the allocation's id and token in a sealed memfd, and
//! re-executes itself (`execve` of `/proc/self/exe`: a new binary image)
//! with that memfd and its daemon connection left open. The new image
//! ([`resume`]) connects, takes the allocation over with HANDOFF (its own
//! fds, a new token), closes the old connection (which releases nothing
//! now), maps the same memory again, restores the vCPU, and the guest
//! counts on from where it stopped: nothing of its RAM was copied or
//! cleared. `backend/tests/minimal_vmm.rs` runs the same two halves in two
//! processes ([`start_and_pause`] in the test, [`resume`] in a child).

use std::fs::File;
use std::io::{Cursor, Read, Seek, Write};
use std::ops::Range;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use hugemem_client::client::{Allocation, Client};
use hugemem_client::guest_memory::guest_layout;
use hugemem_client::lazy::{GuestMapping, LazyGuest, LazyOptions};
use hugemem_client::proto::{
    AllocRequest, ClearMode, PagePolicy, RegionInfo, FEATURE_LAZY, TOKEN_SIZE,
};
use kvm_bindings::{
    kvm_regs, kvm_segment, kvm_sregs, kvm_userspace_memory_region, KVM_MAX_CPUID_ENTRIES,
};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};
use linux_loader::configurator::{pvh::PvhBootConfigurator, BootConfigurator, BootParams};
use linux_loader::loader::elf::start_info::{hvm_memmap_table_entry, hvm_start_info};
use linux_loader::loader::{elf::Elf, elf::PvhBootCapability, KernelLoader};
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vm_memory::{GuestMemoryRegion, GuestRegionMmap};

/// The daemon's default socket (`socket` in its configuration).
pub const DEFAULT_SOCKET: &str = "/run/hugemem/hugemem.sock";
/// What the guest mixes into the value it writes to each page.
const MARKER: u64 = 0x6d69_6e69_6d61_6c00;
/// Where the PVH `hvm_start_info` and its memory map go: not at the start of
/// a page, whose first 8 bytes the guest reads (and must find zero).
const START_INFO: u64 = 0x6040;
const MEMMAP: u64 = 0x6100;

/// What a run did.
#[derive(Debug)]
pub struct Report {
    /// Regions the daemon gave, and how many of them were LAZY.
    pub regions: usize,
    pub lazy_regions: usize,
    /// Smallest page size of the regions (the guest's stride).
    pub page_size: u64,
    /// The guest's line on COM1, e.g. `HUGEMEM-GUEST pages=32 nonzero=0 status=0`.
    pub serial: String,
    /// Faults this VMM served itself (its fallback, when the daemon was gone).
    pub fallback_faults: u64,
}

/// Connects, ALLOCs `size` bytes, boots the micro-guest, checks it, FREEs.
pub fn run_vmm(socket: &Path, size: u64, clear_mode: ClearMode) -> Result<Report> {
    run_vmm_with(socket, size, clear_mode, || {})
}

/// [`run_vmm`], calling `before_boot` once guest RAM is mapped (and, lazy,
/// handed to the daemon) and right before the vCPU starts: a test upgrades
/// the daemon there (`hugemem serve --takeover`), so that the guest's
/// faults reach the new daemon.
pub fn run_vmm_with(
    socket: &Path,
    size: u64,
    clear_mode: ClearMode,
    before_boot: impl FnOnce(),
) -> Result<Report> {
    let mut client = Client::connect(socket)?; // and HANDSHAKE
    client.set_timeout(Some(Duration::from_secs(30)))?; // longer than the ALLOC wait
    client.set_alloc_wait(Some(Duration::from_secs(5)));
    if clear_mode == ClearMode::Lazy && client.features() & FEATURE_LAZY == 0 {
        bail!("the daemon does not offer lazy mode");
    }
    let alloc = client
        .alloc(AllocRequest {
            total_size: size,
            page_policy: PagePolicy::Best, // 1G, else 2M, else 4K pages
            clear_mode,
            lock: false,       // or LOCK later
            parts: vec![],     // one region on any node; or one part per guest node
            want_paths: false, // memfds; true: hugetlbfs files with paths
        })
        .context("ALLOC")?;
    if !alloc.note.is_empty() {
        eprintln!("daemon: {}", alloc.note); // e.g. served on smaller pages
    }
    let is_lazy = |r: &RegionInfo| r.flags & RegionInfo::FLAG_LAZY != 0;
    let lazy_regions = alloc.regions.iter().filter(|r| is_lazy(r)).count();
    // A LAZY region may still hold the previous tenant's bytes: nothing may
    // touch it (not even the kernel loader) before the daemon has the uffd.
    let (mem, lazy_guard) = if lazy_regions == 0 {
        (alloc.guest_memory()?, None)
    } else {
        let (mem, mappings) = map_regions(&alloc, is_lazy)?;
        let guard = LazyGuest::attach(&mut client, &alloc, &mappings, LazyOptions::default())
            .context("lazy hand-off (UFFD): the memory is not clean, the guest must not run")?;
        (mem, Some(guard))
    };
    let page_size = alloc.regions.iter().map(|r| r.page_size).min();
    let page_size = page_size.context("no regions")?;
    before_boot();
    let serial = boot_and_check(&mem, page_size)?;
    let fallback_faults = lazy_guard.as_ref().map_or(0, |g| g.stats().faults);
    // The vCPU has stopped: unmap, drop the uffd copy, close the fds, FREE.
    // The daemon reuses a region only once nothing of ours maps or holds it.
    drop(mem);
    drop(lazy_guard);
    let (id, regions) = (alloc.id, alloc.regions.len());
    drop(alloc);
    client.free(id).context("FREE")?;
    Ok(Report {
        regions,
        lazy_regions,
        page_size,
        serial,
        fallback_faults,
    })
}

/// Maps every region `MAP_SHARED` read-write at its guest address, split
/// around the MMIO hole, as `Allocation::guest_memory` does (which refuses
/// LAZY regions), and lists the mappings of the regions `register` picks.
pub fn map_regions(
    alloc: &Allocation,
    register: impl Fn(&RegionInfo) -> bool,
) -> Result<(GuestMemoryMmap, Vec<GuestMapping>)> {
    let (mut regions, mut mappings) = (Vec::new(), Vec::new());
    for (info, fd) in alloc.regions.iter().zip(&alloc.fds) {
        let file = File::from(fd.try_clone()?);
        // Never map past the end: an access there would be a SIGBUS.
        ensure!(
            file.metadata()?.len() >= info.size,
            "region {} is short",
            info.region_id
        );
        for (region_offset, len, gpa) in guest_layout(info.guest_phys, info.size) {
            let map = MmapRegionBuilder::new(usize::try_from(len)?)
                .with_file_offset(FileOffset::new(file.try_clone()?, region_offset))
                .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
                .with_mmap_flags(libc::MAP_SHARED) // never MAP_NORESERVE, never private
                .with_hugetlbfs(info.page_size > 4096)
                .build()?;
            let addr = map.as_ptr() as u64;
            if register(info) {
                mappings.push(GuestMapping {
                    region_id: info.region_id,
                    region_offset,
                    addr,
                    len,
                });
            }
            let region = GuestRegionMmap::new(map, GuestAddress(gpa));
            regions.push(region.context("guest address overflow")?);
        }
    }
    Ok((GuestMemoryMmap::from_regions(regions)?, mappings))
}

/// Loads the micro-guest as a PVH kernel, runs it on one vCPU, and checks
/// its report against `mem`: its COM1 line and the value it wrote to each page.
pub fn boot_and_check(mem: &GuestMemoryMmap, stride: u64) -> Result<String> {
    let cfg = microguest::PvhConfig {
        stride, // one read per huge page
        marker: MARKER,
        ..Default::default()
    };
    let (entry, image) = load_pvh(mem, &microguest::pvh_elf(&cfg)?)?;
    let (nonzero, serial) = run_vcpu(mem, entry)?;
    // Every stride-aligned address of RAM, but those in the guest's own image.
    let pages: Vec<u64> = mem
        .iter()
        .flat_map(|r| {
            microguest::stride_pages(r.start_addr().0, r.start_addr().0 + r.len(), stride)
        })
        .filter(|a| !image.contains(a))
        .collect();
    let clean = format!("HUGEMEM-GUEST pages={} nonzero=0 status=0", pages.len());
    ensure!(
        nonzero == 0 && serial == clean,
        "the guest reported {serial:?}, not {clean:?}"
    );
    for &gpa in &pages {
        let seen: u64 = mem.read_obj(GuestAddress(gpa))?;
        ensure!(
            seen == microguest::pattern(MARKER, gpa),
            "no guest write at {gpa:#x}"
        );
    }
    Ok(serial)
}

/// `linux-loader` as cloud-hypervisor and Firecracker use it: the ELF's
/// segments into guest RAM, `hvm_start_info` with an E820 map of all RAM.
/// Returns the PVH entry point and the range the image occupies.
fn load_pvh(mem: &GuestMemoryMmap, elf: &[u8]) -> Result<(GuestAddress, Range<u64>)> {
    let kernel = Elf::load(mem, None, &mut Cursor::new(elf), None)?;
    let PvhBootCapability::PvhEntryPresent(entry) = kernel.pvh_boot_cap else {
        bail!("the kernel has no PVH entry point");
    };
    let memmap: Vec<_> = mem
        .iter()
        .map(|r| hvm_memmap_table_entry {
            addr: r.start_addr().0,
            size: r.len(),
            type_: 1, // E820 RAM
            reserved: 0,
        })
        .collect();
    let info = hvm_start_info {
        magic: 0x336e_c578, // XEN_HVM_START_MAGIC_VALUE
        version: 1,
        memmap_paddr: MEMMAP,
        memmap_entries: u32::try_from(memmap.len())?,
        ..Default::default()
    };
    let mut params = BootParams::new(&info, GuestAddress(START_INFO));
    params.set_sections(&memmap, GuestAddress(MEMMAP));
    PvhBootConfigurator::write_bootparams(&params, mem)?;
    Ok((entry, kernel.kernel_load.0..kernel.kernel_end))
}

/// One VM with every region of `mem` as a memory slot, one vCPU entered at
/// `entry` the PVH way, run until the guest writes the exit port. Returns
/// that value (0: it read only zeros) and its COM1 output.
fn run_vcpu(mem: &GuestMemoryMmap, entry: GuestAddress) -> Result<(u8, String)> {
    let (_kvm, _vm, mut vcpu) = create_vm(mem)?;
    // PVH: 32-bit protected mode, flat segments, paging off, ebx = start info.
    set_flat_protected_mode(&vcpu)?;
    let regs = kvm_regs {
        rip: entry.0,
        rbx: START_INFO,
        rflags: 2,
        ..Default::default()
    };
    vcpu.set_regs(&regs)?;
    let mut serial = Vec::new();
    let nonzero = loop {
        match vcpu.run()? {
            VcpuExit::IoOut(0x3f8, bytes) => serial.extend_from_slice(bytes), // COM1
            VcpuExit::IoOut(0x501, &[value]) => break value, // QEMU's isa-debug-exit port
            VcpuExit::IoOut(..) => {}                        // progress: ports 0x3f0, 0x3f4, 0x80
            exit => bail!("unexpected vCPU exit {exit:?}"),
        }
    };
    Ok((
        nonzero,
        String::from_utf8_lossy(&serial).trim_end().to_owned(),
    ))
}

/// A VM with every region of `mem` as a memory slot and one vCPU with the
/// host's supported CPUID. The VM's fds hold no reference to `mem`: keep
/// `mem` alive (mapped) as long as they run.
fn create_vm(mem: &GuestMemoryMmap) -> Result<(Kvm, VmFd, VcpuFd)> {
    let kvm = Kvm::new().context("/dev/kvm")?;
    let vm = kvm.create_vm()?;
    for (slot, r) in mem.iter().enumerate() {
        let region = kvm_userspace_memory_region {
            slot: u32::try_from(slot)?,
            flags: 0,
            guest_phys_addr: r.start_addr().0,
            memory_size: r.len(),
            userspace_addr: r.as_ptr() as u64,
        };
        // SAFETY: the mapping belongs to `mem`, which the callers keep
        // mapped for as long as the VM runs; vm-memory's regions do not
        // overlap.
        unsafe { vm.set_user_memory_region(region) }?;
    }
    let vcpu = vm.create_vcpu(0)?;
    vcpu.set_cpuid2(&kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)?)?;
    Ok((kvm, vm, vcpu))
}

/// 32-bit protected mode with flat 4 GiB code and data segments, paging
/// off: how PVH enters a kernel.
fn set_flat_protected_mode(vcpu: &VcpuFd) -> Result<()> {
    let mut sregs = vcpu.get_sregs()?;
    let code = kvm_segment {
        limit: 0xffff_ffff,
        selector: 0x08,
        type_: 0xb, // execute/read, accessed
        present: 1,
        db: 1,
        s: 1,
        g: 1,
        ..Default::default()
    };
    let data = kvm_segment {
        selector: 0x10,
        type_: 0x3, // read/write, accessed
        ..code
    };
    (sregs.cs, sregs.ds, sregs.es, sregs.fs, sregs.gs, sregs.ss) =
        (code, data, data, data, data, data);
    (sregs.cr0, sregs.cr4, sregs.efer) = (0x31, 0, 0); // PE | ET | NE
    vcpu.set_sregs(&sregs)?;
    Ok(())
}

// ---------------------------------------------------------------------------
// Updating the VMM under a running guest: HANDOFF, re-map, resume.
// ---------------------------------------------------------------------------

/// Where the counting guest keeps its 32-bit counter.
pub const COUNTER_GPA: u64 = 0x7000;
/// Where the counting guest's code goes.
const COUNTING_CODE_GPA: u64 = 0x1000;
/// The counting guest, 32-bit protected mode (`objdump -b binary -mi386`):
///
/// ```text
/// 0:  ff 05 00 70 00 00              incl  0x7000
/// 6:  f7 05 00 70 00 00 ff 0f 00 00  testl $0xfff,0x7000
/// 10: 75 ee                          jne   0x0
/// 12: e6 80                          out   %al,$0x80
/// 14: eb ea                          jmp   0x0
/// ```
///
/// It counts forever and exits to the VMM (port 0x80) every 4096 counts,
/// which is where the VMM looks at the counter and may pause it. (Under a
/// software KVM that emulates paging-off protected mode a count takes some
/// microseconds, hence the small interval.)
const COUNTING_GUEST: [u8; 22] = [
    0xff, 0x05, 0x00, 0x70, 0x00, 0x00, 0xf7, 0x05, 0x00, 0x70, 0x00, 0x00, 0xff, 0x0f, 0x00, 0x00,
    0x75, 0xee, 0xe6, 0x80, 0xeb, 0xea,
];
/// Counts between two of the counting guest's exits.
pub const COUNTS_PER_EXIT: u32 = 1 << 12;

/// A guest paused for an update of its VMM: what the successor process
/// needs to take the memory over and resume the vCPU. It holds the
/// allocation's token: it travels in a memfd, never on a command line.
#[derive(Debug, Clone)]
pub struct Paused {
    /// The daemon's socket.
    pub socket: PathBuf,
    /// The allocation.
    pub alloc_id: u64,
    token: [u8; TOKEN_SIZE],
    /// Guest RAM bytes.
    pub size: u64,
    /// The guest's counter when the vCPU stopped.
    pub counter: u32,
    /// The predecessor's daemon connection, kept open across `execve`
    /// (-1: the predecessor is another process that keeps it).
    pub old_socket_fd: i32,
    regs: kvm_regs,
    sregs: kvm_sregs,
}

/// What an update did.
#[derive(Debug)]
pub struct UpdateReport {
    /// The guest's counter when the old VMM paused it.
    pub counter_at_pause: u32,
    /// The counter as the new VMM found it in the memory it took over.
    pub counter_at_resume: u32,
    /// The counter when the new VMM stopped the guest.
    pub counter_at_end: u32,
    /// HANDOFF and re-map, in the new VMM: from its connect to the vCPU's restart.
    pub takeover: Duration,
    /// Regions handed off (every one CLEAN: no other tenant's bytes).
    pub regions: usize,
}

/// The old VMM: ALLOCs `size` bytes, boots the counting guest, lets it
/// count to at least `count`, and pauses it with its vCPU state saved. The
/// allocation stays this connection's until a successor HANDOFFs it.
pub fn start_and_pause(
    client: &mut Client,
    socket: &Path,
    size: u64,
    count: u32,
) -> Result<(Allocation, Paused)> {
    let alloc = client
        .alloc(AllocRequest {
            total_size: size,
            page_policy: PagePolicy::Best,
            clear_mode: ClearMode::Eager,
            lock: false,
            parts: vec![],
            want_paths: false,
        })
        .context("ALLOC")?;
    let token = alloc
        .token()
        .context("the daemon gave no token: it cannot hand the memory to a successor")?;
    let mem = alloc.guest_memory()?;
    mem.write_slice(&COUNTING_GUEST, GuestAddress(COUNTING_CODE_GPA))?;
    let (_kvm, _vm, mut vcpu) = create_vm(&mem)?;
    set_flat_protected_mode(&vcpu)?;
    vcpu.set_regs(&kvm_regs {
        rip: COUNTING_CODE_GPA,
        rflags: 2,
        ..Default::default()
    })?;
    let counter = run_counting(&mut vcpu, &mem, count)?;
    let paused = Paused {
        socket: socket.to_path_buf(),
        alloc_id: alloc.id,
        token,
        size: alloc.size(),
        counter,
        old_socket_fd: -1,
        regs: vcpu.get_regs()?,
        sregs: vcpu.get_sregs()?,
    };
    Ok((alloc, paused))
}

/// The new VMM: HANDOFF of the paused guest's allocation on a connection
/// of its own, its own mappings of the same memory (nothing copied), a new
/// VM with the saved vCPU state, and the guest counting on for `more`
/// counts. Then it stops the guest and FREEs.
pub fn resume(paused: &Paused, more: u32) -> Result<UpdateReport> {
    let start = Instant::now();
    let mut client = Client::connect(&paused.socket)?;
    client.set_timeout(Some(Duration::from_secs(30)))?;
    let alloc = client
        .handoff(paused.alloc_id, paused.token, false)
        .context("HANDOFF")?;
    if paused.old_socket_fd >= 0 {
        // SAFETY: the predecessor image left this fd open across execve for
        // us and nothing else in this process owns it; closing it now
        // releases nothing (the allocation is ours).
        drop(unsafe { OwnedFd::from_raw_fd(paused.old_socket_fd) });
    }
    ensure!(
        alloc.size() == paused.size,
        "a handed-off allocation of another size"
    );
    let clean = alloc
        .regions
        .iter()
        .all(|r| r.flags & RegionInfo::FLAG_CLEAN != 0);
    ensure!(
        clean,
        "the handed-off regions are not all CLEAN: {:?}",
        alloc.regions
    );
    let mem = alloc.guest_memory()?;
    let counter_at_resume: u32 = mem.read_obj(GuestAddress(COUNTER_GPA))?;
    let (_kvm, _vm, mut vcpu) = create_vm(&mem)?;
    vcpu.set_sregs(&paused.sregs)?;
    vcpu.set_regs(&paused.regs)?;
    let takeover = start.elapsed();
    let target = counter_at_resume
        .checked_add(more)
        .context("the counter would wrap")?;
    let counter_at_end = run_counting(&mut vcpu, &mem, target)?;
    drop((vcpu, _vm, _kvm, mem));
    let (id, regions) = (alloc.id, alloc.regions.len());
    drop(alloc);
    client.free(id).context("FREE")?;
    Ok(UpdateReport {
        counter_at_pause: paused.counter,
        counter_at_resume,
        counter_at_end,
        takeover,
        regions,
    })
}

/// Runs the counting guest until, at one of its exits, its counter is at
/// least `until`; returns the counter then.
fn run_counting(vcpu: &mut VcpuFd, mem: &GuestMemoryMmap, until: u32) -> Result<u32> {
    loop {
        match vcpu.run()? {
            VcpuExit::IoOut(0x80, _) => {
                let counter: u32 = mem.read_obj(GuestAddress(COUNTER_GPA))?;
                if counter >= until {
                    return Ok(counter);
                }
            }
            exit => bail!("unexpected vCPU exit {exit:?}"),
        }
    }
}

impl Paused {
    const MAGIC: &'static [u8; 8] = b"HMVMMUP1";

    /// The state in a memfd (no `MFD_CLOEXEC`: it is meant to cross
    /// `execve` or be inherited by a child), sealed against changes.
    pub fn to_memfd(&self) -> Result<OwnedFd> {
        let mut doc = Vec::new();
        doc.extend_from_slice(Self::MAGIC);
        doc.extend_from_slice(&self.alloc_id.to_le_bytes());
        doc.extend_from_slice(&self.token);
        doc.extend_from_slice(&self.size.to_le_bytes());
        doc.extend_from_slice(&self.counter.to_le_bytes());
        doc.extend_from_slice(&self.old_socket_fd.to_le_bytes());
        doc.extend_from_slice(pod_bytes(&self.regs));
        doc.extend_from_slice(pod_bytes(&self.sregs));
        doc.extend_from_slice(self.socket.as_os_str().as_encoded_bytes());
        let name = std::ffi::CString::new("minimal-vmm-update")?;
        // SAFETY: memfd_create with a valid C string; returns a new fd or -1.
        let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_ALLOW_SEALING) };
        ensure!(
            raw >= 0,
            "memfd_create: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: a fresh fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let mut file = File::from(fd);
        file.write_all(&doc)?;
        let seals =
            libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;
        // SAFETY: fcntl on our own open fd.
        let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) };
        ensure!(
            r == 0,
            "sealing the state: {}",
            std::io::Error::last_os_error()
        );
        Ok(OwnedFd::from(file))
    }

    /// The state from the memfd `fd` that [`Paused::to_memfd`] made.
    pub fn from_memfd(fd: OwnedFd) -> Result<Self> {
        let mut file = File::from(fd);
        file.seek(std::io::SeekFrom::Start(0))?;
        let mut doc = Vec::new();
        file.read_to_end(&mut doc)?;
        let mut rest = doc
            .strip_prefix(Self::MAGIC.as_slice())
            .context("not an update state")?;
        let mut take = |n: usize| -> Result<&[u8]> {
            ensure!(rest.len() >= n, "the update state is truncated");
            let (head, tail) = rest.split_at(n);
            rest = tail;
            Ok(head)
        };
        let alloc_id = u64::from_le_bytes(take(8)?.try_into()?);
        let token: [u8; TOKEN_SIZE] = take(TOKEN_SIZE)?.try_into()?;
        let size = u64::from_le_bytes(take(8)?.try_into()?);
        let counter = u32::from_le_bytes(take(4)?.try_into()?);
        let old_socket_fd = i32::from_le_bytes(take(4)?.try_into()?);
        let regs = pod_from(take(std::mem::size_of::<kvm_regs>())?);
        let sregs = pod_from(take(std::mem::size_of::<kvm_sregs>())?);
        let socket = PathBuf::from(std::str::from_utf8(rest)?);
        Ok(Self {
            socket,
            alloc_id,
            token,
            size,
            counter,
            old_socket_fd,
            regs,
            sregs,
        })
    }
}

/// The bytes of a KVM register struct (plain C data: integers only).
fn pod_bytes<T: Copy>(v: &T) -> &[u8] {
    // SAFETY: `T` is one of KVM's `repr(C)` register structs, integers and
    // arrays of integers only; reading its bytes is reading initialised
    // memory of exactly its size (their layouts have no padding holes the
    // kernel leaves uninitialised: they come from KVM_GET_*REGS).
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
}

/// A KVM register struct from `bytes` (exactly its size, checked by the caller's `take`).
fn pod_from<T: Copy>(bytes: &[u8]) -> T {
    assert_eq!(bytes.len(), std::mem::size_of::<T>());
    // SAFETY: `bytes` holds exactly `size_of::<T>()` bytes, and every bit
    // pattern is a valid value of KVM's integer-only register structs.
    unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) }
}

/// The old VMM's half of `--update`: the guest counts, pauses, and this
/// process re-executes itself (a new binary image, the same memory): the
/// state memfd and the daemon connection cross `execve`; the new image
/// takes the allocation over with HANDOFF before it closes the old
/// connection, so at no moment does nobody own the guest's memory.
fn update_by_exec(socket: &Path, size: u64) -> Result<()> {
    let mut client = Client::connect(socket)?;
    client.set_timeout(Some(Duration::from_secs(30)))?;
    let (alloc, mut paused) = start_and_pause(&mut client, socket, size, 4 * COUNTS_PER_EXIT)?;
    drop(alloc); // our mappings and fds: the successor maps its own
    paused.old_socket_fd = client.socket().as_raw_fd();
    let state = paused.to_memfd()?;
    for fd in [paused.old_socket_fd, state.as_raw_fd()] {
        // SAFETY: fcntl on fds this process owns; clears FD_CLOEXEC only.
        let r = unsafe { libc::fcntl(fd, libc::F_SETFD, 0) };
        ensure!(
            r == 0,
            "keeping fd {fd} across execve: {}",
            std::io::Error::last_os_error()
        );
    }
    eprintln!(
        "minimal_vmm: guest paused at count {}; re-executing",
        paused.counter
    );
    let err = std::process::Command::new("/proc/self/exe")
        .arg("--resume-fd")
        .arg(state.as_raw_fd().to_string())
        .exec();
    Err(err).context("execve of the new VMM image")
}

fn main() -> Result<()> {
    let (mut socket, mut mode, mut mib) = (PathBuf::from(DEFAULT_SOCKET), ClearMode::Eager, 64u64);
    let mut update = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let value = args
            .next()
            .with_context(|| format!("{arg} needs a value"))?;
        match (arg.as_str(), value.as_str()) {
            ("--socket", v) => socket = v.into(),
            ("--mode", "eager") => mode = ClearMode::Eager,
            ("--mode", "lazy") => mode = ClearMode::Lazy,
            ("--size-mib", v) => mib = v.parse().with_context(|| format!("--size-mib {v}"))?,
            ("--update", "exec") => update = true,
            ("--resume-fd", v) => {
                let raw: i32 = v.parse().with_context(|| format!("--resume-fd {v}"))?;
                ensure!(raw > 2, "--resume-fd {v} is not an inherited state fd");
                // SAFETY: the predecessor image left this memfd open across
                // execve for us; nothing else in this process owns it.
                let paused = Paused::from_memfd(unsafe { OwnedFd::from_raw_fd(raw) })?;
                let report = resume(&paused, 4 * COUNTS_PER_EXIT)?;
                println!("{report:?}");
                ensure!(
                    report.counter_at_resume == report.counter_at_pause
                        && report.counter_at_end > report.counter_at_resume,
                    "the guest did not count on from where it was paused"
                );
                return Ok(());
            }
            _ => bail!(
                "usage: minimal_vmm [--socket PATH] [--mode eager|lazy] [--size-mib N] [--update exec]"
            ),
        }
    }
    let size = mib
        .checked_mul(1 << 20)
        .context("--size-mib is too large")?;
    if update {
        return update_by_exec(&socket, size);
    }
    let report = run_vmm(&socket, size, mode)?;
    println!("{report:?}");
    Ok(())
}
